"""GPU check: what a copy of the training state costs a CUDA training loop, through the
product's own commit (``slurm_elastic.live.state.ElasticState``), on one GPU.

    python bench/gpu_copy_check.py              # ~2 minutes on an H100/H200
    python bench/gpu_copy_check.py --cpu-dry-run  # the harness on CPU, tiny sizes

The model: an MLP of ``--layers`` square ``Linear`` layers of width ``--width`` (fp32
parameters, bf16 autocast, Adam), a batch of ``--batch`` rows: real compute, no sleep.
Baseline: the plain loop (forward, backward, ``optimizer.step()``), median ms per step.
Ours, each the same loop plus a commit of the whole state (parameters, buffers and Adam's
moments):

* ``fresh_pageable_every_step``: a synchronous copy to fresh pageable host tensors at
  every step (what ``ElasticState.commit()`` did until 2026-12-04, and ``commit_every=1``
  cost before #20), 3 steps only;
* ``foreground_every_step``: ``ElasticState.commit()`` at every step: a synchronous copy
  into host buffers reused from one commit to the next (pinned);
* ``background_every_step``: ``commit(background=True)`` at every step: pinned buffers
  reused, the copy on a side stream while the next forward and backward run (the
  optimizer's step waits for it);
* ``background_every_50``: the same every 50 steps (a neighbour-copy-like cadence),
  mean ms per step over the window (the copies amortized).

Also the device-to-host bandwidth (pageable vs pinned) of the state. Prints a table and
one JSON line per case (bench, case, ours, baseline, ratio, target, ok); every target is
"reported": the numbers say what a per-step copy costs on a GPU, where a CPU hides it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_elastic.live.state import ElasticState
from slurm_elastic.training.state import host_copy


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per case")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU")
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        args.width, args.layers, args.batch, args.steps = 64, 2, 32, 6
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Loop:
    """The model, its optimizer and one training step on ``device``."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width, bias=False), nn.ReLU()]
        self.model = nn.Sequential(*layers).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(args.batch, args.width, device=device)
        self.device = device
        self.state = ElasticState(self.model, self.opt, step=0)

    def step(self) -> None:
        kind = self.device.type
        with torch.autocast(kind, dtype=torch.bfloat16, enabled=kind == "cuda"):
            loss = self.model(self.x).float().pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def nbytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for entry in self.opt.state.values():
            total += sum(v.numel() * v.element_size() for v in entry.values() if v.dim())
        return total


def timed(loop: Loop, steps: int, commit: Any) -> list[float]:
    """Seconds per step (each step synchronised), ``commit(i)`` after step ``i``."""
    times = []
    for i in range(steps):
        sync(loop.device)
        t0 = time.perf_counter()
        loop.step()
        commit(i)
        sync(loop.device)
        times.append(time.perf_counter() - t0)
    loop.state.wait()
    return times


def bandwidth(loop: Loop) -> dict[str, float]:
    """GB/s of a device-to-host copy of the parameters and Adam's moments."""
    tensors = [p.data for p in loop.model.parameters()]
    tensors += [v for e in loop.opt.state.values() for v in e.values() if v.dim()]
    out: dict[str, float] = {}
    for name, pin in (("pageable", False), ("pinned", True)):
        if pin and loop.device.type != "cuda":
            continue
        dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
        for _ in range(2):
            sync(loop.device)
            t0 = time.perf_counter()
            for d, s in zip(dst, tensors, strict=True):
                d.copy_(s, non_blocking=pin)
            sync(loop.device)
            took = time.perf_counter() - t0
        out[name] = sum(t.numel() * t.element_size() for t in tensors) / took / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("SKIP: no CUDA device (--cpu-dry-run checks the harness)")
        return 0
    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda", 0)
    loop = Loop(args, device)
    for _ in range(3):  # warm-up: kernels, Adam's state allocated
        loop.step()
    state_gb = loop.nbytes() / 1e9
    cases: dict[str, list[float]] = {}
    cases["plain"] = timed(loop, args.steps, lambda i: None)
    cases["fresh_pageable_every_step"] = timed(
        loop, 3, lambda i: host_copy(loop.state.state_dict())
    )
    cases["foreground_every_step"] = timed(loop, args.steps, lambda i: loop.state.commit())
    loop.state.commit(background=True)  # buffers allocated and pinned once
    loop.state.wait()
    cases["background_every_step"] = timed(
        loop, args.steps, lambda i: loop.state.commit(background=True)
    )
    every = 50 if not args.cpu_dry_run else 3
    cases["background_every_50"] = timed(
        loop, 2 * every, lambda i: loop.state.commit(background=True) if i % every == 0 else None
    )
    bw = bandwidth(loop)
    base = statistics.median(cases["plain"])
    common = {
        "unit": "ms/step", "state_gb": round(state_gb, 2), "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "torch": torch.__version__, "d2h_gb_s": {k: round(v, 1) for k, v in bw.items()},
        "width": args.width, "layers": args.layers, "batch": args.batch,
    }  # fmt: skip
    print(f"state {state_gb:.2f} GB on {device}; device-to-host GB/s: {common['d2h_gb_s']}")
    print(f"{'case':<28}{'ours ms':>10}{'plain ms':>10}{'ratio':>8}")
    for case in (
        "fresh_pageable_every_step",
        "foreground_every_step",
        "background_every_step",
        "background_every_50",
    ):
        ts = cases[case]
        ours = statistics.mean(ts) if case.endswith("_50") else statistics.median(ts)
        row = {
            "bench": "gpu_copy", "case": case, "ours": round(ours * 1e3, 2),
            "baseline": round(base * 1e3, 2), "ratio": round(ours / base, 3),
            "target": "reported", "ok": True,
            "stat": "mean" if case.endswith("_50") else "median", **common,
        }  # fmt: skip
        print(f"{case:<28}{row['ours']:>10}{row['baseline']:>10}{row['ratio']:>8}")
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
