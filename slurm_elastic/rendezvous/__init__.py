"""The rendezvous: how node agents find each other, round after round.

Concept: each agent joins *rounds* of a rendezvous kept on the shared filesystem (no
process hosts it, so no single node's loss takes it down). A round gives every agent
its rank, the world size, and the address of that round's **workers' store**, a fresh
TCPStore hosted by the round's rank 0. Nodes that die are evicted by heartbeat
counters watched around a ring; nodes that leave gracefully are removed at once; either
way the survivors re-rendezvous promptly. A requeued or resubmitted job never joins a
closed or stale state of an earlier job (eras).

Contract:

* backend name ``slurm`` (``torchrun --rdzv-backend=slurm --rdzv-endpoint=<dir>``);
* :func:`create_handler` ``(RendezvousParameters) -> SlurmRendezvousHandler``, a
  torch ``RendezvousHandler`` with ``use_agent_store = True`` plus :meth:`leave`;
* every directory from a user-owned anchor down must be the user's and not writable
  by group/others; everything is created ``0700``/``0600`` and used through checked
  directory descriptors without following links. TCPStore has no authentication.

Modules: :mod:`.filesystem` (the few FS primitives, checks, op counters),
:mod:`.state` (the JSON state, read a row at a time), :mod:`.decisions` (the rules,
pure), :mod:`.backend` (lock-free compare-and-set state), :mod:`.run_directory` (eras,
requeue safety, run ids shared by two jobs), :mod:`.heartbeat` (counter heartbeats),
:mod:`.join_intents` (contention-free joining), :mod:`.executor` (the op loop),
:mod:`.torch_compat` (the tested torch range; no private torch name is used anywhere
here), :mod:`.worker_store`
(per-round TCPStore), :mod:`.options` (``--rdzv-conf`` keys), :mod:`.handler`,
:mod:`.factory` (the creator),
:mod:`.registration` (wiring, torchrun entry point). See ``docs/rendezvous.md``.

Importing this package does not import torch; its attributes load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_elastic.rendezvous.factory import create_handler
    from slurm_elastic.rendezvous.handler import SlurmRendezvousHandler
    from slurm_elastic.rendezvous.options import RendezvousOptions
    from slurm_elastic.rendezvous.registration import register

__all__ = ["RendezvousOptions", "SlurmRendezvousHandler", "create_handler", "register"]

_LAZY = {
    "SlurmRendezvousHandler": "slurm_elastic.rendezvous.handler",
    "RendezvousOptions": "slurm_elastic.rendezvous.options",
    "create_handler": "slurm_elastic.rendezvous.factory",
    "register": "slurm_elastic.rendezvous.registration",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
