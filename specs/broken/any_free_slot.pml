/* A learner that requests into any free slot instead of the next in ring order
   (and finds the oldest tick by search when acquiring). SPIN must refute
   inv_order_ring. */
#define REQUEST_INTO(k) :: d_step { LIVE && next_req < T && st[k] == IDLE -> \
                                    tick_of[k] = next_req; step(k, ev_request); next_req++ }
#define ACQUIRE_FROM(k) :: d_step { LIVE && hot == NONE && st[k] == READY && \
                                    tick_of[k] == next_acq -> step(k, ev_acquire); \
                                    hot = k; reading[k] = true; next_acq++ }
#define LEARNER_REQUEST FOR_SLOTS(REQUEST_INTO)
#define LEARNER_ACQUIRE FOR_SLOTS(ACQUIRE_FROM)
#include "../pipeline.pml"
