"""Checkpoints for elastic training: atomic, verified, async, resumable at any world size.

Concept: a run's checkpoints live in one directory on the shared filesystem, one
``step_<N>/`` directory each, committed by an atomic directory rename with a manifest
(sizes + CRC32) inside. A reader only ever sees complete checkpoints, and resumes from the
newest one that verifies. See ``docs/checkpoint.md``.

Contract (what a ``train.py`` relies on):

* :class:`CheckpointManager` ``.save(state, step, blocking=...)`` /
  ``.flush()`` / ``.load_latest()`` / ``.list_checkpoints()``. Replicated (DDP) state is
  written by rank 0 only and read by all ranks. An async save blocks only while the state is
  copied to host memory; at most one save is in flight; ``flush()`` waits (the preemption
  path calls it). Write failures raise :class:`~slurm_elastic.errors.CheckpointWriteError`
  naming the path and the cause; previous checkpoints are never touched by a failed save.
"""

from slurm_elastic.checkpoint.bundle import (
    ResumeInfo,
    capture_rng,
    restore_rng,
    restore_training_state,
    training_state,
)
from slurm_elastic.checkpoint.manager import (
    CHECKPOINT_DIR_ENV,
    CheckpointFlushTimeout,
    CheckpointInfo,
    CheckpointManager,
    LoadedCheckpoint,
)
from slurm_elastic.checkpoint.policy import BatchPlan, loss_scale, micro_batches, plan_batches
from slurm_elastic.checkpoint.sampler import ElasticSampler, StepSlice

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "BatchPlan",
    "CheckpointFlushTimeout",
    "CheckpointInfo",
    "CheckpointManager",
    "ElasticSampler",
    "LoadedCheckpoint",
    "ResumeInfo",
    "StepSlice",
    "capture_rng",
    "loss_scale",
    "micro_batches",
    "plan_batches",
    "restore_rng",
    "restore_training_state",
    "training_state",
]
