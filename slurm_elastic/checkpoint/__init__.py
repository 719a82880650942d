"""Checkpoints for elastic training: atomic, verified, async, resumable at any world size.

Concept: a run's checkpoints live in one directory on the shared filesystem, one
``step_<N>/`` directory each, committed by an atomic directory rename with a manifest
(sizes + CRC32) inside. A reader only ever sees complete checkpoints, and resumes from the
newest one that verifies. Full guide: ``docs/checkpoint.md``; adoption in a train.py:
``examples/checkpoint_minimal.py``.

Contract (what a ``train.py`` relies on):

* :class:`CheckpointManager` (``from_env()`` reads ``$SLURM_ELASTIC_CHECKPOINT_DIR``):
  ``save(state, step, blocking=...)``, ``flush()``, ``load_latest()``, ``list_checkpoints()``.
  Replicated (DDP) state is written by rank 0 only and read by all ranks, in a pickle-free
  format (``torch.save`` only for states holding other objects). An async save returns
  after a walk of the state; the copy to host memory runs in the background, guarded (the
  next ``optimizer.step()`` and forward pass cannot change what is being copied;
  ``wait_staged()`` for other in-place changes); at most one save is in flight;
  ``flush()`` waits (the preemption path calls it). Failures raise
  :class:`~slurm_elastic.errors.CheckpointWriteError` naming the path and the cause; a
  failed save never touches previous checkpoints; damaged ones are skipped with a warning.
* :func:`training_state` / :func:`restore_training_state`: the bundle (model, optimizer,
  scheduler, step, epoch, sample offset, per-rank RNG states, world size).
* :class:`ElasticSampler`: global order per epoch from ``(seed, epoch)`` only, resumable at a
  global sample offset with any world size (each sample exactly once per epoch).
* :func:`plan_batches`, :func:`micro_batches`, :func:`loss_scale`: the world-size policy
  (default: fixed global batch via per-rank shares + gradient accumulation).
* :mod:`slurm_elastic.checkpoint.sharded`: FSDP/DTensor state through
  ``torch.distributed.checkpoint`` (reshards on load), same commit protocol.
* Loads read only paths owned by this user and not writable by others
  (:class:`UntrustedCheckpointError` otherwise), through held directory descriptors, each
  verified before torch reads it; only size/CRC/parse failures are damage (skipped),
  node and filesystem errors raise :class:`CheckpointReadError` and keep every
  checkpoint; manifests name their run and another run's directory raises
  :class:`ForeignRunError` (never loaded or pruned).

Parts: ``store`` (torch-free: names, commit, listing, retention, verification; the only
code touching the directory) ← ``serializer`` (``container``: our format) ← ``saver``
(async, with ``staging``) ← the front ends ``manager`` (replicated) and ``sharded``.
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
from slurm_elastic.checkpoint.trust import UntrustedCheckpointError
from slurm_elastic.errors import CheckpointReadError, ForeignRunError
from slurm_elastic.training.policy import BatchPlan, loss_scale, micro_batches, plan_batches
from slurm_elastic.training.sampler import ElasticSampler, StepSlice

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "BatchPlan",
    "CheckpointFlushTimeout",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointReadError",
    "ElasticSampler",
    "ForeignRunError",
    "LoadedCheckpoint",
    "ResumeInfo",
    "StepSlice",
    "UntrustedCheckpointError",
    "capture_rng",
    "loss_scale",
    "micro_batches",
    "plan_batches",
    "restore_rng",
    "restore_training_state",
    "training_state",
]
