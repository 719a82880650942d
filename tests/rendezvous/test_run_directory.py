"""Directory safety, eras (requeue safety) and option parsing, in one process."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousParameters

from slurm_elastic.errors import ConfigError, RendezvousSetupError
from slurm_elastic.rendezvous import RendezvousOptions, create_handler
from slurm_elastic.rendezvous.filesystem import RendezvousDir
from slurm_elastic.rendezvous.run_directory import Incarnation, RunDirectory, safe_component
from slurm_elastic.rendezvous.state import State, decode_state, encode_state


def _close(run: RunDirectory, number: int) -> None:
    backend = run.era(number).backend()
    current = backend.get_state()
    state = decode_state(current[0]) if current else State()
    state.closed = True
    backend.set_state(encode_state(state), current[1] if current else None)


def _touch_state(run: RunDirectory, number: int) -> None:
    run.era(number).backend().set_state(encode_state(State()), None)


def test_group_writable_root_is_refused_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "rdzv"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o770)
    with pytest.raises(RendezvousSetupError, match="chmod go-w"):
        RunDirectory(root, "run")


def test_symlinked_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(RendezvousSetupError, match="symbolic link"):
        RunDirectory(tmp_path / "link", "run")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, -1)
    with pytest.raises(RendezvousSetupError, match="owned by uid 4242"):
        RunDirectory(root, "run")


def test_directories_are_created_private(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path / "new" / "rdzv", "my job/1")
    era = run.select_era(Incarnation("g", "k"))
    for d in (run.root, run.path, era.path, era.hb_dir, era.keys_dir):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert run.path.name == safe_component("my job/1") and "/" not in run.path.name


def test_unsafe_run_ids_map_to_distinct_safe_names() -> None:
    names = {safe_component(x) for x in ("..", "a/b", "a_b", ".hidden", "a b")}
    assert len(names) == 5
    assert all("/" not in n and not n.startswith(".") for n in names)


def test_same_cohort_joins_the_open_era(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path, "run")
    e1 = run.select_era(Incarnation("array-7", "8.0"))
    _touch_state(run, e1.number)
    e2 = run.select_era(Incarnation("array-7", "9.1"))  # another (requeued) task
    assert e2.number == e1.number


def test_open_era_of_another_cohort_is_not_joined(tmp_path: Path) -> None:
    # A short liveness window: the old era is watched for activity that long (this
    # test is not about the window; tests/rendezvous/test_damage_and_identity.py is).
    run = RunDirectory(tmp_path, "run", liveness_window_s=0.5)
    e1 = run.select_era(Incarnation("job-5.0", "5.0"))
    _touch_state(run, e1.number)
    e2 = run.select_era(Incarnation("job-5.1", "5.1"))  # the requeued job
    assert e2.number == e1.number + 1


def test_closed_era_raises_for_its_own_incarnation_only(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path, "run")
    e1 = run.select_era(Incarnation("array-7", "8.0"))
    _close(run, e1.number)
    with pytest.raises(RendezvousClosedError, match="closed by this job"):
        run.select_era(Incarnation("array-7", "8.0"))
    e2 = run.select_era(Incarnation("array-7", "8.1"))  # the task requeued
    assert e2.number == e1.number + 1
    assert run.select_era(Incarnation("array-7", "9.0")).number == e2.number


def test_old_eras_are_collected(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path, "run", liveness_window_s=0.5)  # each old one is watched

    for i in range(6):
        e = run.select_era(Incarnation(f"job-{i}", f"{i}.0"))
        _touch_state(run, e.number)
    eras = sorted(p.name for p in run.path.iterdir() if p.name.startswith("era."))
    assert eras == ["era.4", "era.5", "era.6"]


def test_malformed_era_metadata_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = RunDirectory(tmp_path, "run")
    e1 = run.select_era(Incarnation("g", "k"))
    (e1.path / "meta").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        e2 = run.select_era(Incarnation("g", "k"))
    assert e2.number == e1.number + 1
    assert "malformed rendezvous era metadata" in caplog.text


def test_incarnation_from_slurm_environment() -> None:
    plain = Incarnation.from_environ({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"})
    assert plain == Incarnation("job-42.2", "42.2")
    array = Incarnation.from_environ(
        {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    )
    assert array == Incarnation("array-40", "43.0")
    a, b = Incarnation.from_environ({}), Incarnation.from_environ({})
    assert a.cohort == b.cohort == "local" and a.key != b.key


def test_options_parse_strings_aliases_and_reject_bad_values() -> None:
    p = RendezvousParameters(
        "slurm", "/x", "r", 1, 2, keep_alive_interval="2", heartbeat_miss_limit="4",
        last_call_timeout_s="0.5", timeout=900,
    )  # fmt: skip
    o = RendezvousOptions.from_parameters(p)
    assert (o.heartbeat_interval_s, o.heartbeat_miss_limit, o.last_call_timeout_s) == (2, 4, 0.5)
    with pytest.raises(ConfigError, match="join_timeout='soon' is not a number"):
        RendezvousOptions.from_parameters(
            RendezvousParameters("slurm", "/x", "r", 1, 2, join_timeout="soon")
        )
    with pytest.raises(ConfigError, match="heartbeat_miss_limit='1' must be >= 2"):
        RendezvousOptions.from_parameters(
            RendezvousParameters("slurm", "/x", "r", 1, 2, heartbeat_miss_limit="1")
        )


def test_create_handler_reports_backend_name_and_agent_store(tmp_path: Path) -> None:
    h = create_handler(
        RendezvousParameters("slurm", str(tmp_path), "r", 1, 1, local_addr="127.0.0.1"),
        environ={},
    )
    assert h.get_backend() == "slurm"
    assert h.use_agent_store is True
    assert h.get_run_id() == "r"


def test_registered_in_torchs_registry(tmp_path: Path) -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from slurm_elastic.rendezvous.registration import register

    register()  # idempotent next to the entry point registration
    handler = rendezvous_handler_registry.create_handler(
        RendezvousParameters("slurm", str(tmp_path), "r", 1, 1, local_addr="127.0.0.1")
    )
    assert handler.get_backend() == "slurm"


def _count_era_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each temporary era an agent builds (a spy: the real method runs)."""
    built: list[str] = []
    real = RendezvousDir.tmp_name

    def spy(self: RendezvousDir, stem: str) -> str:
        if stem.startswith("era."):
            built.append(stem)
        return real(self, stem)

    monkeypatch.setattr(RendezvousDir, "tmp_name", spy)
    return built


def test_agents_starting_at_once_build_one_era(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1,024 agents of a fresh run starting at once each built an era to throw away
    # (and listed a run directory full of them): the formation's set-up took 1-4 s.
    built = _count_era_builds(monkeypatch)
    n = 32
    barrier = threading.Barrier(n)
    numbers: list[int] = []

    def agent(i: int) -> None:
        run = RunDirectory(tmp_path, "run")
        barrier.wait()
        numbers.append(run.select_era(Incarnation("array-7", f"{i}.0")).number)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert numbers == [1] * n
    assert len(built) <= 2, f"{len(built)} of {n} agents built era 1"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["era.1"]


def test_an_era_claimed_by_a_dead_agent_is_created_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _count_era_builds(monkeypatch)
    run = RunDirectory(tmp_path, "run")
    (tmp_path / "run" / ".create.1").mkdir(mode=0o700)  # claimed, then the claimant died
    era = run.select_era(Incarnation("array-7", "0.0"))
    assert (era.number, built) == (1, ["era.1"])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["era.1"]


def test_a_run_directory_of_the_earlier_version_is_refused_with_the_fix(tmp_path: Path) -> None:
    """Before 2026-12-03 an era was named ``epoch.<k>`` (the word meant the training
    epoch too). An agent of this version must not open a second state beside the live
    agents of the earlier one: it refuses, naming the directory and the fix."""
    run = RunDirectory(tmp_path / "rdzv", "run")
    (run.path / "epoch.3").mkdir(mode=0o700)
    with pytest.raises(RendezvousSetupError, match=r"epoch\.3.*another --rdzv-id"):
        run.select_era(Incarnation("g", "k"))
    assert sorted(p.name for p in run.path.iterdir()) == ["epoch.3"]


def test_the_cohort_option_and_its_earlier_name_both_set_who_may_join(tmp_path: Path) -> None:
    """``generation`` meant two things (the state's compare-and-set token and the join
    group); the join group is now ``cohort``, and the earlier key still works."""
    for key in ("cohort", "generation"):
        params = RendezvousParameters(
            backend="slurm", endpoint=str(tmp_path / "rdzv"), run_id="run",
            min_nodes=1, max_nodes=1, **{key: "array-7"},
        )  # fmt: skip
        assert RendezvousOptions.from_parameters(params).cohort == "array-7"
