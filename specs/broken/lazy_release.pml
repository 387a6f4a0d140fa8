/* A learner that releases lazily: release clears its own bookkeeping, the slot
   leaves HOT later, after the next batch may already be HOT. SPIN must refute
   inv_hot (a counter the learner kept itself would not notice). */
byte lazy = 255;
#define LEARNER_RELEASE \
  :: d_step { REL_GUARD && lazy == NONE -> lazy = hot; hot = NONE } \
  :: d_step { lazy != NONE -> tick_of[lazy] = NONE; step(lazy, ev_release); lazy = NONE }
#include "../pipeline.pml"
