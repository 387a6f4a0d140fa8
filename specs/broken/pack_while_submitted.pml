/* A packer that serves a request again after its pack-done was taken, while the
   copy from H[k] may run. SPIN must refute inv_host_war_requested and
   inv_host_war_copy. */
#define PACKABLE(k) ((st[k] == REQUESTED || st[k] == SUBMITTED) && !packed[k])
#include "../pipeline.pml"
