/* CUDA with a learner that takes the oldest batch once its copy finished but before
   the transfer thread reported it (still SUBMITTED), past the table: it assigns
   st[] itself, so fire()'s assertion cannot object. The rows are in G[k], so
   inv_raw holds; SPIN must refute inv_raw_ready. */
#define CUDA 1
#define LEARNER_EXTRA \
  :: d_step { LIVE && hot == NONE && next_acq < next_req && st[acq_slot] == SUBMITTED && \
              !ordered[acq_slot] && !copying[acq_slot] -> \
       st[acq_slot] = HOT; hot = acq_slot; reading[hot] = true; \
       next_acq++; acq_slot = (acq_slot + 1) % D }
#include "../pipeline.pml"
