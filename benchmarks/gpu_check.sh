#!/usr/bin/env bash
# replay_fsm: one short GPU check of the CUDA paths, for a machine with a CUDA device
# (written on machines without one: it has not run on a GPU yet). Target: under 5
# minutes on one H100. Writes everything under $OUT.
#
# Needs (prepare separately; the device machine has no network):
#   - the repo tree as the working directory (or REPO=/path/to/repo);
#   - a Python with a CUDA build of torch (>=2.4), numpy, pytest, hypothesis
#     (pytest-timeout optional): PY=/path/to/python, default python3;
#   - /dev/shm with ~100 MB free (~1 GB more for the full-size copy benchmark, which
#     is skipped below that).
# Usage:  OUT=/some/dir bash gpu_check.sh        (the run tool sets $OUT)
# Exit status: 0 when every step ran and passed, 1 otherwise; $OUT/summary.txt says
# which. Each step has its own timeout, so one hang cannot eat the budget.
set -u
REPO=${REPO:-$PWD}
PY=${PY:-python3}
OUT=${OUT:-/tmp/replay_fsm_gpu_check}
mkdir -p "$OUT/scripts"
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok; [ $rc -ne 0 ] && { verdict="FAILED rc=$rc"; FAILED=1; }
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT after ${limit}s"
    echo "$name: $verdict ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
    tail -n 40 "$OUT/$name.log"
}

# -- the Python parts, written first (GPU_CHECK_WRITE_ONLY=1 stops after this) ----
cat > "$OUT/scripts/probe.py" <<'PYEOF'
"""One probe per process: python probe.py NAME. Prints PROBE NAME: key=value lines."""
import gc, sys, time
import torch

cr = lambda: torch.cuda.cudart()
PORTABLE = 1


def cycles(ms):  # torch.cuda._sleep spins this many GPU clock cycles (~1.4-2 GHz)
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_750_000
    return int(rate_khz * ms)


def say(name, **kv):
    print(f"PROBE {name}: " + " ".join(f"{k}={v!r}" for k, v in kv.items()), flush=True)


def register(t):
    return int(cr().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), PORTABLE))


def p_register():
    """cudaHostRegister of torch shared memory; int() of the result; is_pinned; a second
    registration; whether its error then surfaces at an unrelated kernel launch."""
    t = torch.zeros(1 << 20).share_memory_()
    before = t.is_pinned()
    err = register(t)
    say("register", first=err, pinned_before=before, pinned_after=t.is_pinned())
    err2 = register(t)
    say("register", second=err2, text=str(cr().cudaGetErrorString(cr().cudaError(err2))) if err2 else "")
    try:
        x = torch.ones(1000, device="cuda")
        y = (x * 2).sum().item()
        say("register", kernel_after_failed_register="ok", value=y)
    except RuntimeError as exc:
        say("register", kernel_after_failed_register="RAISED", error=str(exc)[:200])
    say("register", unregister=int(cr().cudaHostUnregister(t.data_ptr())), pinned=t.is_pinned())
    say("register", unregister_again=int(cr().cudaHostUnregister(t.data_ptr())))


def p_setup_fail():
    """CudaBackend.setup whose cudaHostRegister fails (the slot's pages overlap a range
    registered before): the error is read out, so a later kernel on this thread runs."""
    from replay_fsm.transfer.cuda import CudaBackend
    t = torch.zeros(1 << 20).share_memory_()
    tail = t[1 << 19:]
    say("setup_fail", tail_register=register(tail), slot_pinned=t.is_pinned())
    b = CudaBackend("cuda")
    try:
        b.setup([t], lambda s: None, lambda e: None)
        say("setup_fail", setup="ok (no overlap error here)")
    except RuntimeError as exc:
        say("setup_fail", setup="raised", error=str(exc)[:120])
    try:
        y = (torch.ones(1000, device="cuda") * 2).sum().item()
        say("setup_fail", kernel_after="ok", value=y)
    except RuntimeError as exc:
        say("setup_fail", kernel_after="RAISED", error=str(exc)[:200])
    b.close()
    cr().cudaHostUnregister(tail.data_ptr())


def p_views():
    """Host slots given as views of one shared tensor (n, rows, width): adjacent slots on
    one page, registered one by one, as CudaBackend does for a list of views."""
    big = torch.zeros(3, 10, 10).share_memory_()  # 400 B a slot: all on one page
    errs = [register(big[i]) for i in range(3)]
    say("views", errs=errs, pinned=[big[i].is_pinned() for i in range(3)])
    for i in range(3):
        cr().cudaHostUnregister(big[i].data_ptr())


def p_stale():
    """Shared memory freed while still registered, then a new tensor of the same size:
    same address? reported pinned? does a copy from it give its data?"""
    from replay_fsm.data.shared import shared_zeros
    n = 1 << 22
    t = shared_zeros(n, what="probe")
    ptr = t.data_ptr()
    say("stale", register=register(t))
    del t
    gc.collect()
    t2 = shared_zeros(n, what="probe")
    t2.fill_(7.0)
    d = torch.empty(n, device="cuda")
    d.copy_(t2, non_blocking=True)
    torch.cuda.synchronize()
    say("stale", same_address=t2.data_ptr() == ptr, new_reports_pinned=t2.is_pinned(),
        copy_correct=bool((d == 7).all().item()), register_new=register(t2))


def p_spin():
    """Host CPU time of event.synchronize() on a ~300 ms kernel: blocking=False (what
    CudaBackend's ready events were) vs blocking=True."""
    s = torch.cuda.Stream()
    for blocking in (False, True):
        e = torch.cuda.Event(blocking=blocking)
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles(300))
            e.record(s)
        w0, c0 = time.perf_counter(), time.thread_time()
        e.synchronize()
        say("spin", blocking=blocking, wall_s=round(time.perf_counter() - w0, 3),
            cpu_s=round(time.thread_time() - c0, 3))


def p_async():
    """copy_(non_blocking=True) from registered shared memory returns before the copy
    ends; from unregistered (pageable) shared memory it does not (but stays correct)."""
    n = 64 << 20  # 256 MB
    src = torch.empty(n).share_memory_()
    src.fill_(3.0)
    d = torch.empty(n, device="cuda")
    s = torch.cuda.Stream()
    for registered in (True, False):
        if registered:
            register(src)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            t0 = time.perf_counter()
            d.copy_(src, non_blocking=True)
            returned = time.perf_counter() - t0
        s.synchronize()
        done = time.perf_counter() - t0
        say("async", registered=registered, pinned=src.is_pinned(), returned_ms=round(returned * 1e3, 2),
            done_ms=round(done * 1e3, 2), GBps=round(n * 4 / done / 1e9, 1),
            correct=bool((d == 3).all().item()))
        if registered:
            cr().cudaHostUnregister(src.data_ptr())


if __name__ == "__main__":
    globals()["p_" + sys.argv[1]]()
PYEOF

cat > "$OUT/scripts/war.py" <<'PYEOF'
"""Each tick the learner enqueues a long kernel, THEN a read of the batch (sum of obs),
then releases: the copy of a later tick into the same slot must wait for that read.
fence=off drops the release event (the seed's missing fence): a negative control that
must show mismatches, or this check proves nothing. Also: the transfer worker thread's
CPU time over the run (a spinning cudaEventSynchronize shows as ~1 core)."""
import os, sys, threading, time
import torch
from replay_fsm import Pipeline, ReplayBuffer
from replay_fsm.data.sampling import expected_batch


def cycles(ms):
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_750_000
    return int(rate_khz * ms)


def thread_cpu_s(name):
    for t in threading.enumerate():
        if t.name == name and t.native_id:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def run(depth, fence, blocking, ticks=120, step_ms=8.0):
    rb = ReplayBuffer(20_000, 40, 8)
    rb.add_packed(torch.randn(20_000, rb.width))
    n = 4096
    with Pipeline(rb, device="cuda", sample_count=n, ring_depth=depth, base_seed=11,
                  liveness_timeout=60) as pipe:
        b = pipe.backend
        if blocking is not None:  # lazily created events: swap before the first copy
            b.ready = [torch.cuda.Event(blocking=blocking) for _ in b.ready]
        if fence == "off":
            b.after_read = lambda slot: None
        got, want = [], []
        c0, w0 = thread_cpu_s("replay_fsm-transfer"), time.perf_counter()
        for tick, batch in pipe.ticks(0, ticks):
            torch.cuda._sleep(cycles(step_ms))
            got.append(batch["obs"].double().sum())
            done = pipe.pack_record(tick)
            ref = expected_batch(rb.storage, done.snapshot_size, n, pipe.base_seed + tick)
            want.append(rb.layout.views(ref)["obs"].double().sum().item())
        torch.cuda.synchronize()
        wall = time.perf_counter() - w0
        cpu = thread_cpu_s("replay_fsm-transfer") - c0
    bad = sum(abs(g.item() - w) > 1e-6 * max(1.0, abs(w)) for g, w in zip(got, want))
    print(f"WAR depth={depth} fence={fence} ready_blocking={blocking}: "
          f"mismatches={bad}/{ticks} wall={wall:.2f}s worker_cpu={cpu:.2f}s "
          f"({cpu / wall:.0%} of a core)", flush=True)
    return bad


if __name__ == "__main__":
    ok = True
    for depth in (2, 3):
        ok &= run(depth, "on", None) == 0  # the backend as it is
    ok &= run(2, "on", False) == 0
    ok &= run(2, "on", True) == 0
    control = run(2, "off", None)
    if control == 0:
        print("negative control showed no mismatch: this check cannot see a missing fence")
    sys.exit(0 if ok else 1)
PYEOF
[ -n "${GPU_CHECK_WRITE_ONLY:-}" ] && exit 0

# -- 0. the machine ---------------------------------------------------------------------
{
  date -u; uname -a; nvidia-smi 2>&1 | head -20; df -h /dev/shm; ulimit -a | grep -i lock
  git -C "$REPO" log --oneline -1 2>/dev/null; git -C "$REPO" status --short 2>/dev/null | head
  "$PY" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'available', torch.cuda.is_available(), torch.cuda.device_count())"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device through $PY: nothing to check" | tee -a "$SUMMARY"; exit 1
fi

# -- 1. probes of the torch/CUDA behaviour the backend relies on (each in its own process)
for p in register setup_fail views stale spin async; do
    step "probe_$p" 60 "$PY" "$OUT/scripts/probe.py" "$p"
done

# -- 2. the repo's CUDA tests (the contract tests carry no cuda marker: select by -k) --
step pytest_cuda 200 "$PY" -m pytest -q -p no:cacheprovider -rs \
    --junitxml="$OUT/pytest_cuda.xml" \
    "tests/test_pipeline.py" "tests/test_testing_machine.py" "tests/test_extending.py" \
    "tests/test_buffer.py::test_fields_on_the_device_are_stored_on_the_host" \
    "tests/test_compat_behaviour.py::test_on_cuda_the_slots_are_pinned_until_close_and_each_copy_is_the_seeds_span" \
    -k "cuda or setup_fail or fields_on_the_device or on_cuda"

# -- 3. INV-DEVICE-WAR end to end, and the transfer worker's CPU while it waits --------
step war 120 "$PY" "$OUT/scripts/war.py"

# -- 4. the copy benchmark (quick; full size when /dev/shm has room) --------------------
step bench_cuda_copy_quick 90 "$PY" benchmarks/cuda_copy.py --quick
free_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ "${free_kb:-0}" -gt 2000000 ]; then
    step bench_cuda_copy_full 150 "$PY" benchmarks/cuda_copy.py
else
    echo "bench_cuda_copy_full: skipped (/dev/shm has ${free_kb:-?} kB free)" | tee -a "$SUMMARY"
fi
cp benchmarks/results/cuda_copy*.json "$OUT/" 2>/dev/null

echo "---- summary"; cat "$SUMMARY"
ls /dev/shm | grep -c torch_ > "$OUT/dev_shm_torch_files_left.txt" 2>/dev/null
exit $FAILED
