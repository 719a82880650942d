"""A :class:`~slurm_elastic.training.TrainingState` as a checkpoint bundle, and back.

``training_state(...)`` builds the bundle, ``restore_training_state(...)`` puts it back.
The bundle is the training state's one layout (``model``, ``optimizer``, ``scheduler``,
``stateful``, ``progress``: :mod:`slurm_elastic.training.state`) plus what only a
checkpoint needs::

    progress     also {world_size, global_batch_size} at save time
    rng          one entry per rank: torch CPU, CUDA (if initialized), Python, NumPy (if imported)
    extra        anything small and JSON-like the user adds

The bundle contains only tensors, containers and plain values, so it loads with
``torch.load(weights_only=True)``. RNG states are per rank (``training_state`` all-gathers
them when a process group is up, so every rank must call it). On resume with the same world
size each rank gets its own RNG state back (bitwise-exact resume); with a different world
size rank ``r`` gets the state of saved rank ``r % saved_world_size``: per-rank random
streams cannot be preserved across a resize, this keeps them reproducible.

A bundle is checked against the live objects (keys, shapes, dtypes, optimizer groups)
before anything is loaded, so one that does not fit changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from slurm_elastic.checkpoint import exchange
from slurm_elastic.errors import CheckpointMismatchError
from slurm_elastic.training.state import TrainingState, capture_rng, restore_rng

__all__ = [
    "ResumeInfo",
    "capture_rng",
    "restore_rng",
    "restore_state",
    "restore_training_state",
    "state_bundle",
    "training_state",
]


def _dist() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    step: int,
    epoch: int = 0,
    sample_offset: int = 0,
    global_batch_size: int | None = None,
    extra: dict[str, Any] | None = None,
    stateful: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the bundle (see the module docstring). Collective under a process group.

    Args:
        model: the (possibly DDP-wrapped) model.
        optimizer: its optimizer.
        scheduler: an LR scheduler (anything with ``state_dict()``).
        step: optimizer steps taken so far.
        epoch: current epoch.
        sample_offset: global samples consumed in ``epoch`` (``StepSlice.stop``).
        global_batch_size: samples per step at save time.
        extra: small user values.
        stateful: more objects with ``state_dict()``/``load_state_dict()``, by name.

    Returns:
        The bundle; pass it to :meth:`CheckpointManager.save` right away (it references
        live tensors; an async save copies them before returning).
    """
    state = TrainingState(
        model, optimizer, scheduler, stateful=stateful,
        step=step, epoch=epoch, sample_offset=sample_offset,
    )  # fmt: skip
    return state_bundle(state, global_batch_size=global_batch_size, extra=extra)


def state_bundle(
    state: TrainingState,
    *,
    global_batch_size: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A training state as a checkpoint bundle (collective under a process group).

    ``state.progress`` must hold ``step``, ``epoch`` and ``sample_offset``.
    """
    _, world = _dist()
    rng: list[dict[str, Any]] = [capture_rng()]
    if world > 1:  # tensors and plain values, never a pickle from a peer
        rng = exchange.all_gather(rng[0])
    bundle = state.state_dict()
    bundle["progress"].update(world_size=world, global_batch_size=global_batch_size)
    bundle["rng"] = rng
    bundle["extra"] = dict(extra or {})
    return bundle


@dataclass(frozen=True)
class ResumeInfo:
    """Where training resumes, returned by :func:`restore_training_state`."""

    step: int = 0
    epoch: int = 0
    sample_offset: int = 0
    saved_world_size: int = 1
    world_size: int = 1
    global_batch_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size_changed(self) -> bool:
        """The number of ranks differs from the one at save time."""
        return self.saved_world_size != self.world_size


def restore_training_state(
    bundle: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    source: object = "checkpoint",
    restore_rng_states: bool = True,
    stateful: Mapping[str, Any] | None = None,
) -> ResumeInfo:
    """Load a bundle into model/optimizer/scheduler and the RNGs.

    Args:
        bundle: what :func:`training_state` built (e.g. ``LoadedCheckpoint.state``).
        model, optimizer, scheduler: the live objects (same architecture as at save).
        source: named in error messages (pass the checkpoint path).
        restore_rng_states: set ``False`` to keep the current RNG states.
        stateful: the objects registered as ``stateful`` at save time, by name.

    The optimizer keeps the bundle's state tensors (``Optimizer.load_state_dict`` does not
    copy same-device tensors): restore a loaded bundle once, then drop it.

    Raises:
        CheckpointMismatchError: missing/unexpected keys or shapes, an optimizer with
            different parameter groups, or a bundle without the expected parts.
    """
    state = TrainingState(
        model, optimizer, scheduler, stateful=stateful, step=0, epoch=0, sample_offset=0
    )
    return restore_state(bundle, state, source=source, restore_rng_states=restore_rng_states)


def restore_state(
    bundle: Any,
    state: TrainingState,
    *,
    source: object = "checkpoint",
    restore_rng_states: bool = True,
) -> ResumeInfo:
    """Load a bundle into a training state, its progress counters included.

    The bundle is checked against the state first (:meth:`TrainingState.check`): one that
    does not fit raises before anything is loaded. See :func:`restore_training_state`.

    Raises:
        CheckpointMismatchError: names the checkpoint, the part and the difference.
    """
    if not isinstance(bundle, Mapping) or not {"model", "progress"} <= set(bundle):
        missing = sorted({"model", "progress"} - set(bundle)) if isinstance(bundle, Mapping) else []
        raise CheckpointMismatchError(
            f"{source} is not a training_state() bundle (missing {missing or 'everything'}); "
            "save with slurm_elastic.checkpoint.training_state(...)"
        )
    progress = bundle["progress"]
    state.check(bundle, _refusal(source, bundle), exact=False)
    try:  # checked: what is left to fail is a value inside a part
        state.load_state_dict(bundle, copy_tensors=False)
    except (ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise CheckpointMismatchError(f"{source} does not load: {exc}") from exc
    rank, world = _dist()
    rng = bundle.get("rng") or []
    if restore_rng_states and rng:
        restore_rng(rng[rank % len(rng)])
    return ResumeInfo(
        step=int(progress["step"]),
        epoch=int(progress["epoch"]),
        sample_offset=int(progress["sample_offset"]),
        saved_world_size=int(progress["world_size"]),
        world_size=world,
        global_batch_size=progress.get("global_batch_size"),
        extra=dict(bundle.get("extra") or {}),
    )


def _refusal(source: object, bundle: Mapping[str, Any]) -> Any:
    """The error for a part of ``bundle`` that does not fit, with the fix for each part."""

    def refuse(where: str, why: str) -> CheckpointMismatchError:
        if where == "parts":
            missing = sorted({"optimizer", "scheduler", "stateful"} - set(bundle))
            return CheckpointMismatchError(
                f"{source} holds no state for {missing}: it was saved without them "
                "(register the same objects as the run that saved it)"
            )
        if where.startswith("model"):
            return CheckpointMismatchError(
                f"{source} does not match the model: {where}: {why}; build the same "
                "architecture as the run that saved it (or start a new checkpoint directory)"
            )
        return CheckpointMismatchError(
            f"{source}: {where} does not match: {why}; register the same objects as the "
            "run that saved it"
        )

    return refuse
