/* A copy engine that reports completion when the copy starts. SPIN must refute
   inv_raw. */
#define COPY_START(k) :: d_step { ordered[k] && !copying[k] && RELEASE_DRAINED(k) -> \
                                  ordered[k] = false; copying[k] = true; \
                                  if :: st[k] == SUBMITTED -> step(k, ev_complete) \
                                     :: else fi }
#define COMPLETES(k)
#include "../pipeline.pml"
