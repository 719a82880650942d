"""Checkpoint benchmark: our save/load against fair baselines, interleaved in one run.

Cases per state size (default 8, 64, 1024 MiB; ``--quick``: 8 and 32 MiB):

* ``save_vs_torch_save`` our blocking save (inline CRC32, fsync, manifest, directory
                         rename) vs what a careful user writes by hand: ``torch.save`` to a
                         temporary file + fsync + rename + fsync of the directory.
                         Target: throughput ratio >= 0.9.
* ``save_vs_raw``        our blocking save vs a raw sequential write + fsync of the same
                         bytes (the disk's limit). Target >= 0.8.
* ``async_stall``        time the training loop is blocked by an async save vs a blocking
                         save of the same state. The state is a real model's (16 bias-free
                         ``Linear`` layers of the given total size, SGD); one loop
                         iteration is ``save(blocking=False)`` then a forward/backward pass
                         on a batch of ``--batch`` samples and ``optimizer.step()``. Blocked
                         = the ``save()`` call plus the time the staging guards held the
                         loop (the step waiting for the background copy, a forward pass
                         copying buffers first), as counted by the manager
                         (``last_stall_seconds``). Target: ratio <= 0.05.
* ``load_vs_raw``        our verified load as users get it by default (owner/mode checks;
                         on a local or parallel filesystem the CRC pass reads a private
                         mapping of the file and tensors are views of it; parsed only if
                         it matches) vs a raw sequential read of the same file into a
                         reused buffer, both from a cold page cache
                         (``posix_fadvise(DONTNEED)``). Target >= 0.8.
* ``load_copy_vs_raw``   the same with ``load(..., mmap=False)`` (what NFS gets: the file
                         read once into fresh memory, CRC computed alongside). Target >= 0.8.
* ``save_vs_safetensors`` / ``load_vs_safetensors``: why our own container and not
                         safetensors (a well-kept library with the same layout: a JSON
                         header, then raw tensor bytes). The state is a training state
                         (the model's parameters and its Adam state, nested, with integer
                         keys and plain values), as checkpoints hold it. The baseline does
                         what a user of safetensors must for it: flatten the tree to
                         ``name -> tensor`` with the rest as JSON metadata, ``save_file``,
                         fsync, rename, fsync the directory; ``load_file`` (cold cache) and
                         rebuild the tree. It verifies nothing (no checksum); ours CRCs every
                         byte both ways. Target: ratio >= 0.9 (not slower than the library
                         that skips the checksum, within noise).

Fairness: every timed operation starts after ``os.sync()`` (no dirty pages or pending
journal commits from the previous case), and removing what a case wrote happens outside
the timing (our manager runs with ``keep_last=None``: no retention delete is ever timed).
Ours and the baselines alternate within each repeat (order rotated), so disk noise from
other processes hits both; each figure is the median of ``--repeat`` runs.

``--device cuda`` puts the state on the GPU and measures the async stall with pinned
device-to-host staging (fails clearly without CUDA). Prints a table and one JSON object
per case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
from _stopping import stop_on_sigterm

from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.checkpoint.staging import state_nbytes

MiB = 1 << 20


def make_model(nbytes: int, device: str) -> torch.nn.Module:
    """16 bias-free ``Linear(n, n)`` layers holding ``nbytes`` of float32 parameters."""
    torch.manual_seed(0)
    layers = 16
    n = max(8, round(math.sqrt(nbytes / 4 / layers)))
    return torch.nn.Sequential(*[torch.nn.Linear(n, n, bias=False) for _ in range(layers)]).to(
        device
    )


def drop_cache(path: Path) -> None:
    for p in [path] if path.is_file() else list(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        chunk = 16 * MiB
        for i in range(0, len(data), chunk):
            view = data[i : i + chunk]
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save_fsync(state: object, directory: Path) -> None:
    """The careful hand-written baseline: torch.save, fsync, rename, fsync the directory."""
    tmp, final = directory / "plain.pt.tmp", directory / "plain.pt"
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, final)
    fsync_dir(directory)


def _flatten(tree: object, flat: dict[str, torch.Tensor]) -> object:
    """``tree`` as JSON with each tensor replaced by its name in ``flat``."""
    if isinstance(tree, torch.Tensor):
        name = f"t{len(flat)}"
        flat[name] = tree
        return {"T": name}
    if isinstance(tree, dict):
        return {"d": [[_flatten(k, flat), _flatten(v, flat)] for k, v in tree.items()]}
    if isinstance(tree, (list, tuple)):
        return {"l": [_flatten(v, flat) for v in tree]}
    return tree


def _unflatten(node: object, flat: dict[str, torch.Tensor]) -> object:
    if isinstance(node, dict):
        if "T" in node:
            return flat[node["T"]]
        if "d" in node:
            return {_unflatten(k, flat): _unflatten(v, flat) for k, v in node["d"]}
        return [_unflatten(v, flat) for v in node["l"]]
    return node


def safetensors_save(state: object, directory: Path) -> None:
    """The safetensors baseline: flatten, save_file, fsync, rename, fsync the directory."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_flatten(state, flat))
    tmp, final = directory / "state.safetensors.tmp", directory / "state.safetensors"
    save_file(flat, str(tmp), metadata={"tree": skeleton})
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    fsync_dir(directory)


def safetensors_load(path: Path) -> object:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as fh:
        skeleton = json.loads(fh.metadata()["tree"])
    return _unflatten(skeleton, load_file(str(path)))


def run_format(nbytes: int, root: Path, repeat: int) -> list[dict[str, object]]:
    """Our container against safetensors on a training state of ``nbytes`` in total."""
    model = make_model(nbytes // 3, "cpu")  # parameters + Adam's two moments
    opt = torch.optim.Adam(model.parameters(), lr=1e-9)
    model(torch.randn(4, model[0].in_features)).square().mean().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": {"step": 1}}
    size_mib = state_nbytes(state) / MiB  # the project's own count of a tree's bytes
    d = root / f"format{round(size_mib)}"
    (d / "st").mkdir(parents=True)
    mgr = CheckpointManager(d / "ours", keep_last=None)
    step = [0]

    def ours_save() -> None:
        step[0] += 1
        mgr.save(state, step[0])

    def cleanup() -> None:
        for info in mgr.list_checkpoints()[:-1]:
            shutil.rmtree(info.path)
        os.sync()

    t = interleaved({"ours": ours_save, "st": lambda: safetensors_save(state, d / "st")},
                    cleanup, repeat)  # fmt: skip
    rows = [("save_vs_safetensors", size_mib / t["ours"], size_mib / t["st"], ">=", 0.9, "MiB/s")]
    latest = mgr.list_checkpoints()[-1]
    st_file = d / "st" / "state.safetensors"

    def drop() -> None:
        drop_cache(latest.path)
        drop_cache(st_file)

    drop()
    t = interleaved(
        {"ours": lambda: mgr.load(latest.step), "st": lambda: safetensors_load(st_file)},
        drop,
        repeat,
    )
    rows.append(
        ("load_vs_safetensors", size_mib / t["ours"], size_mib / t["st"], ">=", 0.9, "MiB/s")
    )
    mgr.close()
    shutil.rmtree(d)
    return [
        {
            "bench": "checkpoint",
            "case": case,
            "device": "cpu",
            "size_mib": round(size_mib),
            "ours": round(ours, 4),
            "baseline": round(base, 4),
            "unit": unit,
            "ratio": round(ours / base, 3),
            "target": f"{op} {target}",
            "ok": ours / base >= target,
            "baseline_name": f"safetensors {version('safetensors')}",
        }
        for case, ours, base, op, target, unit in rows
    ]


def raw_read(path: Path) -> None:
    buf = bytearray(8 * MiB)
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass


def timed(fn: Callable[[], object]) -> float:
    os.sync()  # start clean: nothing dirty from the previous case is paid here
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(
    cases: dict[str, Callable[[], object]], cleanup: Callable[[], None], repeat: int
) -> dict[str, float]:
    """Median seconds per case; cases alternate (order rotated each repeat)."""
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(cases[name]))
            cleanup()  # untimed
    return {n: statistics.median(t) for n, t in times.items()}


def run_size(
    nbytes: int, root: Path, repeat: int, device: str, batch: int
) -> list[dict[str, object]]:
    model = make_model(nbytes, device)
    state = model.state_dict()
    size_mib = sum(t.numel() * t.element_size() for t in state.values()) / MiB
    d = root / f"size{int(size_mib)}"
    d.mkdir(parents=True)
    ours_dir, plain_dir = d / "ours", d / "plain"
    plain_dir.mkdir()
    mgr = CheckpointManager(ours_dir, keep_last=None)  # no retention inside the timing
    step = [0]

    def ours_save() -> None:
        step[0] += 1
        mgr.save(state, step[0])

    def cleanup() -> None:
        for info in mgr.list_checkpoints()[:-1]:
            shutil.rmtree(info.path)
        for p in plain_dir.iterdir():
            p.unlink()
        os.sync()

    rows = []
    if device == "cpu":
        payload = memoryview(torch.cat([t.view(-1) for t in state.values()]).numpy()).cast("B")
        t = interleaved(
            {
                "ours": ours_save,
                "torch": lambda: torch_save_fsync(state, plain_dir),
                "raw": lambda: raw_write(plain_dir / "raw.bin", payload),
            },
            cleanup,
            repeat,
        )
        del payload
        rows.append(
            ("save_vs_torch_save", size_mib / t["ours"], size_mib / t["torch"], ">=", 0.9, "MiB/s")
        )
        rows.append(("save_vs_raw", size_mib / t["ours"], size_mib / t["raw"], ">=", 0.8, "MiB/s"))

    # Async stall inside a training loop. The first async save allocates the staging
    # buffers (and pinned memory on CUDA): measure the steady state.
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    x = torch.randn(batch, model[0].in_features, device=device)

    def train_step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    def async_iteration() -> float:
        step[0] += 1
        mgr.save(model.state_dict(), step[0], blocking=False)
        train_step()
        mgr.flush()
        if device == "cuda":
            torch.cuda.synchronize()
        return mgr.last_stall_seconds or 0.0

    async_iteration()
    cleanup()
    stalls, blocking, steps = [], [], []
    for _ in range(repeat):
        step[0] += 1
        blocking.append(timed(lambda: mgr.save(model.state_dict(), step[0])))
        cleanup()
        steps.append(timed(train_step))
        os.sync()
        stalls.append(async_iteration())
        cleanup()
    rows.append(
        ("async_stall", statistics.median(stalls), statistics.median(blocking), "<=", 0.05, "s")
    )
    step_s = statistics.median(steps)

    if device == "cpu":
        latest = mgr.list_checkpoints()[-1]
        if latest.manifest is None:
            raise RuntimeError(f"{latest.path} has no readable manifest")
        state_file = latest.path / latest.manifest.files[0].name

        def drop() -> None:
            drop_cache(latest.path)

        drop()
        t = interleaved(
            {
                "ours": lambda: mgr.load(latest.step),
                "copy": lambda: mgr.load(latest.step, mmap=False),
                "raw": lambda: raw_read(state_file),
            },
            drop,
            repeat,
        )
        rows.append(("load_vs_raw", size_mib / t["ours"], size_mib / t["raw"], ">=", 0.8, "MiB/s"))
        rows.append(
            ("load_copy_vs_raw", size_mib / t["copy"], size_mib / t["raw"], ">=", 0.8, "MiB/s")
        )
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
                "device": device,
                "size_mib": round(size_mib),
                "ours": round(ours, 4),
                "baseline": round(base, 4),
                "unit": unit,
                "ratio": round(ratio, 3),
                "target": f"{op} {target}",
                "ok": ok,
                **(
                    {"train_step_s": round(step_s, 4), "batch": batch}
                    if case == "async_stall"
                    else {}
                ),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (8, 32 MiB), < 3 minutes")
    ap.add_argument("--sizes-mib", type=int, nargs="*", help="override state sizes")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory to write into (default: a temp dir)")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the state lives; cuda measures pinned device-to-host staging",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--batch", type=int, default=16, help="samples per training step in the stall case"
    )
    args = ap.parse_args(argv)
    stop_on_sigterm()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); run on a GPU node or use --device cpu",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(args.threads)
    sizes = args.sizes_mib or ([8, 32] if args.quick else [8, 64, 1024])
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    results = []
    try:
        for size in sizes:
            results.extend(run_size(size * MiB, root, args.repeat, args.device, args.batch))
            if args.device == "cpu":
                results.extend(run_format(size * MiB, root, args.repeat))
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
