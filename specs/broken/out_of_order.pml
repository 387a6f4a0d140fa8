/* A learner that acquires whichever batch is READY, not the oldest. SPIN must
   refute inv_order_acquire and inv_order_once. */
#define ACQUIRE_ANY(k) :: d_step { LIVE && hot == NONE && st[k] == READY && k != acq_slot -> \
                                   step(k, ev_acquire); hot = k; reading[k] = true }
#define LEARNER_EXTRA FOR_SLOTS(ACQUIRE_ANY)
#include "../pipeline.pml"
