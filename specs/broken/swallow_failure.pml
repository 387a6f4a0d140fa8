/* A learner that catches the failure and returns as if its run were over: it
   closes the pipeline but never raises. SPIN must refute inv_sticky_raises. */
#define FAULTS 1
#define LEARNER_RAISES :: d_step { !LIVE -> close_pipeline() }; break
#include "../pipeline.pml"
