"""Goodput under a preemption schedule on the real local Slurm: in place vs restart vs requeue.

Each case runs one 4-node training job on the local Slurm cluster (``source
/var/tmp/slurm-elastic-cluster/env``; partitions ``low``/``high``) and, once it trains on
4 nodes, preempts one of its nodes every ``T`` seconds with a ``high``-partition job
(``--exclusive``, ``sleep H``); Slurm signals the preempted job (USR2, its notice) and
requeues it. Cases:

* ``inplace``: ours, ``elastic_array`` (4 array tasks, ``examples/train_ddp.py``): the
  preempted task leaves in place and requeues itself; it rejoins in place when it runs
  again; the other tasks keep their workers;
* ``restart``: the same job with ``SLURM_ELASTIC_IN_PLACE=0`` (every change stops and
  restarts every worker; the notice makes them save first);
* ``requeue``: what users do today: one 4-node job submitted with submitit, the same
  model and step (``bench/goodput_requeue.py``), a checkpoint every ``--save-every``
  steps and submitit's ``Checkpointable`` requeueing the whole job on the notice.

Measured over the same window (``n`` preemptions, ``T`` s apart, starting when the job
trains on 4 nodes): **useful steps per wall-clock second** (a step counts once, at its
last attempt; steps done and later redone count as waste) and **lost steps per
preemption** (step numbers done more than once, per preemption). The global batch is
fixed, so a step is the same work at any world size; steps are paced (``--step-time``)
so that the 2-core machine's CPU share does not decide the result.

Targets (issue 11): in place >= 1.5x whole-job requeue; 0 lost steps per preemption
with a notice. The cluster is shared: a case waits for 4 free nodes, and other jobs can
delay a requeued task (the detail reports ``steps_at_full_world``).

``--quick``: 2 preemptions 15 s apart, in place and requeue only (~3 min here); the full
run (all three, 5 preemptions 30 s apart by default) takes ~15 min. Prints one JSON line
per case (bench, case, ours, baseline, ratio, target, ok, ...) and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from slurm_elastic import ledger as sample_ledger  # noqa: E402
from slurm_elastic.slurm.commands import SlurmClient  # noqa: E402
from slurm_elastic.slurm.jobstate import JobState  # noqa: E402
from slurm_elastic.submit.render import render_template  # noqa: E402

CLUSTER_ENV = Path(os.environ.get("SLURM_ELASTIC_CLUSTER_DIR", "/var/tmp/slurm-elastic-cluster"))
NODES = 4
# The same step, data and saving in every case.
TRAIN = {"dataset_size": 2048, "global_batch": 32, "save_every": 25, "step_time": 0.1}
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
        (tmp / "logs").mkdir(parents=True, exist_ok=True)

    def submit(self, steps: int) -> None:
        if self.system == "requeue":
            self._submit_submitit(steps)
        else:
            self._submit_array(steps)

    def _submit_array(self, steps: int) -> None:
        args = [
            "--steps", str(steps), "--dataset-size", str(TRAIN["dataset_size"]),
            "--global-batch", str(TRAIN["global_batch"]), "--save-every",
            str(TRAIN["save_every"]), "--step-time", str(TRAIN["step_time"]),
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

    def nodes(self) -> list[str]:
        """Nodes the job's running tasks hold now."""
        found: set[str] = set()
        with contextlib.suppress(Exception):
            for info in self.client.job_infos(self.job):
                if info.state in RUNNING and info.node_list:
                    found.update(self.client.hostnames(info.node_list))
        return sorted(found)

    def preempt(self, node: str, hold_s: float, k: int) -> None:
        script = (
            f"#!/bin/bash\n#SBATCH -p high -w {node} --exclusive -J goodput-high\n"
            f"#SBATCH -o {self.tmp}/logs/high-{k}.out\nsleep {hold_s}\n"
        )
        self.high.append(self.client.submit(script))

    def stop(self) -> None:
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


def run_case(
    system: str, n: int, period: float, hold: float, limit: float, drain: float
) -> dict[str, Any]:
    env = cluster_env()
    client = SlurmClient(env=env, timeout_s=60)
    tmp = Path(tempfile.mkdtemp(prefix=f"goodput-{system}-", dir="/var/tmp"))
    case = Case(system, client, env, tmp)
    try:
        steps = int((n * period + 120) / TRAIN["step_time"]) + 1000
        case.submit(steps)
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
            return {"error": f"no world of {NODES} within {limit:.0f} s (cluster busy?)"}
        t_a = time.time()
        for k in range(n):
            wait(lambda k=k: time.time() >= t_a + k * period + period / 4, period + 1, 0.05)
            held = case.nodes()
            if held:
                case.preempt(held[k % len(held)], hold, k)
        wait(lambda: time.time() >= t_a + n * period, period + 1, 0.05)
        t_b = time.time()
        # No more preemptions: let the last cut attempt resume (a redone step shows as
        # lost only once it is done again), then count.
        wait(
            lambda: any(
                r["time"] > t_b + 1 and r["world"] == NODES for r in ledger(case.ledger_path)
            ),
            drain,
            0.5,
        )
        recs = ledger(case.ledger_path)
        done, redone = useful(recs, t_a, t_b)
        full_world = [r for r in recs if t_a <= r["time"] <= t_b and r["world"] == NODES]
        return {
            "steps_per_s": round(done / (t_b - t_a), 3),
            "useful_steps": done,
            "window_s": round(t_b - t_a, 1),
            "preemptions": n,
            "lost_per_preemption": round(redone / n, 2),
            "pace_steps_per_s": round(1 / TRAIN["step_time"], 1),
            "steps_at_full_world": len({r["step"] for r in full_world}),
            "load_avg_1m": round(os.getloadavg()[0], 1),
            "dir": str(tmp),
        }
    finally:
        case.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 preemptions, 15 s apart")
    ap.add_argument("--preemptions", type=int, default=None, help="n (default 5; quick 2)")
    ap.add_argument("--period", type=float, default=None, help="T s (default 30; quick 15)")
    ap.add_argument("--hold", type=float, default=5.0, help="each high job's seconds")
    ap.add_argument("--limit", type=float, default=240.0, help="seconds to reach 4 nodes")
    ap.add_argument(
        "--systems", default=None, help="cases to run (default all; --quick: inplace,requeue)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the case directories")
    args = ap.parse_args(argv)
    n = args.preemptions or (2 if args.quick else 5)
    period = args.period or (15.0 if args.quick else 30.0)
    results: dict[str, dict[str, Any]] = {}
    for system in ("inplace", "restart", "requeue"):
        default = "inplace,requeue" if args.quick else "inplace,restart,requeue"
        if system in (args.systems or default).split(","):
            results[system] = run_case(
                system, n, period, args.hold, args.limit, 30 if args.quick else 90
            )
        else:
            results[system] = {"error": "not run (--systems)"}
        print(f"# {system}: {json.dumps(results[system])}", file=sys.stderr, flush=True)
    if not args.keep:
        for r in results.values():
            if "dir" in r:
                shutil.rmtree(r["dir"], ignore_errors=True)
    base = results["requeue"].get("steps_per_s")
    rows = []
    for system, target, floor in (
        ("inplace", ">= 1.5", 1.5),
        ("restart", ">= 1.0 (reported)", 1.0),
    ):
        if results[system].get("error") == "not run (--systems)":
            continue
        ours = results[system].get("steps_per_s")
        ratio = None if ours is None or not base else round(ours / base, 3)
        rows.append({
            "bench": "goodput", "case": f"{system}_vs_requeue", "ours": ours, "baseline": base,
            "ratio": ratio, "target": f"ratio {target}", "ok": ratio is not None and ratio >= floor,
            "unit": "useful steps/s", "preemptions": n, "period_s": period, "hold_s": args.hold,
            "ours_detail": results[system], "baseline_detail": results["requeue"],
        })  # fmt: skip
    lost = results["inplace"].get("lost_per_preemption")
    lost_base = results["requeue"].get("lost_per_preemption")
    rows.append({
        "bench": "goodput", "case": "lost_steps_per_preemption_inplace_vs_requeue", "ours": lost,
        "baseline": lost_base, "ratio": None if not lost_base or lost is None else round(lost / lost_base, 3),
        "target": "ours == 0 (with a notice)", "ok": lost == 0, "unit": "steps",
        "restart_lost_per_preemption": results["restart"].get("lost_per_preemption"),
    })  # fmt: skip
    for r in rows:
        print(json.dumps(r), flush=True)
    print(f"\n{'case':46} {'ours':>8} {'baseline':>9} {'ratio':>7} {'target':>20} ok")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(
            f"{r['case']:46} {fmt(r['ours']):>8} {fmt(r['baseline']):>9} {fmt(r['ratio']):>7} "
            f"{r['target']:>20} {r['ok']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
