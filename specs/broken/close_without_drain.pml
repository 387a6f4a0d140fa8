/* close() that returns without draining the copies or joining the packer. With
   close() from another thread mid-run, SPIN must refute inv_close. */
#define FAULTS 1
#define CLOSE_DRAINS
#include "../pipeline.pml"
