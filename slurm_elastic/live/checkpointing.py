"""A session's state as a checkpoint, and back.

The session's :class:`~slurm_elastic.live.state.ElasticState` is a
:class:`~slurm_elastic.training.TrainingState`: the registered objects and the progress
(``step``, ``epoch``, ``sample_offset``: global samples consumed in the epoch), in the
layout a checkpoint bundle has. A checkpoint adds the global batch size, the per-rank RNG
states and the user's ``extra`` values, so that a restart at any world size resumes at the
same sample (:class:`~slurm_elastic.training.ElasticSampler` semantics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurm_elastic.checkpoint import CheckpointManager, ResumeInfo
from slurm_elastic.checkpoint.bundle import restore_state, state_bundle
from slurm_elastic.live.state import ElasticState

__all__ = ["resume_latest", "to_bundle"]


def to_bundle(
    state: ElasticState, global_batch_size: int, extra: dict[str, Any] | None
) -> dict[str, Any]:
    """The state as a checkpoint bundle (``extra``: small JSON-like values, or ``None``)."""
    return state_bundle(state, global_batch_size=global_batch_size, extra=extra)


def resume_latest(
    checkpoint: CheckpointManager, state: ElasticState
) -> tuple[Path, ResumeInfo] | None:
    """Load the newest checkpoint into the state, progress included.

    Returns:
        Where it came from and what it held, or ``None`` when there is none.
    """
    loaded = checkpoint.load_latest()
    if loaded is None:
        return None
    info = restore_state(loaded.state, state, source=loaded.path)
    return loaded.path, info
