"""The one module that touches torch's *private* rendezvous names.

``slurm_elastic.rendezvous`` reuses torch's dynamic rendezvous state machine, which is
built from private classes (``_RendezvousState``, ``_NodeDesc``, ``_Action``, the state
holder, the op executor, the join/exit ops). Private names can change in any torch
release, so:

* every other module imports them from here, never from torch directly;
* the supported torch range is checked when this module is imported
  (:data:`SUPPORTED_TORCH`); outside it the import fails with
  :class:`UnsupportedTorchError`, naming the installed version and the fix;
* each hook we rely on (attribute, method, signature, behaviour) has a contract test in
  ``tests/rendezvous/test_torch_contract.py`` that fails when torch changes it. To
  support a new torch release, run those tests against it, adapt this module, then
  widen :data:`SUPPORTED_TORCH`.

The hooks, by consumer:

* ``backend.py``: ``_RendezvousState`` (unpickled from the state files) and the
  classes its pickle names (:data:`STATE_PICKLE_GLOBALS`).
* ``handler.py``/``executor.py``: ``_BackendRendezvousStateHolder`` (overrides
  ``_sanitize`` and ``sync``, same contract; uses ``_backend``, ``_cache_duration``,
  ``_dirty``, ``_token``, ``_last_sync_time``, ``_state``), ``_DistributedRendezvousOpExecutor``
  (overrides ``run``/``_record``; calls its ``_add_to_participants`` … handlers and
  reads ``_state``/``_node``/``_settings``), ``_RendezvousJoinOp`` (decides on a
  context whose ``state.deadline`` we substitute), ``_RendezvousExitOp``,
  ``_RendezvousContext``, ``_remove_participant_epilogue``, ``_Action``, and
  ``DynamicRendezvousHandler`` internals (``_node_desc_generator``, ``_heartbeat_lock``,
  ``_this_node``, ``_op_executor``, ``_settings``, ``_close``, ``_get_deadline``,
  ``_start_heartbeats``/``_stop_heartbeats``, ``_record``).
"""

from __future__ import annotations

import re

import torch
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _remove_participant_epilogue,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _RendezvousState,
)

from slurm_elastic.errors import SlurmElasticError

__all__ = [
    "STATE_PICKLE_GLOBALS",
    "SUPPORTED_TORCH",
    "DynamicRendezvousHandler",
    "RendezvousBackend",
    "RendezvousSettings",
    "RendezvousTimeout",
    "UnsupportedTorchError",
    "_Action",
    "_BackendRendezvousStateHolder",
    "_DistributedRendezvousOpExecutor",
    "_NodeDesc",
    "_RendezvousContext",
    "_RendezvousExitOp",
    "_RendezvousJoinOp",
    "_RendezvousState",
    "_remove_participant_epilogue",
    "check_torch_version",
    "dynamic_handler_round",
]

#: Supported torch versions: ``(lowest, first unsupported)`` as (major, minor); each minor
#: in the range is tested (CI runs the torch-facing tests on 2.13.0 and 2.14.1). The same
#: range is in pyproject.toml and the README.
SUPPORTED_TORCH = ((2, 13), (2, 15))

_DR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

#: The globals a pickled ``_RendezvousState`` may name (restricted unpickler).
STATE_PICKLE_GLOBALS = frozenset(
    {
        (_DR, "_RendezvousState"),
        (_DR, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
    }
)


class UnsupportedTorchError(SlurmElasticError, ImportError):
    """The installed torch is outside the range this rendezvous was verified with."""


def dynamic_handler_round(handler: object) -> int | None:
    """The round held by torch's ``DynamicRendezvousHandler`` (c10d, etcd), else ``None``.

    Reads the private state holder: the one place outside torch that does.
    """
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else None


def check_torch_version(version: str) -> tuple[int, int]:
    """Return ``(major, minor)`` of ``version`` if it is supported.

    Raises:
        UnsupportedTorchError: the version is outside :data:`SUPPORTED_TORCH` or
            cannot be parsed; the message names it and the fix.
    """
    low, high = SUPPORTED_TORCH
    match = re.match(r"^(\d+)\.(\d+)", version)
    supported = " or ".join(f"{low[0]}.{m}" for m in range(low[1], high[1]))
    if match is None:
        raise UnsupportedTorchError(
            f"cannot parse torch version {version!r}; slurm_elastic's rendezvous supports "
            f"torch {supported}. Install a supported torch"
        )
    got = (int(match.group(1)), int(match.group(2)))
    if not low <= got < high:
        raise UnsupportedTorchError(
            f"torch {version} is not supported by slurm_elastic's rendezvous (it relies on "
            f"private torch classes tested with torch {supported}). Install a supported "
            f"torch (pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}'), or run tests/rendezvous/test_torch_contract.py against this version, "
            "adapt slurm_elastic/rendezvous/torch_compat.py and widen SUPPORTED_TORCH"
        )
    return got


check_torch_version(torch.__version__)
