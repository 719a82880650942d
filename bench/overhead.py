"""Steady-state overhead per step: our own-loop API vs a plain hand-written DDP loop.

The same worker (``bench/overhead_worker.py``) runs the same model, data and steps in
three loops, each launched the same way (``slurm-elastic agent --nnodes 1
--nproc-per-node 2``, gloo, one intra-op thread per worker, real compute, no sleep):

* ``plain``: a hand-written DDP loop (the baseline);
* ``session``: ``ElasticSession`` at its defaults, ``with session.step() as s:`` (no
  checkpoint; ``commit_every=0``: no copy of the state per step);
* ``loop``: ``ElasticLoop.run(train_step)`` at its defaults (for information).

The model is an MLP (1024 -> 2048 -> 2048 -> 1024, ReLU) of 8.4 M float32 parameters:
parameters + Adam's two moments are ~101 MB; MSE loss, global batch 32 (16 per rank).
The runs are interleaved: each repetition runs the three loops once, in an order rotated
every repetition. Per run, the time per step is rank 0's time between the starts of two
consecutive step bodies (whatever a loop adds between bodies, e.g. our step boundary, is
in it), median over the steps after the warm-up; the case's value is the median over
repetitions of those medians. Peak host memory: the largest ``ru_maxrss`` among the two
workers, median over repetitions.

Cases: ``session_vs_plain`` (target ours / plain <= 1.03, moonshot 1.01),
``loop_vs_plain`` (reported), ``rss_session_vs_plain`` (reported). A run that did not
finish (timeout, a worker error) is reported as such, with no ratio.

``--quick`` (~3 min here): 3 repetitions of 40 steps (10 warm-up); the full run: 5 of
100 (20 warm-up). Prints a table and one JSON line per case (bench, case, ours,
baseline, ratio, target, ok, unit, ...).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "overhead_worker.py"
PY = sys.executable
TARGET = 1.03
MOONSHOT = 1.01
MODES = ("plain", "session", "loop")


def run_once(mode: str, tmp: Path, steps: int, batch: int, limit: float) -> dict[str, Any]:
    """One launch of ``mode`` under the agent with 2 workers; rank 0's and 1's records."""
    out = tmp / f"out-{mode}-{time.monotonic_ns()}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for key in [k for k in env if k.startswith("SLURM")]:
        env.pop(key)
    argv = [
        PY, "-m", "slurm_elastic.cli.main", "agent", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "slurm", "--rdzv-endpoint", str(out / "rdzv"), "--rdzv-id", "overhead",
        "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
        "--state-dir", str(out / "state"), "--max-restarts", "0",
        str(WORKER), mode, str(out), "--steps", str(steps), "--global-batch", str(batch),
    ]  # fmt: skip
    with open(out / "agent.log", "wb") as log:
        try:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=limit, check=False)  # fmt: skip
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    records = {}
    for rank in (0, 1):
        path = out / f"{mode}.{rank}.json"
        if path.exists():
            records[rank] = json.loads(path.read_text())
    if rc != 0 or len(records) != 2:
        tail = (out / "agent.log").read_text(errors="replace")[-1500:]
        return {"error": f"exit {rc}, {len(records)} of 2 records", "log_tail": tail}
    return {"records": records}


def step_time(record: dict[str, Any], warmup: int) -> float:
    """Median time between consecutive step starts after ``warmup`` steps."""
    starts = record["starts"][warmup:]
    return statistics.median(b - a for a, b in itertools.pairwise(starts))


def outside(record: dict[str, Any], warmup: int) -> float:
    """Median time from the end of a step body to the start of the next one."""
    starts, ends = record["starts"][warmup:], record["ends"][warmup:]
    return statistics.median(b - a for a, b in zip(ends, starts[1:], strict=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions of 40 steps")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--limit", type=float, default=180.0, help="seconds per launch")
    args = ap.parse_args(argv)
    repeat = args.repeat or (3 if args.quick else 5)
    steps = args.steps or (40 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else (10 if args.quick else 20)
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    errors: dict[str, list[str]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="overhead-") as d:
        for rep in range(repeat):
            order = MODES[rep % 3 :] + MODES[: rep % 3]
            for mode in order:
                res = run_once(mode, Path(d), steps, args.global_batch, args.limit)
                if "error" in res:
                    errors[mode].append(res["error"])
                    print(f"# {mode} rep {rep}: {res['error']}\n{res['log_tail']}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    continue
                recs = res["records"]
                run = {
                    "step_s": step_time(recs[0], warmup),
                    "outside_s": outside(recs[0], warmup),
                    "rss_mib": max(r["maxrss_kib"] for r in recs.values()) / 1024,
                    "params": recs[0]["params"],
                }
                per_mode[mode].append(run)
                print(f"# {mode} rep {rep}: {json.dumps(run)}", file=sys.stderr, flush=True)

    def med(mode: str, key: str) -> float | None:
        runs = per_mode[mode]
        return statistics.median(r[key] for r in runs) if runs else None

    base = med("plain", "step_s")
    params = next((r["params"] for rs in per_mode.values() for r in rs), 0)
    common = {"params_m": round(params / 1e6, 2), "state_mb": round(params * 12 / 1e6, 1),
              "workers": 2, "steps": steps, "warmup": warmup, "repeats": repeat,
              "global_batch": args.global_batch, "load_avg": round(os.getloadavg()[0], 2)}  # fmt: skip
    rows = []
    for mode, case, target in (
        ("session", "session_vs_plain", f"<= {TARGET} (moonshot {MOONSHOT})"),
        ("loop", "loop_vs_plain", "reported"),
    ):
        ours = med(mode, "step_s")
        ratio = None if ours is None or base is None else round(ours / base, 4)
        ok = ratio is not None and (ratio <= TARGET if mode == "session" else True)
        pairs = [o["step_s"] / p["step_s"] for o, p in zip(per_mode[mode], per_mode["plain"],
                                                           strict=False)]  # fmt: skip
        rows.append({
            "bench": "overhead", "case": case, "ours": ours and round(ours * 1e3, 2),
            "baseline": base and round(base * 1e3, 2), "ratio": ratio, "target": target,
            "ok": bool(ok), "unit": "ms/step",
            "ours_outside_ms": (o := med(mode, "outside_s")) and round(o * 1e3, 3),
            "baseline_outside_ms": (b := med("plain", "outside_s")) and round(b * 1e3, 3),
            "per_repeat_ratios": [round(x, 3) for x in pairs],
            "errors": {"ours": errors[mode], "baseline": errors["plain"]}, **common,
        })  # fmt: skip
    rss_o, rss_b = med("session", "rss_mib"), med("plain", "rss_mib")
    rows.append({
        "bench": "overhead", "case": "rss_session_vs_plain", "ours": rss_o and round(rss_o, 1),
        "baseline": rss_b and round(rss_b, 1),
        "ratio": None if rss_o is None or rss_b is None else round(rss_o / rss_b, 4),
        "target": "reported", "ok": rss_o is not None and rss_b is not None, "unit": "MiB",
        "loop_mib": (r := med("loop", "rss_mib")) and round(r, 1), **common,
    })  # fmt: skip
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"\n{'case':24} {'ours':>9} {'baseline':>9} {'ratio':>7} {'unit':8} target / ok")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{r['case']:24} {fmt(r['ours']):>9} {fmt(r['baseline']):>9} "
              f"{('-' if r['ratio'] is None else format(r['ratio'], '.3f')):>7} {r['unit']:8} "
              f"{r['target']} / {r['ok']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
