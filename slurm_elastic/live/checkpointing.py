"""A session's state as a checkpoint, and back.

The session's :class:`~slurm_elastic.live.state.ElasticState` holds the registered objects
and three counters (``step``, ``epoch``, ``offset``: global samples consumed in the
epoch). A checkpoint holds them as one :func:`~slurm_elastic.checkpoint.training_state`
bundle, with the global batch size and the user's ``extra`` values, so that a restart at
any world size resumes at the same sample (:class:`~slurm_elastic.checkpoint.
ElasticSampler` semantics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurm_elastic.checkpoint import (
    CheckpointManager,
    ResumeInfo,
    restore_training_state,
    training_state,
)
from slurm_elastic.live.state import ElasticState

__all__ = ["resume_latest", "to_bundle"]


def to_bundle(
    state: ElasticState, global_batch_size: int, extra: dict[str, Any] | None
) -> dict[str, Any]:
    """The state as a checkpoint bundle (``extra``: small JSON-like values, or ``None``)."""
    return training_state(
        state.model,
        state.optimizer,
        state.scheduler,
        step=int(state.counters["step"]),
        epoch=int(state.counters["epoch"]),
        sample_offset=int(state.counters["offset"]),
        global_batch_size=global_batch_size,
        extra=extra,
        stateful=state.stateful or None,
    )


def resume_latest(
    checkpoint: CheckpointManager, state: ElasticState
) -> tuple[Path, ResumeInfo] | None:
    """Load the newest checkpoint into the state, counters included.

    Returns:
        Where it came from and what it held, or ``None`` when there is none.
    """
    loaded = checkpoint.load_latest()
    if loaded is None:
        return None
    info = restore_training_state(
        loaded.state,
        state.model,
        state.optimizer,
        state.scheduler,
        source=loaded.path,
        stateful=state.stateful or None,
    )
    state.counters.update(step=info.step, epoch=info.epoch, offset=info.sample_offset)
    return loaded.path, info
