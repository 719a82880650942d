"""The data position of a session: which samples each rank takes at each step.

The position itself (the epoch, the global samples consumed in it) is held in the
session's :class:`~slurm_elastic.live.state.ElasticState` progress, so it is committed,
rolled back and sent to newcomers with the rest of the state. Here is what it means: the
epoch's global sample order (:class:`~slurm_elastic.training.ElasticSampler`, which
depends only on ``(seed, epoch)``) cut into global batches of a fixed size, and each
rank's share of a batch for any world size (:func:`~slurm_elastic.training.sampler.
rank_share`), so every sample is used exactly once per epoch whatever the world does.
:class:`StepInfo` is one step's place: its samples, the epoch, and the world it ran in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from slurm_elastic.training.sampler import ElasticSampler, rank_share

__all__ = ["DataPosition", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """One optimizer step as seen by one rank (what ``with session.step()`` yields).

    Attributes:
        indices: this rank's dataset indices of the step (possibly empty at an epoch
            tail); a loader over :meth:`ElasticSession.batches` yields the same ones.
        global_size: samples in the step's global batch.
        loss_scale: multiply a *summed* loss by this so DDP's averaged gradient is the
            mean over the global batch.
        step: steps done before this one.
        epoch: the epoch.
        rank: this rank in the current world.
        world_size: ranks in the current world.
        round: the rendezvous round of the current world.
    """

    indices: list[int]
    global_size: int
    loss_scale: float
    step: int
    epoch: int
    rank: int
    world_size: int
    round: int


class DataPosition:
    """The global order of an epoch, and each rank's share of each step.

    Args:
        dataset_size: samples per epoch.
        global_batch_size: samples per step over all ranks.
        seed, shuffle, drop_last: as :class:`~slurm_elastic.training.ElasticSampler`.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        *,
        seed: int,
        shuffle: bool,
        drop_last: bool,
    ) -> None:
        self.sampler = ElasticSampler(
            dataset_size,
            global_batch_size,
            rank=0,
            world_size=1,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
        )
        self._order: tuple[int, list[int]] | None = None

    def global_order(self, epoch: int) -> list[int]:
        """The epoch's sample order over all ranks (computed once per epoch)."""
        if self._order is None or self._order[0] != epoch:
            self.sampler.set_epoch(epoch, 0)
            self._order = (epoch, self.sampler.global_order(epoch))
        return self._order[1]

    def step(self, epoch: int, start: int, rank: int, world: int) -> tuple[list[int], int, int]:
        """Rank ``rank``'s indices of the step from global sample ``start``, and the step's
        global ``(start, stop)``."""
        order = self.global_order(epoch)
        stop = min(start + self.sampler.global_batch_size, self.sampler.epoch_length)
        lo, hi = rank_share(start, stop, rank, world)
        return order[lo:hi], start, stop

    def rest_of_epoch(self, epoch: int, start: int, rank: int, world: int) -> Iterator[list[int]]:
        """Rank ``rank``'s indices of each step from global sample ``start`` to the epoch's
        end, in a world of ``world`` ranks."""
        order = self.global_order(epoch)
        length, size = self.sampler.epoch_length, self.sampler.global_batch_size
        while start < length:
            stop = min(start + size, length)
            lo, hi = rank_share(start, stop, rank, world)
            yield order[lo:hi]
            start = stop
