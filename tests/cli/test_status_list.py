"""``slurm-elastic status`` without a job: the runs of the per-user run index, newest
first, each read as ``status RUN`` reads it (the recorded local run of
``tests/data/events/local-run``; the index entries written by the agents' own
:func:`record_run`). A real local run is listed in ``test_ops_local_run.py``."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from slurm_elastic import events as ev
from slurm_elastic.cli.main import main

RUN = "local-8f6892ca29"


def _record(run_id: str, state: Path) -> None:
    ev.record_run(run_id, state_dir=state, events_dir=state / "events" / run_id)


def _lines(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert main(["status", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_runs_are_listed_newest_first_with_their_state_and_progress(
    recorded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    older = tmp_path / "older"
    shutil.copytree(recorded_run, older)
    (older / "events" / RUN).rename(older / "events" / "older-run")
    _record("older-run", older)
    _record(RUN, recorded_run)
    lines = _lines(capsys)
    assert lines[0].split() == [
        "RUN",
        "STATE",
        "STARTED",
        "ELAPSED",
        "NODES",
        "STEP",
        "STATE",
        "DIR",
    ]
    rows = [line.split() for line in lines[2:] if line.strip()][:2]
    assert [r[0] for r in rows] == [RUN, "older-run"]  # the newest start first
    assert rows[0][1] == "COMPLETED" and rows[0][4:] == ["1m20s", "3", "300", str(recorded_run)]
    assert rows[1][1] == "COMPLETED" and rows[1][-1] == str(older)
    assert lines[-1].startswith(f"run index: {ev.run_index_dir()}")
    assert all(line == line.rstrip() for line in lines)

    lines = _lines(capsys, "--last", "1")
    assert [line.split()[0] for line in lines[2:3]] == [RUN]
    assert "1 older run(s) not shown (--last N)" in lines

    doc = json.loads("\n".join(_lines(capsys, "--json")))
    assert [r["run_id"] for r in doc["runs"]] == [RUN, "older-run"]
    first = doc["runs"][0]
    assert (first["state"], first["world_nodes"], first["step"]) == ("COMPLETED", 3, 300)
    assert first["events_dir"] == str(recorded_run / "events" / RUN)
    assert (doc["older"], doc["gone"]) == (0, 0)


def test_runs_whose_state_directory_is_gone_are_counted_not_listed(
    recorded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = tmp_path / "gone"
    shutil.copytree(recorded_run, gone)
    _record(RUN, recorded_run)
    _record("deleted-run", gone)
    shutil.rmtree(gone)
    lines = _lines(capsys)
    assert [line.split()[0] for line in lines[2:3]] == [RUN]
    assert "1 run(s) whose state directory is gone not shown" in lines
    assert json.loads("\n".join(_lines(capsys, "--json")))["gone"] == 1


def test_an_empty_index_says_where_it_looked(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _lines(capsys)
    assert lines[0] == "no runs: their agents record a run when they start"
    assert str(ev.run_index_dir()) in lines[-1]
    assert json.loads("\n".join(_lines(capsys, "--json")))["runs"] == []


def test_entries_that_are_not_this_users_files_are_left_out(
    recorded_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The index is read as hostile input: a link (it could point anywhere), a directory
    or FIFO at an entry's name, an entry that names another run, a temporary file and
    garbage are not listed; the real entry still is."""
    _record(RUN, recorded_run)
    index = ev.run_index_dir()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"run_id": "linked", "state_dir": "/", "events_dir": "/"}))
    (index / "linked.json").symlink_to(elsewhere)
    (index / "dir.json").mkdir()
    os.mkfifo(index / "fifo.json")
    entry = json.loads((index / f"{RUN}.json").read_text())
    (index / "renamed.json").write_text(json.dumps(entry))  # names RUN, not "renamed"
    (index / f".{RUN}.123.tmp").write_text(json.dumps(entry))
    (index / "garbage.json").write_bytes(b"\xff\x00 not json")
    with caplog.at_level(logging.WARNING):
        lines = _lines(capsys)
    listed = [
        line.split()[0] for line in lines[2:] if line.strip() and not line.startswith("run index")
    ]
    assert listed == [RUN], lines
    warned = caplog.text
    for name in ("linked.json", "dir.json", "fifo.json", "garbage.json"):
        assert name in warned, (name, warned)


@pytest.mark.parametrize("flag", ["--watch", "--goodput"])
def test_watch_and_goodput_need_a_run(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", flag]) == 2
    err = capsys.readouterr().err
    assert f"status {flag} needs a run: slurm-elastic status RUN" in err


def test_last_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--last", "0"]) == 2
    assert "--last 0: must be at least 1" in capsys.readouterr().err
