"""World-size policy: keep training meaningful when the number of ranks changes.

Default (``"fixed_global"``): the **global batch stays fixed**. Each step's global batch
of ``G`` samples is split over the current ranks (:class:`ElasticSampler`); a rank whose
share exceeds ``max_micro_batch`` accumulates gradients over several micro-batches. With
DDP (which *averages* gradients over ranks) every micro-batch loss is the **sum** of its
per-sample losses times :func:`loss_scale` ``= world_size / global_size``; then the
averaged gradient is exactly the mean over the global batch, whatever the world size and
the micro-batch split, and the learning rate needs no change. What still differs between
world sizes is only float rounding: the same terms are summed in a different grouping
(per-rank partial sums, then an all-reduce), which changes results in the last bits; see
docs/checkpoint.md for the bound used in the tests.

Optional (``"fixed_local"``): the per-rank batch stays fixed and the global batch becomes
``local * world_size``; then scale the learning rate with the global batch: ``"linear"``
(Goyal et al., 2017) or ``"sqrt"`` (for Adam-like optimizers), relative to the world size
the base LR was tuned for. Training then follows a different (but sensible) trajectory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from slurm_elastic.errors import CheckpointError

__all__ = ["BatchPlan", "loss_scale", "lr_factor", "micro_batches", "plan_batches"]

T = TypeVar("T")

Mode = Literal["fixed_global", "fixed_local"]
LrScaling = Literal["none", "linear", "sqrt"]


@dataclass(frozen=True)
class BatchPlan:
    """How one rank runs a step at the current world size.

    Attributes:
        mode: ``"fixed_global"`` or ``"fixed_local"``.
        global_batch_size: samples per optimizer step over all ranks (give it to the sampler).
        world_size: ranks now.
        max_micro_batch: largest forward/backward batch per rank (accumulate above it).
        accumulation_steps: micro-batches per step, the same on every rank (the largest
            share of a full step divided by ``max_micro_batch``, rounded up).
        lr_factor: multiply the base learning rate by this.
    """

    mode: Mode
    global_batch_size: int
    world_size: int
    max_micro_batch: int
    accumulation_steps: int
    lr_factor: float


def lr_factor(global_batch_size: int, base_global_batch_size: int, scaling: LrScaling) -> float:
    """LR multiplier for a global batch relative to the one the base LR was tuned for."""
    ratio = global_batch_size / base_global_batch_size
    if scaling == "linear":
        return ratio
    if scaling == "sqrt":
        return math.sqrt(ratio)
    if scaling == "none":
        return 1.0
    raise CheckpointError(f"lr_scaling={scaling!r} must be 'none', 'linear' or 'sqrt'")


def plan_batches(
    world_size: int,
    *,
    global_batch_size: int | None = None,
    local_batch_size: int | None = None,
    max_micro_batch: int | None = None,
    mode: Mode = "fixed_global",
    lr_scaling: LrScaling = "none",
    base_world_size: int | None = None,
) -> BatchPlan:
    """Decide global batch, accumulation and LR factor for ``world_size`` ranks.

    Args:
        world_size: ranks now.
        global_batch_size: required for ``"fixed_global"``.
        local_batch_size: required for ``"fixed_local"`` (per-rank samples per step).
        max_micro_batch: memory limit per forward pass (default: no accumulation).
        mode: see the module docstring.
        lr_scaling: only for ``"fixed_local"``; relative to ``base_world_size``.
        base_world_size: the world size the base LR was tuned for.

    Raises:
        CheckpointError: a missing or non-positive size, or an unknown mode.
    """
    if world_size < 1:
        raise CheckpointError(f"world_size={world_size} must be >= 1")
    if mode == "fixed_global":
        if global_batch_size is None or global_batch_size < world_size:
            raise CheckpointError(
                f"global_batch_size={global_batch_size} must be set and >= world_size="
                f"{world_size} for mode 'fixed_global' (every rank needs a sample)"
            )
        factor = 1.0
        g = global_batch_size
    elif mode == "fixed_local":
        if local_batch_size is None or local_batch_size < 1:
            raise CheckpointError(
                f"local_batch_size={local_batch_size} must be >= 1 for mode 'fixed_local'"
            )
        g = local_batch_size * world_size
        base = local_batch_size * (base_world_size or world_size)
        factor = lr_factor(g, base, lr_scaling)
    else:
        raise CheckpointError(f"mode={mode!r} must be 'fixed_global' or 'fixed_local'")
    largest_share = -(-g // world_size)
    micro = max_micro_batch or largest_share
    if micro < 1:
        raise CheckpointError(f"max_micro_batch={max_micro_batch} must be >= 1")
    return BatchPlan(mode, g, world_size, micro, -(-largest_share // micro), factor)


def loss_scale(global_size: int, world_size: int) -> float:
    """Factor for a *summed* micro-batch loss so that DDP's averaged gradient equals the
    mean over the step's ``global_size`` samples (``world_size / global_size``)."""
    return world_size / global_size


def micro_batches(indices: Sequence[T], count: int) -> Iterator[Sequence[T]]:
    """Split a rank's share into exactly ``count`` contiguous chunks (sizes differ by at
    most one; some may be empty).

    Every rank must run the same number of backward passes per step under DDP (each one
    all-reduces), so use the plan's ``accumulation_steps`` on every rank, even for a short
    or empty share at the epoch tail.
    """
    if count < 1:
        raise CheckpointError(f"count={count} must be >= 1")
    q, r = divmod(len(indices), count)
    start = 0
    for i in range(count):
        stop = start + q + (1 if i < r else 0)
        yield indices[start:stop]
        start = stop
