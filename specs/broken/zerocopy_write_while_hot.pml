/* Zero-copy with a packer that refreshes a slot's rows while the learner holds it
   HOT (G[k] is H[k]). SPIN must refute inv_host_war_requested and inv_raw. */
#define ZEROCOPY 1
#define PACKABLE(k) ((st[k] == REQUESTED && !packed[k] && htick[k] != tick_of[k]) || \
                     st[k] == HOT)
#include "../pipeline.pml"
