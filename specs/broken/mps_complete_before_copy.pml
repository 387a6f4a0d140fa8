/* MPS whose pump calls on_complete before it issues the copy and never waits for
   the device. SPIN must refute inv_raw. */
#define MPS 1
#define PUMP(k) :: d_step { LIVE && ordered[k] -> ordered[k] = false; \
                            if :: st[k] == SUBMITTED -> step(k, ev_complete) :: else fi; \
                            copying[k] = true }
#include "../pipeline.pml"
