/* MPS whose release does not synchronize the device, so reads outlive release and
   the pump copies into G[k] under them. SPIN must refute inv_device_war. */
#define MPS 1
#define END_READS(k)
#include "../pipeline.pml"
