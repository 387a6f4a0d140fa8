"""CUDA (and ROCm through the same torch.cuda surface).

Host slots are page-locked in place with cudaHostRegister, so the packer's shared
memory is the DMA source. One copy stream; per slot a ready event (recorded after
the copy) and a release event (recorded on the learner's current stream at
release). The copy stream waits on the release event before overwriting G[i]
(INV-DEVICE-WAR: the seed's missing fence); the learner's stream waits on the
ready event at acquire (INV-RAW).
"""

from __future__ import annotations

import torch

from ..wire import CopyOrder
from .base import (
    HostSlots,
    OnComplete,
    OnError,
    TransferBackend,
    allocate_like,
    available_device,
    parse_device,
)

CUDA_HOST_REGISTER_PORTABLE = 1


class CudaBackend(TransferBackend):
    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda", *, timing: bool = False) -> None:
        """``timing``: CUDA-event copy timings (``last_copy_ms``) and NVTX ranges
        around each copy submission (on when the pipeline traces)."""
        self.device = parse_device(device)
        if self.device.type != "cuda":  # "cpu" became cuda:0 here once
            raise ValueError(f"backend 'cuda' is for cuda[:N] devices (ROCm's too), got "
                             f"device {str(self.device)!r}")
        available_device(self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timing = timing
        self.last_copy_ms: dict[int, float] = {}
        # The host slots setup registered, held (not just their addresses) until close
        # unregisters them: a registration never outlives its mapping, whatever the
        # caller does with the list it gave (which ``host`` is).
        self._registered: list[torch.Tensor] = []
        self._regions: list[torch.Tensor] = []  # every host slot, pinned at setup
        self._pinned = False
        self._closed = False

    @property
    def host_pinned(self) -> bool:
        """Whether the host slots are page-locked now: from a setup that pinned them
        until close, and while each still is. Asked each time, not kept: a slot setup
        found pinned already (someone else's registration) stays so only as long as
        they keep it."""
        return self._pinned and all(region.is_pinned() for region in self._regions)

    def setup(self, host_slots: HostSlots, on_complete: OnComplete,
              on_error: OnError) -> None:
        self.host = host_slots
        self.on_complete = on_complete
        self.on_error = on_error
        regions = [host_slots] if isinstance(host_slots, torch.Tensor) else list(host_slots)
        self._regions = regions
        try:
            # Under the slot device: a runtime call makes the current device's primary
            # context if it has none (cuda:1 would otherwise put one on cuda:0 too).
            with torch.cuda.device(self.device):
                for region in regions:
                    if region.is_pinned():
                        continue
                    ptr = region.data_ptr()
                    err = int(torch.cuda.cudart().cudaHostRegister(
                        ptr, region.numel() * region.element_size(),
                        CUDA_HOST_REGISTER_PORTABLE))
                    if err != 0:
                        # Else the runtime's last error stays set on this (the learner's)
                        # thread, and torch raises it at its next kernel launch here.
                        _clear_last_error(self.device)
                        raise RuntimeError(f"cudaHostRegister of the host slots failed: "
                                           f"cudaError {err}{_error_text(err)}")
                    self._registered.append(region)
                self._pinned = True
                self.device_slots = allocate_like(host_slots, self.device)
                self.stream = torch.cuda.Stream(self.device)
                n = len(host_slots)
                # blocking: the transfer worker sleeps in ready.synchronize() instead of
                # spinning a core until the copy (and the reads it waits for) ends.
                self.ready = [torch.cuda.Event(enable_timing=self.timing, blocking=True)
                              for _ in range(n)]
                self.started = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
                self.released = [torch.cuda.Event() for _ in range(n)]
        except BaseException:
            # Nothing stays page-locked behind a setup that failed part way (a CUDA
            # out-of-memory for the device slots): the host slots' memory is freed
            # later, and a registration left on it outlives the mapping.
            self.close()
            raise

    def submit(self, order: CopyOrder) -> None:
        slot = order.slot
        if self.timing:
            torch.cuda.nvtx.range_push(f"replay_fsm/copy tick {order.tick} slot {slot}")
        try:
            with torch.cuda.stream(self.stream):
                if order.after_release is not None:
                    # INV-DEVICE-WAR: kernels still reading G[slot] finish first.
                    self.stream.wait_event(self.released[order.after_release.slot])
                if self.timing:
                    self.started[slot].record(self.stream)
                if self.monitor is not None:
                    self.monitor.copy_started(slot)
                self.device_slots[slot].copy_(self.host[slot], non_blocking=True)
                self.ready[slot].record(self.stream)
        finally:  # a copy that raised leaves no range open on the worker's NVTX stack
            if self.timing:
                torch.cuda.nvtx.range_pop()
        self.ready[slot].synchronize()
        if self.monitor is not None:
            self.monitor.copy_finished(slot)
        if self.timing:
            self.last_copy_ms[slot] = self.started[slot].elapsed_time(self.ready[slot])
        self.on_complete(slot)

    def trace(self, enabled: bool) -> None:
        self.timing = self.timing or enabled

    def before_read(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def after_read(self, slot: int) -> None:
        self.released[slot].record(torch.cuda.current_stream(self.device))

    def copy_held(self, slot: int) -> bool:
        # The copy stream waits on this event (INV-DEVICE-WAR): until the learner's
        # stream passes it, the copy has not begun, and the time is the learner's
        # step still queued on the device, not the copy's. (reads_pending stays
        # False: checked mode asks it when the copy is enqueued, behind that wait.)
        return not self.released[slot].query()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if hasattr(self, "stream"):
                self.stream.synchronize()
                torch.cuda.current_stream(self.device).synchronize()
        finally:  # a device error in the drain still unregisters the host slots
            failed = False
            while self._registered:
                ptr = self._registered.pop().data_ptr()
                failed |= int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0
            self._pinned, self._regions = False, []
            if failed:  # nothing left to undo; the runtime's last error is read out
                _clear_last_error(self.device)


def _clear_last_error(device: torch.device) -> None:
    """Read out, and so reset, the CUDA runtime's last error on this thread, which a
    failed runtime call (cudaHostRegister, cudaHostUnregister) leaves set: torch reads
    it (cudaGetLastError) after its next kernel launch on this thread and raises it
    there, as the error of that unrelated op. torch's cudart binding may lack
    cudaGetLastError; then one tiny kernel launched here lets torch's own launch check
    read it out (the error that check raises is the stale one). Best effort: it never
    raises (a context already broken stays broken)."""
    try:
        get_last_error = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
        if get_last_error is not None:
            get_last_error()
        else:
            _launch_check(device)
    except Exception:  # noqa: BLE001 - the stale error itself, read out by torch
        pass


def _launch_check(device: torch.device) -> None:
    """One kernel launch on ``device``: torch checks the last error after it."""
    torch.empty(1, device=device).fill_(0.0)


def _error_text(err: int) -> str:
    """": " and the CUDA runtime's own words for error ``err``, or "" where the runtime
    gives none (a torch whose binding lacks cudaGetErrorString)."""
    try:
        cudart = torch.cuda.cudart()
        return f": {cudart.cudaGetErrorString(cudart.cudaError(err))}"
    except Exception:  # noqa: BLE001 - the number alone still names the error
        return ""
