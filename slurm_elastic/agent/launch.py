"""``run_agent``: the one place where configuration is wired into torch's objects.

It mirrors ``torch.distributed.launcher.api.launch_agent`` (rendezvous parameters, worker
spec, agent, shutdown) and adds what a Slurm node needs:

* the preemption path: the notice signal (``preempt_signal``, USR2 by default) or SIGTERM
  creates the node's notice file and is forwarded to the workers, which checkpoint and
  exit (``slurm_elastic.notice``); the agent waits up to ``shutdown_timeout_s`` for them,
  leaves the rendezvous *without closing it* (survivors re-form at once), and requeues
  only its own job or array task when the policy allows (:mod:`.stop`, :mod:`.requeue`);
* the end of a run: on success the rendezvous is closed and the array's still-pending
  tasks are cancelled, so nothing of the job stays in the queue; a node that comes back
  after the run was closed exits 0 at once;
* exit codes that say what happened (:class:`~slurm_elastic.agent.exit_codes.ExitCode`).

The pieces live beside it: :mod:`.rendezvous_params` (config to torch's rendezvous
parameters), :mod:`.worker_env` (the workers' command and environment),
:mod:`.run_files` (private directories, run key, log layout).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException, Std
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
)

from slurm_elastic import envvars, events
from slurm_elastic.agent import node_dirs, warm_workers
from slurm_elastic.agent.elastic_agent import SlurmElasticAgent
from slurm_elastic.agent.exit_codes import ExitCode
from slurm_elastic.agent.notice_window import check_notice_window
from slurm_elastic.agent.rendezvous_params import rendezvous_parameters
from slurm_elastic.agent.requeue import cancel_pending_tasks, requeue_own
from slurm_elastic.agent.run_files import (
    RoundLogsSpecs,
    private_directories,
    run_key,
    worker_logs,
)
from slurm_elastic.agent.run_owner import check_run_cluster
from slurm_elastic.agent.stop import (
    Stop,
    act_on_early_signals,
    exit_after_signal,
    install_stop_handlers,
    leave_rendezvous,
)
from slurm_elastic.agent.warm_workers import WarmWorkers
from slurm_elastic.agent.watchdog import ProgressWatch
from slurm_elastic.agent.worker_env import python_entrypoint, worker_environment
from slurm_elastic.channel import NodeChannel
from slurm_elastic.config import ElasticConfig
from slurm_elastic.errors import (
    ConfigError,
    RendezvousSetupError,
    RunIdInUseError,
    SlurmElasticError,
    SlurmError,
    UnsafeDirectoryError,
)
from slurm_elastic.slurm.control import SlurmControl
from slurm_elastic.slurm.env import SlurmEnv

__all__ = ["run_agent"]

log = logging.getLogger(__name__)


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
    warm: WarmWorkers | None = None,
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
        warm: the workers' interpreters, started before torch was imported (the CLI
            does); default: started here, per ``worker_start``. Closed on return.

    Returns:
        An :class:`ExitCode`.
    """
    env = os.environ if environ is None else environ
    slurm = SlurmEnv.from_environ(env)
    if warm is None:
        warm = warm_workers.start(config, os.environ, entrypoint, args, module)
    node_dirs.sweep()  # of agents killed before they could remove theirs
    node_dir = node_dirs.create()
    channel = NodeChannel(node_dir)
    try:
        return _run(
            _Launch(
                config=config,
                entrypoint=entrypoint,
                args=tuple(args),
                module=module,
                redirects=redirects,
                tee=tee,
                rdzv_conf=rdzv_conf,
                slurm=slurm,
                client=client,
                channel=channel,
                warm=warm,
            )
        )
    finally:
        if warm is not None:
            warm.close()
        shutil.rmtree(node_dir, ignore_errors=True)


@dataclass(frozen=True)
class _Launch:
    """One agent's launch: what :func:`run_agent` was asked to run, and where.

    Attributes:
        config: the resolved configuration.
        entrypoint, args, module: the workers' script or module and its arguments.
        redirects, tee: torchrun's ``--redirects`` and ``--tee``, as the user gave them.
        rdzv_conf: extra rendezvous settings (``--rdzv-conf``).
        slurm: the node's Slurm environment.
        client: the Slurm seam (``None``: the default one, created when first needed).
        channel: the node channel through which the agent and its workers talk (its
            directory: :mod:`.node_dirs`).
        warm: the workers' waiting interpreters (:mod:`.warm_workers`), if any.
    """

    config: ElasticConfig
    entrypoint: str
    args: Sequence[str]
    module: bool
    redirects: str
    tee: str
    rdzv_conf: Mapping[str, str] | None
    slurm: SlurmEnv
    client: SlurmControl | None
    channel: NodeChannel
    warm: WarmWorkers | None


def _run(launch: _Launch) -> int:
    """The agent's life in steps: the run's files, the stop signals, the rendezvous, the
    workers' rounds, and what the node asks of Slurm as it leaves."""
    config = launch.config
    os.environ.update(worker_environment(config, launch.slurm, launch.channel))
    log.info("agent config: %s", config.as_dict())
    log_dir, redirects, tee = worker_logs(config, launch.redirects, launch.tee)
    if not _prepare_run_files(config, log_dir, launch.slurm):
        return ExitCode.USAGE
    _announce_start(launch, log_dir)
    stop, early = install_stop_handlers(config.preempt_signum, launch.channel)
    handler = _open_rendezvous(launch, stop, early)
    if isinstance(handler, ExitCode):
        return handler
    agent = _make_agent(launch, handler, stop, log_dir, redirects, tee)
    stop.leave_in_place = agent.request_live_leave
    return _supervise(launch, agent, handler, stop)


def _prepare_run_files(
    config: ElasticConfig,
    log_dir: Path,
    slurm: SlurmEnv,
    environ: Mapping[str, str] = os.environ,
) -> bool:
    """Create and check the run's private directories and its key, and that a run id
    taken from the job id is not another cluster's or another submission's (False:
    unusable)."""
    try:
        private_directories(config, log_dir)
        key = run_key(config)
        os.environ[envvars.KEY_FILE_ENV] = str(key)
        if config.run_id is not None and config.run_id == slurm.run_id:
            submission = environ.get(envvars.SUBMISSION_ENV)
            check_run_cluster(key.parent, config.run_id, slurm.cluster_name, submission)
    except (RunIdInUseError, ValueError) as exc:
        log.error("%s", exc)
        return False
    except (UnsafeDirectoryError, OSError) as exc:
        log.error("cannot use the run's directories: %s", exc)
        return False
    return True


def _announce_start(launch: _Launch, log_dir: Path) -> None:
    """The ``AgentStart`` event, and the run's record for ``slurm-elastic status JOB``."""
    config = launch.config
    events.emit(
        events.AgentStart(
            config=config.as_dict(),
            requeue_count=launch.slurm.restart_count,
            job=launch.slurm.own_job_ref,
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


def _open_rendezvous(
    launch: _Launch, stop: Stop, early: list[signal.Signals]
) -> RendezvousHandler | ExitCode:
    """Act on start-up signals, check the notice window, create the rendezvous handler.

    Returns:
        The handler, or the :class:`ExitCode` of an agent that stops before any round.
    """
    config = launch.config
    try:
        act_on_early_signals(stop, early)  # a notice during start-up: act on it now (raises)
        # does a checkpoint save fit the warning this task gets? (a WARNING if not)
        check_notice_window(config, launch.slurm, os.environ)
        params = rendezvous_parameters(config, launch.rdzv_conf)
        return rdzv_registry.get_rendezvous_handler(params)
    except SignalException:  # stopped before there was anything to stop
        return exit_after_signal(config, launch.slurm, launch.client, None, stop)
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


def _make_agent(
    launch: _Launch,
    handler: RendezvousHandler,
    stop: Stop,
    log_dir: Path,
    redirects: str,
    tee: str,
) -> SlurmElasticAgent:
    """torch's worker spec and our agent, wired to the node's files and the stop signals."""
    config = launch.config
    cmd, cmd_args = python_entrypoint(launch.entrypoint, launch.args, launch.module)
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
        launch.channel.clear()

    return SlurmElasticAgent(
        spec=spec,
        logs_specs=RoundLogsSpecs(
            log_dir=str(log_dir),
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
        progress=ProgressWatch(launch.channel.progress),
        hang_timeout_s=config.hang_timeout_s,
        before_round=before_round,
        channel=launch.channel,
        notice_signal=stop.notice_signal,
        leave=lambda: leave_rendezvous(handler),
        leave_timeout_s=config.shutdown_timeout_s,
        warm=launch.warm,
        stop_check=stop.raise_if_lost,
    )


def _supervise(
    launch: _Launch, agent: SlurmElasticAgent, handler: RendezvousHandler, stop: Stop
) -> ExitCode:
    """Run the workers' rounds to the end; then close the run on success, or requeue."""
    config = launch.config
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
        code = exit_after_signal(config, launch.slurm, launch.client, handler, stop)
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
        cancel_pending_tasks(launch.slurm, launch.client)
    elif config.requeue == "always":
        outcome = requeue_own(config, launch.slurm, launch.client)
        if isinstance(outcome, SlurmError):
            log.warning("requeue of %s failed: %s", launch.slurm.own_job_ref, outcome)
    return code
