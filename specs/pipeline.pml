/* replay_fsm: the learner, packer, transfer worker, copy engine and device compute
   over a ring of D slots, for T ticks. Every slot state change goes through
   fire() from slot_table.pml, which is generated from replay_fsm.spec.

   spin -DD=3 -DT=7 -a pipeline.pml && gcc -O2 -o pan pan.c && ./pan -a -N inv_hot
   spin -DD=3 -DT=7 -DNOCLAIMS -a pipeline.pml && gcc -O2 -o pan pan.c && ./pan
   (deadlock freedom: no invalid end state; tests/test_spin.py runs all of it.)

   -DSEED_ORDERING: the copy into G[i] does not wait for the release of G[i]
   (the seed's defect); pipeline_broken.pml sets it and SPIN must refute it.
   -DFAULTS: any actor may fail the pipeline once; the learner then stops. */

#ifndef D
#define D 2
#endif
#ifndef T
#define T 5
#endif
#define NONE 255

#if D == 2
#define FOR_SLOTS(M) M(0) M(1)
#define ALL(P) (P(0) && P(1))
#elif D == 3
#define FOR_SLOTS(M) M(0) M(1) M(2)
#define ALL(P) (P(0) && P(1) && P(2))
#else
#error "the model is written for D = 2 or 3"
#endif

#include "slot_table.pml"
mtype st[D] = IDLE;

byte tick_of[D];   /* the tick slot i holds */
byte htick[D] = NONE;  /* the tick whose rows are in H[i] */
byte gtick[D] = NONE;  /* the tick whose rows are in G[i] */
bool hwrite[D];    /* the packer is writing H[i] */
bool packed[D];    /* a pack-done message for slot i is in flight */
bool ordered[D];   /* a copy order for slot i waits for the copy engine */
bool copying[D];   /* the copy engine reads H[i] and writes G[i] */
bool reading[D];   /* the learner's kernels read G[i] (may outlive release) */
byte next_req = 0; byte req_slot = 0;
byte next_acq = 0; byte acq_slot = 0;
byte hot = NONE; byte nhot = 0;
bool order_ok = true;
bool failed = false;
bool learner_done = false;

/* INV-HOST-WAR: no copy reads H[i] while the packer writes it, and the packer
   writes H[i] only while REQUESTED (or once the slot is dead: FAILED, CLOSED). */
#define NO_HOST_WAR(k) ((!(hwrite[k] && copying[k])) && \
                        (!hwrite[k] || st[k] == REQUESTED || st[k] == FAILED || st[k] == CLOSED))
#define NO_DEVICE_WAR(k) (!(copying[k] && reading[k]))
#define RAW_OK(k) (st[k] != HOT || (!copying[k] && gtick[k] == tick_of[k]))

#ifndef NOCLAIMS  /* -DNOCLAIMS: no never claim, so pan checks invalid end states */
ltl inv_hot { [] (nhot <= 1) }
ltl inv_order { [] order_ok }
ltl inv_host_war { [] ALL(NO_HOST_WAR) }
ltl inv_device_war { [] ALL(NO_DEVICE_WAR) }
ltl inv_raw { [] ALL(RAW_OK) }
ltl live { <> learner_done }
#endif

#define CLOSE(k) fire(k, ev_close);

active proctype learner() {
  do
  :: atomic { !failed && next_req < T && st[req_slot] == IDLE ->
       fire(req_slot, ev_request); tick_of[req_slot] = next_req;
       next_req++; req_slot = (req_slot + 1) % D }
  :: atomic { !failed && hot == NONE && next_acq < next_req && st[acq_slot] == READY ->
       order_ok = order_ok && tick_of[acq_slot] == next_acq;
       fire(acq_slot, ev_acquire); hot = acq_slot; nhot++;
       reading[acq_slot] = true;
       next_acq++; acq_slot = (acq_slot + 1) % D }
  :: atomic { !failed && hot != NONE ->
       fire(hot, ev_release); nhot--; hot = NONE }
  :: atomic { (failed || (next_acq == T && hot == NONE)) -> break }
  od;
  atomic { FOR_SLOTS(CLOSE) learner_done = true }
}

#define FINISH_READS(k) :: atomic { reading[k] && st[k] != HOT -> reading[k] = false }
active proctype compute() {
end: do FOR_SLOTS(FINISH_READS) od
}

#define PACK_START(k) :: atomic { st[k] == REQUESTED && !hwrite[k] && !packed[k] && \
                                  htick[k] != tick_of[k] -> hwrite[k] = true }
#define PACK_END(k) :: atomic { hwrite[k] -> hwrite[k] = false; htick[k] = tick_of[k]; \
                                if :: st[k] == REQUESTED -> packed[k] = true :: else fi }
active proctype packer() {
end: do FOR_SLOTS(PACK_START) FOR_SLOTS(PACK_END) od
}

#define SUBMIT(k) :: atomic { packed[k] -> packed[k] = false; \
                              if :: st[k] == REQUESTED -> fire(k, ev_submit); ordered[k] = true \
                                 :: else fi }
active proctype transfer() {
end: do FOR_SLOTS(SUBMIT) od
}

#ifdef SEED_ORDERING
#define RELEASE_DRAINED(k) true
#else
#define RELEASE_DRAINED(k) (!reading[k])
#endif
#define COPY_START(k) :: atomic { ordered[k] && !copying[k] && RELEASE_DRAINED(k) -> \
                                  ordered[k] = false; copying[k] = true }
#define COPY_END(k) :: atomic { copying[k] -> copying[k] = false; gtick[k] = htick[k]; \
                                if :: st[k] == SUBMITTED -> fire(k, ev_complete) :: else fi }
active proctype copy_engine() {
end: do FOR_SLOTS(COPY_START) FOR_SLOTS(COPY_END) od
}

#ifdef FAULTS
#define FAIL(k) fire(k, ev_fail);
active proctype fault() {
  if
  :: atomic { !failed && !learner_done -> FOR_SLOTS(FAIL) failed = true;
              if :: hot != NONE -> nhot--; hot = NONE :: else fi }
  :: skip
  fi
}
#endif
