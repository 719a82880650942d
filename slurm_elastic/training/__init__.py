"""Training concepts shared by checkpoints and in-place changes (torch, no I/O).

* :class:`TrainingState`: the one model of the state training carries (model, optimizer,
  scheduler, other stateful objects, progress counters), its one layout and its
  structural check; checkpoints (:func:`slurm_elastic.checkpoint.training_state`) and
  in-place commits (:class:`slurm_elastic.live.ElasticState`) both use it.
* :class:`ElasticSampler`: global order per epoch from ``(seed, epoch)`` only, resumable at
  a global sample offset with any world size (each sample exactly once per epoch).
* :func:`plan_batches`, :func:`micro_batches`, :func:`loss_scale`: the world-size policy
  (default: fixed global batch via per-rank shares + gradient accumulation).

``slurm_elastic.checkpoint`` re-exports the sampler and the policy under their old names.
"""

from slurm_elastic.training.policy import (
    BatchPlan,
    loss_scale,
    lr_factor,
    micro_batches,
    plan_batches,
)
from slurm_elastic.training.sampler import ElasticSampler, StepSlice, rank_share
from slurm_elastic.training.state import (
    TensorSpec,
    TrainingState,
    capture_rng,
    restore_rng,
)

__all__ = [
    "BatchPlan",
    "ElasticSampler",
    "StepSlice",
    "TensorSpec",
    "TrainingState",
    "capture_rng",
    "loss_scale",
    "lr_factor",
    "micro_batches",
    "plan_batches",
    "rank_share",
    "restore_rng",
]
