/* The refinement probe (pipeline.pml -DREFINE -DNOCLAIMS), for
   replay_fsm/verify/refinement.py. It writes refine.txt in the working directory:

     S <guards> <state>              once for every reachable state
     E <kind> <tick> <state> | <state>   once for every learner step from every state

   <state> is the projection onto what the Core also has: st[0..D), tick_of[0..D),
   next_req, next_acq, acq_slot, hot, failed, closed (mtypes as SPIN numbers them);
   <guards> has bit 0, 1, 2 set when the learner, at the head of its loop, may
   request, acquire or release; <kind> is 1, 2, 3 for request, acquire, release.
   While the learner packs chunks of a batch itself (at `packing`) it is inside its
   sample_large_batch, between the head's steps: its guards are the head's.

   The probe is a process that can always take one step, which changes nothing: a
   search without partial-order reduction (-DNOREDUCE) therefore runs it, and its
   C code, exactly once in every state it stores. It also keeps every state from
   being an end state, so this build checks no claim and no deadlock. */

c_code {
  static FILE *refine_out;
  static char refine_before[256];
  static int refine_kind, refine_tick;

  static void refine_open(void) {
    if (refine_out) return;
    refine_out = fopen("refine.txt", "w");
    if (!refine_out) { perror("refine.txt"); exit(2); }
  }
  static void refine_raw(char *b) {
    int k, n = 0;
    for (k = 0; k < D; k++) n += sprintf(b + n, "%d ", (int) now.st[k]);
    for (k = 0; k < D; k++) n += sprintf(b + n, "%d ", (int) now.tick_of[k]);
    sprintf(b + n, "%d %d %d %d %d %d", (int) now.next_req, (int) now.next_acq,
            (int) now.acq_slot, (int) now.hot, (int) now.failed, (int) now.closed);
  }
  void refine_state(int guards) {
    char b[256];
    refine_open();
    refine_raw(b);
    fprintf(refine_out, "S %d %s\n", guards, b);
  }
  void refine_pre(int kind) {
    refine_kind = kind;
    refine_tick = kind == 1 ? (int) now.next_req : kind == 2 ? (int) now.next_acq : -1;
    refine_raw(refine_before);
  }
  void refine_post(void) {
    char b[256];
    refine_open();
    refine_raw(b);
    fprintf(refine_out, "E %d %d %s | %s\n", refine_kind, refine_tick, refine_before, b);
  }
}

#define AT_HEAD (learner@head || learner@packing)
byte probe_guards;
active proctype probe() {
end: do
  :: atomic {
       probe_guards = (AT_HEAD && REQ_GUARD) + 2 * (AT_HEAD && ACQ_GUARD) +
                      4 * (AT_HEAD && REL_GUARD);
       c_code { refine_state(now.probe_guards); now.probe_guards = 0; } }
  od
}
