"""The training-state bundle: everything an exact resume needs, in one tree.

``training_state(...)`` builds it, ``restore_training_state(...)`` puts it back. Keys::

    model        model.state_dict() (a DDP/FSDP wrapper's ``.module`` is unwrapped)
    optimizer    optimizer.state_dict()            (if given)
    scheduler    lr_scheduler.state_dict()         (if given)
    stateful     {name: obj.state_dict()} of any other registered objects (a second
                 optimizer, a GradScaler, an EMA model, ...; if given)
    progress     {step, epoch, sample_offset, world_size, global_batch_size}
    rng          one entry per rank: torch CPU, CUDA (if initialized), Python, NumPy (if imported)
    extra        anything small and JSON-like the user adds

The bundle contains only tensors, containers and plain values, so it loads with
``torch.load(weights_only=True)``. RNG states are per rank (``training_state`` all-gathers
them when a process group is up, so every rank must call it). On resume with the same world
size each rank gets its own RNG state back (bitwise-exact resume); with a different world
size rank ``r`` gets the state of saved rank ``r % saved_world_size``: per-rank random
streams cannot be preserved across a resize, this keeps them reproducible.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from slurm_elastic.checkpoint import exchange
from slurm_elastic.errors import CheckpointMismatchError

__all__ = [
    "ResumeInfo",
    "capture_rng",
    "restore_rng",
    "restore_training_state",
    "training_state",
]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _dist() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as plain values/tensors (weights-only loadable)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`capture_rng` (missing parts are left alone)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            (
                s["name"],
                s["keys"].numpy().astype("uint32"),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )


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
    _, world = _dist()
    rng: list[dict[str, Any]] = [capture_rng()]
    if world > 1:  # tensors and plain values, never a pickle from a peer
        rng = exchange.all_gather(rng[0])
    bundle: dict[str, Any] = {
        "model": _unwrap(model).state_dict(),
        "progress": {
            "step": step,
            "epoch": epoch,
            "sample_offset": sample_offset,
            "world_size": world,
            "global_batch_size": global_batch_size,
        },
        "rng": rng,
        "extra": dict(extra or {}),
    }
    if optimizer is not None:
        bundle["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        bundle["scheduler"] = scheduler.state_dict()
    if stateful:
        bundle["stateful"] = {name: obj.state_dict() for name, obj in stateful.items()}
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
    try:
        progress = bundle["progress"]
        model_state = bundle["model"]
    except (KeyError, TypeError) as exc:
        raise CheckpointMismatchError(
            f"{source} is not a training_state() bundle (missing {exc}); save with "
            "slurm_elastic.checkpoint.training_state(...)"
        ) from exc
    try:
        _unwrap(model).load_state_dict(model_state, strict=True)
    except RuntimeError as exc:
        raise CheckpointMismatchError(
            f"{source} does not match the model: {exc}; build the same architecture as "
            "the run that saved it (or start a new checkpoint directory)"
        ) from exc
    if optimizer is not None:
        if "optimizer" not in bundle:
            raise CheckpointMismatchError(f"{source} holds no optimizer state")
        try:
            optimizer.load_state_dict(bundle["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointMismatchError(
                f"{source} optimizer state does not match the optimizer: {exc}"
            ) from exc
    if scheduler is not None:
        if "scheduler" not in bundle:
            raise CheckpointMismatchError(f"{source} holds no LR scheduler state")
        scheduler.load_state_dict(bundle["scheduler"])
    if stateful:
        _restore_stateful(bundle, stateful, source)
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


def _restore_stateful(bundle: dict[str, Any], stateful: Mapping[str, Any], source: object) -> None:
    """Load the bundle's ``stateful`` entries into the objects registered under their names.

    Raises:
        CheckpointMismatchError: a name has no saved state, or its state does not fit.
    """
    saved = bundle.get("stateful")
    missing = sorted(set(stateful) - set(saved or {}))
    if not isinstance(saved, dict) or missing:
        raise CheckpointMismatchError(
            f"{source} holds no state for {missing or sorted(stateful)}; it was saved "
            "without them (register the same objects as the run that saved it)"
        )
    for name, obj in stateful.items():
        try:
            obj.load_state_dict(saved[name])
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise CheckpointMismatchError(
                f"{source} state of {name!r} does not match: {exc}"
            ) from exc
