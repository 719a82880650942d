"""The fault matrix's harness: one real training job on the local Slurm, faults, checks.

A :class:`FaultRun` renders the real ``elastic_array``/``fault_tolerant`` templates with
``tests/faults/paced_train.py`` (``examples/train_ddp.py`` plus a pace the test controls),
submits them, finds the job's agents and workers in the process table (all nodes share
the PID namespace), injects faults, and at the end checks what every case must hold:

* the job completes (every task in its expected final state);
* no checkpoint is lost or corrupted: ``CheckpointManager.load_latest`` verifies the
  final step's checkpoint;
* the ledger shows every sample exactly once per epoch, and the final parameters are
  within ``ATOL`` of an uninterrupted one-process run of the same training;
* nothing of the job is left in the queue (only this run's job ids are looked at) and no
  process of the run is left in the process table.

Several faults share one job where one run can carry them in sequence (each waits for
the run to have recovered before the next): :class:`Scenario` records each case's
outcome, and each case is still its own test (``tests/faults/test_*.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic import ledger
from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.errors import CheckpointCorruptError
from slurm_elastic.slurm.jobstate import JobInfo, JobState
from tests.conftest import SlurmCluster
from tests.e2e.jobs import (
    FAST,
    agent_events,
    assert_ledger_ok,
    effective_ledger,
    max_abs_diff,
    render,
)
from tests.e2e.test_slurm_e2e import reference_params
from tests.helpers import wait_for

PACED = Path(__file__).resolve().parent / "paced_train.py"
# The example the jobs run (tests/faults/paced_train.py); FAULTS_TRAIN_MODULE picks another
# example of examples/ with train_ddp's command line.
TRAIN_MODULE = os.environ.get("FAULTS_TRAIN_MODULE", "train_ddp")
# The membership path: train_ddp runs on ElasticLoop, which changes membership in place
# ("in-place", the default); FAULTS_PATH=restart exports SLURM_ELASTIC_IN_PLACE=0 into the
# jobs, so every change restarts the workers (the path of scripts that do not opt in).
PATHS = ("in-place", "restart")
PATH = os.environ.get("FAULTS_PATH", "in-place")
if PATH not in PATHS:
    raise ValueError(f"FAULTS_PATH={PATH!r}: expected one of {', '.join(PATHS)}")
ATOL = 2e-6  # as tests/e2e: float reassociation across world sizes only
DATASET = 400
GLOBAL_BATCH = 16
SKIPPED = "skipped: "
TERMINAL = {s for s in JobState if s.is_terminal}

# One reference run per training configuration, shared by the whole session.
_REFERENCES: dict[tuple[str, ...], Path] = {}


def train_args(steps: int, save_every: int = 10) -> list[str]:
    """The training every case runs (its reference is computed once per ``steps``)."""
    return [
        "--steps",
        str(steps),
        "--dataset-size",
        str(DATASET),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--save-every",
        str(save_every),
    ]


def reference(tmp_root: Path, args: list[str], module: str = "train_ddp") -> Path:
    """Final parameters of the uninterrupted one-process run of ``args`` (cached).

    ``module``: the example; ``train_own_loop`` has its own in-process reference."""
    key = (module, *args)
    if key not in _REFERENCES:
        where = tmp_root / f"reference-{len(_REFERENCES)}"
        where.mkdir(parents=True)
        if module == "train_own_loop":
            sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
            try:
                import train_own_loop
            finally:
                sys.path.pop(0)
            import torch

            out = where / "params.pt"
            torch.save(train_own_loop.reference(args), out)
            _REFERENCES[key] = out
        else:
            _REFERENCES[key] = reference_params(where, args)
    return _REFERENCES[key]


@dataclass(frozen=True)
class Proc:
    """A process of the run, as the process table shows it."""

    pid: int
    ppid: int
    cmdline: str
    env: dict[str, str]

    @property
    def task(self) -> str | None:
        return self.env.get("SLURM_ARRAY_TASK_ID")

    @property
    def node(self) -> str | None:
        return self.env.get("SLURMD_NODENAME")


def _read_proc(pid: int) -> Proc | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
        env_raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    ppid = int(stat.rsplit(")", 1)[1].split()[1])
    env = dict(
        item.split("=", 1) for item in env_raw.decode(errors="replace").split("\0") if "=" in item
    )
    return Proc(pid, ppid, raw.replace(b"\0", b" ").decode(errors="replace"), env)


def processes_mentioning(text: str) -> list[Proc]:
    """Processes whose command line contains ``text`` (never this test process)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        proc = _read_proc(int(entry))
        if proc is not None and text in proc.cmdline:
            found.append(proc)
    return found


def _signal_masks(pid: int) -> dict[str, int]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {
        key: int(value.strip(), 16)
        for key, _, value in (line.partition(":") for line in status.splitlines())
        if key in ("SigBlk", "SigCgt")
    }


def batch_script_holds(job_id: str, signum: int) -> bool:
    """Whether job ``job_id``'s batch script is past the point where a notice ``signum``
    could be lost: its process (the child of ``slurmstepd: [<job_id>.batch]``) blocks
    the signal (the ``elastic_array`` script's re-run, holding it pending) or is the
    agent with its handler. Slurm says ``RUNNING`` before the node starts the batch
    step, and drops a signal sent in that gap; the script's first lines re-run it with
    the signal blocked, and a notice during that ``exec`` is dropped (a documented
    limit, ``docs/reliability.md``)."""
    bit = 1 << (signum - 1)
    stepds = {p.pid for p in processes_mentioning(f"slurmstepd: [{job_id}.batch]")}
    for entry in os.listdir("/proc"):
        proc = _read_proc(int(entry)) if entry.isdigit() else None
        if proc is None or proc.ppid not in stepds or proc.cmdline.startswith("slurmstepd"):
            continue
        masks = _signal_masks(proc.pid)
        if masks.get("SigBlk", 0) & bit or (
            masks.get("SigCgt", 0) & bit and "slurm_script" not in proc.cmdline
        ):
            return True
    return False


@dataclass
class FaultRun:
    """One training job of the matrix on the local cluster.

    Args:
        cluster: the ``slurm_cluster`` fixture.
        tmp: this run's directory (logs, state, ledger, params, pace file).
        mode: ``elastic_array`` or ``fault_tolerant``.
        steps: optimizer steps in total.
        values: more template/config values (``nnodes``, ``partition``, ...).
    """

    cluster: SlurmCluster
    tmp: Path
    mode: str = "elastic_array"
    steps: int = 400
    save_every: int = 10
    values: dict[str, Any] = field(default_factory=dict)
    #: the example paced_train.py runs (train_ddp's command line), and more of its flags
    train_module: str = TRAIN_MODULE
    train_extra: list[str] = field(default_factory=list)
    #: the membership path of the job (``FAULTS_PATH`` by default)
    path: str = PATH
    job: str = ""
    extra_jobs: list[str] = field(default_factory=list)
    _round_at: dict[float, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        (self.tmp / "logs").mkdir(parents=True, exist_ok=True)
        self.pace_file.touch()

    # ------------------------------------------------------------------ paths
    @property
    def state(self) -> Path:
        return self.tmp / "state"

    @property
    def pace_file(self) -> Path:
        return self.tmp / "pace"

    @property
    def hold_file(self) -> Path:
        return self.tmp / "hold-write"

    @property
    def run_id(self) -> str:
        """The rendezvous run id: the configured one, else Slurm's job id (the default)."""
        return str(self.values.get("run_id", self.job))

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.values.get("checkpoint_dir", self.state / "checkpoints" / self.run_id))

    @property
    def train_args(self) -> list[str]:
        return train_args(self.steps, self.save_every)

    def script(self) -> str:
        args = [
            *self.train_args,
            "--step-time",
            "0.15",
            "--out",
            str(self.tmp / "params.pt"),
            "--ledger",
            str(self.tmp / "ledger.jsonl"),
            "--pace-file",
            str(self.pace_file),
            "--hold-write-file",
            str(self.hold_file),
            "--train-module",
            self.train_module,
            *self.train_extra,
        ]
        values = {
            "entrypoint": str(PACED),
            "args": args,
            "launcher": f"{sys.executable} -m slurm_elastic.cli.main",
            "output_dir": str(self.tmp / "logs"),
            "state_dir": str(self.state),
            "setup": "export OMP_NUM_THREADS=1",
            "job_name": f"faults-{self.tmp.name}"[:40],
            **({"env": {"SLURM_ELASTIC_IN_PLACE": "0"}} if self.path == "restart" else {}),
            "partition": "low",
            **FAST,
            "max_restarts": 20,
            **self.values,
        }
        return render(self.mode, values)

    # ------------------------------------------------------------------ lifecycle
    def submit(self) -> str:
        self.job = self.cluster.client.submit(self.script())
        return self.job

    def submit_extra(self, script: str) -> str:
        """Submit another job this run owns (cancelled at the end, checked off the queue)."""
        job = self.cluster.client.submit(script)
        self.extra_jobs.append(job)
        return job

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
            for p in sorted((self.tmp / "logs").glob("*.out"))
        )

    def diagnosis(self, lines: int = 25, events: int = 40) -> str:
        """Each task's last ``lines`` agent log lines (the workers' ``[rank...]`` output
        left out) and the run's last ``events`` events but routine progress and saves, for a
        failed case."""
        logs = []
        for path in sorted((self.tmp / "logs").glob("*.out")):
            text = path.read_text(errors="replace").splitlines()
            own = [line[:300] for line in text if not line.startswith("[rank")]
            logs.append(f"--- {path.name}\n" + "\n".join(own[-lines:]))
        tail = []
        routine = ("train.progress", "checkpoint.saved", "checkpoint.removed")
        for e in [e for e in self.events() if e["kind"] not in routine][-events:]:
            own_fields = [f"{k}={v}" for k, v in e.fields().items()][:7]
            fields = [f"at={e['host']}:{e['pid']}", *own_fields]
            when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
            tail.append(" ".join([when, str(e["kind"]), *fields]))
        return "\n".join(logs) + f"\n--- the last {len(tail)} agent events\n" + "\n".join(tail)

    def events(self, since: float = 0.0, kind: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in agent_events(self.state, self.run_id)
            if e["time"] >= since and (kind is None or e["kind"] == kind)
        ]

    def _ledger_tail(self) -> list[dict[str, Any]]:
        path = self.tmp / "ledger.jsonl"
        if not path.exists():
            return []
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - (256 << 10)))
            tail = fh.read().decode(errors="replace").splitlines()[1:]
        out = []
        for line in tail:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def training_at(self, world: int, since: float, new_round: bool = False) -> bool:
        """Every rank of a world of ``world`` workers trains after ``since``.

        Either each (re)started worker said so (``train.start``, the restart path), or the
        ledger has steps of all ``world`` ranks at that world size after ``since`` (the
        world changed in place, without a new ``train.start``). With ``new_round`` (after
        a fault) only steps of a *later round* than the one training at ``since`` count:
        a fault takes a moment to act, and the world size may be the same after it.
        """
        ranks = {e["rank"] for e in self.events(since, "train.start") if e["world_size"] == world}
        if len(ranks) == world:
            return True
        tail = self._ledger_tail()
        if not new_round:
            self._round_at[since] = -1
        elif since not in self._round_at:  # first call, right after the fault: the old round
            self._round_at[since] = max(
                (r.get("round", -1) for r in tail if r.get("time", 0) < since), default=-1
            )
        return len({r["rank"] for r in self._steps_after(tail, world, since)}) == world

    def _steps_after(
        self, tail: list[dict[str, Any]], world: int, since: float
    ) -> list[dict[str, Any]]:
        """Ledger steps at world size ``world`` after ``since``, in a later round than the
        one :meth:`training_at` saw training at ``since`` (any round without ``new_round``)."""
        old = self._round_at.get(since, -1)
        return [
            r
            for r in tail
            if r.get("world") == world and r.get("time", 0) >= since and r.get("round", 0) > old
        ]

    def first_step_at(self, world: int, since: float) -> float | None:
        """The time of the first of those steps (after :meth:`training_at` held), if any
        (on the restart path ``train.start`` may come before the first step)."""
        steps = self._steps_after(self._ledger_tail(), world, since)
        return min((r["time"] for r in steps), default=None)

    def wait_training(
        self, world: int, since: float, timeout: float, what: str, new_round: bool = False
    ) -> None:
        wait_for(
            lambda: self.training_at(world, since, new_round),
            timeout,
            f"{what}: {world} workers training\n{self.logs()}",
            interval=0.2,
        )

    def wait_world_below(self, world: int, since: float, timeout: float, what: str) -> None:
        """Wait until a round after ``since`` formed with fewer than ``world`` nodes
        (workers restarted in it, or the survivors re-formed in place)."""
        kinds = ("agent.workers_started", "agent.reformed_in_place")
        wait_for(
            lambda: any(
                e["group_world_size"] < world
                for e in self.events(since)
                if e["kind"] in kinds and e.get("group_world_size")
            ),
            timeout,
            f"{what}: a round of fewer than {world} nodes\n{self.logs()}",
            interval=0.2,
        )

    def step_now(self) -> int:
        """The newest step any worker reported in the ledger (0 before the first)."""
        path = self.tmp / "ledger.jsonl"
        if not path.exists():
            return 0
        last = path.read_text().strip().splitlines()[-1:]
        return json.loads(last[0])["step"] if last else 0

    def infos(self) -> list[JobInfo]:
        return self.cluster.client.job_infos(self.job)

    def task_info(self, task: int) -> JobInfo:
        return self.cluster.client.job_info(f"{self.job}_{task}")

    def wait_task(self, task: int, states: set[JobState], timeout: float) -> JobInfo:
        return self.cluster.wait_state(f"{self.job}_{task}", states, timeout)

    # ------------------------------------------------------------------ processes
    def agents(self) -> list[Proc]:
        return [
            p
            for p in processes_mentioning(str(self.tmp))
            if "slurm_elastic.cli.main agent" in p.cmdline
        ]

    def workers(self) -> list[Proc]:
        agents = {a.pid for a in self.agents()}
        return [
            p
            for p in processes_mentioning(str(self.tmp))
            if p.ppid in agents and "paced_train.py" in p.cmdline
        ]

    def agent_of_task(self, task: int) -> Proc:
        return wait_for(
            lambda: next((a for a in self.agents() if a.task == str(task)), None),
            60,
            f"the agent of task {task}",
        )

    def store_host(self) -> Proc:
        """The agent that hosts the current round's workers' store (its rank 0)."""
        root = Path(self.values.get("rdzv_endpoint", self.state / "rdzv"))
        records = sorted(root.glob("*/era.*/store"), key=lambda p: p.stat().st_mtime)
        assert records, f"no worker-store record under {root}"
        record = json.loads(records[-1].read_text())
        pid = int(record["node"].split("_")[-2])  # torch's node desc: addr_pid_localid
        agent = next((a for a in self.agents() if a.pid == pid), None)
        assert agent is not None, f"store host {record} is not an agent of this run"
        return agent

    @staticmethod
    def kill(proc: Proc, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)

    # ------------------------------------------------------------------ the end
    def finish(
        self, expected: Callable[[JobInfo], bool] | None = None, timeout: float = 600
    ) -> list[JobInfo]:
        """Let training run at full speed and wait for every task to end."""
        self.pace_file.unlink(missing_ok=True)
        self.hold_file.unlink(missing_ok=True)
        infos = wait_for(
            lambda: (i := self.infos()) and all(x.state in TERMINAL for x in i) and i,
            timeout,
            f"job {self.job} to finish\n{self.logs()}",
            interval=0.5,
        )
        return infos

    def cleanup(self) -> None:
        """Cancel what is left of this run's jobs (only this run's ids)."""
        self.pace_file.unlink(missing_ok=True)
        self.hold_file.unlink(missing_ok=True)
        for job in [self.job, *self.extra_jobs]:
            if job:
                with contextlib.suppress(Exception):
                    self.cluster.client.cancel(job)

    def check_end(self, tmp_root: Path) -> None:
        """The invariants of every case (see the module docstring)."""
        # nothing of ours in the queue
        ours = {self.job, *self.extra_jobs}
        left = [
            q for q in self.cluster.client.queue() if q.job_id in ours or q.array_job_id in ours
        ]
        assert not left, f"left in the queue: {left}"
        # nothing of ours in the process table
        wait_for(
            lambda: not processes_mentioning(str(self.tmp)),
            60,
            f"processes of the run to exit: {processes_mentioning(str(self.tmp))}",
            interval=0.5,
        )
        # the newest checkpoint is the last step, and it verifies (load_latest verifies CRCs)
        loaded = CheckpointManager(self.checkpoint_dir).load_latest()
        assert loaded is not None, f"no loadable checkpoint in {self.checkpoint_dir}"
        assert loaded.step == self.steps, (
            f"newest verified checkpoint {loaded.step} != {self.steps}"
        )
        # every sample exactly once per epoch; final parameters as an uninterrupted run
        assert_ledger_ok(self.tmp / "ledger.jsonl", DATASET)
        per_epoch = effective_ledger(self.tmp / "ledger.jsonl")
        steps_done = sum(len(v) for v in per_epoch.values()) // GLOBAL_BATCH
        assert steps_done == self.steps, f"{steps_done} effective steps, expected {self.steps}"
        diff = max_abs_diff(
            self.tmp / "params.pt", reference(tmp_root, self.train_args, self.train_module)
        )
        assert diff < ATOL, f"final parameters differ by {diff} from the uninterrupted run"

    def check_interim(self, case: str) -> None:
        """A case's own end state, right after its recovery (a later case could repair
        damage it did, so the run's end checks alone would not see it): no orphan
        worker, at most one agent per running task, no sample used twice in an epoch so
        far, and the newest committed checkpoint verifies."""

        def process_problems() -> list[str]:
            procs = processes_mentioning(str(self.tmp))
            agents = [p for p in procs if "slurm_elastic.cli.main agent" in p.cmdline]
            pids = {a.pid for a in agents}
            orphans = [
                p
                for p in procs
                if "paced_train.py" in p.cmdline and p.pid not in pids and p.ppid not in pids
            ]
            running = {i.array_task_id for i in self.infos() if i.state == JobState.RUNNING}
            tasks = [a.task for a in agents]
            doubled = sorted({str(t) for t in tasks if tasks.count(t) > 1})
            stray = sorted({str(t) for t in tasks if t not in running})
            return [
                *([f"workers without their agent: {orphans}"] if orphans else []),
                *([f"two agents of task(s) {doubled}: {agents}"] if doubled else []),
                *([f"agents of tasks not RUNNING {stray}: {agents}"] if stray else []),
            ]

        # An agent that was told to go may still be exiting: its state, not its speed.
        problems: list[str] = []

        def settled() -> bool:
            problems[:] = process_problems()
            return not problems

        try:
            wait_for(settled, 60, f"the processes to settle after {case}", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"after {case}: {'; '.join(problems)}") from exc
        problems = ledger.check(ledger.read(self.tmp / "ledger.jsonl"), DATASET, so_far=True)
        assert not problems, f"after {case}: {problems}"
        # Read-only (latest_verified would also recover and report, as a resume does):
        # a committed checkpoint verifies, CRCs included. Right after a case that damaged
        # the only one, the next save (every 10 steps) makes one: waited for.
        store = CheckpointManager(self.checkpoint_dir).store
        damaged: list[str] = []

        def verifies() -> bool:
            damaged.clear()
            for info in reversed(store.list_checkpoints()):
                try:
                    store.verify(info.step, deep=True)
                    return True
                except (CheckpointCorruptError, FileNotFoundError) as exc:
                    damaged.append(f"step {info.step}: {exc}")  # or pruned while read
            return False

        try:
            wait_for(verifies, 120, "a committed checkpoint that verifies", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"after {case}: no checkpoint verifies: {damaged}") from exc


class Scenario:
    """Runs faults in sequence on one job and records each case's outcome.

    A case that fails is recorded (with its traceback) and the scenario stops: later
    cases are recorded as not reached. Each test then asserts its own case's outcome.
    """

    def __init__(self, diagnose: Callable[[], str] | None = None) -> None:
        self.outcomes: dict[str, str | None] = {}
        #: what to add to a failed case's traceback (e.g. the job's log tails): CI keeps
        #: only the test output, so a failure must carry what explains it
        self.diagnose = diagnose
        self.broken: str | None = None
        self.end_error: str | None = None
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        if self.broken is not None:
            self.outcomes[name] = f"not reached: case {self.broken!r} failed before it"
            yield
            return
        start = time.monotonic()
        try:
            yield
        except pytest.skip.Exception as exc:
            self.outcomes[name] = f"{SKIPPED}{exc.msg}"
        except Exception:
            self.outcomes[name] = traceback.format_exc() + self._diagnosis()
            self.broken = name
        else:
            self.outcomes[name] = None
        self.seconds[name] = time.monotonic() - start

    def _diagnosis(self) -> str:
        if self.diagnose is None:
            return ""
        try:
            return f"\n--- at the failure:\n{self.diagnose()}"
        except Exception as exc:  # the diagnosis must not hide the failure
            return f"\n--- no diagnosis: {type(exc).__name__}: {exc}"

    def run(
        self, name: str, body: Callable[[], None], after: Callable[[str], None] | None = None
    ) -> None:
        """Run case ``name``; then ``after(name)``: the case's own end checks.

        ``FAULT_CASES_ONLY`` (comma-separated case names; for working on one
        case) skips the others.
        """
        only = os.environ.get("FAULT_CASES_ONLY")
        if only and name not in only.split(","):
            self.outcomes[name] = f"{SKIPPED}not in FAULT_CASES_ONLY={only}"
            return
        with self.case(name):
            if self.broken is None or self.broken == name:
                body()
                if after is not None:
                    after(name)

    def check(self, name: str) -> None:
        """Assert case ``name`` held, and the run's end invariants too."""
        assert name in self.outcomes, f"case {name!r} was never run: {self.end_error}"
        outcome = self.outcomes[name]
        if outcome is not None and outcome.startswith(SKIPPED):
            pytest.skip(reason=outcome[len(SKIPPED) :])
        assert outcome is None, f"case {name!r} failed:\n{outcome}"
        assert self.end_error is None, f"the run's end checks failed:\n{self.end_error}"
