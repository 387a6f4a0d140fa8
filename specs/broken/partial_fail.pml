/* A failure path that spares the HOT slot so the learner can finish its tick.
   SPIN must refute inv_sticky. */
#define FAULTS 1
#define FAIL_UNLESS_HOT(k) if :: st[k] != HOT -> step(k, ev_fail) :: else fi;
#define FAULT_FAIL FOR_SLOTS(FAIL_UNLESS_HOT) failed = true
#include "../pipeline.pml"
