"""The slurm_elastic demo, narrated: an elastic array job survives a preemption.

Run through ``scripts/demo.sh`` (which sets up the venv and the local Slurm cluster).

With ``--cluster slurm``: renders the ``elastic_array`` template for examples/train_ddp.py
(1..4 nodes, one array task per node), submits it, waits until all 4 nodes train in one
world, preempts array task 1 the way Slurm does (``scancel --signal=USR2``), and narrates
from the agents' events: the node checkpoints and requeues itself, the survivors go on at
3 nodes within seconds, the task comes back and the world grows to 4 again, the run
finishes and nothing of the job is left in the queue.

With ``--cluster local`` (no Slurm here): the same story with 3 local node agents: one is
preempted (``SIGUSR2``, as Slurm's notice), the other two go on, and a replacement agent
joins (what Slurm's requeue does), so the world grows back to 3.

Both end by printing ``slurm-elastic status`` of their own run and the path of its
timeline picture (``slurm-elastic timeline``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slurm_elastic.cli.status import run_status
from slurm_elastic.cli.timeline import run_timeline
from slurm_elastic.events import read_events
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.submit import LocalJob, local, submit
from slurm_elastic.submit.render import render_template

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_ddp.py"
T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


class Narrator:
    """Prints each new agent/checkpoint event of the run once, in words."""

    def __init__(self, events_dir: Path) -> None:
        self.events_dir = events_dir
        self.seen = 0
        self.world: int | None = None
        self.events: list[Any] = []

    def distinct_hosts(self) -> bool:
        """Whether nodes have their own host names (not local agents on one machine)."""
        return len({e["host"] for e in self.events if e["kind"] == "agent.start"}) > 1

    def poll_all(self) -> list[Any]:
        """Every event so far (narrating the new ones)."""
        self.poll()
        return self.events

    def poll(self) -> list[Any]:
        if not self.events_dir.exists():
            return []
        self.events = events = list(read_events(self.events_dir))
        new, self.seen = events[self.seen :], len(events)
        for e in new:
            kind = e["kind"]
            host = e.get("host") if self.distinct_hosts() else f"agent {e.get('pid')}"
            if (
                kind in ("agent.workers_started", "agent.reformed_in_place")
                and e["group_world_size"] != self.world
            ):
                self.world = e["group_world_size"]
                how = " (workers kept running)" if kind == "agent.reformed_in_place" else ""
                say(f"world is now {self.world} node(s) x 1 worker{how}")
            elif kind == "agent.signal":
                say(f"{host}: got {e['signal']} (preemption notice) -> workers checkpoint")
            elif kind == "agent.requeued":
                say(f"{host}: left the rendezvous and requeued its own task {e['job']}")
            elif kind == "checkpoint.saved" and e.get("step", 0) % 100 == 0:
                say(f"checkpoint step {e['step']} committed ({e.get('seconds', 0):.2f} s)")
            elif kind == "agent.exit":
                say(f"{host}: agent exits {e['code']}")
        return new

    def wait(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if predicate():
                return
            time.sleep(0.3)
        raise SystemExit(f"demo: timed out waiting for {what}")


def run_slurm(work: Path, steps: int) -> tuple[int, str]:
    client = SlurmClient()
    (work / "logs").mkdir()
    script = render_template(
        "elastic_array",
        {
            "mode": "elastic_array",
            "entrypoint": str(TRAIN),
            "args": [
                "--steps",
                str(steps),
                "--step-time",
                "0.1",
                "--dataset-size",
                "400",
                "--global-batch",
                "16",
                "--save-every",
                "50",
            ],
            "nnodes": "1:4",
            "nproc_per_node": 1,
            "cpus_per_task": 2,
            "launcher": f"{sys.executable} -m slurm_elastic.cli.main",
            "output_dir": str(work / "logs"),
            "state_dir": str(work / "state"),
            "setup": "export OMP_NUM_THREADS=1",
            "job_name": "demo",
            "heartbeat_interval_s": 0.5,
            "last_call_timeout_s": 2,
            "monitor_interval_s": 0.2,
        },
    )
    (work / "job.sbatch").write_text(script)
    job = client.submit(script)
    say(f"submitted array job {job} (4 tasks = 4 nodes; script: {work / 'job.sbatch'})")
    n = Narrator(work / "state" / "events" / job)

    def trains(nodes: int) -> list[Any]:
        if not n.events_dir.exists():
            return []
        return [
            e
            for e in read_events(n.events_dir)
            # a worker starts in a world of that size, or switches to it in place
            if e["kind"] in ("train.start", "live.reformed") and e["world_size"] == nodes
        ]

    try:
        n.wait(lambda: trains(4), 240, "all 4 nodes training")
        time.sleep(3)
        say(f"preempting array task {job}_1: scancel --signal=USR2 --batch (Slurm's notice)")
        client.cancel(f"{job}_1", signal="USR2", batch=True)
        mark = len(trains(4))
        n.wait(lambda: trains(3), 120, "the survivors to go on at 3 nodes")

        def over() -> bool:
            return any(e["kind"] == "agent.workers_succeeded" for e in n.events)

        n.wait(lambda: len(trains(4)) > mark or over(), 240, "the requeued task to rejoin")
        if len(trains(4)) <= mark:
            say(
                f"the run finished before Slurm started {job}_1 again (a busy cluster): "
                "the finishing agents cancel it"
            )
        n.wait(
            lambda: all(i.state.is_terminal for i in client.job_infos(job)),
            600,
            "the run to finish",
        )
    finally:
        client.cancel(job)
    n.poll()
    states = {i.ref: i.state.value for i in client.job_infos(job)}
    say(f"array tasks: {states}")
    left = [q.ref for q in client.queue() if q.array_job_id == job]
    say(f"left in the queue: {left or 'nothing'}")
    say(
        f"checkpoints: {sorted(p.name for p in (work / 'state' / 'checkpoints' / job).glob('step_*'))}"
    )
    # CANCELLED beside COMPLETED is normal: the first agent to finish cancels queued tasks
    ok = "COMPLETED" in states.values() and set(states.values()) <= {"COMPLETED", "CANCELLED"}
    return (0 if ok and not left else 1), job


TRAIN_ARGS = ["--step-time", "0.1", "--dataset-size", "400", "--global-batch", "16"]
FAST: dict[str, Any] = {
    "heartbeat_interval_s": 0.5,
    "last_call_timeout_s": 2,
    "monitor_interval_s": 0.2,
}


def run_local(work: Path, steps: int) -> tuple[int, str]:
    """3 local node agents; one preempted, a replacement joins. Returns (rc, run dir)."""
    say("no Slurm cluster here: running 3 local node agents x 1 worker instead")
    folder = work / "local"
    job = submit(
        str(TRAIN),
        [*TRAIN_ARGS, "--steps", str(steps), "--save-every", "50"],
        mode="elastic_array",
        cluster="local",
        folder=folder,
        nnodes="1:3",
        nproc_per_node=1,
        env={"OMP_NUM_THREADS": "1"},
        **FAST,
    )
    assert isinstance(job, LocalJob)
    say(f"started local job {job.job_id}: 3 agents (logs: {folder}/node*.log)")
    n = Narrator(folder / "state" / "events" / job.job_id)
    extra: subprocess.Popen[bytes] | None = None

    def trains(nodes: int) -> int:
        return sum(
            1
            for e in n.poll_all()
            # a worker starts in a world of that size, or switches to it in place
            if e["kind"] in ("train.start", "live.reformed") and e["world_size"] == nodes
        )

    try:
        n.wait(lambda: trains(3), 180, "all 3 nodes training")
        time.sleep(3)
        victim = job.pids[1]
        say(f"preempting node agent 1 (pid {victim}): SIGUSR2, Slurm's preemption notice")
        os.kill(victim, signal.SIGUSR2)
        n.wait(lambda: trains(2), 120, "the survivors to go on at 2 nodes")
        mark = trains(3)
        say("a replacement agent joins (what Slurm's requeue of the task does)")
        with open(folder / "node3.log", "ab") as out:
            extra = subprocess.Popen(
                local.node_command(folder / "spec.json"),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=local.node_environment(extra={"OMP_NUM_THREADS": "1"}),
                start_new_session=True,
            )
        n.wait(lambda: trains(3) > mark, 180, "the world to grow back to 3")
        job.wait(600)  # the preempted agent counts as failed there: judge by exit codes
        extra.wait(60)
    finally:
        job.cancel()
        if extra is not None and extra.poll() is None:
            extra.terminate()
            extra.wait(30)
    n.poll()
    codes = job.exit_codes()
    say(f"agents exited {codes} + replacement {extra.returncode} (4: preempted, no requeue here)")
    ok = codes[1] == 4 and codes[0] == codes[2] == extra.returncode == 0
    return (0 if ok else 1), str(folder)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", choices=("slurm", "local"), default="slurm")
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slurm-elastic-demo-", dir="/var/tmp"))
    say(f"working directory (shared by all nodes): {work}")
    if args.cluster == "slurm":
        rc, run = run_slurm(work, args.steps)
    else:
        rc, run = run_local(work, args.steps)
    say(f"the run, as `slurm-elastic status {run}` shows it:")
    print(flush=True)
    run_status(run)
    png = work / "timeline.png"
    run_timeline(run, str(png), out=open(os.devnull, "w"))  # noqa: SIM115
    say(f"timeline of this run (slurm-elastic timeline {run} -o ...): {png}")
    say("demo finished: " + ("OK" if rc == 0 else f"FAILED ({rc})"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
