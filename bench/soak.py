"""Soak: many consecutive membership changes in one run; nothing may leak.

One run id, two real agents on this machine (``slurm-elastic agent``, no Slurm: the
membership machinery is the same; Slurm only starts the agents): agent A runs all the
time, agent B joins and leaves (SIGTERM: it stops its workers and leaves the
rendezvous) in turn. Every join and every leave is one membership change of A's run:
on the **restart** path A's workers are restarted from the newest checkpoint (a new
worker process each time); on the **in-place** path (issue #11; ``examples/train_ddp.py``
runs on ``ElasticLoop`` since it was merged) A's worker process stays and only re-forms
its group. ``--path restart|in-place`` selects the path (``restart`` sets
``SLURM_ELASTIC_IN_PLACE=0``) and asserts which one happened (``worker_processes``);
without it the script's default path runs and the count is reported. ``--entrypoint`` picks another training script with
train_ddp's command line.

After each change, once A's worker trains again, it samples A and its workers:

* ``agent_rss_mb``, ``worker_rss_mb``: resident memory (``VmRSS``);
* ``agent_fds``, ``agent_threads``: open descriptors and threads of A;
* ``agent_children``: A's live child processes (its worker: exactly 1);
* ``rdzv_state_files`` (capped: the backend keeps two segments of 64 generations), ``rdzv_hb_files``
  (only live agents'), ``rdzv_other_files`` (head, meta, store), ``checkpoint_entries``
  (``keep_last=3``; no leftover ``.tmp-step_*``).

The **baseline** of each case is the median of its first quarter of samples (after two
warm-up changes), **ours** the median of the last quarter, in the same run, each taken
over the samples of one phase (B present or gone: B's connections and files come and
go with it), the phase where the case grew most: a leak
shows as ours > baseline. Targets: memory ratio <= 1.10; counts at most baseline + a
small slack. ``leftover_processes`` (baseline 0): processes of the run alive after both
agents exited; ``events_files``: each agent merges the files of its node's gone processes
into the node's archive (``slurm_elastic.events.compact``), so the directory holds the
archive and the files of live processes (and of those that just left); ``rdzv_key_files``:
one per job allocation (Slurm's job id; restarts replace it), none for local agents.
Every count is judged.

Prints a table and one JSON object per case (keys bench, case, ours, baseline, ratio,
target, ok, unit, changes, path). ``--quick``: 12 changes (~2-3 min on an idle 2-core
machine); default 100.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _stopping import stop_on_sigterm

from slurm_elastic.rendezvous.backend import SEGMENT

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_ddp.py"
RUN_ID = "soak"

# memory: ratio target; counts: allowed growth over the baseline
MEMORY_TARGET = 1.10
COUNT_SLACK = {
    # the rendezvous backend caches descriptors of up to 3 state segments (2 each, one per
    # backend object: rendezvous/backend.py) where the first quarter had 1: up to +4
    "agent_fds": 4,
    "agent_threads": 2,
    "agent_children": 0,
    "rdzv_other_files": 1,
    "checkpoint_entries": 1,
    "events_files": 1,
    "rdzv_key_files": 0,
}
# absolute caps (by design): the backend keeps the current and the previous segment of
# state generations (2 x SEGMENT files, slurm_elastic/rendezvous/backend.py); heartbeat
# files only of live agents (2, +1 leaving)
CAPS = {"rdzv_state_files": 2 * SEGMENT, "rdzv_hb_files": 3}


#: The sample's phase: B present (world 2) or gone (world 1); counts differ by design
#: between the two (B's connections), so a quarter is compared with the same phase only.
WORLD = "world"
#: ... and whether A's node is rank 0, the host of the round's store (a TCPStore server:
#: its thread, listener and connections, 11 descriptors here). Rank 0 is the node with
#: the lowest pid on one host, and pids wrap (at 32,768 here): in a 646-change run A
#: hosted the store in its first 19 rounds with B, in 4 of the next 262 and in the last
#: 42, so its descriptors went 34-38 -> 26-27 -> 37-38 with nothing leaking.
HOSTS_STORE = "a_hosts_store"


def _phase_medians(
    case: str, first: list[dict[str, float]], last: list[dict[str, float]]
) -> tuple[float, float]:
    """(baseline, ours) of ``case``: the first and last quarter's medians in the phase
    (world size, and whether A hosts the store) where it grew most; both quarters'
    medians if no phase is in both."""

    def phase(s: dict[str, float]) -> tuple[float, float | None]:
        return s[WORLD], s.get(HOSTS_STORE)

    pairs = []
    for key in {phase(s) for s in first} & {phase(s) for s in last}:
        base = statistics.median(s[case] for s in first if phase(s) == key)
        ours = statistics.median(s[case] for s in last if phase(s) == key)
        pairs.append((ours - base, base, ours))
    if not pairs:
        return statistics.median(s[case] for s in first), statistics.median(s[case] for s in last)
    _, base, ours = max(pairs)
    return base, ours


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def _mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            pids.append(int(entry))
    return pids


def _count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root)) if root.exists() else 0


@dataclass
class Soak:
    """Two agents of one run on this machine; B joins and leaves ``changes`` times."""

    tmp: Path
    changes: int
    path: str | None = None
    entrypoint: Path = TRAIN

    def __post_init__(self) -> None:
        self.state = self.tmp / "state"
        self.events_dir = self.state / "events" / RUN_ID
        self.ckpt_dir = self.state / "checkpoints" / RUN_ID
        self.samples: list[dict[str, float]] = []
        self.worker_pids: list[int] = []

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        return {
            **env,
            "OMP_NUM_THREADS": "1",
            "SLURM_ELASTIC_HEARTBEAT_INTERVAL_S": "0.5",
            "SLURM_ELASTIC_HEARTBEAT_MISS_LIMIT": "4",
            "SLURM_ELASTIC_LAST_CALL_TIMEOUT_S": "1",
            "SLURM_ELASTIC_MONITOR_INTERVAL_S": "0.2",
            "SLURM_ELASTIC_SHUTDOWN_TIMEOUT_S": "30",
            "SLURM_ELASTIC_MAX_RESTARTS": "1000",
            # --path restart: the same script on the restart path (ElasticLoop's switch)
            **({"SLURM_ELASTIC_IN_PLACE": "0"} if self.path == "restart" else {}),
        }

    def _agent(self, name: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "-m", "slurm_elastic.cli.main", "agent",
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-id", RUN_ID,
            "--state-dir", str(self.state), str(self.entrypoint),
            "--steps", "100000000", "--dataset-size", "400", "--global-batch", "16",
            "--save-every", "10", "--step-time", "0.05", "--leave-wait", "30",
            "--ledger", str(self.tmp / "ledger.jsonl"),
        ]  # fmt: skip
        log = open(self.tmp / f"agent-{name}.log", "ab")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(argv, env=self._env(), stdout=log, stderr=subprocess.STDOUT)

    def _wait_training(
        self, agent: int, world: int, since: float, timeout: float
    ) -> tuple[int, int | None]:
        """Wait until a worker of ``agent`` trains in a world of ``world``: its pid and
        rank, from its step records in the ledger (both paths write them). Only the
        file's last 64 KB are read, whatever the run's length: reading the whole event
        log at each poll made the changes slower as the log grew (5.7 -> 10 s per change
        by the 640th)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = set(_children(agent))
            for rec in reversed(self._ledger_tail()):
                if (
                    rec.get("world") == world
                    and rec.get("time", 0) >= since
                    and rec.get("pid") in kids
                ):
                    rank = rec.get("rank")
                    return int(rec["pid"]), rank if isinstance(rank, int) else None
            time.sleep(0.1)
        raise TimeoutError(f"agent {agent}'s worker did not train at world {world} in {timeout} s")

    def _ledger_tail(self) -> list[dict[str, Any]]:
        path = self.tmp / "ledger.jsonl"
        if not path.exists():
            return []
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - (64 << 10)))
            lines = fh.read().decode(errors="replace").splitlines()[1:]
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def _sample(self, agent: int) -> dict[str, float]:
        kids = _children(agent)
        return {
            "agent_rss_mb": _status(agent, "VmRSS") / 1024,
            "worker_rss_mb": sum(_status(k, "VmRSS") for k in kids) / 1024,
            "agent_fds": len(os.listdir(f"/proc/{agent}/fd")),
            "agent_threads": _status(agent, "Threads"),
            "agent_children": len(kids),
            **self._rdzv_counts(),
            "checkpoint_entries": len(list(self.ckpt_dir.iterdir()))
            if self.ckpt_dir.exists()
            else 0,
            "events_files": _count_files(self.events_dir),
        }

    def _rdzv_counts(self) -> dict[str, float]:
        counts = {
            "rdzv_state_files": 0,
            "rdzv_hb_files": 0,
            "rdzv_key_files": 0,
            "rdzv_other_files": 0,
        }
        root = self.state / "rdzv"
        for path in root.rglob("*") if root.exists() else []:
            if not path.is_file():
                continue
            if path.name.startswith("state."):
                counts["rdzv_state_files"] += 1
            elif path.parent.name == "hb":
                counts["rdzv_hb_files"] += 1
            elif path.parent.name == "keys":
                counts["rdzv_key_files"] += 1
            else:
                counts["rdzv_other_files"] += 1
        return counts

    def run(self, progress: bool = False) -> list[dict[str, Any]]:
        a = self._agent("a")
        b: subprocess.Popen[bytes] | None = None
        try:
            self.worker_pids.append(self._wait_training(a.pid, 1, 0, 300)[0])
            for i in range(self.changes):
                t0 = time.time()
                if b is None:
                    b, world = self._agent(f"b{i}"), 2
                else:
                    b.send_signal(signal.SIGTERM)
                    b.wait(timeout=120)
                    b, world = None, 1
                worker, rank = self._wait_training(a.pid, world, t0, 300)
                self.worker_pids.append(worker)
                time.sleep(0.5)  # let the new worker settle into its loop
                hosts = None if rank is None else float(rank == 0)  # one worker per node
                self.samples.append({**self._sample(a.pid), WORLD: world, HOSTS_STORE: hosts})
                if progress:
                    print(
                        f"change {i + 1}/{self.changes}: world {world} {self.samples[-1]}",
                        flush=True,
                    )
        finally:
            for proc in (b, a):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in (b, a):
                if proc is not None:
                    try:
                        proc.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        deadline = time.monotonic() + 30
        while _mentioning(str(self.tmp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.results(len(_mentioning(str(self.tmp))))

    def results(self, leftover: int) -> list[dict[str, Any]]:
        warm = self.samples[2:] if len(self.samples) > 6 else self.samples
        # at least 2 samples a quarter where there are 4: both phases in each quarter
        quarter = max(2 if len(warm) >= 4 else 1, len(warm) // 4)
        rows: list[dict[str, Any]] = []
        first, last = warm[:quarter], warm[-quarter:]
        for case in (c for c in self.samples[0] if c not in (WORLD, HOSTS_STORE)):
            base, ours = _phase_medians(case, first, last)
            ratio = ours / base if base else (1.0 if ours == base else float("inf"))
            if case.endswith("_mb"):
                target, ok = f"<= {MEMORY_TARGET}x", ratio <= MEMORY_TARGET
            elif case in CAPS:
                ours = max(s[case] for s in self.samples)
                base, ratio = CAPS[case], ours / CAPS[case]
                target, ok = f"<= {CAPS[case]} (cap)", ours <= CAPS[case]
            elif case in COUNT_SLACK:
                target, ok = f"<= +{COUNT_SLACK[case]}", ours <= base + COUNT_SLACK[case]
            else:  # every count is judged
                raise KeyError(f"soak: no target for {case!r}")
            rows.append(
                self._row(
                    case, ours, base, ratio, target, ok, "MiB" if case.endswith("_mb") else "count"
                )
            )
        # the path: restart gives a new worker process per change, in-place keeps it
        distinct = len(set(self.worker_pids))
        expect = len(self.worker_pids) if self.path == "restart" else 1
        rows.append(
            self._row(
                "worker_processes",
                distinct,
                expect,
                distinct / expect,
                f"== {expect}",
                distinct == expect,
                "count",
            )
        )
        rows.append(
            self._row(
                "leftover_processes",
                leftover,
                0,
                0.0 if not leftover else float("inf"),
                "== 0",
                leftover == 0,
                "count",
            )
        )
        return rows

    def _row(
        self, case: str, ours: float, base: float, ratio: float, target: str, ok: bool, unit: str
    ) -> dict[str, Any]:
        return {
            "bench": "soak",
            "case": case,
            "ours": round(float(ours), 3),
            "baseline": round(float(base), 3),
            "ratio": round(ratio, 3) if ratio != float("inf") else None,
            "target": target,
            "ok": bool(ok),
            "unit": unit,
            "changes": self.changes,
            "path": self.path,
        }


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'case':<22}{'ours':>10}{'baseline':>10}{'ratio':>8}{'target':>12}  ok")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(
            f"{r['case']:<22}{r['ours']:>10}{r['baseline']:>10}{ratio:>8}{r['target']:>12}  {r['ok']}"
        )
    for r in rows:
        print(json.dumps(r))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 changes instead of 100")
    parser.add_argument("--changes", type=int, default=None)
    parser.add_argument(
        "--path",
        choices=("restart", "in-place"),
        default=None,
        help="assert this path (restart: a new worker per change; in-place: one worker)",
    )
    parser.add_argument("--entrypoint", type=Path, default=TRAIN, help="the training script")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args()
    stop_on_sigterm()
    changes = args.changes or (12 if args.quick else 100)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        soak = Soak(Path(tmp), changes, args.path, args.entrypoint)
        rows = soak.run(progress=args.progress)
    print_rows(rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
