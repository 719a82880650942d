"""Membership changes without restarting workers: in-memory state, re-formed in place.

Concept: when a node joins, leaves with notice, a spare is promoted, or a peer dies,
the workers that stay keep their processes. The agent runs the new rendezvous round
while they train and hands each worker its new rank, world size and the round's store
through the node channel (:mod:`~slurm_elastic.live.roster`); at a step
boundary the workers agree, tear down the process group and build the new one, and
newcomers receive the committed state by broadcast from a survivor.

Contract:

* :class:`ElasticSession` keeps the user's own loop (``for batch in loader:`` with
  ``with session.step():`` around each optimizer step; any number of
  ``state_dict``/``load_state_dict`` objects; ``examples/train_own_loop.py``);
* :class:`ElasticLoop` is the session around a step function (a script stays within a
  few lines of plain DDP; ``examples/train_ddp.py``);
* :class:`ElasticState` is the state API underneath (``commit`` / ``restore`` / ``sync``);
* :mod:`~slurm_elastic.live.world` re-forms the process group (``LiveWorld``), the loop
  decides when;
* without the agent's node channel, or with ``SLURM_ELASTIC_IN_PLACE=0``, the loop
  takes the restart path (save on notice, the agent restarts the workers).

``slurm_elastic.live.roster`` is torch-free; the rest imports torch (lazily here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_elastic.live.fsdp import FSDPConfig, ShardsLostError
    from slurm_elastic.live.loop import ElasticLoop, ReformTimeoutError, Step, is_peer_failure
    from slurm_elastic.live.session import ElasticSession, StepInfo
    from slurm_elastic.live.state import ElasticState

__all__ = [
    "ElasticLoop",
    "ElasticSession",
    "ElasticState",
    "FSDPConfig",
    "ReformTimeoutError",
    "ShardsLostError",
    "Step",
    "StepInfo",
    "is_peer_failure",
]


def __getattr__(name: str) -> Any:
    if name in ("ElasticLoop", "ReformTimeoutError", "Step", "is_peer_failure"):
        from slurm_elastic.live import loop

        return getattr(loop, name)
    if name in ("ElasticSession", "StepInfo"):
        from slurm_elastic.live import session

        return getattr(session, name)
    if name in ("FSDPConfig", "ShardsLostError"):
        from slurm_elastic.live import fsdp

        return getattr(fsdp, name)
    if name == "ElasticState":
        from slurm_elastic.live.state import ElasticState

        return ElasticState
    raise AttributeError(f"module 'slurm_elastic.live' has no attribute {name!r}")
