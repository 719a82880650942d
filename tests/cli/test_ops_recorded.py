"""status, logs and timeline on a recorded events directory (tests/data/events/local-run):
3 local agents, agent 17528 preempted, the two others went on at 2 nodes, a
replacement agent (17787) joined and the world grew back to 3; 300 steps, completed.
The recording has a torn last line and one event of a kind from a newer version.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from slurm_elastic import events as ev
from slurm_elastic.cli.main import main
from slurm_elastic.cli.runs import locate
from slurm_elastic.cli.status import collect
from slurm_elastic.cli.summary import STATUS_SCHEMA

REPO = Path(__file__).resolve().parent.parent.parent
RUN = "local-8f6892ca29"


def _status_json(job: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["status", job, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_table_shows_nodes_world_checkpoint_progress_and_throughput(
    recorded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", str(recorded_run)]) == 0
    out = capsys.readouterr().out
    assert f"run {RUN}   state COMPLETED" in out
    assert "world 3 node(s) / 3 worker(s)" in out
    assert "step 300/300" in out and "100%" in out
    assert re.search(r"throughput \d+\.\d\d steps/s, \d+\.\d samples/s", out)
    assert re.search(r"last checkpoint step 300, .* ago", out)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("vm:")}
    assert {k: v[2:4] for k, v in rows.items()} == {
        "vm:17527": ["-", "finished"],
        "vm:17528": ["-", "preempted"],
        "vm:17529": ["-", "finished"],
        "vm:17787": ["-", "finished"],
    }
    assert rows["vm:17527"][5] == "2"  # restarted when the world shrank and when it grew
    assert "1 event(s) of kinds this version does not know" in out


def test_status_json_follows_the_documented_schema(
    recorded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _status_json(str(recorded_run), capsys)
    documented = (REPO / "docs" / "operability.md").read_text()
    table = documented.split("### `--json` schema", 1)[1].split("## logs", 1)[0]
    keys = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert keys == list(doc) or sorted(keys) == sorted(doc)
    assert doc["schema"] == STATUS_SCHEMA == "slurm-elastic.status/1"
    assert (doc["run_id"], doc["state"], doc["round"]) == (RUN, "COMPLETED", 2)
    assert doc["world"] == {"nodes": 3, "workers": 3}
    assert doc["progress"] == {"step": 300, "total_steps": 300, "fraction": 1.0}
    assert doc["throughput"]["steps_per_s"] > 1 and doc["throughput"]["samples_per_s"] > 16
    assert doc["checkpoint"]["step"] == 300 and doc["checkpoint"]["age_s"] >= 0
    assert doc["counts"]["preemptions"] == 1 and doc["counts"]["unknown_events"] == 1
    assert doc["counts"]["restarts"] == 4 and doc["counts"]["checkpoints"] == 7
    assert doc["ended"] >= doc["started"] and doc["elapsed_s"] == pytest.approx(80, abs=2)
    assert doc["slurm"] is None
    node_keys = {
        "node",
        "host",
        "job",
        "state",
        "rank",
        "restarts",
        "requeues",
        "last_heartbeat",
        "last_heartbeat_age_s",
    }
    assert all(set(n) == node_keys for n in doc["nodes"])
    for name in re.findall(r"`(\w+)`", table.split("| `nodes` |", 1)[1].split("\n", 1)[0]):
        assert name in node_keys


def test_events_dir_and_run_index_id_find_the_same_run(
    recorded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    by_state = _status_json(str(recorded_run), capsys)
    by_events = _status_json(str(recorded_run / "events" / RUN), capsys)
    ev.record_run(RUN, state_dir=recorded_run, events_dir=recorded_run / "events" / RUN)
    by_id = _status_json(RUN, capsys)
    for doc in (by_events, by_id):
        assert doc["nodes"] == by_state["nodes"] or len(doc["nodes"]) == 4
        assert doc["progress"] == by_state["progress"]


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ("987654321", "no run '987654321': not in the run index"),
        ("/nonexistent/run", "'/nonexistent/run': no such directory"),
        ("bad id!", "is neither a Slurm job id"),
    ],
)
def test_a_wrong_job_is_one_line_and_exit_2(
    job: str, message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no Slurm commands: the index is all there is
    assert main(["status", job]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_directory_without_events_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", str(tmp_path)]) == 2
    assert "is no run directory" in capsys.readouterr().err


def test_logs_prefix_every_line_and_filter_by_rank_and_node(
    recorded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["logs", str(recorded_run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(re.match(r"^\[vm:\d+ rank \d #\d( err)?\] ", line) for line in lines)
    # rank 0 printed the step lines; its node took part in 3 rounds (3 attempts)
    assert {
        m.group(1) for m in map(re.compile(r"^\[vm:17527 rank 0 #(\d)\] step").match, lines) if m
    } == {"1", "2", "3"}
    assert any(line.startswith("[vm:17527 rank 0 #3] step 300 loss") for line in lines)
    assert main(["logs", str(recorded_run), "--rank", "1"]) == 0  # rank 1 prints nothing
    assert capsys.readouterr().out == ""
    assert main(["logs", str(recorded_run), "--rank", "0", "--node", "vm:17527"]) == 0
    assert capsys.readouterr().out.splitlines() == lines  # only rank 0 (on 17527) printed
    assert main(["logs", str(recorded_run), "--node", "vm:17529"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["logs", str(recorded_run), "--follow"]) == 0  # the run ended: it returns
    assert capsys.readouterr().out.splitlines() == lines
    assert main(["logs", str(recorded_run), "--node", "nosuch"]) == 1
    assert "no logs for run" in capsys.readouterr().err


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_timeline_draws_lanes_marks_world_and_throughput(
    recorded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = collect(locate(str(recorded_run)), slurm=False)
    lanes = {key: [(iv.world_nodes) for iv in n.intervals] for key, n in summary.nodes.items()}
    assert lanes == {"vm:17527": [3, 2, 3], "vm:17528": [3], "vm:17529": [3, 2, 3], "vm:17787": [3]}
    assert [n for _, n in summary.world_series] == [3, 2, 3, 0]
    assert sorted({what for _, _, what in summary.marks}) == ["checkpoint", "preempt", "restart"]
    assert len([r for _, r in summary.throughput_series if r == r]) > 10
    out = tmp_path / "t.png"
    assert main(["timeline", str(recorded_run), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    width, height = _png_size(out)
    assert width > 800 and height > 500


def test_timeline_into_a_missing_directory_is_one_line_and_exit_2(
    recorded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["timeline", str(recorded_run), "-o", str(tmp_path / "no" / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1
