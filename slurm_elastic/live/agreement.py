"""``BoundaryVote``: the step-boundary agreement, one step behind and off the critical path.

At every step boundary each rank contributes a few integers (does its node leave, which
new round it holds ready, ...) and all ranks need the same view of them (an
``all_reduce`` with MAX). Waited for at once, that collective is a second
synchronisation point per step: every step pays the ranks' skew in the optimizer step
and the next forward once more, and on NCCL the ``.tolist()`` is a device sync that stops
the host from running ahead. So the vote of boundary ``k`` is started asynchronously
there and its result is read at boundary ``k + 1``, when it has long completed (gloo: the
work ran on the group's threads while the step computed; NCCL: the result was copied to
pinned host memory on the current stream behind the all-reduce, and only that event is
waited for, not the step's kernels).

Every rank starts and reads the votes at the same boundaries, so all act on the same
values at the same step: a decision (switch, leave, save together) simply takes effect
one step later than the signal that caused it. A graceful change still happens at a
step boundary that every rank reaches with the same state (no step is lost), and a peer
failure surfaces as an exception of the step's own collectives or of :meth:`result`, as
before. A vote still in flight must be :meth:`drop`-ped before its group is torn down
(a live reference keeps a destroyed group's resources).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["BoundaryVote"]


class BoundaryVote:
    """One asynchronous ``all_reduce(MAX)`` of a few integers, read one boundary later.

    Args:
        device: where the collective tensor lives (CUDA with NCCL, else CPU).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._work: dist.Work | None = None
        self._tensor: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        #: this rank's own contribution to the vote in flight
        self.mine: tuple[int, ...] = ()

    @property
    def in_flight(self) -> bool:
        """Whether a vote was started and not yet read or dropped."""
        return self._tensor is not None

    def start(self, values: Sequence[int], device: torch.device | None = None) -> None:
        """Collective: start the vote of this boundary (every rank, the same length).

        Args:
            values: this rank's integers.
            device: where the tensor lives now (the group may have changed).

        Raises:
            RuntimeError: a vote is already in flight (read or drop it first).
        """
        if self.in_flight:
            raise RuntimeError("a boundary vote is already in flight: read it first")
        if device is not None:
            self._device = device
        self.mine = tuple(int(v) for v in values)
        tensor = torch.tensor(self.mine, dtype=torch.int64, device=self._device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        if tensor.device.type == "cuda":
            # The current stream waits for NCCL's (no host wait); the result is copied
            # to pinned memory behind it, and the next boundary waits for that event only.
            if work is not None:
                work.wait()
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._host, self._event, work = host, event, None
        self._work, self._tensor = work, tensor

    def result(self) -> list[int] | None:
        """The vote in flight, reduced over all ranks (waits if it has not completed).

        Returns:
            The MAX over ranks of each value, or ``None`` if no vote is in flight.

        Raises:
            torch.distributed.DistError, RuntimeError: the collective failed (a peer gone).
        """
        if self._tensor is None:
            return None
        work, tensor, host, event = self._work, self._tensor, self._host, self._event
        self.drop()
        if event is not None and host is not None:
            event.synchronize()
            return [int(v) for v in host.tolist()]
        if work is not None:
            work.wait()
        return [int(v) for v in tensor.tolist()]

    def drop(self) -> None:
        """Forget the vote in flight (before its group is torn down)."""
        self._work = self._tensor = self._host = self._event = None
