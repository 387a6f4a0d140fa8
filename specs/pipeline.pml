/* replay_fsm: the learner, packer, transfer worker, copy engine and device compute
   over a ring of D slots, for T ticks starting at tick 0. Every slot state change
   goes through step(), which records the history the claims need and calls fire()
   from slot_table.pml, generated from replay_fsm.spec: a change the table does
   not have is an assertion failure.

   spin -DD=3 -DT=7 -a pipeline.pml && gcc -DNFAIR=3 -o pan pan.c && ./pan -a -f -N inv_hot
   spin -DD=3 -DT=7 -DNOCLAIMS -a pipeline.pml && gcc -DSAFETY -o pan pan.c && ./pan
   (deadlock freedom: no invalid end state.) The claims and witnesses are in
   claims.pml; tests/test_spin.py checks all of them for every variant below and
   specs/INVARIANTS.md lists them.

   Backends (at most one; none: the emulated and manual backends, whose copy engine
   runs beside the transfer thread and completes copies itself):
   -DCUDA      submit blocks the transfer thread until the copy completed; the copy
               stream waits on the slot's release event; kernels outlive release.
   -DZEROCOPY  the CPU backend: G[i] is H[i], so the learner reads what the packer
               writes; no copy; on_complete runs on the transfer thread; CPU reads
               are over when the learner releases.
   -DMPS       the transfer thread only defers the order; the learner's pump issues
               the copy and waits for it (device synchronize) while it waits for a
               batch; release synchronizes the device, so reads end at release.
   The learner may pack the chunks of the oldest requested tick the packer has not
   reached (Pipeline(learner_packs=True), specs/LEARNER_PACKS.md): a request has C
   chunks (-DC=, default 2); the packer and the learner each claim a chunk in one
   atomic step (the claim lock) before writing it into H[k], so every chunk has one
   writer, and whoever counts the last chunk written posts the pack-done message.
   Faults:
   -DFAULTS    once, any actor fails the pipeline or someone closes it.
   -DPACKER_FAULTS  the packer may die (even mid-write) or go silent (alive, never
               packs again); the learner's watchdog then fails the pipeline
               (CollectorDied).
   Refinement: -DREFINE (with -DNOCLAIMS) adds a probe that writes every reachable
               state's projection and the learner's guards; see
               replay_fsm/verify/refinement.py.
   The files in broken/ (and pipeline_broken.pml, the seed's ordering) each define
   one of the actor step macros below before including this file; SPIN must refute
   the claim each one targets (tests/test_spin_broken.py). */

#ifndef D
#define D 2
#endif
#ifndef T
#define T 5
#endif
#ifndef C
#define C 2
#endif
#define NONE 255

#if (defined(CUDA) + defined(ZEROCOPY) + defined(MPS)) > 1
#error "choose at most one backend: CUDA, ZEROCOPY or MPS"
#endif

#if D == 2
#define FOR_SLOTS(M) M(0) M(1)
#define ALL(P) (P(0) && P(1))
#define ANY(P) (P(0) || P(1))
#define ALL_PAIRS(P) (P(0, 1) && P(1, 0))
#define ANY_PAIR(P) (P(0, 1) || P(1, 0))
#elif D == 3
#define FOR_SLOTS(M) M(0) M(1) M(2)
#define ALL(P) (P(0) && P(1) && P(2))
#define ANY(P) (P(0) || P(1) || P(2))
#define ALL_PAIRS(P) (P(0, 1) && P(0, 2) && P(1, 0) && P(1, 2) && P(2, 0) && P(2, 1))
#define ANY_PAIR(P) (P(0, 1) || P(0, 2) || P(1, 0) || P(1, 2) || P(2, 0) || P(2, 1))
#else
#error "the model is written for D = 2 or 3"
#endif

#include "slot_table.pml"
mtype st[D] = IDLE;

/* History, kept by step() alone so that an actor's own bookkeeping cannot vouch
   for itself: whether slot k left READY in its last transition, and how many HOT
   periods have ended (the n-th HOT period must hold tick n). A bool rather than
   the whole source state: it is all inv_raw_ready needs, and it keeps the state
   space of the fault runs small. */
bool from_ready[D];
byte nrel = 0;

inline step(k, ev) {
  from_ready[k] = (st[k] == READY);
  fire(k, ev);
  if
  :: ev == ev_release -> nrel++
  :: else
  fi
}

byte tick_of[D] = NONE; /* the tick slot k holds from request until release (Core) */
byte htick[D] = NONE;   /* the tick whose rows are all in H[k] (NONE while written) */
byte gtick[D] = NONE;   /* the tick whose rows are in G[k] (unused with ZEROCOPY) */
bool hwrite[D];         /* the packer is writing a chunk of H[k] */
bool lwrite[D];         /* the learner is writing a chunk of H[k], in the packer's place */
byte left[D];           /* chunks of slot k's request no one claimed (the claim cells) */
byte done[D];           /* chunks of slot k's request written and counted */
byte stale = 0;         /* requests the learner started that the packer has not dropped */
bool packed[D];         /* a pack-done message for slot k is in flight */
bool ordered[D];        /* a copy order for slot k exists and its copy has not started */
bool copying[D];        /* a copy reads H[k] and writes G[k] */
bool reading[D];        /* the learner's reads of G[k] (kernels may outlive release) */
byte next_req = 0;      /* learner: next tick to request (Core.next_tick) */
byte req_slot = 0;
byte next_acq = 0;      /* learner: oldest requested tick not yet acquired */
byte acq_slot = 0;
byte hot = NONE;        /* Core.hot_slot */
bool failed = false;    /* Core.failure is not None */
bool closed = false;    /* Core.closed */
bool learner_raised = false; /* the learner left its loop because a call raised */
bool learner_done = false;   /* the learner returned from close() */
bool packer_dead = false;
bool packer_silent = false;
#if defined(CUDA) || defined(ZEROCOPY)
byte busy = NONE;       /* the slot whose submit blocks the transfer thread */
#endif

/* The data the learner's reads see, and who writes it: with zero-copy G[k] is H[k]. */
#ifdef ZEROCOPY
#define G_TICK(k) htick[k]
#define G_WRITE(k) H_WRITE(k)
#else
#define G_TICK(k) gtick[k]
#define G_WRITE(k) copying[k]
#endif

#define LIVE (!failed && !closed)
#define IS_REQUESTED(k) (st[k] == REQUESTED)
#define HELD(k) (st[k] == REQUESTED || st[k] == SUBMITTED || st[k] == READY || st[k] == HOT)
#define WRITING(k) hwrite[k]
#define H_WRITE(k) (hwrite[k] || lwrite[k])  /* anyone writes H[k] */
#define DEAD(k) (st[k] == FAILED || st[k] == CLOSED)
#define DRAINED(k) (!copying[k] && !ordered[k] && !H_WRITE(k))

/* The learner's guards: the refinement check compares them with the real Core. */
#define REQ_GUARD (LIVE && next_req < T && st[req_slot] == IDLE)
#define ACQ_GUARD (LIVE && hot == NONE && next_acq < next_req && st[acq_slot] == READY)
#define REL_GUARD (LIVE && hot != NONE)
#define WAITING (LIVE && hot == NONE && next_acq < next_req && st[acq_slot] != READY)
/* Pipeline._judge_locked (Watchdog.verdict): a dead packer, or no heartbeat while a request waits. */
#define PACKER_GONE (packer_dead || (packer_silent && ANY(IS_REQUESTED)))
/* Pipeline._take_locked: the learner waits for the oldest requested tick, which has
   chunks no one claimed. ChannelLink.take lets it start one only while at most D
   requests wait in the channel; the requests it started stay there until the packer
   reads them, and one more may be held by the packer: so at most D + 1 it started
   are not dropped. (The real take checks that bound once per take, before its first
   chunk; the model checks it only for a request's first chunk: more runs.) */
#define TAKE_GUARD (LIVE && next_acq < next_req && st[acq_slot] == REQUESTED && \
                    left[acq_slot] > 0 && (left[acq_slot] < C || stale <= D))

#define FAIL_SLOT(k) step(k, ev_fail);
#define CLOSE_SLOT(k) step(k, ev_close);
#define DROP_ORDER(k) ordered[k] = false;
inline fail_pipeline() {
  FOR_SLOTS(FAIL_SLOT)
  failed = true;
  hot = NONE
}
inline close_pipeline() {
  if
  :: !closed ->
       FOR_SLOTS(CLOSE_SLOT)
       closed = true;
       hot = NONE;
#ifdef MPS
       FOR_SLOTS(DROP_ORDER) /* deferred orders are dropped: never issued */
#endif
  :: else
  fi
}

#ifdef REFINE
/* The learner's steps report (kind, pre-state, post-state): refine_probe.pml. */
#define REFINE_PRE(kind) c_code { refine_pre(kind); };
#define REFINE_POST c_code { refine_post(); };
#else
#define REFINE_PRE(kind)
#define REFINE_POST
#endif

/* Every actor step below is a macro that a file in broken/ may define first, to
   put one bug into an otherwise unchanged model. */

/* -- the learner ------------------------------------------------------------- */

#ifndef LEARNER_REQUEST
#define LEARNER_REQUEST \
  :: d_step { REQ_GUARD -> REFINE_PRE(1) \
       tick_of[req_slot] = next_req; left[req_slot] = C; done[req_slot] = 0; \
       step(req_slot, ev_request); \
       next_req++; req_slot = (req_slot + 1) % D; REFINE_POST }
#endif
#ifndef LEARNER_ACQUIRE
#define LEARNER_ACQUIRE \
  :: d_step { ACQ_GUARD -> REFINE_PRE(2) \
       step(acq_slot, ev_acquire); hot = acq_slot; reading[hot] = true; \
       next_acq++; acq_slot = (acq_slot + 1) % D; REFINE_POST }
#endif
#ifndef END_READS
#if defined(ZEROCOPY) || defined(MPS)
#define END_READS(k) reading[k] = false; /* CPU reads are synchronous; MPS synchronizes */
#else
#define END_READS(k)  /* kernels still queued keep reading G[k] after release */
#endif
#endif
#ifndef LEARNER_RELEASE
#define LEARNER_RELEASE \
  :: d_step { REL_GUARD -> REFINE_PRE(3) \
       END_READS(hot) tick_of[hot] = NONE; step(hot, ev_release); hot = NONE; \
       REFINE_POST }
#endif
#ifndef LEARNER_EXTRA
#define LEARNER_EXTRA
#endif
/* A chunk of H[k] written is counted (PackerHandle.advance, under the claim lock);
   the count that completes the request posts its pack-done message (the learner's
   to the transfer worker, as the packer's). */
#define CHUNK_WRITTEN(k) done[k]++; \
  if :: done[k] == C -> htick[k] = tick_of[k]; \
                        if :: st[k] == REQUESTED -> packed[k] = true :: else fi \
     :: else fi
/* The next chunk of slot k's request for the writer that just counted one (the
   count and the claim are one step: PackerHandle.advance). Like the code, it does
   not look whether the pipeline is still live or the slot still REQUESTED. */
#define NEXT_CHUNK(k, writing) \
  if :: left[k] > 0 -> left[k]--; writing[k] = true; htick[k] = NONE :: else fi
/* The learner packs chunks of the tick it waits for: the first claim (one step
   under the claim lock), then write, count and claim the next, until none is left
   (Packer.take). */
#ifndef LEARNER_CLAIM
#define LEARNER_CLAIM d_step { TAKE_GUARD -> if :: left[acq_slot] == C -> stale++ :: else fi; \
                               left[acq_slot]--; lwrite[acq_slot] = true; \
                               htick[acq_slot] = NONE }
#endif
#define LEARNER_PACK :: LEARNER_CLAIM; \
  packing: do \
  :: d_step { lwrite[acq_slot] -> lwrite[acq_slot] = false; CHUNK_WRITTEN(acq_slot); \
              NEXT_CHUNK(acq_slot, lwrite) } \
  :: !lwrite[acq_slot] -> break \
  od
#ifdef MPS
#ifndef PUMP
/* AcceleratorBackend.pump: copy, synchronize, on_complete, on the learner thread,
   which waits for the device meanwhile. */
#define PUMP(k) :: atomic { LIVE && ordered[k] -> ordered[k] = false; copying[k] = true; \
                            !copying[k]; \
                            if :: st[k] == SUBMITTED -> step(k, ev_complete) :: else fi }
#endif
#define LEARNER_PUMP FOR_SLOTS(PUMP)
#else
#define LEARNER_PUMP
#endif
#ifndef WATCHDOG
#ifdef PACKER_FAULTS
#define WATCHDOG :: d_step { WAITING && PACKER_GONE -> fail_pipeline() } /* CollectorDied */
#else
#define WATCHDOG
#endif
#endif
#ifndef CLOSE_DRAINS
#define CLOSE_DRAINS ALL(DRAINED);
#endif
/* Once a call raised (failed or closed), the learner leaves its loop raising. */
#ifndef LEARNER_RAISES
#define LEARNER_RAISES :: d_step { !LIVE -> learner_raised = true; close_pipeline() }; break
#endif

active proctype learner() {
head:
  do
  LEARNER_REQUEST
  LEARNER_ACQUIRE
  LEARNER_RELEASE
  LEARNER_PUMP
  LEARNER_PACK
  WATCHDOG
  LEARNER_EXTRA
  /* Pipeline.close(), after a call raised or after the last tick: the Core first,
     at once; then it joins the packer and transfer threads and drains the copies
     (INV-CLOSE). */
  LEARNER_RAISES
  :: d_step { LIVE && next_acq == T && hot == NONE -> close_pipeline() }; break
  od;
  CLOSE_DRAINS
  learner_done = true
}

/* -- the device's compute: reads of G[k] that outlive release --------------- */

#define FINISH_READS(k) :: d_step { reading[k] && st[k] != HOT -> reading[k] = false }
active proctype compute() {
end: do FOR_SLOTS(FINISH_READS) od
}

/* -- the packer: one request at a time (Packer.service) ---------------------- */

#ifndef PACKABLE
#define PACKABLE(k) (st[k] == REQUESTED && left[k] > 0)
#endif
/* The claim of a request's first chunk for the packer and the start of its write
   in one step: the packer claims under the claim lock before it gathers, one chunk
   at a time, and goes on with the same request's next chunk until none is left.
   (The real packer reads requests in order; the model lets it start any request
   with a chunk left: more runs.) */
#define PACK_START(k) :: d_step { !packer_silent && !ANY(WRITING) && PACKABLE(k) -> \
                                  left[k]--; hwrite[k] = true; htick[k] = NONE }
#define PACK_END(k) :: d_step { hwrite[k] -> hwrite[k] = false; CHUNK_WRITTEN(k); \
                                NEXT_CHUNK(k, hwrite) }
#define STOP_WRITING(k) hwrite[k] = false;
active proctype packer() {
end: do
  FOR_SLOTS(PACK_START)
  FOR_SLOTS(PACK_END)
  :: d_step { !packer_silent && stale > 0 -> stale-- } /* reads one the learner started */
#ifdef PACKER_FAULTS
  :: d_step { !packer_silent && !ANY(WRITING) -> packer_silent = true }
  :: d_step { !packer_silent -> FOR_SLOTS(STOP_WRITING) packer_dead = true }; break
#endif
  od
}

/* -- the transfer worker: pack-done -> submit (Pipeline._on_pack_done) ------- */

#if defined(CUDA) || defined(ZEROCOPY)
#ifdef CUDA
#define ISSUE(k) ordered[k] = true;
#else
#define ISSUE(k)
#endif
/* submit returns only when the copy completed (CUDA: ready event synchronize) or
   at once (CPU: nothing to copy); on_complete then runs on this thread. */
#define SUBMIT(k) :: d_step { packed[k] -> packed[k] = false; \
                              if :: st[k] == REQUESTED -> step(k, ev_submit); ISSUE(k) \
                                 :: else fi; busy = k }; \
                     d_step { !ordered[k] && !copying[k] -> \
                              if :: st[k] == SUBMITTED -> step(k, ev_complete) :: else fi; \
                              busy = NONE }
#else
#define SUBMIT(k) :: d_step { packed[k] -> packed[k] = false; \
                              if :: st[k] == REQUESTED -> step(k, ev_submit); \
                                    ordered[k] = true \
                                 :: else fi }
#endif
active proctype transfer() {
end: do FOR_SLOTS(SUBMIT) od
}

/* -- the copy engine (CUDA: the copy stream; MPS: the device the pump waits on) */

#ifndef ZEROCOPY
#ifndef RELEASE_DRAINED
#define RELEASE_DRAINED(k) (!reading[k])  /* the copy waits on the release event */
#endif
#ifndef COPY_START
#ifdef MPS
#define COPY_START(k)  /* the learner's pump issues the copies */
#else
#define COPY_START(k) :: d_step { ordered[k] && !copying[k] && RELEASE_DRAINED(k) -> \
                                  ordered[k] = false; copying[k] = true }
#endif
#endif
#ifndef COMPLETES
#if defined(CUDA) || defined(MPS)
#define COMPLETES(k)  /* the submitter calls on_complete once it waited for the copy */
#else
#define COMPLETES(k) if :: st[k] == SUBMITTED -> step(k, ev_complete) :: else fi
#endif
#endif
#define COPY_END(k) :: d_step { copying[k] -> copying[k] = false; gtick[k] = htick[k]; \
                                COMPLETES(k) }
active proctype copy_engine() {
end: do FOR_SLOTS(COPY_START) FOR_SLOTS(COPY_END) od
}
#endif

/* -- faults ------------------------------------------------------------------ */

#ifdef FAULTS
#ifndef FAULT_FAIL
#define FAULT_FAIL fail_pipeline()
#endif
active proctype fault() {
  if
  :: d_step { LIVE -> FAULT_FAIL }      /* any actor: Core.fail */
  :: d_step { LIVE -> close_pipeline() } /* close() from another thread */
  :: skip
  fi
}
#endif

#ifdef REFINE
#include "refine_probe.pml"
#endif
#ifndef NOCLAIMS
#include "claims.pml"
#endif
