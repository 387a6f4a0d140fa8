/* Zero-copy where the learner's reads of H[k] may outlive release (an asynchronous
   CPU consumer, or a batch kept past after_tick): the packer then rewrites rows
   being read. SPIN must refute inv_device_war. */
#define ZEROCOPY 1
#define END_READS(k)
#include "../pipeline.pml"
