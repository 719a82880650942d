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
import math
import os
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_elastic import envvars
from slurm_elastic.errors import ConfigError
from slurm_elastic.signals import DEFAULT_PREEMPT_SIGNAL, preempt_signal_name
from slurm_elastic.slurm.env import SlurmEnv

__all__ = [
    "ENV_PREFIX",
    "RDZV_BACKENDS",
    "REQUEUE_POLICIES",
    "CliFlag",
    "ElasticConfig",
    "Rule",
    "cli_flags",
    "field_default",
    "field_rule",
    "field_type",
    "load_config",
    "parse_nnodes",
]

ENV_PREFIX = envvars.PREFIX
RDZV_BACKENDS = ("slurm", "c10d", "etcd-v2", "etcd", "static")
REQUEUE_POLICIES = ("never", "preempt", "always")
WORKER_STARTS = ("warm", "cold")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Rule:
    """The one validation rule of a config field (``None`` values are not checked).

    Attributes:
        text: the rule as the error message states it (``"must be >= 2"``).
        ok: whether a (non-``None``) value satisfies it.
    """

    text: str
    ok: Callable[[Any], bool]


def _at_least(minimum: float, unit: str = "") -> Rule:
    return Rule(f"must be >= {minimum:g}{unit}", lambda v: v >= minimum)


_SECONDS = Rule("must be > 0 seconds", lambda v: v > 0)


@dataclass(frozen=True)
class CliFlag:
    """How a config field appears on the command line (``slurm-elastic agent``/``config``).

    Attributes:
        names: the flags, first the canonical one (torchrun's spellings as aliases).
        help: the help text.
        choices: the accepted values, if a closed set.
    """

    names: tuple[str, ...]
    help: str | None = None
    choices: tuple[str, ...] | None = None


def _field(
    default: Any, rule: Rule | None = None, flag: CliFlag | None = None
) -> Any:  # Any: dataclasses.field's own return type
    return field(default=default, metadata={"rule": rule, "flag": flag})


def _flag(*names: str, help: str | None = None, choices: tuple[str, ...] | None = None) -> CliFlag:
    return CliFlag(tuple(names), help, choices)


@dataclass(frozen=True)
class ElasticConfig:
    """Everything the agent, rendezvous and checkpoints need for one run.

    Each field carries its one validation rule (:func:`field_rule`; the rendezvous
    options of the same name use the same rule) and, if it has one, its command-line
    flag (:func:`cli_flags`) in its metadata.

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
        log_dir: where the agent writes per-rank worker logs (``None``: ``state_dir/logs/<run_id>``,
            also copied to its output with a ``[rank<R>]:`` prefix, unless redirects/tee are set).
        local_addr: address other nodes reach this node at; default the Slurm node name.
        max_restarts: worker-group restarts an agent may spend on failures.
        join_timeout_s: how long a node waits for a rendezvous to form.
        last_call_timeout_s: extra wait for more nodes once ``min_nodes`` have joined.
        heartbeat_interval_s: how often an agent proves it is alive.
        heartbeat_miss_limit: missed heartbeats (observed by a peer) before eviction;
            at least 2, so that one late observation never evicts a live node.
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
        worker_start: ``warm`` (the agent starts its workers' interpreters first, before
            it imports torch itself, so a new node's workers skip ``import torch``;
            :mod:`slurm_elastic.agent.warm_workers`) or ``cold``.
    """

    min_nodes: int = _field(1, _at_least(1))
    max_nodes: int = 1  # its rule (>= min_nodes) spans two fields: __post_init__
    nproc_per_node: int | None = _field(
        None, _at_least(1), _flag("--nproc-per-node", "--nproc_per_node")
    )
    run_id: str | None = _field(
        None,
        Rule(
            "must be 1-128 characters of letters, digits, '.', '_' or '-' (it names directories)",
            lambda v: bool(_RUN_ID.match(v)),
        ),
        _flag("--rdzv-id", "--rdzv_id"),
    )
    state_dir: Path = _field(Path(".slurm_elastic"), None, _flag("--state-dir"))
    rdzv_backend: str = _field(
        "slurm",
        Rule(f"must be one of {', '.join(RDZV_BACKENDS)}", lambda v: v in RDZV_BACKENDS),
        _flag("--rdzv-backend", "--rdzv_backend"),
    )
    rdzv_endpoint: str | None = _field(
        None,
        None,
        _flag(
            "--rdzv-endpoint",
            "--rdzv_endpoint",
            help="slurm backend: shared directory; c10d/etcd-v2: HOST:PORT",
        ),
    )
    checkpoint_dir: Path | None = _field(None, None, _flag("--checkpoint-dir"))
    events_dir: Path | None = None
    log_dir: Path | None = _field(None, None, _flag("--log-dir", "--log_dir"))
    local_addr: str | None = _field(None, None, _flag("--local-addr", "--local_addr"))
    max_restarts: int = _field(3, _at_least(0), _flag("--max-restarts", "--max_restarts"))
    join_timeout_s: float = _field(600.0, _at_least(0.1, " seconds"), _flag("--join-timeout"))
    last_call_timeout_s: float = _field(3.0, _at_least(0.01, " seconds"))
    heartbeat_interval_s: float = _field(1.0, _at_least(0.05, " seconds"))
    heartbeat_miss_limit: int = _field(5, _at_least(2))
    close_timeout_s: float = _field(30.0, _at_least(0.1, " seconds"))
    shutdown_timeout_s: float = _field(
        60.0,
        _SECONDS,
        _flag("--shutdown-timeout", help="seconds the workers get to checkpoint after a notice"),
    )
    hang_timeout_s: float | None = _field(
        None,
        Rule("must be > 0 seconds, or null to disable the watchdog", lambda v: v > 0),
        _flag("--hang-timeout", help="restart workers after this many seconds without progress"),
    )
    monitor_interval_s: float = _field(0.5, _SECONDS, _flag("--monitor-interval"))
    preempt_signal: str = _field(
        DEFAULT_PREEMPT_SIGNAL, None, _flag("--signal", help="preemption notice signal (USR2)")
    )
    requeue: str = _field(
        "preempt",
        Rule(
            f"must be one of {', '.join(REQUEUE_POLICIES)} (our own requeue of this node's "
            "task; Slurm's --requeue=expedite is the job-file key 'expedited_requeue: true')",
            lambda v: v in REQUEUE_POLICIES,
        ),
        _flag("--requeue", choices=REQUEUE_POLICIES),
    )
    max_requeues: int = _field(20, _at_least(0), _flag("--max-requeues"))
    worker_start: str = _field(
        "warm",
        Rule(
            f"must be one of {', '.join(WORKER_STARTS)} (warm: the agent starts the workers' "
            "interpreters, torch imported, before it needs them; cold: when it needs them)",
            lambda v: v in WORKER_STARTS,
        ),
        _flag("--worker-start", choices=WORKER_STARTS, help="warm or cold worker start"),
    )

    def __post_init__(self) -> None:
        _check_limits(self)
        for fld in dataclasses.fields(self):
            value = getattr(self, fld.name)
            rule = fld.metadata.get("rule")
            if rule is not None and value is not None:
                _check(rule.ok(value), fld.name, value, rule.text)
        _check(
            self.max_nodes >= self.min_nodes,
            "max_nodes",
            self.max_nodes,
            f"must be >= min_nodes ({self.min_nodes}); use nnodes: 'MIN:MAX'",
        )
        # Normalise "SIGUSR2"/"usr2"/"12" to "USR2" and reject what is not a signal.
        object.__setattr__(self, "preempt_signal", preempt_signal_name(self.preempt_signal))

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


#: Upper bounds that catch typos (an extra digit, a value in the wrong unit) early.
LIMITS: dict[str, float] = {
    "min_nodes": 100_000,
    "max_nodes": 100_000,
    "nproc_per_node": 4096,
    "max_restarts": 1_000_000,
    "max_requeues": 1_000_000,
    "heartbeat_miss_limit": 100_000,
}
#: Durations (``*_s``) must be finite and at most this many seconds (about 116 days).
MAX_SECONDS = 1e7


def _check_limits(config: ElasticConfig) -> None:
    for name, limit in LIMITS.items():
        value = getattr(config, name)
        if value is not None:
            _check(value <= limit, name, value, f"must be at most {limit:,.0f}")
    for fld in dataclasses.fields(config):
        value = getattr(config, fld.name)
        if fld.name.endswith("_s") and value is not None:
            _check(
                math.isfinite(value) and value <= MAX_SECONDS,
                fld.name,
                value,
                f"must be a finite number of seconds, at most {MAX_SECONDS:.0e}",
            )


def _check(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r} = {value!r}: {rule}")


_FIELDS = {f.name: f for f in dataclasses.fields(ElasticConfig)}


def field_rule(key: str) -> Rule | None:
    """The validation rule of config field ``key`` (``None``: any value of its type).

    Raises:
        KeyError: ``key`` is not a config field.
    """
    rule: Rule | None = _FIELDS[key].metadata.get("rule")
    return rule


def field_default(key: str) -> Any:
    """The dataclass default of config field ``key``."""
    return _FIELDS[key].default


def cli_flags() -> dict[str, CliFlag]:
    """Config field -> its command-line flag, for the fields that have one (field order)."""
    return {
        name: fld.metadata["flag"]
        for name, fld in _FIELDS.items()
        if fld.metadata.get("flag") is not None
    }


def field_type(key: str) -> type:
    """The scalar type a command-line value of field ``key`` is parsed as (int, float, str)."""
    kind = str(_FIELDS[key].type)
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str


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
            if not isinstance(value, str | os.PathLike):
                raise ValueError  # {a: 1} must not become the path "{'a': 1}"
            return Path(os.path.expanduser(os.fspath(value)))
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ValueError
    except (TypeError, ValueError) as exc:
        expected = kind.split(" |")[0]
        expected = {"Path": "Path (a string)"}.get(expected, expected)
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
        elif envvars.lookup(name) is None:
            raise ConfigError(
                f"unknown environment variable {name}={value!r}: {ENV_PREFIX}<KEY> variables "
                f"set config keys ({', '.join(_FIELDS)}); unset it or fix the name"
            )
    return _collect(picked, "the environment")


def _from_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    from slurm_elastic.yamlfile import load_mapping  # keeps 1:4 and 4:00:00 strings

    return _collect(load_mapping(path), f"config file {os.fspath(path)!r}")


def _cwd(environ: Mapping[str, str]) -> Path:
    """The working directory, spelled as the shell's ``$PWD`` when that is still true
    (it keeps symlinked paths); a stale ``$PWD`` (a process started with another cwd)
    is ignored."""
    cwd = os.getcwd()
    pwd = environ.get("PWD")
    try:
        if pwd and os.path.samefile(pwd, cwd):
            return Path(pwd)
    except OSError:
        pass
    return Path(cwd)


def _derived(slurm: SlurmEnv, environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if slurm.run_id:
        out["run_id"] = slurm.run_id
    out["nproc_per_node"] = slurm.gpus_per_node or 1
    base = slurm.submit_dir or _cwd(environ)
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
    overrides_source: str = "the command line",
) -> ElasticConfig:
    """Build the config from defaults, Slurm, YAML, environment and CLI overrides.

    Args:
        path: optional YAML file.
        environ: the environment (default ``os.environ``).
        overrides: CLI values; ``None`` values mean "not given".
        slurm: the parsed Slurm environment (default parsed from ``environ``).
        overrides_source: where ``overrides`` came from, as error messages name it
            (``"job file 'job.yaml'"``; default ``"the command line"``).

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
        _collect({k: v for k, v in (overrides or {}).items() if v is not None}, overrides_source)
    )
    if "max_nodes" not in merged and "min_nodes" in merged:
        merged["max_nodes"] = max(merged["min_nodes"], 1)
    run_id = merged.get("run_id")
    state_dir = Path(merged.get("state_dir", ElasticConfig.state_dir))
    if run_id:
        merged.setdefault("checkpoint_dir", state_dir / "checkpoints" / run_id)
        merged.setdefault("events_dir", state_dir / "events" / run_id)
    return ElasticConfig(**merged)
