/* The claims of specs/INVARIANTS.md over pipeline.pml's state, one per clause,
   named after the invariant ID; and the witnesses (w_*), "never X" claims that SPIN
   must refute, each showing that a situation a claim guards against is reachable,
   so that no claim holds because its situation never arises.

   Claims read slot states (st[]), the ticks slots hold, the buffers' contents and
   flags, and the history step() keeps (from_ready[], nrel); none reads a counter that the
   actor being checked maintains for itself. Included by pipeline.pml unless
   NOCLAIMS is defined. tests/test_spin.py checks every inv_* claim with ./pan -a -f
   (weak fairness) and refutes every w_* witness. */

/* With faults a requested tick may end FAILED or CLOSED instead of READY. */
#if defined(FAULTS) || defined(PACKER_FAULTS)
#define ESCAPE (failed || closed)
#else
#define ESCAPE false
#endif

/* INV-HOT: at most one slot HOT, counted over the slot states. */
#define NOT_BOTH_HOT(i, j) (!(st[i] == HOT && st[j] == HOT))
ltl inv_hot { [] ALL_PAIRS(NOT_BOTH_HOT) }

/* INV-ORDER, requested consecutively: while the pipeline lives, the ticks the slots
   hold are distinct, lie in [nrel, next_req) and are as many as that run is long:
   exactly nrel, nrel + 1, ..., next_req - 1 (each HOT period so far held one tick). */
#if D == 2
#define N_HELD (HELD(0) + HELD(1))
#define ALL_UNORDERED(P) P(0, 1)
#else
#define N_HELD (HELD(0) + HELD(1) + HELD(2))
#define ALL_UNORDERED(P) (P(0, 1) && P(0, 2) && P(1, 2))
#endif
#define IN_RUN(k) (!HELD(k) || (tick_of[k] >= nrel && tick_of[k] < next_req))
#define DISTINCT(i, j) (!(HELD(i) && HELD(j) && tick_of[i] == tick_of[j]))
ltl inv_order_consecutive { [] (ALL(IN_RUN) && ALL_UNORDERED(DISTINCT) &&
                                (!LIVE || N_HELD == next_req - nrel)) }

/* INV-ORDER, ring order: tick t sits in slot t mod D while pending or hot. */
#define IN_RING_SLOT(k) (!HELD(k) || tick_of[k] % D == k)
ltl inv_order_ring { [] ALL(IN_RING_SLOT) }

/* INV-ORDER, acquired in request order: no older tick is pending while one is HOT. */
#define NO_OLDER_PENDING(i, j) (!(st[i] == HOT && HELD(j) && tick_of[j] < tick_of[i]))
ltl inv_order_acquire { [] ALL_PAIRS(NO_OLDER_PENDING) }

/* INV-ORDER, each exactly once: the n-th HOT period holds tick n (none skipped,
   none repeated) ... */
#define NTH_HOT_HOLDS_N(k) (st[k] != HOT || tick_of[k] == nrel)
ltl inv_order_once { [] ALL(NTH_HOT_HOLDS_N) }
/* ... and every one of the T ticks is acquired and released. */
ltl inv_order_every { <> (nrel == T || ESCAPE) }

/* INV-HOST-WAR: H[k] is written (by the packer or the learner) only while slot k
   is REQUESTED (or dead: the pipeline failed or closed under a write) ... */
#define WRITES_REQUESTED(k) (!H_WRITE(k) || st[k] == REQUESTED || DEAD(k))
ltl inv_host_war_requested { [] ALL(WRITES_REQUESTED) }
/* ... never while a copy from H[k] is ordered or running ... */
#define NO_WRITE_UNDER_COPY(k) (!(H_WRITE(k) && (ordered[k] || copying[k])))
ltl inv_host_war_copy { [] ALL(NO_WRITE_UNDER_COPY) }
/* ... and every chunk of it by one writer: while slot k is REQUESTED its request's
   C chunks are each unclaimed, being written by the packer or by the learner, or
   written, and no more (a chunk claimed twice counts twice; the model counts, it
   does not name chunks). A dead packer's chunk is lost: the watchdog ends the run. */
#define ONE_WRITER(k) (st[k] != REQUESTED || packer_dead || \
                       left[k] + hwrite[k] + lwrite[k] + done[k] == C)
ltl inv_host_one_writer { [] ALL(ONE_WRITER) }

/* INV-DEVICE-WAR: G[k] is not written while reads of it, possibly from a HOT
   period already released, are in flight (zero-copy: the packer writes G[k]). */
#define NO_WRITE_UNDER_READS(k) (!(G_WRITE(k) && reading[k]))
ltl inv_device_war { [] ALL(NO_WRITE_UNDER_READS) }

/* INV-RAW: a HOT slot's G[k] holds its tick and nothing writes it ... */
#define HOT_DATA_COMPLETE(k) (st[k] != HOT || (!G_WRITE(k) && G_TICK(k) == tick_of[k]))
ltl inv_raw { [] ALL(HOT_DATA_COMPLETE) }
/* ... and it became HOT from READY: no slot is acquired before its copy completed. */
#define HOT_FROM_READY(k) (st[k] != HOT || from_ready[k])
ltl inv_raw_ready { [] ALL(HOT_FROM_READY) }

/* INV-LIVE, first half: the learner always returns (done or raised), and every
   requested tick becomes READY (with faults: or the pipeline fails or closes). */
ltl inv_live { <> learner_done }
#define BECOMES_READY(k) (st[k] != REQUESTED || <> (st[k] == READY || ESCAPE))
ltl inv_live_ready { [] ALL(BECOMES_READY) }

/* INV-CLOSE: when close() returns every slot is CLOSED, no copy is in flight and
   the packer is not writing; CLOSED is for good. */
#define CLOSED_DRAINED(k) (st[k] == CLOSED && DRAINED(k))
#define IS_CLOSED(k) (st[k] == CLOSED)
ltl inv_close { [] ((learner_done -> ALL(CLOSED_DRAINED)) &&
                    (closed -> [] (closed && ALL(IS_CLOSED)))) }

#ifdef PACKER_FAULTS
/* INV-LIVE, second half: a packer that died or went silent makes the learner raise
   once it waits for a request no one serves: not packed, not being packed by the
   learner, and one the learner may not take (no chunk left, or too many started). */
#define UNSERVED(k) (st[k] == REQUESTED && !packed[k])
#define ORPHANED (WAITING && UNSERVED(acq_slot) && !lwrite[acq_slot] && !TAKE_GUARD)
ltl inv_live_watchdog { [] (((packer_dead || packer_silent) && ORPHANED) ->
                            <> learner_raised) }
#endif
#if defined(FAULTS) || defined(PACKER_FAULTS)
/* INV-STICKY: a failure is for good: every slot FAILED or CLOSED, none HOT ... */
ltl inv_sticky { [] (failed -> [] (failed && hot == NONE && ALL(DEAD))) }
/* ... and a learner with ticks left raises instead of going on. */
ltl inv_sticky_raises { [] (((failed || closed) && nrel < T) -> <> learner_raised) }
#endif

/* -- witnesses: each must be refuted ------------------------------------------ */

/* INV-HOT: a second slot is READY while one is HOT. */
#define HOT_AND_READY(i, j) (st[i] == HOT && st[j] == READY)
ltl w_hot_beside_ready { [] !ANY_PAIR(HOT_AND_READY) }
/* INV-ORDER: the ring is full (every slot holds a tick) ... */
ltl w_ring_full { [] !ALL(HELD) }
/* ... the ring wraps: a slot is HOT again with tick >= D ... */
#define WRAPPED(k) (st[k] == HOT && tick_of[k] >= D)
ltl w_ring_wraps { [] !ANY(WRAPPED) }
/* ... and two batches are READY at once, so the learner has a choice. */
#define BOTH_READY(i, j) (st[i] == READY && st[j] == READY)
ltl w_two_ready { [] !ANY_PAIR(BOTH_READY) }
/* INV-RAW: the learner waits for the oldest batch while its slot is SUBMITTED ... */
ltl w_oldest_submitted { [] !(WAITING && st[acq_slot] == SUBMITTED) }
/* ... or while G of that slot is being written. */
ltl w_wait_under_write { [] !(WAITING && G_WRITE(acq_slot)) }
/* INV-HOST-WAR, INV-DEVICE-WAR: pack, copy and compute overlap. */
#define PACK_AND_READ(i, j) (hwrite[i] && reading[j])
ltl w_pack_during_reads { [] !ANY_PAIR(PACK_AND_READ) }
#ifndef ZEROCOPY
#define PACK_AND_COPY(i, j) (hwrite[i] && copying[j])
ltl w_pack_during_copy { [] !ANY_PAIR(PACK_AND_COPY) }
#define COPY_AND_READ(i, j) (copying[i] && reading[j])
ltl w_copy_during_reads { [] !ANY_PAIR(COPY_AND_READ) }
#endif
#if !defined(ZEROCOPY) && !defined(MPS)
/* INV-DEVICE-WAR: reads outlive release, and a copy waits on the release fence. */
#define READ_AFTER_RELEASE(k) (reading[k] && st[k] != HOT)
ltl w_reads_outlive_release { [] !ANY(READ_AFTER_RELEASE) }
#define COPY_AT_FENCE(k) (ordered[k] && reading[k])
ltl w_copy_waits_for_release { [] !ANY(COPY_AT_FENCE) }
#endif
#ifdef CUDA
/* the transfer thread is blocked in submit while another pack-done waits */
#define PACKED(k) packed[k]
ltl w_submit_blocks { [] !(busy != NONE && ANY(PACKED)) }
#endif
#ifdef MPS
/* the learner waits for a batch while the pump's copy runs */
#define PUMPING(k) (copying[k] && st[k] == SUBMITTED)
ltl w_pump_while_waiting { [] !(WAITING && ANY(PUMPING)) }
#endif
/* INV-LIVE: the learner waits for a batch. */
ltl w_learner_waits { [] !WAITING }
/* INV-HOST-WAR: the learner packs a batch, the packer packs one while the learner
   packs another, and both write chunks of the same batch at once. */
#define LEARNER_WRITING(k) lwrite[k]
ltl w_learner_packs { [] !ANY(LEARNER_WRITING) }
ltl w_two_writers { [] !(ANY(WRITING) && ANY(LEARNER_WRITING)) }
#define SHARED(k) (hwrite[k] && lwrite[k])
ltl w_shared_request { [] !ANY(SHARED) }
#ifdef PACKER_FAULTS
/* INV-LIVE watchdog: a dead or a silent packer with a request pending. */
ltl w_dead_packer_request { [] !(packer_dead && ANY(UNSERVED)) }
ltl w_silent_packer_request { [] !(packer_silent && ANY(UNSERVED)) }
#endif
#if defined(FAULTS) || defined(PACKER_FAULTS)
/* INV-STICKY: a failure under a running copy, under a batch in use ... (the
   watchdog fires while the learner waits: with synchronous reads it finds no read
   in flight, and on MPS, whose learner runs the copies, no copy; there only FAULTS
   reaches these) */
#if !defined(ZEROCOPY) && (defined(FAULTS) || !defined(MPS))
#define COPYING(k) copying[k]
ltl w_fail_during_copy { [] !(failed && ANY(COPYING)) }
#endif
#if defined(FAULTS) || !(defined(ZEROCOPY) || defined(MPS))
#define FAILED_IN_USE(k) (st[k] == FAILED && reading[k])
ltl w_fail_while_read { [] !ANY(FAILED_IN_USE) }
#endif
#endif
#ifdef FAULTS
/* ... or under a pack (a dead packer writes nothing, so only FAULTS reaches it). */
#define FAILED_MID_WRITE(k) (hwrite[k] && st[k] == FAILED)
ltl w_fail_during_write { [] !ANY(FAILED_MID_WRITE) }
/* INV-CLOSE: close() while a copy or a pack is in flight, so draining matters. */
#define IN_FLIGHT(k) (!DRAINED(k))
ltl w_close_in_flight { [] !(closed && ANY(IN_FLIGHT)) }
#endif
