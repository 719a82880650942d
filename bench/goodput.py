"""Goodput under preemption on the real local Slurm: efficiency of in place vs whole-job requeue.

Each case runs one 4-node training job on the local Slurm cluster (``source
/var/tmp/slurm-elastic-cluster/env``; partitions ``low``/``high``) and, once it trains on
4 nodes, disturbs it on a schedule:

* ``60s``: one of its nodes is preempted every 60 s by a ``high``-partition job
  (``--exclusive``, ``sleep H``); Slurm signals the preempted task (USR2, its notice) and
  requeues it;
* ``storm``: a preemption every 20 s, and one silent node loss (one node's processes are
  SIGSTOPped for the rest of the window: no socket closes, no notice).

Systems: ``inplace`` (ours, ``elastic_array``, ``examples/train_ddp.py``: the preempted
task leaves in place, the others keep their workers, it rejoins in place), ``restart``
(the same with ``SLURM_ELASTIC_IN_PLACE=0``) and ``requeue`` (what users do today: one
4-node submitit job, the same model and step, a checkpoint every ``save_every`` steps,
submitit's ``Checkpointable`` requeueing the whole job on the notice;
``bench/goodput_requeue.py``).

**Compute-bound steps, no pacing.** The global batch is fixed (256 samples); each rank
computes its share of it through a deep shared-weight MLP (``--depth``), so a rank does
more work per step when nodes are missing. Nothing sleeps.

**Efficiency** = useful samples in the window / the samples an uninterrupted run
processes with the nodes actually available over the same window. A step counts once,
at its last attempt, if that ended in the window (redone steps are waste); the job waits
after the window until the last cut attempt is done again. Available nodes, sampled every
0.5 s: 4, minus nodes a ``high`` job runs on, minus the frozen node (a preempted node
counts as available until the ``high`` job starts: the grace period is ours to spend).
The uninterrupted throughput at 4, 3, 2 and 1 nodes is measured in the same run: at 4, the
steady rate of each job, the mean of 10 s before its window and 10 s once it trains on
every node again after it; at 3, 2 and 1, the in-place job after its window (once every
task it holds trains again, then with one task cancelled at a time), scaled by each
job's 4-node rate. Each job is judged against its own rates: this VM's speed drifts by
10-40 % between minutes, so a job judged against the other job's rate would be judged
partly on when it ran (that reading, against the faster job's rates, is still reported:
``ours_vs_fastest``, ``baseline_vs_fastest``; and so are the raw useful samples of both
jobs). The cluster must be idle: a case refuses to report when a job that is not the
bench's holds or waits for a node.

Targets (issue 22): in place >= 0.90 efficiency at one preemption per 60 s (moonshot
0.95) and >= 1.5x the whole-job requeue's efficiency; the storm is reported.

``--quick``: the ``60s`` schedule with one preemption, in place and requeue (~4 min
here). The full run: ``60s`` with 4 preemptions and the storm (6 preemptions), in place
and requeue (~20 min); ``--systems`` adds ``restart``. Prints one JSON line per case
(bench, case, ours, baseline, ratio, target, ok, ...) and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _stopping import stop_on_sigterm  # noqa: E402

from slurm_elastic import ledger as sample_ledger  # noqa: E402
from slurm_elastic.slurm.commands import SlurmClient  # noqa: E402
from slurm_elastic.slurm.jobstate import JobInfo, JobState  # noqa: E402
from slurm_elastic.submit.render import render_template  # noqa: E402

CLUSTER_ENV = Path(os.environ.get("SLURM_ELASTIC_CLUSTER_DIR", "/var/tmp/slurm-elastic-cluster"))
NODES = 4
# The same model, data, step and saving in every case: a rank's compute is its share of
# the fixed global batch through ``depth`` shared-weight layers (no pacing).
TRAIN = {
    "dataset_size": 8192, "global_batch": 256, "hidden": 256, "depth": 96, "save_every": 25,
}  # fmt: skip
SCHEDULES = {  # name -> (seconds between preemptions, a silent node loss)
    "60s": (60.0, False),
    "storm": (20.0, True),
}
RUNNING = {JobState.RUNNING}


def cluster_env() -> dict[str, str]:
    """The environment with ``SLURM_CONF`` of the local cluster (its ``env`` file)."""
    env = dict(os.environ)
    path = CLUSTER_ENV / "env"
    if not env.get("SLURM_CONF") and path.exists():
        for line in path.read_text().splitlines():
            line = line.strip().removeprefix("export ").strip()
            if "=" in line and not line.startswith("#"):
                key, value = line.split("=", 1)
                env[key] = value.strip().strip("'\"")
    if not env.get("SLURM_CONF"):
        raise SystemExit(
            f"no SLURM_CONF and no {path}: start the local cluster "
            "(scripts/slurm-cluster up) or source its env file"
        )
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        if not key.startswith("SLURM_ELASTIC_CLUSTER"):
            env.pop(key)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}:{REPO / 'bench'}")
    env.pop("MASTER_PORT", None)
    env.pop("MASTER_ADDR", None)
    return env


def ledger(path: Path) -> list[dict[str, Any]]:
    return sample_ledger.read(path)


#: seconds without a logged step after which the job's stacks are dumped (diagnosis)
STALL_DUMP_S = 20.0


def wait(pred: Any, limit: float, poll: float = 0.25) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    return None


class Case:
    """One training job of one system on the cluster."""

    def __init__(self, system: str, client: SlurmClient, env: dict[str, str], tmp: Path):
        self.system, self.client, self.env, self.tmp = system, client, env, tmp
        self.ledger_path = tmp / "ledger.jsonl"
        self.job = ""
        self.high: list[str] = []
        self.frozen: list[int] = []
        self.frozen_node = ""
        self.dumps: list[float] = []
        (tmp / "logs").mkdir(parents=True, exist_ok=True)

    def dump_if_stalled(self) -> None:
        """Stacks of the job's processes (``py-spy dump``, if installed) into the case
        directory when no step was logged for :data:`STALL_DUMP_S`: at most 3, spaced
        by that much, for diagnosis (keep them with ``--keep``)."""
        now = time.time()
        if len(self.dumps) >= 3 or (self.dumps and now - self.dumps[-1] < STALL_DUMP_S):
            return
        try:  # the ledger's mtime: one stat per call, not a read of the whole ledger
            quiet = now - self.ledger_path.stat().st_mtime
        except FileNotFoundError:
            return
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if quiet < STALL_DUMP_S or not Path(spy).exists():
            return
        last = ledger(self.ledger_path)[-1:]
        self.dumps.append(now)
        found = subprocess.run(["pgrep", "-f", str(self.tmp)], capture_output=True, text=True)
        out = self.tmp / f"stacks-{len(self.dumps)}.txt"
        with open(out, "w") as fh:
            fh.write(f"no step for {quiet:.1f} s (last: {last})\n")
            for pid in found.stdout.split():
                fh.write(f"\n===== pid {pid}\n")
                fh.flush()
                subprocess.run([spy, "dump", "--pid", pid], stdout=fh, stderr=fh, timeout=30)
        print(f"# stalled: stacks in {out}", file=sys.stderr, flush=True)

    def submit(self, steps: int) -> None:
        if self.system == "requeue":
            self._submit_submitit(steps)
        else:
            self._submit_array(steps)

    def _submit_array(self, steps: int) -> None:
        args = [
            "--steps", str(steps), "--dataset-size", str(TRAIN["dataset_size"]),
            "--global-batch", str(TRAIN["global_batch"]), "--hidden", str(TRAIN["hidden"]),
            "--depth", str(TRAIN["depth"]), "--save-every", str(TRAIN["save_every"]),
            "--ledger", str(self.ledger_path),
        ]  # fmt: skip
        setup = "export OMP_NUM_THREADS=1"
        if self.system == "restart":
            setup += "\nexport SLURM_ELASTIC_IN_PLACE=0"
        values = {
            "mode": "elastic_array", "entrypoint": str(REPO / "examples" / "train_ddp.py"),
            "args": args, "launcher": f"{sys.executable} -m slurm_elastic.cli.main",
            "output_dir": str(self.tmp / "logs"), "state_dir": str(self.tmp / "state"),
            "setup": setup, "job_name": f"goodput-{self.system}", "nnodes": f"1:{NODES}",
            "nproc_per_node": 1, "cpus_per_task": 2, "partition": "low",
            "heartbeat_interval_s": 0.5, "heartbeat_miss_limit": 4, "last_call_timeout_s": 2,
            "monitor_interval_s": 0.2, "shutdown_timeout_s": 30, "join_timeout_s": 600,
        }  # fmt: skip
        self.job = self.client.submit(render_template("elastic_array", values))

    def _submit_submitit(self, steps: int) -> None:
        import submitit
        from goodput_requeue import RequeueTrainer

        old = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)  # sbatch exports the submitting environment
        try:
            ex = submitit.AutoExecutor(
                folder=self.tmp / "submitit" / "%j", cluster="slurm", slurm_max_num_timeout=100
            )
            ex.update_parameters(
                nodes=NODES, tasks_per_node=1, cpus_per_task=2, slurm_partition="low",
                timeout_min=600, name="goodput-requeue",
                slurm_setup=["export OMP_NUM_THREADS=1"],
            )  # fmt: skip
            opts = {**TRAIN, "steps": steps, "seed": 0, "ledger": str(self.ledger_path)}
            opts["checkpoint"] = str(self.tmp / "requeue.pt")
            self.job = str(ex.submit(RequeueTrainer(opts)).job_id)
        finally:
            os.environ.clear()
            os.environ.update(old)

    def ours(self, info: JobInfo) -> bool:
        return self.job in (info.job_id, info.array_job_id) or info.job_id in self.high

    def queue(self) -> list[JobInfo]:
        with contextlib.suppress(Exception):
            return self.client.queue()
        return []

    def nodes(self, queue: list[JobInfo] | None = None) -> list[str]:
        """Nodes the job's running tasks hold now."""
        found: set[str] = set()
        for info in self.queue() if queue is None else queue:
            mine = self.job in (info.job_id, info.array_job_id)
            if mine and info.state in RUNNING and info.node_list:
                found.update(self.client.hostnames(info.node_list))
        return sorted(found)

    def available(self, queue: list[JobInfo]) -> int:
        """Nodes the job could train on now: not taken by a ``high`` job, not frozen."""
        taken = {
            h for i in queue if i.job_id in self.high and i.state in RUNNING and i.node_list
            for h in self.client.hostnames(i.node_list)
        }  # fmt: skip
        return NODES - len(taken) - (1 if self.frozen else 0)

    def preempt(self, node: str, hold_s: float, k: int) -> None:
        script = (
            f"#!/bin/bash\n#SBATCH -p high -w {node} --exclusive -J goodput-high\n"
            f"#SBATCH -o {self.tmp}/logs/high-{k}.out\nsleep {hold_s}\n"
        )
        self.high.append(self.client.submit(script))

    def freeze(self, node: str) -> list[int]:
        """SIGSTOP every process of this case on ``node`` (a silent loss)."""
        pids = _processes_on(str(self.tmp), node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        self.frozen = pids
        return pids

    def thaw(self) -> None:
        for pid in self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.frozen = []

    def cancel_task(self, task: int) -> None:
        self.client.cancel(f"{self.job}_{task}")

    def stop(self) -> None:
        self.thaw()
        for ref in [self.job, *self.high]:
            if ref:
                with contextlib.suppress(Exception):
                    self.client.cancel(ref)

        def gone() -> bool:
            with contextlib.suppress(Exception):
                infos = [
                    i for ref in [self.job, *self.high] if ref for i in self.client.job_infos(ref)
                ]
                return all(i.state.is_terminal for i in infos)
            return True

        wait(gone, 60, 0.5)


def _processes_on(text: str, node: str) -> list[int]:
    """Processes whose command line mentions ``text`` and that Slurm runs on ``node``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline and f"SLURMD_NODENAME={node}\0".encode() in environ + b"\0":
            found.append(int(entry))
    return found


def useful(recs: list[dict[str, Any]], t_a: float, t_b: float) -> tuple[int, int]:
    """(steps whose last attempt finished in [t_a, t_b], step numbers first done in the
    window and done more than once)."""
    attempts: dict[int, dict[Any, float]] = {}
    for r in recs:
        key = r.get("attempt", r.get("round"))
        seen = attempts.setdefault(r["step"], {})
        seen[key] = max(seen.get(key, 0.0), r["time"])  # an attempt ends at its last rank
    done = sum(1 for a in attempts.values() if t_a <= max(a.values()) <= t_b)
    redone = sum(1 for a in attempts.values() if len(a) > 1 and t_a <= min(a.values()) <= t_b)
    return done, redone


def steady_rate(case: Case, world: int, settle_s: float, measure_s: float) -> float | None:
    """Steps/s of the job while it trains at ``world`` ranks undisturbed (None: it did not)."""
    path = case.ledger_path
    at_world = wait(
        lambda: sum(1 for r in ledger(path)[-8 * world :] if r["world"] == world) >= 4 * world,
        120,
        0.5,
    )
    if not at_world:
        return None
    time.sleep(settle_s)  # the bench's own clock: a measurement window, not a wait for state
    t_a = time.time()
    time.sleep(measure_s)
    t_b = time.time()
    recs = [r for r in ledger(path) if t_a <= r["time"] <= t_b]
    if {r["world"] for r in recs} != {world}:
        return None  # the world changed meanwhile: not an undisturbed rate
    return useful(recs, t_a, t_b)[0] / (t_b - t_a)


def world_now(case: Case) -> int | None:
    """The world of the job's last 12 ledger rows, if they all agree."""
    recs = ledger(case.ledger_path)[-12:]
    worlds = {r["world"] for r in recs}
    return worlds.pop() if len(recs) == 12 and len(worlds) == 1 else None


def all_tasks_train(case: Case) -> int | None:
    """The world once every task the job holds trains in it (stacks dumped on a stall)."""
    case.dump_if_stalled()
    w = world_now(case)
    return w if w is not None and w == len(case.nodes()) else None


def fewer_nodes_rates(case: Case, own: dict[int, float], refs: dict[Any, float]) -> None:
    """Undisturbed rates below 4 nodes: once every task the job holds trains (after a
    storm the thawed node rejoins first), then with one task cancelled at a time."""
    for task in (None, *range(NODES - 1, 0, -1)):
        if task is not None:
            held = len(case.nodes())
            case.cancel_task(task)
            wait(lambda h=held: len(case.nodes()) < h, 30, 0.5)
        w = wait(lambda: all_tasks_train(case), 90, 0.5)
        if not w or w >= NODES or w in own:
            continue
        rate = steady_rate(case, w, 3.0, 8.0)
        if rate is not None:
            own[w] = refs[w] = rate


def idle_or_refuse(case: Case, limit: float) -> str | None:
    """None once no job but the bench's holds or waits for a node; else why not."""
    foreign = wait(lambda: not [i for i in case.queue() if not case.ours(i)], limit, 1.0)
    if foreign is None:
        others = sorted({i.job_id for i in case.queue() if not case.ours(i)})
        return f"the cluster is not idle (jobs {', '.join(others)}): not reported"
    return None


def run_case(
    system: str,
    schedule: str,
    n: int,
    hold: float,
    limit: float,
    refs: dict[Any, float],
    keep: bool = False,
) -> dict[str, Any]:
    """One job through one schedule; ``refs`` gets the undisturbed rates it measures
    (``(schedule, 4)``: the best 4-node rate of the schedule's jobs; ``w < 4``: the
    in-place job's, measured once). However it ends (a result, an error, the bench
    stopped), its jobs are cancelled and, unless ``keep``, its directory is deleted."""
    period, silent = SCHEDULES[schedule]
    env = cluster_env()
    client = SlurmClient(env=env, timeout_s=60)
    tmp = Path(tempfile.mkdtemp(prefix=f"goodput-{system}-", dir="/var/tmp"))
    case = Case(system, client, env, tmp)
    print(f"# {system} {schedule}: case directory {tmp}", file=sys.stderr, flush=True)
    try:
        refused = idle_or_refuse(case, limit)
        if refused:
            return {"error": refused}
        case.submit(100_000)
        full = wait(
            lambda: (
                len({r["pid"] for r in ledger(case.ledger_path)[-40:] if r["world"] == NODES})
                == NODES
                and len(case.nodes()) == NODES
            ),
            limit,
            0.5,
        )
        if not full:
            return {"error": f"no world of {NODES} within {limit:.0f} s"}
        before = steady_rate(case, NODES, 3.0, 10.0)
        if before is None:
            return {"error": f"no undisturbed rate at {NODES} nodes"}
        t_a = time.time()
        events = [(t_a + k * period + period / 4, "preempt", k) for k in range(n)]
        if silent:
            events.append((t_a + 1.6 * period, "freeze", -1))
        events.sort()
        timeline: list[tuple[float, int]] = []
        foreign: set[str] = set()
        log: list[str] = []
        while time.time() < t_a + n * period:
            case.dump_if_stalled()
            queue = case.queue()
            foreign |= {i.job_id for i in queue if not case.ours(i)}
            timeline.append((time.time(), case.available(queue)))
            while events and time.time() >= events[0][0]:
                _, what, k = events.pop(0)
                held = [h for h in case.nodes(queue) if h != case.frozen_node]
                if not held:  # e.g. the whole job is being requeued: try again soon
                    events.insert(0, (time.time() + 1.0, what, k))
                    break
                if what == "preempt":
                    case.preempt(held[k % len(held)], hold, k)
                else:
                    case.frozen_node = held[-1]
                    log.append(f"froze {held[-1]}: {len(case.freeze(held[-1]))} processes")
            time.sleep(0.5)
        t_b = time.time()
        timeline.append((t_b, timeline[-1][1]))
        case.thaw()
        # No more disturbance: let the last cut attempt be done again (a redone step
        # counts where it was finally done), then count.
        wait(
            lambda: any(r["time"] > t_b + 1 and r["world"] >= 2 for r in ledger(case.ledger_path)),
            60,
            0.5,
        )
        if foreign:
            return {"error": f"jobs {sorted(foreign)} used the cluster in the window: not reported"}
        # The undisturbed 4-node rate again once the job trains on every node (this VM's
        # speed drifts by 10-20 % between minutes: one sample before the window alone
        # gave efficiencies above 1); the job's rate is the mean of both samples.
        back = wait(lambda: all_tasks_train(case) == NODES, 120, 0.5)
        after = steady_rate(case, NODES, 3.0, 10.0) if back else None
        rate4 = before if after is None else (before + after) / 2
        refs[schedule, NODES] = max(refs.get((schedule, NODES), 0.0), rate4)
        own = {NODES: rate4}
        recs = ledger(case.ledger_path)
        done, redone = useful(recs, t_a, t_b)
        status = status_useful_s(tmp / "state", t_a, t_b) if system != "requeue" else None
        node_s = {w: 0.0 for w in range(NODES + 1)}
        for (t0, w), (t1, _) in itertools.pairwise(timeline):
            node_s[w] += t1 - t0
        if system == "inplace" and NODES - 1 not in refs:
            fewer_nodes_rates(case, own, refs)
        return {
            "useful_steps": done,
            "useful_samples": done * TRAIN["global_batch"],
            "window_s": round(t_b - t_a, 1),
            "preemptions": n,
            "silent_loss": silent,
            "lost_per_preemption": round(redone / max(n, 1), 2),
            "node_seconds": {w: round(s, 1) for w, s in node_s.items() if s},
            "undisturbed_steps_per_s": {w: round(r, 3) for w, r in own.items()},
            "steps_per_s_at_4_before_after": [
                round(before, 3),
                None if after is None else round(after, 3),
            ],
            # the same window as `status --goodput` books it from the events alone, next
            # to the ledger's view (useful steps at the job's own undisturbed 4-node rate)
            "useful_s_status_goodput": status,
            "useful_s_ledger": round(done / rate4, 1),
            "events": log,
            "load_avg_1m": round(os.getloadavg()[0], 1),
            **({"dir": str(tmp)} if keep else {}),
        }
    finally:
        case.stop()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def status_useful_s(state: Path, t_a: float, t_b: float) -> float | None:
    """Seconds of [t_a, t_b] that ``slurm-elastic status --goodput`` books as useful."""
    from slurm_elastic.cli.goodput import account
    from slurm_elastic.events import read_events

    runs = sorted((state / "events").glob("*"))
    if len(runs) != 1:
        return None
    spans = account(list(read_events(runs[0]))).spans
    clipped = (min(s.end, t_b) - max(s.start, t_a) for s in spans if s.category == "useful")
    return round(sum(c for c in clipped if c > 0), 1)


def efficiency(result: dict[str, Any], refs: dict[int, float]) -> tuple[float | None, str]:
    """Useful samples / what an undisturbed run does with the available nodes."""
    if "error" in result:
        return None, result["error"]
    expected = 0.0
    for w, seconds in result["node_seconds"].items():
        if w not in refs:
            return None, f"no undisturbed rate at {w} nodes"
        expected += seconds * refs[w] * TRAIN["global_batch"]
    return round(result["useful_samples"] / expected, 3), ""


def own_rates(
    results: dict[tuple[str, str], dict[str, Any]], schedule: str, result: dict[str, Any]
) -> dict[int, float]:
    """The rates ``result``'s job is judged against: its own undisturbed 4-node rate (the
    mean of its samples before and after its window), fewer nodes scaled from the
    in-place job's as in :func:`reference_rates`."""
    own4 = result.get("undisturbed_steps_per_s", {}).get(NODES)
    return reference_rates(results, schedule, own4) if own4 else {}


def reference_rates(
    results: dict[tuple[str, str], dict[str, Any]], schedule: str, best4: float
) -> dict[int, float]:
    """Steps/s at each world size for ``schedule``: 4 from the faster of its jobs, fewer
    from the in-place job's own rates (where measured) scaled to it."""
    refs = {NODES: best4}
    for (system, _), r in results.items():
        own = r.get("undisturbed_steps_per_s", {})
        if system == "inplace" and NODES in own and len(own) > 1:
            for w, rate in own.items():
                if w != NODES:
                    refs.setdefault(w, rate * best4 / own[NODES])
    return refs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60s schedule, one preemption")
    ap.add_argument("--schedules", default=None, help="60s,storm (quick: 60s)")
    ap.add_argument(
        "--preemptions",
        type=int,
        default=None,
        help="per schedule (default 60s: 4, storm: 6; quick 1)",
    )
    ap.add_argument("--hold", type=float, default=5.0, help="each high job's seconds")
    ap.add_argument("--limit", type=float, default=240.0, help="seconds to reach 4 nodes")
    ap.add_argument("--systems", default="inplace,requeue", help="inplace,restart,requeue")
    ap.add_argument("--keep", action="store_true", help="keep the case directories")
    args = ap.parse_args(argv)
    stop_on_sigterm()
    schedules = (args.schedules or ("60s" if args.quick else "60s,storm")).split(",")
    systems = args.systems.split(",")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    measured: dict[Any, float] = {}
    for schedule in schedules:
        n = args.preemptions or (1 if args.quick else {"60s": 4, "storm": 6}[schedule])
        for system in ("inplace", "restart", "requeue"):
            if system in systems:
                results[system, schedule] = run_case(
                    system, schedule, n, args.hold, args.limit, measured, args.keep
                )
                print(f"# {system} {schedule}: {json.dumps(results[system, schedule])}",
                      file=sys.stderr, flush=True)  # fmt: skip
    for r in results.values():
        where = r.pop("dir", None)
        if where:
            print(f"# kept: {where}", file=sys.stderr)
    rows = []
    for schedule in schedules:
        fastest = reference_rates(results, schedule, measured.get((schedule, NODES), 0.0))
        base = results.get(("requeue", schedule), {"error": "not run (--systems)"})
        base_eff, base_why = efficiency(base, own_rates(results, schedule, base))
        base_fast, _ = efficiency(base, fastest)
        for system in ("inplace", "restart"):
            if (system, schedule) not in results:
                continue
            r = results[system, schedule]
            refs = own_rates(results, schedule, r)
            eff, why = efficiency(r, refs)
            eff_fast, _ = efficiency(r, fastest)
            ratio = None if eff is None or not base_eff else round(eff / base_eff, 3)
            judged = (system, schedule) == ("inplace", "60s")
            ok_eff = eff is not None and eff >= 0.90
            ok_ratio = ratio is not None and ratio >= 1.5
            rows.append({
                "bench": "goodput", "case": f"efficiency_{system}_{schedule}", "ours": eff,
                "baseline": base_eff, "ratio": ratio,
                "target": "ours >= 0.90 (moonshot 0.95), ratio >= 1.5" if judged else "reported",
                "ok": eff is not None and (not judged or (ok_eff and ok_ratio)),
                "ok_efficiency": ok_eff, "ok_ratio": ok_ratio, "unit": "efficiency",
                "error": why or None, "baseline_error": base_why or None,
                "reference_steps_per_s": {w: round(v, 3) for w, v in sorted(refs.items())},
                # the earlier reading: both against the faster job's rates (the machine's
                # speed when each job ran then weighs in: reported, not judged)
                "ours_vs_fastest": eff_fast, "baseline_vs_fastest": base_fast,
                "fastest_steps_per_s": {w: round(v, 3) for w, v in sorted(fastest.items())},
                "ours_detail": r, "baseline_detail": base,
            })  # fmt: skip
            ours_s, base_s = r.get("useful_samples"), base.get("useful_samples")
            ratio = None if ours_s is None or not base_s else round(ours_s / base_s, 3)
            rows.append({
                "bench": "goodput", "case": f"useful_samples_{system}_vs_requeue_{schedule}",
                "ours": ours_s, "baseline": base_s, "ratio": ratio,
                "target": "reported (each job's own speed weighs in)",
                "ok": ratio is not None, "unit": "samples",
                "error": r.get("error"), "baseline_error": base.get("error"),
                "lost_per_preemption": r.get("lost_per_preemption"),
                "baseline_lost_per_preemption": base.get("lost_per_preemption"),
            })  # fmt: skip
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"\n{'case':40} {'ours':>9} {'baseline':>9} {'ratio':>7} {'target':>28} ok")
    for row in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
        print(
            f"{row['case']:40} {fmt(row['ours']):>9} {fmt(row['baseline']):>9} "
            f"{fmt(row['ratio']):>7} {row['target']:>28} {row['ok']}"
        )
        for key in ("error", "baseline_error"):
            if row.get(key):
                print(f"    {key}: {row[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
