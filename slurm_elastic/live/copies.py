"""FSDP2's neighbour copies, taken in the background.

Every ``copy_every`` steps each rank of a 1-D mesh sends its shards (parameters and
optimizer state) to the same local rank of the next node and keeps the previous node's,
so that after one node is lost the survivors still hold every shard of that step
(:mod:`~slurm_elastic.live.shards` rebuilds the state from them).

The step boundary only copies the rank's shards to host memory and starts the copy: a
thread swaps them with the neighbours on a process group of its own (a JSON header and
the tensors' bytes, no pickle; the sizes announced first and refused over the bound
before anything is allocated; the neighbour's structure checked against the local model
before it is decoded); a later boundary adopts the finished copy (:meth:`NeighbourCopies.poll`). Until
then the previous copy stands. One copy is in flight at a time: the next due boundary
waits for the previous one on every rank, so the pairs of sends and receives stay matched.

A copy still in flight when its mesh goes (a change, a failure) is abandoned: with gloo
its group's own connections are shut down, so its thread ends at once instead of waiting
on a peer that is gone; the previous copy is what the recovery uses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slurm_elastic.checkpoint import exchange
from slurm_elastic.errors import StateExchangeError
from slurm_elastic.live.abort import connected_sockets, shut_down_sockets

__all__ = ["Copy", "NeighbourCopies", "swap"]

log = logging.getLogger(__name__)

_SIZE_TAG, _HEADER_TAG, _DATA_TAG = 7301, 7303, 7302


def _pair(*works: Any) -> None:
    for work in works:
        if work is not None:  # None: this rank is not in the group (never here)
            work.wait()


def swap(
    value: Any,
    dest: int,
    src: int,
    limit: int,
    device: Any,
    *,
    group: Any = None,
    step: int = 0,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """Collective between pairs: send ``value`` (tensors, containers, plain values) to
    rank ``dest`` and return rank ``src``'s; every rank sends and receives once, so a
    ring completes. No pickle: a JSON header and the tensors' bytes in one buffer
    (:func:`~slurm_elastic.checkpoint.exchange.encode`). The sizes come first, with
    ``step``: over ``limit`` bytes, or another step, is refused before anything is
    allocated; ``check`` sees the received structure before it is decoded.

    Raises:
        StateExchangeError: refused (size, step, malformed); or what ``check`` raises.
    """
    import torch.distributed as dist

    header, data = exchange.encode(value)
    mine = torch.tensor([len(header), data.numel(), step], dtype=torch.int64, device=device)
    theirs = torch.zeros(3, dtype=torch.int64, device=device)
    _pair(
        dist.isend(mine, dest, group=group, tag=_SIZE_TAG),
        dist.irecv(theirs, src, group=group, tag=_SIZE_TAG),
    )
    hlen, dlen, their_step = (int(v) for v in theirs.tolist())
    if not (0 < hlen <= min(limit, exchange.MAX_HEADER) and 0 <= dlen <= limit):
        raise StateExchangeError(
            f"rank {src} announced a shard copy of {hlen} + {dlen} bytes; at most {limit} allowed"
        )
    if their_step != step:
        raise StateExchangeError(f"rank {src} sent the copy of step {their_step}, not {step}")
    out = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    got_header = torch.empty(hlen, dtype=torch.uint8, device=device)
    got = torch.empty(dlen, dtype=torch.uint8, device=device)
    _pair(
        dist.isend(out, dest, group=group, tag=_HEADER_TAG),
        dist.isend(data.to(device), dest, group=group, tag=_DATA_TAG),
        dist.irecv(got_header, src, group=group, tag=_HEADER_TAG),
        dist.irecv(got, src, group=group, tag=_DATA_TAG),
    )
    return exchange.decode(got_header.cpu().numpy().tobytes(), got.cpu(), check=check)


@dataclass
class Copy:
    """A neighbour copy: this rank's and its neighbour's pieces of one step, and the
    session's other state of that step (progress, scheduler, other stateful objects)."""

    step: int
    round: int
    shards: int
    pieces: dict[int, dict[str, Any]]
    rest: dict[str, Any]


class NeighbourCopies:
    """The neighbour copies of one mesh: their process group, the copy in flight and
    the newest finished one.

    Args:
        backend: the world's backend (the copies' group uses the same).
        dest: the rank this one's shards go to (the same local rank of the next node).
        src: the rank whose shards come here.
        limit: the most bytes a neighbour's piece may have.
        device: where the bytes travel (the backend's device).

    Collective over the current world (it creates the group).
    """

    def __init__(self, backend: str, dest: int, src: int, limit: int, device: Any) -> None:
        import torch.distributed as dist

        self.dest, self.src, self.limit, self.device = dest, src, limit, device
        gloo = "gloo" in backend
        before = connected_sockets() if gloo else frozenset()
        self.group = dist.new_group(backend=backend)
        self._sockets = connected_sockets() - before if gloo else frozenset()
        self._flight: tuple[Copy, threading.Thread, list[BaseException]] | None = None
        self.newest: Copy | None = None

    def start(self, copy: Copy, own: int, peer: int, check: Callable[[Any], None]) -> None:
        """Start sending ``copy.pieces[own]`` and receiving piece ``peer`` (checked by
        ``check`` before it is kept), after the previous copy finished (waited for).

        Raises:
            Exception: the previous copy's failure (see :meth:`poll`).
        """
        self.poll(wait=True)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                if torch.device(self.device).type == "cuda":  # per thread
                    torch.cuda.set_device(self.device)
                copy.pieces[peer] = swap(
                    copy.pieces[own], self.dest, self.src, self.limit, self.device,
                    group=self.group, step=copy.step, check=check,
                )  # fmt: skip
            except BaseException as exc:  # handed to the training thread by poll()
                errors.append(exc)

        thread = threading.Thread(target=run, name="slurm-elastic-shard-copy", daemon=True)
        self._flight = (copy, thread, errors)
        thread.start()

    def poll(self, *, wait: bool = False) -> None:
        """Adopt the copy in flight if it finished (``wait``: wait for it).

        Raises:
            Exception: its failure: a peer failure (the collective failed: the session's
                recovery follows), or :class:`StateExchangeError` (a refused piece).
        """
        if self._flight is None:
            return
        copy, thread, errors = self._flight
        if wait:
            thread.join()  # a silent peer: the stall guard shuts this group's sockets too
        if thread.is_alive():
            return
        self._flight = None
        if errors:
            raise errors[0]
        self.newest = copy

    def take_newest(self) -> Copy | None:
        """At a failure: the newest finished copy (a failed one in flight is dropped)."""
        try:
            self.poll()
        except Exception as exc:
            log.warning("the neighbour copy in flight failed (%s): the previous one stands", exc)
        newest, self.newest = self.newest, None
        return newest

    def close(self) -> None:
        """Abandon a copy still in flight (its mesh goes): its thread ends at once."""
        if self._flight is None:
            return
        _, thread, _ = self._flight
        self._flight = None
        if thread.is_alive() and self._sockets:
            shut_down_sockets(self._sockets)
            thread.join(timeout=10.0)
        if thread.is_alive():
            log.warning("a neighbour copy in flight did not end; it is left behind")
