"""Startup benchmark: job start -> first training step, ours vs ``srun torchrun`` (c10d).

Both sides run on the local Slurm cluster in this same run, as sbatch jobs of N nodes x 2
workers running the same worker (``bench/startup_worker.py``: one DDP step with gloo):

* **ours**: the rendered ``elastic`` template (one allocation, srun starts one
  ``slurm-elastic agent`` per node; shared-directory rendezvous) with min = max = N;
* **baseline**: ``srun torchrun --nnodes=N --nproc-per-node=2 --rdzv-backend=c10d
  --rdzv-endpoint=<first node>:29500 --rdzv-id=$SLURM_JOB_ID`` in an sbatch script.

"Job start" is the batch script's first command (``date +%s.%N`` into a file); "first
training step" is when rank 0 has finished step 1 (the worker writes a timestamp). Both
jobs ask for the same resources (N nodes, one task per node, 2 CPUs per task). Runs of the
two sides are interleaved (the order alternates per repeat) and the median is reported.
Target: ours / baseline <= 1.1.

The breakdown (medians, seconds after job start) says where the time goes: ``process``
(the worker process exists: launcher start-up + rendezvous + spawning), ``imported``
(``import torch`` done), ``group`` (``init_process_group`` done), ``first_step``; for ours
also the agents' own events (rendezvous complete, workers started).

``--quick``: N = 2, 2 repeats. Full: N = 2 and 4, 3 repeats (``--repeat`` to change).
Prints a table and one JSON object per case (keys bench, case, ours, baseline, ratio,
target, ok, unit, ...). Needs the local cluster (``scripts/slurm-cluster up``; SLURM_CONF
or /var/tmp/slurm-elastic-cluster/env); other users' jobs only delay the start of ours.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _stopping import stop_on_sigterm

from slurm_elastic.events import read_events
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.submit.render import render_template

HERE = Path(__file__).resolve().parent
WORKER = HERE / "startup_worker.py"
CLUSTER_ENV = Path(os.environ.get("SLURM_ELASTIC_CLUSTER_DIR", "/var/tmp/slurm-elastic-cluster"))
TARGET = 1.1
NPROC = 2
MILESTONES = ("process", "imported", "group", "first_step")


def cluster_env() -> dict[str, str]:
    env = dict(os.environ)
    if not env.get("SLURM_CONF"):
        env_file = CLUSTER_ENV / "env"
        if env_file.is_file():
            for line in env_file.read_text().splitlines():
                line = line.strip().removeprefix("export ")
                if "=" in line and not line.startswith("#"):
                    key, _, value = line.partition("=")
                    env[key] = (shlex.split(value) or [""])[0]
    return env


def ours_script(n: int, out: Path, work: Path) -> str:
    return render_template(
        "elastic",
        {
            "entrypoint": str(WORKER),
            "args": [str(out)],
            "launcher": f"{sys.executable} -m slurm_elastic.cli.main",
            "output_dir": str(work / "logs"),
            "state_dir": str(work / "state"),
            "setup": f"date +%s.%N > {shlex.quote(str(out / 'job_start'))}\n"
            "export OMP_NUM_THREADS=1",
            "job_name": f"bench-startup-ours-{n}",
            "min_nodes": n,
            "max_nodes": n,
            "nproc_per_node": NPROC,
            "cpus_per_task": 2,
        },
    )


def baseline_script(n: int, out: Path, work: Path) -> str:
    q = shlex.quote
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name=bench-startup-torchrun-{n}",
            f"#SBATCH --nodes={n}",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --cpus-per-task=2",
            f"#SBATCH --output={work / 'logs'}/%x-%j.out",
            f"date +%s.%N > {q(str(out / 'job_start'))}",
            "export OMP_NUM_THREADS=1",
            'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"srun --ntasks-per-node=1 --cpus-per-task=2 {q(sys.executable)} -m torch.distributed.run"
            f" --nnodes={n} --nproc-per-node={NPROC} --rdzv-backend=c10d"
            ' --rdzv-endpoint="$HEAD:29500" --rdzv-id="$SLURM_JOB_ID"'
            f" --log-dir={q(str(out / 'torch-logs'))}"
            f" {q(str(WORKER))} {q(str(out))}",
            "",
        ]
    )


def run_job(client: SlurmClient, script: str, out: Path, timeout: float) -> dict[str, Any]:
    """Submit, wait for the end, return the milestones (seconds after job start)."""
    out.mkdir(parents=True)
    job = client.submit(script)
    deadline = time.monotonic() + timeout
    try:
        while True:
            info = client.job_info(job)
            if info.state.is_terminal:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} did not finish within {timeout:.0f} s")
            time.sleep(0.1)
    except BaseException:  # out of time, or the bench stopped: the job goes with it
        client.cancel(job)
        # and its processes, which write into the work directory, end before it is deleted
        end = time.monotonic() + 60
        while time.monotonic() < end and not client.job_info(job).state.is_terminal:
            time.sleep(0.2)
        raise
    result = out / "first_step.json"
    if not result.exists() or not (out / "job_start").exists():
        raise RuntimeError(f"job {job} ended {info.state.value} without a first step")
    start = float((out / "job_start").read_text())
    record = json.loads(result.read_text())
    times = {k: record[k] - start for k in MILESTONES}
    return {"job": job, "start": start, "state": info.state.value, **times}


def agent_milestones(work: Path, job: str, start: float) -> dict[str, float]:
    """First time of each agent event kind of ``job``, seconds after job start."""
    directory = work / "state" / "events" / job
    first: dict[str, float] = {}
    if directory.exists():
        for event in read_events(directory):
            first.setdefault(event["kind"], event["time"] - start)
    return first


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs if key in r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N=2, 2 repeats")
    p.add_argument("--nodes", type=int, nargs="+", default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600, help="per job, queueing included")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    stop_on_sigterm()
    sizes = args.nodes or ([2] if args.quick else [2, 4])
    repeat = args.repeat or (2 if args.quick else 3)

    client = SlurmClient(env=cluster_env(), timeout_s=60)
    client.check()
    work = Path(tempfile.mkdtemp(prefix="slurm-elastic-bench-startup-", dir="/var/tmp"))
    (work / "logs").mkdir()
    print(f"# work directory {work}", file=sys.stderr, flush=True)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        for rep in range(repeat):
            for n in sizes:
                sides = ["ours", "baseline"] if rep % 2 == 0 else ["baseline", "ours"]
                for side in sides:
                    out = work / f"{side}-n{n}-r{rep}"
                    make = ours_script if side == "ours" else baseline_script
                    run = run_job(client, make(n, out, work), out, args.timeout)
                    if side == "ours":
                        run.update(agent_milestones(work, run["job"], run["start"]))
                    runs.setdefault((n, side), []).append(run)
                    print(
                        f"# N={n} {side:8s} rep {rep}: first step {run['first_step']:.2f} s "
                        f"after job start (job {run['job']})",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if args.keep:
            print(f"# work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    results = []
    header = f"{'case':8s} {'ours s':>8s} {'torchrun s':>10s} {'ratio':>6s} {'target':>6s} ok"
    print(header)
    print("-" * len(header))
    for n in sizes:
        ours, base = runs[(n, "ours")], runs[(n, "baseline")]
        o, b = median_of(ours, "first_step"), median_of(base, "first_step")
        detail_keys = sorted({k for r in ours for k in r if k.startswith("agent.")})
        result = {
            "bench": "startup",
            "case": f"N={n}",
            "ours": round(o, 3),
            "baseline": round(b, 3),
            "ratio": round(o / b, 3),
            "target": TARGET,
            "ok": o / b <= TARGET,
            "unit": "s from batch script start to rank 0's first step (median)",
            "repeats": repeat,
            "ours_runs": [round(r["first_step"], 3) for r in ours],
            "baseline_runs": [round(r["first_step"], 3) for r in base],
            "ours_breakdown": {k: round(median_of(ours, k), 3) for k in MILESTONES},
            "baseline_breakdown": {k: round(median_of(base, k), 3) for k in MILESTONES},
            "ours_agent_events": {k: round(median_of(ours, k), 3) for k in detail_keys},
        }
        results.append(result)
        print(f"{result['case']:8s} {o:8.2f} {b:10.2f} {o / b:6.2f} {TARGET:6.2f} {result['ok']}")
    print()
    print(
        "breakdown (median seconds after job start): worker process / torch imported / "
        "process group / first step"
    )
    for r in results:
        for side in ("ours", "baseline"):
            bd = r[f"{side}_breakdown"]
            print(f"  {r['case']} {side:8s} " + " / ".join(f"{bd[k]:.2f}" for k in MILESTONES))
        if r["ours_agent_events"]:
            events = ", ".join(f"{k} {v:.2f}" for k, v in r["ours_agent_events"].items())
            print(f"  {r['case']} ours agent events: {events}")
    print()
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
