"""The agent's rendezvous parameters: the config translated into torch's
``RendezvousParameters``, for our ``slurm`` backend and for torch's own.

torch's handlers read their timeouts as whole seconds and accept only the ``--rdzv-conf``
keys they know; ours takes fractions and checks its keys itself
(:mod:`~slurm_elastic.rendezvous.options`). Every key and value is checked here, before
any I/O, so a typo is a usage error and not a rendezvous that never forms.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters

from slurm_elastic.config import ElasticConfig
from slurm_elastic.errors import ConfigError
from slurm_elastic.rendezvous.options import RendezvousOptions, check_keys

__all__ = ["rendezvous_parameters"]

_TORCH_BACKENDS_INT_TIMEOUTS = ("c10d", "etcd-v2", "etcd", "static")


def _seconds(value: float, backend: str) -> str:
    # torch's handlers read timeouts with get_as_int; ours accepts fractions.
    if backend in _TORCH_BACKENDS_INT_TIMEOUTS:
        return str(max(1, math.ceil(value)))
    return repr(float(value))


def rendezvous_parameters(
    config: ElasticConfig, extra_conf: Mapping[str, str] | None = None
) -> RendezvousParameters:
    """Translate the config into torch's ``RendezvousParameters`` for any backend."""
    if config.run_id is None:
        raise ConfigError(
            "no run id: outside a Slurm job pass --rdzv-id (or run_id in the config file)"
        )
    backend = config.rdzv_backend
    endpoint = str(config.rdzv_dir) if backend == "slurm" else (config.rdzv_endpoint or "")
    if backend != "slurm" and not endpoint:
        raise ConfigError(
            f"rdzv_backend {backend!r} needs --rdzv-endpoint HOST:PORT (e.g. an etcd server)"
        )
    conf: dict[str, Any] = {
        "join_timeout": _seconds(config.join_timeout_s, backend),
        "last_call_timeout": _seconds(config.last_call_timeout_s, backend),
        "close_timeout": _seconds(config.close_timeout_s, backend),
    }
    if backend == "slurm":
        conf["heartbeat_interval"] = _seconds(config.heartbeat_interval_s, backend)
        conf["heartbeat_miss_limit"] = str(config.heartbeat_miss_limit)
    else:
        conf["keep_alive_interval"] = _seconds(config.heartbeat_interval_s, backend)
        conf["keep_alive_max_attempt"] = str(config.heartbeat_miss_limit)
    _check_extra_conf(backend, extra_conf or {})
    conf.update(extra_conf or {})
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **conf,
    )
    if backend == "slurm":
        RendezvousOptions.from_parameters(params)  # every key and value, before any I/O
    return params


#: The ``--rdzv-conf`` keys torch's own backends read (torch 2.13).
_TORCH_CONF_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "timeout",
    "read_timeout",
    "is_host",
    "store_type",
    "rank",
    "protocol",
    "cacert",
    "ca_cert",
    "cert",
    "key",
    "ssl_cert",
    "ssl_cert_key",
    "etcd_prefix",
)


def _check_extra_conf(backend: str, extra: Mapping[str, str]) -> None:
    """Refuse unknown ``--rdzv-conf`` keys (slurm: :mod:`~slurm_elastic.rendezvous.options`)."""
    if backend == "slurm":
        check_keys(extra)
        return
    for key in sorted(extra):
        if key not in _TORCH_CONF_KEYS:
            close = difflib.get_close_matches(key, _TORCH_CONF_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"unknown rendezvous option {key!r} for backend {backend!r} (--rdzv-conf)"
                f"{hint} (known: {', '.join(_TORCH_CONF_KEYS)})"
            )
