/* A learner that reads the claim cell in one step and sets it in the next (the
   claim outside the lock): the packer may claim in between and both write H[k].
   SPIN must refute inv_host_one_writer. */
#define LEARNER_CLAIM d_step { TAKE_GUARD -> skip }; \
                      d_step { claimed[acq_slot] = true; stale++; lwrite[acq_slot] = true }
#include "../pipeline.pml"
