"""The round's store for rank assignment, with waits that notice a broken round.

After a round completes, torch's ``SimpleElasticAgent._assign_worker_ranks`` has every
agent write its role info to the round's store and wait for the others' (rank 0 reads
them all, then writes each agent's ranks). A member that dies between the round's
completion and its write is waited for until the store times out (120 s by default),
after which the agent fails. :class:`RoundBoundStore` replaces those blocking reads by
short polls that also ask the rendezvous whether the round is still whole
(:class:`~slurm_elastic.rendezvous.protocols.RoundWatching`); when it is not, or when
the store's host is gone, :class:`~slurm_elastic.errors.RoundLostError` (the error the
rendezvous raises for the same fact) tells the agent to join the next round instead.

A store host that is *frozen* (SIGSTOP, a hung kernel) still accepts connections and
takes requests nobody answers, and torch's client waits for its answer without a
timeout: every call is waited for in slices (:func:`~slurm_elastic.rendezvous.
bounded_call.call_bounded`), asking ``round_lost`` between them; a call that outlives the
round, or the store's timeout, is abandoned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from slurm_elastic.errors import RoundBrokenError, RoundLostError
from slurm_elastic.rendezvous.bounded_call import StoreUnansweredError, call_bounded

# RoundBrokenError: the former name of RoundLostError, re-exported for old imports.
__all__ = ["RoundBoundStore", "RoundBrokenError", "RoundLostError"]

_POLL_START_S = 0.005
_POLL_CAP_S = 0.1
_ASK_EVERY_S = 0.5


class RoundBoundStore:
    """A store whose reads wait for their keys while the round stays whole.

    Only the calls ``_assign_worker_ranks`` makes are offered: ``set``, ``multi_set``,
    ``get``, ``multi_get``. A read first polls ``check(keys)`` (a non-blocking query:
    a timed-out blocking wait would log a warning from c10d per poll); every
    ``ask_every_s`` it asks ``round_lost``. Past the store's own timeout the read is
    made as torch makes it, and fails as torch's would.

    Args:
        store: the round's store (a ``PrefixStore`` over the round's TCPStore).
        round_lost: true once the round is broken (the rendezvous' ``round_lost``).
        ask_every_s: how often to ask ``round_lost`` while keys are missing.
    """

    def __init__(
        self, store: Any, round_lost: Callable[[], bool], ask_every_s: float = _ASK_EVERY_S
    ) -> None:
        self._store = store
        self._round_lost = round_lost
        self._ask_every_s = ask_every_s

    def set(self, key: str, value: str | bytes) -> None:
        self._call(self._store.set, key, value)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._call(self._store.multi_set, list(keys), list(values))

    def get(self, key: str) -> bytes:
        self._wait_for([key])
        return self._call(self._store.get, key)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._wait_for(list(keys))
        return self._call(self._store.multi_get, list(keys))

    def _wait_for(self, keys: list[str]) -> None:
        timeout: timedelta = self._store.timeout
        start = time.monotonic()
        deadline = start + timeout.total_seconds()
        next_ask = start + self._ask_every_s
        delay = _POLL_START_S
        while not self._call(self._store.check, keys):
            now = time.monotonic()
            if now >= deadline:
                return  # the read below times out as torch's does
            if now >= next_ask:
                if self._round_lost():
                    raise RoundLostError(
                        "the round lost a member before every node wrote its rank info"
                    )
                next_ask = now + self._ask_every_s
            time.sleep(delay)
            delay = min(delay * 2, _POLL_CAP_S)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, waited for while the round stays whole and for at most the
        store's timeout (+ one slice): a frozen host's store never answers."""
        timeout_s = self._store.timeout.total_seconds()
        try:
            return call_bounded(
                lambda: fn(*args),
                limit_s=timeout_s + self._ask_every_s,
                give_up=lambda: "the round lost a member" if self._round_lost() else None,
                slice_s=self._ask_every_s,
            )
        except StoreUnansweredError as exc:
            raise RoundLostError(f"rank assignment: {exc}") from None
        except dist.DistNetworkError as exc:
            # The round's store lives on its rank 0 node: that node is gone.
            raise RoundLostError(f"the round's store is unreachable: {exc}") from exc
