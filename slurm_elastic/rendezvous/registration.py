"""Registration of backend ``slurm`` with torch (kept free of torch imports).

Three ways in, one creator (:func:`slurm_elastic.rendezvous.factory.create_handler`):

* torchrun: the ``torchrun.handlers`` entry point ``slurm`` points at
  :func:`torchrun_entrypoint` (a zero-argument factory returning the creator), so
  ``torchrun --rdzv-backend=slurm --rdzv-endpoint=/shared/dir --rdzv-id=JOB ...`` works;
* ``elastic_launch(LaunchConfig(rdzv_backend="slurm", ...))`` and our agent: torch loads
  the entry point when it imports its rendezvous package; :func:`register` does it
  explicitly (idempotent) where entry points are not installed;
* programmatically: ``create_handler(RendezvousParameters(...))``.

This module imports nothing from torch at import time: torch loads the entry point while
*its* rendezvous package is being imported, and a torch import here would make that a
circular import whenever this module is imported first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )

__all__ = ["BACKEND_NAME", "register", "torchrun_entrypoint"]

#: The registry name (the handler's ``get_backend()`` returns it; torch checks).
BACKEND_NAME = "slurm"


def _creator(params: RendezvousParameters) -> RendezvousHandler:
    from slurm_elastic.rendezvous.factory import create_handler

    return create_handler(params)


def torchrun_entrypoint() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: return the creator for backend ``slurm``."""
    return _creator


def register() -> None:
    """Register backend ``slurm`` in torch's handler registry (idempotent)."""
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND_NAME, _creator)
