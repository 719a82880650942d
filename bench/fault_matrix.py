"""Run the fault matrix (tests/faults/) and rewrite its table in docs/reliability.md.

    python bench/fault_matrix.py                 # run the matrix on both paths, rewrite the table
    python bench/fault_matrix.py --path in-place # one path (the other column: "not run")
    python bench/fault_matrix.py --from-junit in-place=X.xml restart=Y.xml  # only rewrite
    python bench/fault_matrix.py -k array        # a subset (pytest -k); other rows keep "not run"

Two membership paths (``FAULTS_PATH``, tests/faults/harness.py): **in place** (the
examples run on ``ElasticLoop``: survivors re-form without restarting their workers) runs
every case; **restart** (``SLURM_ELASTIC_IN_PLACE=0``: every membership change restarts
the workers, the path of scripts that do not opt in) runs the cases whose outcome depends
on the path (:data:`RESTART_K`: the array carrier job and the time limit); the other
cases do not involve a membership change of running workers and show "same" there.

The table lies between ``<!-- fault-matrix:begin -->`` and ``<!-- fault-matrix:end -->``;
everything else in the file is left alone. One row per case: the fault, what must hold,
the result of this run on each path (pass / FAIL / xfail / skipped with its reason) and
the time.
Needs the local Slurm cluster (``source /var/tmp/slurm-elastic-cluster/env``); run it
from the repository root with the package importable (``PYTHONPATH=$PWD``).
Prints one JSON line per case (keys bench, case, ours, baseline, ratio, target, ok).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from _stopping import run_child, stop_on_sigterm

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"
PATHS = ("in-place", "restart")
#: The cases run on the restart path too (pytest -k): those where the path matters.
RESTART_K = "test_array_fault or test_time_limit"
#: Tests that run both paths themselves (parametrized): one row, in the in-place column.
BOTH_PATHS_IN_ONE = frozenset({"test_soak.py::test_soak_small"})

# test id (file::name[param]) -> (fault, what is checked beyond the invariants)
CASES: dict[str, tuple[str, str]] = {
    "test_array_faults.py::test_array_fault[worker_sigkill]": (
        "worker SIGKILL",
        "its agent restarts it; the others restart from the newest checkpoint (restart) or "
        "re-form in place around it (in place); never from step 0",
    ),
    "test_array_faults.py::test_array_fault[kill_during_checkpoint_write]": (
        "SIGKILL of rank 0 in the middle of a checkpoint write",
        "the partial `.tmp-step_*` is never loaded; resume from a committed step (restart) "
        "or from the survivors' commit (in place)",
    ),
    "test_array_faults.py::test_array_fault[corrupted_newest_checkpoint]": (
        "newest checkpoint corrupted (one byte flipped), then all workers killed",
        "it is skipped (`checkpoint.skipped`), resume from the one before",
    ),
    "test_array_faults.py::test_array_fault[usr2_preemption]": (
        "graceful preemption by USR2 (`scancel --signal=USR2 --batch`)",
        "workers save (restart) or leave at the survivors' switch (in place); the task "
        "requeues itself and rejoins",
    ),
    "test_array_faults.py::test_array_fault[sigterm_preemption]": (
        "SIGTERM to one task (`scancel --signal=TERM --batch`)",
        "workers save or leave in place; agent exits TERMINATED (5), survivors go on; "
        "requeued by hand, it rejoins",
    ),
    "test_array_faults.py::test_array_fault[scontrol_requeue_task]": (
        "`scontrol requeue` of one array task",
        "survivors go on at 2; the task comes back and rejoins",
    ),
    "test_array_faults.py::test_array_fault[agent_sigkill]": (
        "SIGKILL of an agent (not the store host)",
        "survivors re-form at 2 (evicted at once: its link closed); requeued by hand, it rejoins",
    ),
    "test_array_faults.py::test_array_fault[store_host_agent_sigkill]": (
        "SIGKILL of the agent hosting the workers' store",
        "survivors re-form at 2 on a new store; requeued by hand, it rejoins",
    ),
    "test_array_faults.py::test_array_fault[frozen_node]": (
        "a frozen node: one task's agent and worker SIGSTOPped, sockets open (silent loss)",
        "survivors train at 2 within the eviction window + 5 s (heartbeat eviction, blocked "
        "collective aborted in place); thawed, it rejoins",
    ),
    "test_array_faults.py::test_array_fault[frozen_store_host]": (
        "the agent hosting the workers' store frozen with its worker (SIGSTOP: its kernel "
        "still accepts connections nobody answers)",
        "survivors train at 2 within the eviction window + 5 s on a new store, never waiting "
        "on the frozen one; thawed, it rejoins",
    ),
    "test_array_faults.py::test_array_fault[partitioned_node]": (
        "a partitioned node: its link set down (it runs and reaches the shared filesystem, "
        "not its peers)",
        "evicted by its peers' unanswered pings (cause unreachable), survivors train at 2 "
        "within the eviction window + 5 s; its link back, it rejoins",
    ),
    "test_array_faults.py::test_array_fault[high_partition_preemption]": (
        "preemption by a `high`-partition job (`-w node --exclusive`)",
        "USR2 notice: workers save, the task requeues itself and rejoins",
    ),
    "test_array_faults.py::test_array_fault[node_down]": (
        "a node set DOWN (`scontrol update NodeName=… State=DOWN`)",
        "Slurm requeues its task; survivors go on; it rejoins",
    ),
    "test_array_faults.py::test_array_fault[scancel_task]": (
        "`scancel` of one array task",
        "survivors finish the run; that task ends CANCELLED",
    ),
    "test_array_faults.py::test_array_fault[scontrol_missing_slurm_requeues]": (
        "`scontrol` missing from PATH in the job (as in a container), task preempted by a `high` job",
        "clear `'scontrol' was not found on PATH` in the log; Slurm's own requeue brings it back",
    ),
    "test_storage_faults.py::test_storage_fault[stale_rendezvous_dir]": (
        "stale rendezvous directory of an earlier (SIGKILLed) job, same run id and root",
        "the new job starts and trains; it does not join the dead era",
    ),
    "test_storage_faults.py::test_storage_fault[enospc_checkpoint_dir]": (
        "ENOSPC on the checkpoint directory (small tmpfs filled mid-run)",
        "`checkpoint.failed` names the cause; saved checkpoints intact; completes once space is back",
    ),
    "test_shared_root.py::test_two_jobs_with_different_run_ids_share_a_root": (
        "two jobs, one rendezvous root, different run ids",
        "both complete, each exact",
    ),
    "test_shared_root.py::test_a_second_job_with_the_same_run_id_is_refused_clearly": (
        "two jobs, one rendezvous root, the same run id",
        "the second is refused (exit 2, `RunIdInUseError` names the run id); the first is undisturbed",
    ),
    "test_time_limit.py::test_time_limit_notice_checkpoints_and_requeues": (
        "the time limit (`--time=2 --signal=B:USR2@45`)",
        "Slurm's notice: checkpoint, requeue, resume from it, complete",
    ),
    "test_time_limit.py::test_a_notice_during_start_up_does_not_lose_the_task": (
        "a notice (USR2) during start-up, before the agent's handler exists",
        "the task is not lost: it completes",
    ),
    "test_slurmctld_restart.py::test_training_survives_a_slurmctld_restart": (
        "slurmctld restarted mid-run",
        "training goes on; a requeue after the restart still works",
    ),
    "test_config_errors.py::test_malformed_value_inside_a_job_fails_fast_and_clearly": (
        "malformed `SLURM_ELASTIC_*` value inside a job",
        "agent exits USAGE (2) at once, message names key and value, not requeued",
    ),
    "test_config_errors.py::test_malformed_config_or_flag_is_one_clear_line": (
        "malformed job file / flag / env (7 variants)",
        "exit 2, one line naming key, value and fix, no traceback",
    ),
    "test_config_errors.py::test_a_bad_value_in_a_job_file_is_attributed_to_the_file": (
        "a bad value in a job file (`submit job.yaml`)",
        "the message names the file, not 'the command line'",
    ),
    "test_agent_signals.py::test_a_notice_before_the_agent_handles_it_is_held_then_acted_on": (
        "a notice (USR2) during the job script's `setup`, or while the agent imports torch "
        "(no Slurm, the real rendered script; 2 variants)",
        "not fatal, not lost: the agent acts on it once its handler exists",
    ),
    "test_agent_signals.py::test_a_failed_self_requeue_waits_for_slurms_sigterm": (
        "the agent's own requeue fails (`scontrol` not on PATH) after a notice (no Slurm)",
        "one clear message; the agent stays until Slurm's SIGTERM, then exits PREEMPTED (4)",
    ),
    "test_soak.py::test_soak_small": (
        "soak: consecutive membership changes (small version of bench/soak.py), both paths",
        "no growth in RSS, fds, threads, children, rendezvous, checkpoint and event files",
    ),
}

INVARIANTS = (
    "Every Slurm case also asserts the end invariants: the job completed; the newest "
    "checkpoint is the last step and verifies (`load_latest`); every sample used exactly "
    "once per epoch (ledger); final parameters within 2e-6 of an uninterrupted run; none "
    "of the run's jobs left in the queue and none of its processes alive. Column s: "
    "seconds of the test; a job that carries several cases counts on its first case."
)


def _key(testcase: ET.Element) -> str:
    file = testcase.get("classname", "").rsplit(".", 1)[-1] + ".py"
    name = testcase.get("name", "")
    base = re.sub(r"\[.*\]$", "", name)
    if base in (
        "test_malformed_config_or_flag_is_one_clear_line",
        "test_a_notice_before_the_agent_handles_it_is_held_then_acted_on",
        "test_soak_small",
    ):
        name = base  # one row for its variants
    return f"{file}::{name}"


def _reason(fail: ET.Element) -> str:
    """The failure's own reason: the innermost error line (not the carrier's wrapper)."""
    text = f"{fail.get('message') or ''}\n{fail.text or ''}"
    if "not reached:" in text:
        return "not reached: " + text.split("not reached:", 1)[1].strip().splitlines()[0]
    errors = [
        line.strip().removeprefix("E").strip()
        for line in text.splitlines()
        if re.match(r"^E?\s*\w*(Error|Exception): ", line) and "failed:" not in line
    ]
    return (errors[-1] if errors else (fail.get("message") or ""))[:200]


def parse_junit(path: Path) -> dict[str, tuple[str, float, str]]:
    """test key -> (result, seconds, detail); variants of one row are merged."""
    results: dict[str, tuple[str, float, str]] = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        key = _key(tc)
        seconds = float(tc.get("time", 0))
        if (skip := tc.find("skipped")) is not None:
            kind = (
                "xfail"
                if "xfail" in (skip.get("type", "") + skip.get("message", ""))
                else "skipped"
            )
            result, detail = kind, skip.get("message", "")
        elif (fail := tc.find("failure")) is not None or (fail := tc.find("error")) is not None:
            result, detail = "FAIL", _reason(fail)
        else:
            result, detail = "pass", ""
        if key in results:
            old = results[key]
            worst = old[0] if old[0] != "pass" else result
            results[key] = (worst, old[1] + seconds, old[2] or detail)
        else:
            results[key] = (result, seconds, detail)
    return results


def _cell(result: tuple[str, float, str] | None) -> str:
    if result is None:
        return "not run"
    outcome, _seconds, detail = result
    shown = outcome if not detail or outcome == "pass" else f"{outcome}: {detail}"
    return shown.replace("|", "/").replace("\n", " ")


def table(results: dict[str, dict[str, tuple[str, float, str]]], when: str) -> str:
    """The markdown table; ``results``: path -> test key -> (result, seconds, detail)."""
    lines = [
        f"Last run: {when}. {INVARIANTS}",
        "",
        "| fault | also checked | in place | restart | s (in place / restart) |",
        "|---|---|---|---|---|",
    ]
    restart_run = "restart" in results
    keys = list(CASES) + sorted({k for r in results.values() for k in r} - set(CASES))
    for key in keys:
        fault, checked = CASES.get(key, (f"`{key}`", "(not described)"))
        cells, times = [], []
        for path in PATHS:
            got = results.get(path, {}).get(key)
            if got is None and path == "restart" and key in BOTH_PATHS_IN_ONE:
                cells.append("(both paths in one test: in-place column)")
            elif got is None and path == "restart" and restart_run:
                cells.append("same (path-independent)")
            else:
                cells.append(_cell(got))
            times.append(f"{got[1]:.0f}" if got else "-")
        lines.append(f"| {fault} | {checked} | {cells[0]} | {cells[1]} | {' / '.join(times)} |")
    return "\n".join(lines)


def rewrite(doc: Path, body: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: markers {BEGIN} / {END} not found; add them where the table goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def _run(path: str, k: str | None) -> Path:
    """Run tests/faults on ``path`` (pytest -k ``k``); the junit file."""
    junit = Path(tempfile.mkdtemp(prefix=f"fault-matrix-{path}-")) / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", str(REPO / "tests" / "faults"), "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "-o", "junit_family=xunit2"]  # fmt: skip
    if k:
        cmd += ["-k", k]
    env = {
        **os.environ,
        "SLURM_ELASTIC_FAULTS": "1",
        "FAULTS_PATH": path,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    print(f"== fault matrix, {path} path: {' '.join(cmd[3:])}", flush=True)
    run_child(cmd, cwd=REPO, env=env)  # stopped: pytest gets SIGTERM first
    return junit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--from-junit",
        nargs="+",
        metavar="[PATH=]FILE",
        help="rewrite from these junit XML files (PATH: in-place (default) or restart), run nothing",
    )
    parser.add_argument("--path", choices=(*PATHS, "both"), default="both")
    parser.add_argument("-k", default=None, help="pytest -k expression (a subset)")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args()
    stop_on_sigterm()
    junits: list[tuple[str, Path]] = []
    if args.from_junit:
        for item in args.from_junit:
            path, sep, file = item.partition("=")
            if not sep:
                path, file = "in-place", item
            if path not in PATHS:
                parser.error(f"--from-junit {item!r}: the path must be one of {', '.join(PATHS)}")
            junits.append((path, Path(file)))
    else:
        for path in PATHS if args.path == "both" else (args.path,):
            k = args.k
            if path == "restart":
                k = f"({RESTART_K}) and ({k})" if k else RESTART_K
            junits.append((path, _run(path, k)))
    results: dict[str, dict[str, tuple[str, float, str]]] = {}
    for path, junit in junits:
        if junit.exists():
            results.setdefault(path, {}).update(parse_junit(junit))
    if not results:
        raise SystemExit("no junit results: pytest did not run")
    newest = max(j.stat().st_mtime for _, j in junits if j.exists())
    when = dt.datetime.fromtimestamp(newest, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rewrite(args.doc, table(results, when))
    for path, per_path in results.items():
        for key, (result, seconds, _detail) in per_path.items():
            ok = result in ("pass", "xfail")
            print(json.dumps({"bench": "fault_matrix", "case": f"{path}:{key}", "ours": result,
                              "baseline": "pass", "ratio": None, "target": "pass", "ok": ok,
                              "seconds": round(seconds, 1), "path": path}))  # fmt: skip
    every = [r[0] for per_path in results.values() for r in per_path.values()]
    return 0 if all(r in ("pass", "xfail", "skipped") for r in every) else 1


if __name__ == "__main__":
    sys.exit(main())
