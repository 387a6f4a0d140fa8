/* Generated from replay_fsm.spec.TRANSITIONS by replay_fsm.verify.promela: do not edit.
   Regenerate: python -c 'from replay_fsm.verify.promela import slot_table; print(slot_table(), end="")' > specs/slot_table.pml */
mtype = { IDLE, REQUESTED, SUBMITTED, READY, HOT, FAILED, CLOSED };
mtype = { ev_request, ev_submit, ev_complete, ev_acquire, ev_release, ev_fail, ev_close };

/* Fire event ev on slot i: a row of the table, or an assertion failure. */
inline fire(i, ev) {
  if
  :: st[i] == IDLE && ev == ev_request -> st[i] = REQUESTED
  :: st[i] == REQUESTED && ev == ev_submit -> st[i] = SUBMITTED
  :: st[i] == SUBMITTED && ev == ev_complete -> st[i] = READY
  :: st[i] == READY && ev == ev_acquire -> st[i] = HOT
  :: st[i] == HOT && ev == ev_release -> st[i] = IDLE
  :: st[i] == IDLE && ev == ev_fail -> st[i] = FAILED
  :: st[i] == REQUESTED && ev == ev_fail -> st[i] = FAILED
  :: st[i] == SUBMITTED && ev == ev_fail -> st[i] = FAILED
  :: st[i] == READY && ev == ev_fail -> st[i] = FAILED
  :: st[i] == HOT && ev == ev_fail -> st[i] = FAILED
  :: st[i] == IDLE && ev == ev_close -> st[i] = CLOSED
  :: st[i] == REQUESTED && ev == ev_close -> st[i] = CLOSED
  :: st[i] == SUBMITTED && ev == ev_close -> st[i] = CLOSED
  :: st[i] == READY && ev == ev_close -> st[i] = CLOSED
  :: st[i] == HOT && ev == ev_close -> st[i] = CLOSED
  :: st[i] == FAILED && ev == ev_close -> st[i] = CLOSED
  :: else -> assert(false) /* no such row */
  fi
}
