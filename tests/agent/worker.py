"""A training-like worker for agent tests (started by the agent, not by pytest).

Usage: worker.py OUT_DIR STEPS [BEHAVIOUR]

Each step does a gloo all_reduce whose result proves the world is consistent, reports
progress, and agrees on the preemption notice. The "checkpoint" is the step number that
rank 0 writes atomically to OUT_DIR/step, so a restarted group resumes where it was.
Every event is one JSON line appended to OUT_DIR/records.jsonl.

BEHAVIOUR: "" (plain), "hang" (rank 0 stops making progress at step 3 of the first
attempt), "fail" (the last rank exits 3 at step 2 of the first attempt), "clockstep"
(progress is reported with a wall time 100 s in the past, as if the node's clock had
stepped forward by 100 s between the worker's report and the agent's reading).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_elastic import notice


def record(out: str, **fields: object) -> None:
    fields.update(
        pid=os.getpid(),
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
        group_rank=int(os.environ["GROUP_RANK"]),
        restart=int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        node=os.environ.get("TEST_NODE_NAME", ""),
        time=time.time(),
    )
    with open(os.path.join(out, "records.jsonl"), "a") as fh:
        fh.write(json.dumps(fields) + "\n")


def main() -> int:
    out, steps = sys.argv[1], int(sys.argv[2])
    behaviour = sys.argv[3] if len(sys.argv) > 3 else ""
    step_s = float(os.environ.get("WORKER_STEP_S", "0.05"))
    torch.set_num_threads(1)
    notice.install_preemption_handler()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    step_file = os.path.join(out, "step")
    start = int(Path(step_file).read_text()) if os.path.exists(step_file) else 0
    record(
        out,
        event="start",
        start_step=start,
        node_dir=os.environ.get(notice.NODE_DIR_ENV),
        local_rank=int(os.environ["LOCAL_RANK"]),
    )
    for step in range(start, steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        if int(t.item()) != world:
            record(out, event="bad_allreduce", value=t.item())
            return 5
        if behaviour == "clockstep":
            path = os.path.join(os.environ[notice.NODE_DIR_ENV], "progress")
            with open(path, "w") as fh:
                fh.write(f"{step:20d} {time.time() - 100:20.6f}\n")
        else:
            notice.report_progress(step)
        if behaviour == "hang" and restart == 0 and step == 3 and rank == 0:
            record(out, event="hanging", step=step)
            time.sleep(3600)
        if behaviour == "fail" and restart == 0 and step == 2 and rank == world - 1:
            record(out, event="failing", step=step)
            return 3
        if rank == 0:
            tmp = f"{step_file}.tmp"
            with open(tmp, "w") as fh:
                fh.write(str(step + 1))
            os.replace(tmp, step_file)
        # Agreed, as a real loop does: each rank's process gets the notice signal at its
        # own moment, so a rank acting alone could leave its peers blocked in a collective.
        agreed, mine = notice.preemption_agreed()
        if agreed and (mine or notice.await_new_round(timeout_s=60)):
            record(out, event="preempted", step=step)
            return 0
        time.sleep(step_s)
    record(out, event="done", step=steps)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
