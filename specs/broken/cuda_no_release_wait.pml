/* CUDA whose copy stream does not wait on the slot's release event (the seed's
   defect on the CUDA model). SPIN must refute inv_device_war. */
#define CUDA 1
#define RELEASE_DRAINED(k) true
#include "../pipeline.pml"
