"""``RendezvousOptions``: the rendezvous knobs, parsed from torch's ``RendezvousParameters``.

``--rdzv-conf`` values arrive as strings; keys match :class:`slurm_elastic.config.ElasticConfig`
(with or without the ``_s`` suffix), and torch's own names are accepted as aliases:

==========================  ===========================================  =========
key                          meaning                                      default
==========================  ===========================================  =========
join_timeout                 max wait for a round to form (s)              600
last_call_timeout            extra wait for more nodes once min_nodes (s)  3
close_timeout                max time to close/leave (s)                   30
heartbeat_interval           beat/observation interval (s)                 1
  (alias keep_alive_interval)
heartbeat_miss_limit         unchanged intervals before a node is dead     5
  (alias keep_alive_max_attempt)
poll_interval                first state poll delay while waiting (s)      0.05
store_timeout                timeout of the per-round TCPStore (s)         120
store_port                   port of the per-round TCPStore (0: any)       0
interface                    network interface whose IPv4 to advertise     (none)
local_addr                   address to advertise (also ``--local-addr``)  (derived)
cohort / incarnation         override the requeue identities               (derived)
  (alias generation)         (``cohort``: who may join an open era)
successors                   ring successors each node watches             2
reform_grace                 re-formation: wait this long after min_nodes  0.5
                             joined, then complete once the wait list is
                             empty (instead of the full last call)
==========================  ===========================================  =========

The keys that are also :class:`~slurm_elastic.config.ElasticConfig` fields
(``join_timeout``, ``last_call_timeout``, ``close_timeout``, ``heartbeat_interval``,
``heartbeat_miss_limit``, ``local_addr``) take their default **and their one validation
rule** from the config field of the same name (:func:`slurm_elastic.config.field_rule`),
so a value the config accepts is a value the rendezvous accepts. The others are
rendezvous-only and have their rule here.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from slurm_elastic.config import Rule, field_default, field_rule
from slurm_elastic.errors import ConfigError

__all__ = ["KNOWN_KEYS", "SHARED_WITH_CONFIG", "RendezvousOptions", "check_keys"]

#: RendezvousOptions fields that are ElasticConfig fields (same name, default and rule).
SHARED_WITH_CONFIG = (
    "join_timeout_s",
    "last_call_timeout_s",
    "close_timeout_s",
    "heartbeat_interval_s",
    "heartbeat_miss_limit",
    "local_addr",
)

_NAMES = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_interval",
    "keep_alive_interval",
    "heartbeat_miss_limit",
    "keep_alive_max_attempt",
    "poll_interval",
    "store_timeout",
    "store_port",
    "interface",
    "local_addr",
    "cohort",
    "generation",
    "incarnation",
    "successors",
    "reform_grace",
)
#: Keys torch adds itself: ``elastic_launch``'s rendezvous timeout, torchrun's node rank.
_TORCH_ADDED = ("timeout", "rank")
#: Every key the ``slurm`` backend accepts (each name also with the ``_s`` suffix).
KNOWN_KEYS = frozenset((*_NAMES, *(f"{n}_s" for n in _NAMES), *_TORCH_ADDED))


def check_keys(keys: object) -> None:
    """Refuse rendezvous option keys the ``slurm`` backend does not know.

    Raises:
        ConfigError: naming the first unknown key and the closest known one.
    """
    for key in sorted(str(k) for k in keys):  # type: ignore[attr-defined]
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, _NAMES, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"unknown rendezvous option {key!r} (--rdzv-conf){hint} "
                f"(known: {', '.join(_NAMES)})"
            )


def _raw(params: RendezvousParameters, names: tuple[str, ...]) -> tuple[str, object] | None:
    for name in names:
        for key in (name, f"{name}_s"):
            value = params.config.get(key)
            if value is not None and value != "":
                return key, value
    return None


def _at_least(minimum: float) -> Rule:
    return Rule(f"must be >= {minimum:g}", lambda v: v >= minimum)


def _checked(key: str, value: object, result: float, rule: Rule | None) -> None:
    if rule is not None and not rule.ok(result):
        raise ConfigError(f"rendezvous option {key}={value!r} {rule.text}")


def _float(params: RendezvousParameters, default: float, *names: str, rule: Rule | None) -> float:
    found = _raw(params, names)
    if found is None:
        return default
    key, value = found
    try:
        result = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"rendezvous option {key}={value!r} is not a number") from exc
    if not math.isfinite(result):
        raise ConfigError(f"rendezvous option {key}={value!r} must be a finite number")
    _checked(key, value, result, rule)
    return result


def _int(params: RendezvousParameters, default: int, *names: str, rule: Rule | None) -> int:
    found = _raw(params, names)
    if found is None:
        return default
    key, value = found
    try:
        result = int(str(value))
    except ValueError as exc:
        raise ConfigError(f"rendezvous option {key}={value!r} is not an integer") from exc
    _checked(key, value, result, rule)
    return result


def _str(params: RendezvousParameters, *names: str) -> str | None:
    found = _raw(params, names)
    return None if found is None else str(found[1])


@dataclass(frozen=True)
class RendezvousOptions:
    """Validated rendezvous options (see the module docstring for the keys)."""

    join_timeout_s: float = field_default("join_timeout_s")
    last_call_timeout_s: float = field_default("last_call_timeout_s")
    close_timeout_s: float = field_default("close_timeout_s")
    heartbeat_interval_s: float = field_default("heartbeat_interval_s")
    heartbeat_miss_limit: int = field_default("heartbeat_miss_limit")
    poll_interval_s: float = 0.05
    store_timeout_s: float = 120.0
    store_port: int = 0
    interface: str | None = None
    local_addr: str | None = field_default("local_addr")
    cohort: str | None = None
    incarnation: str | None = None
    successors: int = 2
    reform_grace_s: float = 0.5

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> RendezvousOptions:
        """Parse ``params.config`` (string values) and ``params.local_addr``.

        Raises:
            ConfigError: an unknown key, or a value that is not a number or out of range
                (the message names it).
        """
        check_keys(params.config)
        d = cls()
        return cls(
            join_timeout_s=_float(
                params, d.join_timeout_s, "join_timeout", rule=field_rule("join_timeout_s")
            ),
            last_call_timeout_s=_float(
                params,
                d.last_call_timeout_s,
                "last_call_timeout",
                rule=field_rule("last_call_timeout_s"),
            ),
            close_timeout_s=_float(
                params, d.close_timeout_s, "close_timeout", rule=field_rule("close_timeout_s")
            ),
            heartbeat_interval_s=_float(
                params,
                d.heartbeat_interval_s,
                "heartbeat_interval",
                "keep_alive_interval",
                rule=field_rule("heartbeat_interval_s"),
            ),
            heartbeat_miss_limit=_int(
                params,
                d.heartbeat_miss_limit,
                "heartbeat_miss_limit",
                "keep_alive_max_attempt",
                rule=field_rule("heartbeat_miss_limit"),
            ),
            poll_interval_s=_float(
                params, d.poll_interval_s, "poll_interval", rule=_at_least(0.001)
            ),
            store_timeout_s=_float(params, d.store_timeout_s, "store_timeout", rule=_at_least(1.0)),
            store_port=_int(params, d.store_port, "store_port", rule=_at_least(0)),
            interface=_str(params, "interface"),
            local_addr=params.local_addr or _str(params, "local_addr"),
            cohort=_str(params, "cohort", "generation"),
            incarnation=_str(params, "incarnation"),
            successors=_int(params, d.successors, "successors", rule=_at_least(1)),
            reform_grace_s=_float(params, d.reform_grace_s, "reform_grace", rule=_at_least(0.0)),
        )
