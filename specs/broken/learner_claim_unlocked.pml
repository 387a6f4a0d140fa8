/* A learner that reads the claim cells in one step and sets them in the next (the
   claim outside the lock): the packer may claim the same chunk in between, and both
   write it. SPIN must refute inv_host_one_writer. */
byte seen; /* the learner's read of left[acq_slot] */
#define LEARNER_CLAIM d_step { TAKE_GUARD -> seen = left[acq_slot] }; \
                      d_step { if :: seen == C -> stale++ :: else fi; \
                               left[acq_slot] = seen - 1; lwrite[acq_slot] = true; \
                               htick[acq_slot] = NONE }
#include "../pipeline.pml"
