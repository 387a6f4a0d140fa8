/* A learner that waits for its batch without asking whether the packer lives.
   SPIN must refute inv_live_watchdog and inv_live, and the plain build (NOCLAIMS)
   must report the learner stuck in an invalid end state. */
#define PACKER_FAULTS 1
#define WATCHDOG
#include "../pipeline.pml"
