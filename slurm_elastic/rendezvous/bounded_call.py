"""Calls to a round's store that a frozen store host cannot hold forever.

A store host that is frozen (SIGSTOP, a hung kernel) still accepts connections and takes
requests that nobody answers, and torch's TCPStore client waits for some answers without
a timeout (torch 2.13, measured with a 2 s timeout against a stopped server: a timed-out
``get`` waited past 60 s, the constructor's ``ping`` past 100 s, a ``check`` past 20 s,
each until the measurement stopped). The caller
cannot interrupt a call blocked in C++, so :func:`call_bounded` runs it on a daemon
thread and waits for it in slices, asking between them whether the caller still wants
its answer; a call it stops waiting for is abandoned (its thread ends when the host dies
or thaws, and holds the client until then).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from slurm_elastic.errors import StoreUnansweredError

__all__ = ["StoreUnansweredError", "call_bounded"]


def call_bounded(
    fn: Callable[[], Any],
    *,
    limit_s: float,
    give_up: Callable[[], str | None] = lambda: None,
    slice_s: float = 0.5,
) -> Any:
    """``fn()`` on a helper thread: its result, or the error it raised.

    Args:
        fn: the call (e.g. a store's ``get``).
        limit_s: wait at most this long for it.
        give_up: asked after each slice of waiting; a reason (a string) abandons the call.
        slice_s: how long each wait lasts.

    Raises:
        StoreUnansweredError: abandoned (the message says why).
    """
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the waiting caller
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="slurm-elastic-store-call", daemon=True).start()
    deadline = time.monotonic() + limit_s
    while not done.wait(max(0.0, min(slice_s, deadline - time.monotonic()))):
        reason = give_up()
        if reason is not None:
            raise StoreUnansweredError(f"no answer from the store, and {reason}")
        if time.monotonic() >= deadline:
            raise StoreUnansweredError(
                f"no answer from the store within {limit_s:.0f} s: its host is frozen or cut off"
            )
    ok, value = outcome[0]
    if ok:
        return value
    raise value
