"""``run_agent``: the one place where configuration is wired into torch's objects.

It mirrors ``torch.distributed.launcher.api.launch_agent`` (rendezvous parameters, worker
spec, agent, shutdown) and adds what a Slurm node needs:

* the preemption path: the notice signal (``preempt_signal``, USR2 by default) or SIGTERM
  creates the node's notice file and is forwarded to the workers, which checkpoint and
  exit (``slurm_elastic.notice``); the agent waits up to ``shutdown_timeout_s`` for them,
  leaves the rendezvous *without closing it* (survivors re-form at once), and requeues
  only its own job or array task when the policy allows;
* the end of a run: on success the rendezvous is closed and the array's still-pending
  tasks are cancelled, so nothing of the job stays in the queue; a node that comes back
  after the run was closed exits 0 at once;
* exit codes that say what happened (:class:`~slurm_elastic.agent.exit_codes.ExitCode`).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
)

from slurm_elastic import envvars, events, notice, signals
from slurm_elastic.agent import node_dirs
from slurm_elastic.agent.elastic_agent import SlurmElasticAgent
from slurm_elastic.agent.exit_codes import ExitCode
from slurm_elastic.agent.notice_window import check_notice_window
from slurm_elastic.agent.watchdog import ProgressWatch
from slurm_elastic.config import ElasticConfig
from slurm_elastic.errors import (
    ConfigError,
    RendezvousSetupError,
    SlurmElasticError,
    SlurmError,
    UnsafeDirectoryError,
)
from slurm_elastic.live import auth, control
from slurm_elastic.privatefs import ensure_private_dir, private_tree
from slurm_elastic.rendezvous.options import RendezvousOptions, check_keys
from slurm_elastic.rendezvous.protocols import LeavableRendezvous
from slurm_elastic.slurm.control import SlurmControl, default_control
from slurm_elastic.slurm.env import SlurmEnv

__all__ = ["WORKER_ENV", "rendezvous_parameters", "run_agent"]

log = logging.getLogger(__name__)

#: Variables the agent adds to its workers' environment (besides torch's).
WORKER_ENV = (
    envvars.RUN_ID_ENV,
    envvars.CHECKPOINT_DIR_ENV,
    envvars.EVENTS_DIR_ENV,
    envvars.REQUEUE_COUNT_ENV,
    envvars.NOTICE_FILE_ENV,
    envvars.HEARTBEAT_FILE_ENV,
    envvars.PREEMPT_SIGNAL_ENV,
    control.CONTROL_DIR_ENV,
    control.ROUND_ENV,
)

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


class _Stop:
    """What asked the agent to stop; set from signal handlers (main thread only)."""

    def __init__(self, notice_signal: signal.Signals, notice_file: Path) -> None:
        self.notice_signal = notice_signal
        self.notice_file = notice_file
        self.noticed = False  # preemption/time-limit notice seen
        self.stopping = False  # a SignalException is already on its way
        self.signals: list[str] = []
        #: set once the agent exists: starts a graceful leave in place, if possible
        self.leave_in_place: Callable[[], bool] | None = None
        self.leaving_in_place = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        self.signals.append(sig.name)
        if sig == self.notice_signal:
            self.noticed = True
        # Workers learn of it from the file even before the forwarded signal arrives.
        notice.raise_notice(self.notice_file, reason=sig.name)
        if self.stopping:
            return  # e.g. Slurm's SIGTERM after the USR2 notice: already shutting down
        # A notice, or Slurm's SIGTERM at preemption (KillWait follows): leave in place
        # when the workers can, so the survivors re-form without waiting for them.
        if (
            sig in (self.notice_signal, signal.SIGTERM)
            and not self.leaving_in_place
            and self.leave_in_place is not None
            and self.leave_in_place()
        ):
            # The workers train on until the survivors switch, then exit; the agent
            # then stops through the ordinary path. A second signal escalates.
            self.leaving_in_place = True
            log.warning("received %s: leaving in place (workers exit at the switch)", sig.name)
            events.emit(events.AgentSignal(signal=sig.name, notice=self.noticed, in_place=True))
            return
        self.stopping = True
        log.warning("received %s: stopping workers (they checkpoint first)", sig.name)
        events.emit(events.AgentSignal(signal=sig.name, notice=self.noticed))
        # torch's agent forwards ``sigval`` to the workers and waits shutdown_timeout_s:
        # forward the notice signal, which workers handle (checkpoint, then exit), even
        # for SIGTERM, whose default action would kill them before they can save.
        raise SignalException(f"agent {os.getpid()} got {sig.name}", sigval=self.notice_signal)


def _python_entrypoint(entrypoint: str, args: Sequence[str], module: bool) -> tuple[str, tuple]:
    if module:
        return sys.executable, ("-u", "-m", entrypoint, *args)
    return sys.executable, ("-u", entrypoint, *args)


def run_agent(
    config: ElasticConfig,
    entrypoint: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    redirects: str = "0",
    tee: str = "0",
    rdzv_conf: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    client: SlurmControl | None = None,
) -> int:
    """Run this node's agent until the run finishes, fails, or the node is preempted.

    Args:
        config: the resolved configuration.
        entrypoint: the training script (or module with ``module=True``).
        args: its arguments.
        module: run ``python -m entrypoint``.
        redirects: torchrun's ``--redirects`` (0 none, 1 stdout, 2 stderr, 3 both).
        tee: torchrun's ``--tee``.
        rdzv_conf: extra rendezvous settings (torchrun's ``--rdzv-conf``).
        environ: the environment to read Slurm from (default ``os.environ``).
        client: the Slurm seam (default: a new ``SlurmClient``).

    Returns:
        An :class:`ExitCode`.
    """
    env = os.environ if environ is None else environ
    slurm = SlurmEnv.from_environ(env)
    node_dirs.sweep()  # of agents killed before they could remove theirs
    node_dir = node_dirs.create()
    notice_file = node_dir / "notice"
    heartbeat_file = node_dir / "progress"
    control_dir = node_dir / "control"
    try:
        return _run(
            config,
            entrypoint,
            args,
            module,
            redirects,
            tee,
            rdzv_conf,
            slurm,
            client,
            notice_file,
            heartbeat_file,
            control_dir,
        )
    finally:
        shutil.rmtree(node_dir, ignore_errors=True)


def _worker_environment(
    config: ElasticConfig,
    slurm: SlurmEnv,
    notice_file: Path,
    heartbeat_file: Path,
    control_dir: Path,
) -> dict[str, str]:
    values: dict[str, object] = {
        envvars.RUN_ID_ENV: config.run_id,
        envvars.CHECKPOINT_DIR_ENV: config.checkpoint_dir,
        envvars.EVENTS_DIR_ENV: config.events_dir,
        envvars.REQUEUE_COUNT_ENV: slurm.restart_count,
        envvars.NOTICE_FILE_ENV: notice_file,
        envvars.HEARTBEAT_FILE_ENV: heartbeat_file,
        envvars.PREEMPT_SIGNAL_ENV: config.preempt_signal,
        control.CONTROL_DIR_ENV: control_dir,
        # Our handlers own TERM/HUP/QUIT and the notice signal; torch's keeps SIGINT.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGINT",
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets 1 when several workers share a node; we know the node's CPUs from
        # Slurm, so give each worker its share (torch would otherwise size its thread
        # pools by the whole machine, not by the allocation).
        nproc = config.nproc_per_node or 1
        cpus = slurm.cpus_on_node or os.cpu_count() or 1
        values["OMP_NUM_THREADS"] = max(1, cpus // nproc)
        log.info(
            "OMP_NUM_THREADS unset: %s per worker (%s CPUs / %s workers)",
            values["OMP_NUM_THREADS"],
            cpus,
            nproc,
        )
    return {k: str(v) for k, v in values.items() if v is not None}


class _RoundLogsSpecs(DefaultLogsSpecs):
    """torch's log layout, one ``attempt_<n>`` directory per round, none overwritten.

    torch names a round's directory after ``TORCHELASTIC_RESTART_COUNT`` and deletes it
    first; a restart not charged to ``max_restarts`` (a membership change) reuses the
    count and would wipe the previous round's logs. Here ``n`` counts rounds instead (the
    workers' environment is unchanged).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rounds = 0
        self._root = kwargs.get("log_dir")

    def reify(self, envs: dict[int, dict[str, str]]) -> Any:
        numbered = {
            r: {**e, "TORCHELASTIC_RESTART_COUNT": str(self._rounds)} for r, e in envs.items()
        }
        self._rounds += 1
        dest = super().reify(numbered)
        if self._root:  # torch makes attempt_<n>/<rank> with the umask: 0700 like ours
            private_tree(Path(self._root))
        return dest


def _worker_logs(config: ElasticConfig, redirects: str, tee: str) -> tuple[Path | None, str, str]:
    """Where the workers' output goes: per-rank files kept across restarts and requeues.

    With no ``log_dir`` configured, the files go under ``state_dir/logs/<run_id>`` and are
    also copied to the agent's output (``tee``), each line prefixed ``[rank<R>]:``, unless
    the user chose ``redirects``/``tee`` explicitly (``slurm-elastic logs`` reads them).
    """
    if config.log_dir is not None:
        return config.log_dir, redirects, tee
    if config.run_id is None or (redirects, tee) != ("0", "0"):
        return None, redirects, tee
    return config.state_dir / "logs" / config.run_id, "0", "3"


def _private_directories(config: ElasticConfig, log_dir: Path | None) -> None:
    """Create the run's directories ``0700`` (whatever the umask or a setgid parent) and
    check the existing ones: the state directory and, wherever they are, the rendezvous
    root, checkpoints, events and logs. Below the state directory every component must be
    private; a directory configured elsewhere is checked from itself down.

    Raises:
        UnsafeDirectoryError: a component is a link, not ours, or writable by others.
        OSError: one cannot be created.
    """
    state = Path(os.path.abspath(config.state_dir))
    wanted: list[Path | None] = [state, config.events_dir, config.checkpoint_dir, log_dir]
    if config.rdzv_backend == "slurm":
        wanted.append(config.rdzv_dir)
    for directory in wanted:
        if directory is None:
            continue
        path = Path(os.path.abspath(directory))
        inside = path == state or state in path.parents
        ensure_private_dir(path, root=state if inside else path)


def _run_key(config: ElasticConfig) -> Path:
    """The run key's file (created by the first agent), in the run's private directory
    that every node shares: the rendezvous root for the ``slurm`` backend, else the state
    directory. Its workers seal the round's store with it (:mod:`slurm_elastic.live.auth`).
    """
    base = Path(
        os.path.abspath(config.rdzv_dir if config.rdzv_backend == "slurm" else config.state_dir)
    )
    keys = ensure_private_dir(base / ".keys", root=base)
    return auth.load_or_create_key(keys, f"{config.run_id or 'run'}.key")


def _run(
    config: ElasticConfig,
    entrypoint: str,
    args: Sequence[str],
    module: bool,
    redirects: str,
    tee: str,
    rdzv_conf: Mapping[str, str] | None,
    slurm: SlurmEnv,
    client: SlurmControl | None,
    notice_file: Path,
    heartbeat_file: Path,
    control_dir: Path,
) -> int:
    os.environ.update(_worker_environment(config, slurm, notice_file, heartbeat_file, control_dir))
    log.info("agent config: %s", config.as_dict())
    log_dir, redirects, tee = _worker_logs(config, redirects, tee)
    try:
        _private_directories(config, log_dir)
        os.environ[envvars.KEY_FILE_ENV] = str(_run_key(config))
    except (UnsafeDirectoryError, OSError) as exc:
        log.error("cannot use the run's directories: %s", exc)
        return ExitCode.USAGE
    events.emit(
        events.AgentStart(
            config=config.as_dict(),
            requeue_count=slurm.restart_count,
            job=slurm.own_job_ref,
        )
    )
    if config.run_id and config.events_dir:  # so that `slurm-elastic status JOB` finds it
        events.record_run(
            config.run_id,
            state_dir=config.state_dir,
            events_dir=config.events_dir,
            checkpoint_dir=config.checkpoint_dir,
            log_dir=log_dir,
        )

    stop = _Stop(config.preempt_signum, notice_file)
    handled = {config.preempt_signum, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
    for sig in handled:
        signal.signal(sig, stop.handler)
    early = signals.take_early_notices(handled)
    # The job script may start the agent with the notice blocked (held pending until
    # now): from here on the handler acts on it.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)

    try:
        for sig in early:  # a notice during start-up: act on it now (raises)
            if sig in handled:
                log.warning("%s arrived while the agent was starting: acting on it now", sig.name)
                stop.handler(sig, None)
            else:
                log.warning("ignored %s during start-up: not the notice signal", sig.name)
        # does a checkpoint save fit the warning this task gets? (a WARNING if not)
        check_notice_window(config, slurm, os.environ)
        params = rendezvous_parameters(config, rdzv_conf)
        handler = rdzv_registry.get_rendezvous_handler(params)
    except SignalException:  # stopped before there was anything to stop
        return _after_signal(config, slurm, client, None, stop)
    except RendezvousClosedError as exc:  # a late agent of a run that has finished
        log.info("the run %s is already finished: nothing to do (%s)", config.run_id, exc)
        events.emit(events.AgentExit(code=ExitCode.FINISHED.name))
        return ExitCode.FINISHED
    except (ConfigError, RendezvousSetupError) as exc:  # fix the config or the directory
        log.error("cannot set up the rendezvous: %s", exc)
        events.emit(events.AgentExit(code=ExitCode.USAGE.name, error=str(exc)))
        return ExitCode.USAGE
    except (SlurmElasticError, RendezvousError, ValueError) as exc:
        log.error("cannot set up the rendezvous: %s", exc)
        events.emit(events.AgentExit(code=ExitCode.RENDEZVOUS_FAILED.name, error=str(exc)))
        return ExitCode.RENDEZVOUS_FAILED

    cmd, cmd_args = _python_entrypoint(entrypoint, args, module)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=config.nproc_per_node or 1,
        entrypoint=cmd,
        args=cmd_args,
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval_s,
        local_addr=config.local_addr,
    )

    def before_round(group: WorkerGroup) -> None:
        # The old workers are stopped: the next ones start clean, with no stale notice
        # and no progress report of the last attempt.
        notice.clear_notice(notice_file)
        notice.clear_notice(heartbeat_file)
        control.clear(control_dir)

    agent = SlurmElasticAgent(
        spec=spec,
        logs_specs=_RoundLogsSpecs(
            log_dir=str(log_dir) if log_dir else None,
            redirects=Std.from_str(redirects),
            tee=Std.from_str(tee),
        ),
        log_line_prefix_template="[rank${rank}]:",
        start_method="spawn",
        exit_barrier_timeout=max(60.0, config.close_timeout_s),
        shutdown_timeout=max(1, math.ceil(config.shutdown_timeout_s)),
        membership_grace_s=config.heartbeat_interval_s * (config.heartbeat_miss_limit + 1),
        # The watchdog arms at the first progress report of a round: start-up (imports,
        # data loading, process-group init) may legitimately take long, and a peer that
        # never arrives is the rendezvous' business, not the watchdog's.
        progress=ProgressWatch(heartbeat_file),
        hang_timeout_s=config.hang_timeout_s,
        before_round=before_round,
        control_dir=control_dir,
        notice_file=notice_file,
        notice_signal=stop.notice_signal,
        leave=lambda: _leave(handler),
        leave_timeout_s=config.shutdown_timeout_s,
    )
    stop.leave_in_place = agent.request_live_leave

    code = ExitCode.FAILED
    try:
        result = agent.run()
        if result is None or not result.is_failed():
            # None: a spare that the finished run let go (RendezvousGracefulExitError).
            code = ExitCode.FINISHED
        else:
            log.error(
                "workers failed and max_restarts=%s is spent: %s",
                config.max_restarts,
                result.failures,
            )
            code = ExitCode.FAILED
    except SignalException:
        code = _after_signal(config, slurm, client, handler, stop)
        return code
    except (RendezvousClosedError, RendezvousGracefulExitError):
        log.info("the run %s is already finished: nothing to do", config.run_id)
        code = ExitCode.FINISHED
        return code
    except RendezvousError as exc:
        log.error("rendezvous failed: %s", exc)
        code = ExitCode.RENDEZVOUS_FAILED
        return code
    finally:
        events.emit(events.AgentExit(code=code.name))
        log.info("agent exits with %d (%s)", code, code.name)

    # Reached only after agent.run() returned: close the run on success (torch does the
    # same in launch_agent); a failed node closes nothing, so others may carry on.
    if code == ExitCode.FINISHED:
        with contextlib.suppress(RendezvousError):
            handler.shutdown()
        _cancel_pending_tasks(slurm, client)
    elif config.requeue == "always":
        outcome = _requeue_own(config, slurm, client)
        if isinstance(outcome, SlurmError):
            log.warning("requeue of %s failed: %s", slurm.own_job_ref, outcome)
    return code


def _leave(handler: RendezvousHandler | None) -> None:
    """Leave the rendezvous without closing it, when the backend can (ours can)."""
    if not isinstance(handler, LeavableRendezvous):
        return  # torch's backends: peers evict this node after the keep-alive window
    try:
        handler.leave()
    except (RendezvousError, OSError) as exc:
        log.warning("could not leave the rendezvous gracefully: %s", exc)


def _after_signal(
    config: ElasticConfig,
    slurm: SlurmEnv,
    client: SlurmControl | None,
    handler: RendezvousHandler | None,
    stop: _Stop,
) -> ExitCode:
    # torch's agent has already forwarded the signal and waited up to
    # shutdown_timeout_s for the workers (their checkpoint flush), then killed them.
    stop.stopping = True  # from here on, signals are only recorded (no second exception)
    _leave(handler)
    if not stop.noticed:
        events.emit(events.AgentTerminated(signals=list(stop.signals)))
        return ExitCode.TERMINATED
    if config.requeue == "never":
        return ExitCode.PREEMPTED
    outcome = _requeue_own(config, slurm, client)
    if outcome is True:
        return ExitCode.PREEMPTED_REQUEUED
    if outcome is not False:
        _wait_for_slurm(stop, slurm, outcome)
    return ExitCode.PREEMPTED


#: Signals with which Slurm ends a task (preemption, time limit, scancel, requeue).
_ENDING = frozenset({"SIGTERM", "SIGHUP", "SIGQUIT"})


def _wait_for_slurm(stop: _Stop, slurm: SlurmEnv, error: SlurmError) -> None:
    """The task could not requeue itself: stay until Slurm ends it, then exit.

    Exiting now would end the task as finished: during a preemption's GraceTime, Slurm
    then has nothing left to requeue (PreemptMode=REQUEUE only requeues a task it stops
    itself). Staying lets Slurm's own SIGTERM, at the end of the grace time or at the time
    limit, end the task as Slurm decides: requeued on a preemption. The workers are
    stopped and the rendezvous left already; a SIGTERM that came with the notice (e.g.
    GraceTime=0) ends the wait at once. Slurm's SIGKILL after KillWait is the backstop.
    """
    log.error(
        "cannot requeue %s myself (%s); waiting for Slurm to end this task: a preemption "
        "requeues it (PreemptMode=REQUEUE), a time limit or scancel ends it. To requeue on "
        "every notice, make scontrol reachable in the job (e.g. bind Slurm's commands "
        "into the container and put them on PATH in the job's setup)",
        slurm.own_job_ref,
        error,
    )
    while not _ENDING.intersection(stop.signals):
        time.sleep(0.2)  # the signal handler records Slurm's signal in stop.signals
    log.info("Slurm ended the task (%s)", ", ".join(stop.signals))


def _client(client: SlurmControl | None) -> SlurmControl:
    return client if client is not None else default_control()


def _requeue_own(
    config: ElasticConfig, slurm: SlurmEnv, client: SlurmControl | None
) -> bool | SlurmError:
    """Requeue this node's own job or array task.

    Returns:
        True: requeued. False: not to be requeued (not in Slurm, ``max_requeues``
        reached). The :class:`SlurmError` of a requeue that failed (no ``scontrol`` on
        PATH, Slurm refused): only Slurm's own requeue can bring the task back.
    """
    ref = slurm.own_job_ref
    if ref is None:
        log.info("not in a Slurm job: nothing to requeue")
        return False
    if slurm.restart_count >= config.max_requeues:
        log.warning(
            "not requeueing %s: requeued %d times already (max_requeues=%d)",
            ref,
            slurm.restart_count,
            config.max_requeues,
        )
        return False
    try:
        _client(client).requeue(ref)
    except SlurmError as exc:
        # Slurm may be requeueing the job itself (PreemptMode=REQUEUE) at the same time;
        # the caller says what follows.
        return exc
    log.info("requeued %s", ref)
    events.emit(events.AgentRequeued(job=ref, requeue_count=slurm.restart_count + 1))
    return True


def _cancel_pending_tasks(slurm: SlurmEnv, client: SlurmControl | None) -> None:
    """After success, nothing of the array may stay queued (requeued or never started)."""
    if not slurm.is_array_task or slurm.array_job_id is None:
        return
    try:
        _client(client).cancel(slurm.array_job_id, state="PENDING")
    except SlurmError as exc:
        log.warning("could not cancel the pending tasks of %s: %s", slurm.array_job_id, exc)
