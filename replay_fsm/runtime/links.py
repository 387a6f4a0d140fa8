"""How the learner side talks to a packer: shared-memory channels, or the seed's
queues and dict messages (for collectors written for the seed)."""

from __future__ import annotations

import queue
from typing import Any, Protocol

from ..data.channel import ChannelClosed
from ..data.packer import PackerHandle
from ..wire import PackDone, PackRequest, decode, encode


class CollectorLink(Protocol):
    def send(self, request: PackRequest, *, snapshot: tuple[int, int],
             hot_slot: int) -> None: ...

    def receive(self, timeout: float) -> PackDone | None:
        """The next pack-done message, None after ``timeout``.

        Raises:
            ChannelClosed: the link was closed.
        """

    def close(self) -> None: ...


class ChannelLink:
    def __init__(self, handle: PackerHandle) -> None:
        self.handle = handle

    def send(self, request: PackRequest, *, snapshot: tuple[int, int],
             hot_slot: int) -> None:
        if not self.handle.requests.put(encode(request)[0], timeout=10.0):
            raise RuntimeError("request channel stayed full for 10 s; the packer is stuck")

    def receive(self, timeout: float) -> PackDone | None:
        got = self.handle.done.get(timeout=timeout)
        return None if got is None else decode(PackDone, *got)

    def close(self) -> None:
        self.handle.close()


class QueueLink:
    """The seed's ``collector_pack_request_queue`` / ``collector_pack_ready_queue``."""

    def __init__(self, requests: Any, ready: Any) -> None:
        self.requests, self.ready = requests, ready
        self._closed = False

    def send(self, request: PackRequest, *, snapshot: tuple[int, int],
             hot_slot: int) -> None:
        self.requests.put(request.to_seed_dict(snapshot_ptr=snapshot[0],
                                               snapshot_size=snapshot[1],
                                               learner_hot_slot=hot_slot))

    def receive(self, timeout: float) -> PackDone | None:
        if self._closed:
            raise ChannelClosed()
        try:
            msg = self.ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if msg is None or self._closed:
            raise ChannelClosed()
        return PackDone.from_seed_dict(msg)

    def close(self) -> None:
        self._closed = True
        try:
            self.ready.put_nowait(None)  # wake the transfer worker, as the seed did
        except Exception:  # noqa: BLE001 - a full or broken queue: the flag suffices
            pass
