/* A learner that may skip a tick when it requests. SPIN must refute
   inv_order_consecutive. */
#define LEARNER_EXTRA \
  :: d_step { LIVE && next_req + 1 < T && st[req_slot] == IDLE -> \
       tick_of[req_slot] = next_req + 1; step(req_slot, ev_request); \
       next_req = next_req + 2; req_slot = (req_slot + 1) % D }
#include "../pipeline.pml"
