/* The seed's ordering: the copy into a device slot does not wait for the release
   of that slot. SPIN must refute inv_device_war with a counterexample. */
#define RELEASE_DRAINED(k) true
#include "pipeline.pml"
