"""ElasticSampler: one global sample order per epoch, resumable at any world size.

The global order of epoch ``e`` is ``torch.randperm(n, generator=seed + e)``, the very
permutation :class:`torch.utils.data.DistributedSampler` draws (so switching costs no
reshuffle), and depends on nothing else. The order is consumed in *global batches* of
``global_batch_size`` consecutive samples, one per optimizer step; each global batch is
split into ``world_size`` contiguous shares whose sizes differ by at most one. The progress
of an epoch is therefore one number, the **global sample offset** (samples consumed so
far), and resuming at offset ``o`` with any world size continues with exactly the samples
not yet seen: every sample is seen exactly once per epoch across membership changes.

Why not torch's ``torch.distributed.elastic.utils.data.ElasticDistributedSampler``: it
strides samples over ranks with a fixed per-rank batch, so the global batch changes with
the world size; it pads the epoch tail with repeated samples so that shares are equal (a
sample seen twice); and its ``start_index`` skips dataset *indices* ``< start_index`` and
permutes the rest with a generator seeded by the epoch only, so a resumed epoch does not
continue the interrupted order. ``DistributedSampler`` pads the same way. We reuse their
permutation (``randperm`` seeded ``seed + epoch``) and replace the rest.

Tail of an epoch: with ``n % global_batch_size = r > 0`` the last step of the epoch is a
short global batch of ``r`` samples (``drop_last=False``, default), split as evenly as
possible; when ``r < world_size`` some ranks get an **empty** share for that step and must
still take part in the collective (a forward pass on an empty batch gives zero gradients).
Scale the loss by the step's real global size (:func:`slurm_elastic.training.policy.loss_scale`)
so the short step is a proper mean. With ``drop_last=True`` those ``r`` samples are skipped
in that epoch (they are different samples each epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from slurm_elastic.errors import CheckpointError

__all__ = ["ElasticSampler", "StepSlice", "rank_share"]


def rank_share(start: int, stop: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return this rank's contiguous ``[lo, hi)`` part of the global range ``[start, stop)``.

    Shares differ by at most one sample; lower ranks get the extra ones.
    """
    q, r = divmod(stop - start, world_size)
    lo = start + rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


@dataclass(frozen=True)
class StepSlice:
    """One optimizer step as seen by one rank.

    Attributes:
        start: global sample offset before the step.
        stop: global sample offset after the step (store this as ``sample_offset``).
        indices: this rank's dataset indices (possibly empty at the epoch tail).
    """

    start: int
    stop: int
    indices: list[int]

    @property
    def global_size(self) -> int:
        """Samples in this step's global batch, over all ranks."""
        return self.stop - self.start


class ElasticSampler:
    """Batch sampler (usable as ``DataLoader(batch_sampler=...)``) for elastic training.

    Args:
        dataset_size: number of samples ``n``.
        global_batch_size: samples per optimizer step over all ranks.
        rank: this rank (default: torch.distributed, else 0).
        world_size: number of ranks (default: torch.distributed, else 1).
        seed: the order of epoch ``e`` depends only on ``(seed, e)``.
        shuffle: ``False`` keeps ``0..n-1`` order.
        drop_last: skip the short last global batch of each epoch.

    Raises:
        CheckpointError: non-positive sizes or a rank outside ``[0, world_size)``.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if rank is None or world_size is None:
            dist = torch.distributed
            on = dist.is_available() and dist.is_initialized()
            rank = rank if rank is not None else (dist.get_rank() if on else 0)
            world_size = (
                world_size if world_size is not None else (dist.get_world_size() if on else 1)
            )
        if dataset_size < 1 or global_batch_size < 1:
            raise CheckpointError(
                f"dataset_size={dataset_size} and global_batch_size={global_batch_size} "
                "must both be >= 1"
            )
        if not 0 <= rank < world_size:
            raise CheckpointError(f"rank={rank} must be in [0, world_size={world_size})")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0

    @property
    def epoch_length(self) -> int:
        """Samples consumed per epoch (``n``, or less with ``drop_last``)."""
        if self.drop_last:
            return self.dataset_size - self.dataset_size % self.global_batch_size
        return self.dataset_size

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        """Position the sampler at ``offset`` global samples into ``epoch``.

        Raises:
            CheckpointError: offset outside ``[0, epoch_length]``.
        """
        if not 0 <= offset <= self.epoch_length:
            raise CheckpointError(
                f"sample offset {offset} is outside epoch of {self.epoch_length} samples; "
                "was the checkpoint written for a different dataset?"
            )
        self.epoch = epoch
        self.offset = offset

    def global_order(self, epoch: int | None = None) -> list[int]:
        """The full sample order of ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.dataset_size))
        gen = torch.Generator()
        gen.manual_seed(self.seed + e)
        return torch.randperm(self.dataset_size, generator=gen).tolist()

    def slices(self) -> Iterator[StepSlice]:
        """Yield this rank's share of each remaining step of the current epoch."""
        order = self.global_order()
        end = self.epoch_length
        start = self.offset
        while start < end:
            stop = min(start + self.global_batch_size, end)
            lo, hi = rank_share(start, stop, self.rank, self.world_size)
            yield StepSlice(start, stop, order[lo:hi])
            start = stop

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.slices():
            yield step.indices

    def __len__(self) -> int:
        """Remaining steps in the current epoch."""
        remaining = self.epoch_length - self.offset
        return -(-remaining // self.global_batch_size)
