"""Checkpoint benchmark: our save/load against raw I/O and plain torch.save, in one run.

Cases per state size (64 MiB and 1 GiB; ``--quick``: 8 and 32 MiB):

* ``save_vs_raw``        our blocking save (CRC32 + fsync + manifest + rename) vs a raw
                         sequential write + fsync of the same number of bytes, same directory.
                         Target: ratio (throughput ours / baseline) >= 0.8.
* ``save_vs_torch_save`` our blocking save vs plain ``torch.save(state, path)`` (which does
                         not fsync: its data may still be in the page cache). Target >= 0.8.
* ``async_stall``        time the training loop is blocked by an async save (staging into
                         reused host buffers) vs a blocking save. Target: ratio <= 0.1.
* ``load_vs_raw``        our verified load (CRC32 pass + torch.load) vs a raw sequential
                         read, both from a cold page cache (``posix_fadvise(DONTNEED)``).
                         Target >= 0.5 (two passes over the data vs one).

Each timing is the median of ``--repeat`` runs, interleaving ours and the baseline so that
disk noise from other processes hits both. Prints a table and one JSON object per case.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slurm_elastic.checkpoint import CheckpointManager

MiB = 1 << 20


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    parts = 16
    numel = nbytes // 4 // parts
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(parts)}


def drop_cache(path: Path) -> None:
    for p in [path] if path.is_file() else list(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        chunk = 16 * MiB
        for i in range(0, len(data), chunk):
            view = data[i : i + chunk]
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def raw_read(path: Path) -> None:
    buf = bytearray(16 * MiB)
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_pair(
    ours: Callable[[], object], base: Callable[[], object], repeat: int
) -> tuple[float, float]:
    a, b = [], []
    for _ in range(repeat):
        b.append(timed(base))
        a.append(timed(ours))
    return statistics.median(a), statistics.median(b)


def run_size(nbytes: int, root: Path, repeat: int) -> list[dict[str, object]]:
    state = make_state(nbytes)
    payload = memoryview(torch.cat([t.view(-1) for t in state.values()]).numpy().tobytes())
    size_mib = len(payload) / MiB
    d = root / f"size{int(size_mib)}"
    mgr = CheckpointManager(d / "ours", keep_last=1)
    step = [0]

    def ours_save() -> None:
        step[0] += 1
        mgr.save(state, step[0])

    def torch_save() -> None:
        path = d / "plain.pt"
        torch.save(state, path)
        path.unlink()

    d.mkdir(parents=True)
    rows = []
    t_ours, t_raw = median_pair(ours_save, lambda: raw_write(d / "raw.bin", payload), repeat)
    rows.append(("save_vs_raw", size_mib / t_ours, size_mib / t_raw, ">=", 0.8, "MiB/s"))
    t_ours2, t_plain = median_pair(ours_save, torch_save, repeat)
    rows.append(("save_vs_torch_save", size_mib / t_ours2, size_mib / t_plain, ">=", 0.8, "MiB/s"))

    # Async stall: the first async save allocates the staging buffers; measure steady state.
    mgr.save(state, step[0] + 1, blocking=False)
    mgr.flush()
    step[0] += 1
    stalls, syncs = [], []
    for _ in range(repeat):
        step[0] += 1
        syncs.append(timed(lambda: mgr.save(state, step[0])))
        step[0] += 1
        stalls.append(timed(lambda: mgr.save(state, step[0], blocking=False)))
        mgr.flush()
    stall, sync = statistics.median(stalls), statistics.median(syncs)
    rows.append(("async_stall", stall, sync, "<=", 0.1, "s"))

    latest = mgr.latest_verified(deep=False)
    assert latest is not None
    state_file = latest.path / "state.pt"

    def ours_load() -> None:
        drop_cache(latest.path)
        mgr.load(latest.step)

    def base_load() -> None:
        drop_cache(state_file)
        raw_read(state_file)

    t_load, t_read = median_pair(ours_load, base_load, repeat)
    rows.append(("load_vs_raw", size_mib / t_load, size_mib / t_read, ">=", 0.5, "MiB/s"))
    mgr.close()
    shutil.rmtree(d)

    out = []
    for case, ours, base, op, target, unit in rows:
        ratio = ours / base
        ok = ratio >= target if op == ">=" else ratio <= target
        out.append(
            {
                "bench": "checkpoint",
                "case": case,
                "size_mib": round(size_mib),
                "ours": round(ours, 4),
                "baseline": round(base, 4),
                "unit": unit,
                "ratio": round(ratio, 3),
                "target": f"{op} {target}",
                "ok": ok,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (8, 32 MiB), < 1 minute")
    ap.add_argument("--sizes-mib", type=int, nargs="*", help="override state sizes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory to write into (default: a temp dir)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = args.sizes_mib or ([8, 32] if args.quick else [64, 1024])
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    results = []
    try:
        for size in sizes:
            results.extend(run_size(size * MiB, root, args.repeat))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{'case':<20}{'size':>8}{'ours':>12}{'baseline':>12}{'unit':>7}{'ratio':>8}{'target':>9}  ok"
    )
    for r in results:
        print(
            f"{r['case']:<20}{r['size_mib']:>6}Mi{r['ours']:>12.3f}{r['baseline']:>12.3f}"
            f"{r['unit']:>7}{r['ratio']:>8.3f}{r['target']:>9}  {'yes' if r['ok'] else 'MISS'}"
        )
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
