/* The seed's ordering: the copy into a device slot does not wait for the release
   of that slot. SPIN must refute inv_device_war with a counterexample. */
#define SEED_ORDERING 1
#include "pipeline.pml"
