"""The one configuration object of slurm_elastic.

:class:`ElasticConfig` is frozen and validated in ``__post_init__``; every message names
the key, the value and the rule. :func:`load_config` builds it from, highest first:

1. ``overrides`` (what the CLI flags set),
2. ``SLURM_ELASTIC_<KEY>`` environment variables (e.g. ``SLURM_ELASTIC_MAX_NODES=4``),
3. a YAML file (a mapping of the keys below; ``nnodes: "1:4"`` is accepted too),
4. values derived from the Slurm environment (:class:`~slurm_elastic.slurm.env.SlurmEnv`):
   run id, nproc per node (GPUs on the node, else 1), state dir, local address,
5. the defaults of the dataclass.

Durations are floats in seconds and named ``*_s``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from slurm_elastic.errors import ConfigError
from slurm_elastic.slurm.env import SlurmEnv

__all__ = [
    "ENV_PREFIX",
    "RDZV_BACKENDS",
    "REQUEUE_POLICIES",
    "ElasticConfig",
    "load_config",
    "parse_nnodes",
]

ENV_PREFIX = "SLURM_ELASTIC_"
RDZV_BACKENDS = ("slurm", "c10d", "etcd-v2", "etcd", "static")
REQUEUE_POLICIES = ("never", "preempt", "always")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class ElasticConfig:
    """Everything the agent, rendezvous and checkpoints need for one run.

    Attributes:
        min_nodes: the job starts once this many agents are healthy.
        max_nodes: agents above this wait as hot spares.
        nproc_per_node: workers per node; ``None`` = GPUs on the node, else 1.
        run_id: rendezvous/checkpoint namespace; default the (array) job id.
        state_dir: root of per-run state on the shared filesystem.
        rdzv_backend: ``slurm`` (ours), or torch's ``c10d``/``etcd-v2``/``etcd``/``static``.
        rdzv_endpoint: for ``slurm`` a directory (default ``state_dir/rdzv``); for the
            others torch's ``host:port``.
        checkpoint_dir: default ``state_dir/checkpoints/<run_id>``.
        events_dir: default ``state_dir/events/<run_id>``.
        log_dir: where the agent writes worker logs (``None``: inherit stdout/stderr).
        local_addr: address other nodes reach this node at; default the Slurm node name.
        max_restarts: worker-group restarts an agent may spend on failures.
        join_timeout_s: how long a node waits for a rendezvous to form.
        last_call_timeout_s: extra wait for more nodes once ``min_nodes`` have joined.
        heartbeat_interval_s: how often an agent proves it is alive.
        heartbeat_miss_limit: missed heartbeats (observed by a peer) before eviction.
        close_timeout_s: how long closing the rendezvous may take.
        shutdown_timeout_s: grace budget on preemption: checkpoint flush + worker stop.
        hang_timeout_s: a worker group with no progress report for this long is
            restarted; ``None`` disables the watchdog.
        monitor_interval_s: how often the agent checks its workers.
        preempt_signal: the early-notice signal Slurm sends (``--signal``); USR2 because
            NCCL may swallow USR1.
        requeue: ``never``; ``preempt`` (requeue own task after a preemption notice,
            SIGTERM or time limit); ``always`` (also after giving up on failures).
        max_requeues: stop requeueing once ``SLURM_RESTART_COUNT`` reaches this.
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int | None = None
    run_id: str | None = None
    state_dir: Path = Path(".slurm_elastic")
    rdzv_backend: str = "slurm"
    rdzv_endpoint: str | None = None
    checkpoint_dir: Path | None = None
    events_dir: Path | None = None
    log_dir: Path | None = None
    local_addr: str | None = None
    max_restarts: int = 3
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 3.0
    heartbeat_interval_s: float = 1.0
    heartbeat_miss_limit: int = 5
    close_timeout_s: float = 30.0
    shutdown_timeout_s: float = 60.0
    hang_timeout_s: float | None = None
    monitor_interval_s: float = 0.5
    preempt_signal: str = "USR2"
    requeue: str = "preempt"
    max_requeues: int = 20

    def __post_init__(self) -> None:
        _check(self.min_nodes >= 1, "min_nodes", self.min_nodes, "must be >= 1")
        _check(
            self.max_nodes >= self.min_nodes,
            "max_nodes",
            self.max_nodes,
            f"must be >= min_nodes ({self.min_nodes}); use nnodes: 'MIN:MAX'",
        )
        if self.nproc_per_node is not None:
            _check(self.nproc_per_node >= 1, "nproc_per_node", self.nproc_per_node, "must be >= 1")
        if self.run_id is not None:
            _check(
                bool(_RUN_ID.match(self.run_id)),
                "run_id",
                self.run_id,
                "must be 1-128 characters of letters, digits, '.', '_' or '-' "
                "(it names directories)",
            )
        _check(
            self.rdzv_backend in RDZV_BACKENDS,
            "rdzv_backend",
            self.rdzv_backend,
            f"must be one of {', '.join(RDZV_BACKENDS)}",
        )
        _check(
            self.requeue in REQUEUE_POLICIES,
            "requeue",
            self.requeue,
            f"must be one of {', '.join(REQUEUE_POLICIES)}",
        )
        for name in ("max_restarts", "max_requeues"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        _check(
            self.heartbeat_miss_limit >= 1,
            "heartbeat_miss_limit",
            self.heartbeat_miss_limit,
            "must be >= 1",
        )
        for name in (
            "join_timeout_s",
            "last_call_timeout_s",
            "heartbeat_interval_s",
            "close_timeout_s",
            "shutdown_timeout_s",
            "monitor_interval_s",
        ):
            _check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0 seconds")
        if self.hang_timeout_s is not None:
            _check(
                self.hang_timeout_s > 0,
                "hang_timeout_s",
                self.hang_timeout_s,
                "must be > 0 seconds, or null to disable the watchdog",
            )
        # Normalise "SIGUSR2"/"usr2"/"12" to "USR2" and reject what is not a signal.
        object.__setattr__(self, "preempt_signal", _signal_name(self.preempt_signal))

    # Resolved locations -------------------------------------------------------------
    @property
    def rdzv_dir(self) -> Path:
        """The shared rendezvous root for the ``slurm`` backend."""
        return Path(self.rdzv_endpoint) if self.rdzv_endpoint else self.state_dir / "rdzv"

    @property
    def preempt_signum(self) -> signal.Signals:
        """``preempt_signal`` as a :class:`signal.Signals`."""
        return signal.Signals[f"SIG{self.preempt_signal}"]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able mapping (for logging the resolved config and for events)."""
        return {
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()
        }


def _check(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r} = {value!r}: {rule}")


def _signal_name(value: object) -> str:
    raw = str(value).strip().upper()
    if raw.isdigit():
        try:
            return signal.Signals(int(raw)).name.removeprefix("SIG")
        except ValueError:
            pass
    name = raw.removeprefix("SIG")
    if f"SIG{name}" in signal.Signals.__members__ and name not in ("KILL", "STOP"):
        return name
    raise ConfigError(
        f"config key 'preempt_signal' = {value!r}: must be a catchable signal name "
        "such as USR2, USR1, TERM or HUP"
    )


_FIELDS = {f.name: f for f in dataclasses.fields(ElasticConfig)}
# SLURM_ELASTIC_* variables that are not config keys: set by the agent for its workers,
# read by the CLI (log level) or by scripts/slurm-cluster (CLUSTER_*).
_NOT_CONFIG = frozenset({"notice_file", "heartbeat_file", "requeue_count", "log_level", "cluster"})
_NOT_CONFIG_PREFIXES = ("cluster_", "test_")


def parse_nnodes(value: object) -> tuple[int, int]:
    """Parse torchrun's ``--nnodes`` form: ``4`` or ``"1:4"``."""
    text = str(value).strip()
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            return int(lo), int(hi)
        n = int(text)
        return n, n
    except ValueError as exc:
        raise ConfigError(
            f"config key 'nnodes' = {value!r}: expected N or MIN:MAX, e.g. 4 or '1:4'"
        ) from exc


def _coerce(key: str, value: Any, source: str) -> Any:
    """Turn ``value`` (from YAML, env or CLI) into the field's type, or raise."""
    fld = _FIELDS[key]
    kind = str(fld.type)
    optional = "None" in kind
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"config key {key!r} from {source}: must not be empty")
    try:
        if kind.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind.startswith("float"):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind.startswith("Path"):
            return Path(os.path.expanduser(str(value)))
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ValueError
    except (TypeError, ValueError) as exc:
        expected = kind.split(" |")[0]
        raise ConfigError(
            f"config key {key!r} = {value!r} from {source}: expected {expected}"
        ) from exc


def _collect(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key == "nnodes":
            out["min_nodes"], out["max_nodes"] = parse_nnodes(value)
            continue
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, [*_FIELDS, "nnodes"], n=2)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(
                f"unknown config key {raw_key!r} in {source}{hint} "
                f"(known keys: nnodes, {', '.join(_FIELDS)})"
            )
        out[key] = _coerce(key, value, source)
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    picked = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in _FIELDS or key == "nnodes":
            picked[key] = value
        elif key not in _NOT_CONFIG and not key.startswith(_NOT_CONFIG_PREFIXES):
            raise ConfigError(
                f"unknown environment variable {name}={value!r}: {ENV_PREFIX}<KEY> variables "
                f"set config keys ({', '.join(_FIELDS)}); unset it or fix the name"
            )
    return _collect(picked, "the environment")


def _from_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {os.fspath(path)!r} must hold a mapping of keys, got {type(data).__name__}"
        )
    return _collect(data, f"config file {os.fspath(path)!r}")


def _derived(slurm: SlurmEnv, environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if slurm.run_id:
        out["run_id"] = slurm.run_id
    out["nproc_per_node"] = slurm.gpus_per_node or 1
    base = slurm.submit_dir or Path(environ.get("PWD") or os.getcwd())
    out["state_dir"] = base / ".slurm_elastic"
    if slurm.node_name:
        out["local_addr"] = slurm.node_name
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    slurm: SlurmEnv | None = None,
) -> ElasticConfig:
    """Build the config from defaults, Slurm, YAML, environment and CLI overrides.

    Args:
        path: optional YAML file.
        environ: the environment (default ``os.environ``).
        overrides: CLI values; ``None`` values mean "not given".
        slurm: the parsed Slurm environment (default parsed from ``environ``).

    Raises:
        ConfigError: an unknown key, a wrong type or an impossible value; the message
            names the key, the value and the rule.
    """
    env = os.environ if environ is None else environ
    slurm = SlurmEnv.from_environ(env) if slurm is None else slurm
    merged: dict[str, Any] = _derived(slurm, env)
    if path is not None:
        merged.update(_from_yaml(path))
    merged.update(_from_env(env))
    merged.update(
        _collect({k: v for k, v in (overrides or {}).items() if v is not None}, "the command line")
    )
    if "max_nodes" not in merged and "min_nodes" in merged:
        merged["max_nodes"] = max(merged["min_nodes"], 1)
    run_id = merged.get("run_id")
    state_dir = Path(merged.get("state_dir", ElasticConfig.state_dir))
    if run_id:
        merged.setdefault("checkpoint_dir", state_dir / "checkpoints" / run_id)
        merged.setdefault("events_dir", state_dir / "events" / run_id)
    return ElasticConfig(**merged)
