"""The transfer worker: a thread that turns pack-done messages into copy orders.

It receives from the collector link, asks the pipeline to fire ``submit`` on the
core (which returns the copy order, or None when the pipeline has stopped), and
hands the order to the backend. Any exception it meets fails the pipeline, chained.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..data.channel import ChannelClosed
from ..signals import join_started
from ..wire import CopyOrder, PackDone

POLL_S = 0.1


class TransferWorker:
    def __init__(self, receive: Callable[[float], PackDone | None],
                 on_done: Callable[[PackDone], CopyOrder | None],
                 submit: Callable[[CopyOrder], None],
                 fail: Callable[[BaseException], None]) -> None:
        self._receive, self._on_done, self._submit, self._fail = receive, on_done, submit, fail
        # A plain flag, not a threading.Event: Event.set() takes the Event's own lock
        # in Python code (Condition.__enter__), and a Ctrl-C landing right after that
        # acquire left the lock taken for good, so the next close() (which must
        # finish the one the Ctrl-C cut short) blocked for ever in set() (helper-79).
        self._stopping = False
        self._busy_since_ns: int | None = None  # inside one message's handling since
        self._thread = threading.Thread(target=self._run, name="replay_fsm-transfer",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def busy_since_ns(self) -> int | None:
        """Since when (``time.monotonic_ns``) the worker has been handling one message
        (its SUBMIT and the backend's submit), None while it waits for one: a submit
        that never returns holds back every message behind it. The value names the
        episode: another message is another value."""
        return self._busy_since_ns

    def stop(self, timeout: float) -> list[str]:
        """Stop and join within ``timeout``; returns what was left running."""
        self._stopping = True
        if self._thread is not threading.current_thread():
            join_started(self._thread, timeout)
            if self._thread.is_alive():
                return [f"the transfer worker did not stop within {timeout:.0f} s (a "
                        "backend submit that never returns); it is a daemon thread and "
                        "is left behind"]
        return []

    def handle(self, done: PackDone) -> None:
        """What the worker does with one pack-done message: fire SUBMIT, then hand
        the copy order to the backend. The learner's thread calls it too, for a batch
        it packed itself, where the backend allows (``submit_on_learner``)."""
        order = self._on_done(done)
        if order is not None:
            self._submit(order)

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    done = self._receive(POLL_S)
                except ChannelClosed:
                    return
                if done is not None:
                    self._busy_since_ns = time.monotonic_ns()
                    try:
                        self.handle(done)
                    finally:
                        self._busy_since_ns = None
        except BaseException as exc:  # noqa: BLE001 - reported to the learner
            self._fail(exc)
