"""What one boundary vote costs a DDP step, with torch alone (no slurm_elastic).

The session's only per-step cost against plain DDP is its boundary vote (one async
``all_reduce`` of six int64 about every ``vote_interval_s``; docs/performance.md). This
bench measures the same collective without the library, so the two can be compared:
two processes (gloo on 127.0.0.1, one intra-op thread each) train the MLP of
``bench/overhead.py`` (1024 -> 2048 -> 2048 -> 1024, ReLU, Adam, 16 samples per rank,
real compute) under plain DDP, and alternate blocks of ``--per`` steps (3: about the
session's votes per step at this step time) of:

* ``plain``: DDP steps (the baseline);
* ``entry``: the same, with one vote per block cast at the first step's entry
  (``async_op=True``) and read at its end (what the session does);
* ``preopt``: the vote cast after the backward, before ``optimizer.step()`` (the ranks
  are aligned by the gradient all-reduce there), read at the step's end;
* ``sync``: the vote cast and waited for after the optimizer step;
* ``plain2``: DDP steps again (the method's null: 1 +- one run's noise).

Each block is timed on rank 0 between two barriers; the order of the variants is
reversed every other block. A case's ratio is the median over blocks of (its block /
the ``plain`` block of the same round); ``ratio_of_sums`` beside it. Reported, no target
(it explains the session's overhead). ``--quick``: 40 rounds (~1 min here); full: 150.

Prints a table and one JSON line per case (bench, case, ours, baseline, ratio, target,
ok, unit, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _stopping import stop_on_sigterm

KINDS = ("plain", "entry", "preopt", "sync", "plain2")


def worker(rank: int, port: int, rounds: int, per: int, out: str) -> None:
    """One rank: the alternating blocks; rank 0 writes the block times to ``out``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
    )  # fmt: skip
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(16, 1024), torch.randn(16, 1024)

    def cast() -> tuple[torch.Tensor, Any]:
        flags = torch.tensor([0, 1, 0, 0, 0, -1], dtype=torch.int64)  # as the session's
        return flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)

    def step(kind: str, votes: bool) -> None:
        vote = cast() if votes and kind == "entry" else None
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if votes and kind == "preopt":
            vote = cast()
        opt.step()
        if votes and kind == "sync":
            vote = cast()
        if vote is not None:
            vote[1].wait()
            vote[0].tolist()

    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(5):
        step("plain", False)
    for r in range(rounds):
        for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for i in range(per):
                step(kind, i == 0)
            dist.barrier()
            times[kind].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(rounds: int, per: int, limit_s: float) -> dict[str, Any]:
    """Both ranks once; rank 0's block times, or an error."""
    with tempfile.TemporaryDirectory(prefix="vote-cost-") as d:
        out = os.path.join(d, "times.json")
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        args = [str(port), str(rounds), str(per), out]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(rank), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in (0, 1)
        ]
        deadline = time.monotonic() + limit_s
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {limit_s:.0f} s"}
        finally:  # out of time, or the bench stopped
            for q in procs:
                if q.poll() is None:
                    q.kill()
                    q.wait()
        if any(p.returncode for p in procs) or not os.path.exists(out):
            tail = b"".join(logs).decode(errors="replace")[-1500:]
            return {"error": f"exit {[p.returncode for p in procs]}", "log_tail": tail}
        return {"times": json.loads(Path(out).read_text())}


def rows(res: dict[str, Any], per: int, warmup: int) -> list[dict[str, Any]]:
    common = {"bench": "vote_cost", "target": "reported", "ok": True, "unit": "ms/step",
              "per": per, "load_avg": round(os.getloadavg()[0], 2)}  # fmt: skip
    out = []
    for kind in KINDS[1:]:
        row: dict[str, Any] = {**common, "case": f"{kind}_vs_plain", "ours": None,
                               "baseline": None, "ratio": None}  # fmt: skip
        if "error" in res:
            row |= {"ok": False, "errors": [res["error"]]}
            out.append(row)
            continue
        ours, base = res["times"][kind][warmup:], res["times"]["plain"][warmup:]
        pairs = [a / b for a, b in zip(ours, base, strict=True)]
        row |= {
            "ours": round(statistics.median(ours) / per * 1e3, 2),
            "baseline": round(statistics.median(base) / per * 1e3, 2),
            "ratio": round(statistics.median(pairs), 4),
            "ratio_of_sums": round(sum(ours) / sum(base), 4),
            "blocks": len(pairs),
        }
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 rounds (~1 min)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of blocks (150)")
    ap.add_argument("--per", type=int, default=3, help="steps per block, one vote each")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds for the run")
    args = ap.parse_args(argv)
    stop_on_sigterm()
    if args.per < 1:
        ap.error(f"--per={args.per}: must be >= 1")
    rounds = args.rounds or (40 if args.quick else 150)
    if rounds < 6:
        ap.error(f"--rounds={rounds}: must be >= 6 (the first 3 are a warm-up)")
    found = rows(run(rounds, args.per, args.limit), args.per, warmup=3)
    for row in found:
        print(json.dumps(row), flush=True)
    print(f"\n{'case':18} {'ours':>8} {'baseline':>9} {'ratio':>7} unit")
    for r in found:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{r['case']:18} {fmt(r['ours']):>8} {fmt(r['baseline']):>9} "
              f"{fmt(r['ratio']):>7} {r['unit']}")  # fmt: skip
    return 0 if all(r["ok"] for r in found) else 1


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
               sys.argv[6])  # fmt: skip
        sys.exit(0)
    sys.exit(main())
