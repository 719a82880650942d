"""Issue #21, checkpoint items: hostile neighbours and hostile files.

Each case is reproduced with real files, real processes and, where the attack needs one, a
real second local user (a member of the group that owns the project directory, as on a
shared HPC filesystem: ``2775`` setgid, umask ``002``), created for the test and removed
afterwards. Directory swaps are real ``renameat2(RENAME_EXCHANGE)`` calls made by that
user. Two seams, said where used: an I/O error (``EIO``) is injected at the checkpoint
code's ``read_file`` fault point (no failing disk here); ``ENOMEM`` is real (an
address-space limit in a child process).
"""

from __future__ import annotations

import ctypes
import errno
import fractions
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.manager import CheckpointManager
from slurm_elastic.checkpoint.manifest import Manifest, crc32_file, verify_checkpoint
from slurm_elastic.errors import CheckpointCorruptError, CheckpointError
from tests.checkpoint.old_format import write_torch_checkpoint
from tests.helpers import Other, second_user, wait_for

HERE = Path(__file__).parent
CHILD = HERE / "hostile_child.py"
SHARDED_WORKER = HERE / "sharded_worker.py"
RUN_ID_ENV = "SLURM_ELASTIC_RUN_ID"


def state_for(step: int, n: int = 4096) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=gen), "step": step}


def child_env(run_id: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_ELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"
    if run_id is not None:
        env[RUN_ID_ENV] = run_id
    return env


def run_child(*args: str, run_id: str | None = None) -> tuple[int, list[dict[str, object]]]:
    res = subprocess.run(
        [sys.executable, str(CHILD), *args],
        env=child_env(run_id),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert lines, f"child {args} printed nothing (rc {res.returncode}):\n{res.stderr}"
    return res.returncode, lines


@pytest.fixture
def no_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


@pytest.fixture
def neighbour() -> Iterator[Other]:
    """A second local user: the group member next door (needs root)."""
    if os.geteuid() != 0:
        pytest.skip(reason="creating a second local user needs root")
    with second_user() as other:
        yield other


@pytest.fixture
def project(neighbour: Other) -> Iterator[Path]:
    """A group project directory: ``<base>/checkpoints`` is ``2775``, owned by the
    neighbour's group (so the neighbour may rename entries in it)."""
    base = Path(tempfile.mkdtemp(prefix="ckpt-project-", dir="/tmp"))
    os.chmod(base, 0o755)
    shared = base / "checkpoints"
    shared.mkdir()
    os.chown(shared, 0, neighbour.gid)
    os.chmod(shared, 0o2775)
    try:
        yield shared
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Payload:
    """Unpickling this runs ``touch <marker>``: code execution, observable."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------- swaps by the neighbour

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """``renameat2(a, b, RENAME_EXCHANGE)``: both names swap atomically."""
    if _LIBC.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def start_swapping(other: Other, a: Path, b: Path, stop: Path, seconds: float) -> int:
    """As ``other``, swap ``a`` and ``b`` as fast as possible until ``stop`` exists (at
    most ``seconds``); return the swapper's pid."""

    def swap_loop() -> None:
        deadline = time.monotonic() + seconds
        swaps = 0
        while time.monotonic() < deadline and not os.path.exists(stop):
            exchange(a, b)
            swaps += 1
        if swaps == 0:
            raise RuntimeError("no swap happened")

    return other.start(swap_loop)


def stop_swapping(pid: int, stop: Path) -> None:
    """Tell the swapper to stop (``stop`` must be visible to it) and reap it."""
    stop.touch()
    status: list[int] = []

    def reaped() -> bool:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(code)
        return bool(done)

    try:
        wait_for(reaped, 30, "the swapper to stop")
    finally:
        if not status:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status[0]) == 0, "the swapper failed (see its output)"


def plant_lookalike(
    real: Path, lookalike: Path, owner: Other, forge: Callable[[Path], None]
) -> None:
    """Copy the checkpoint directory ``real`` to ``lookalike``, let ``forge`` change it,
    and give all of it to ``owner`` (as if they had written it)."""
    shutil.copytree(real, lookalike)
    forge(lookalike)
    for path in [lookalike, *lookalike.rglob("*")]:
        os.chown(path, owner.uid, owner.gid)


def reforge_manifest(step_dir: Path, changed: str) -> None:
    """Rewrite ``step_dir``'s manifest so that ``changed``'s size and CRC32 match again."""
    old = Manifest.from_json((step_dir / "manifest.json").read_text(), source=step_dir)
    files = tuple(
        type(f)(f.name, *crc32_file(step_dir / f.name)) if f.name == changed else f
        for f in old.files
    )
    forged = Manifest(
        old.step, old.kind, old.world_size, files, created=old.created, metadata=old.metadata
    )
    (step_dir / "manifest.json").write_text(forged.to_json())


# ================================================================ 1. damage vs environment


def missing_device() -> str:
    """A CUDA device this node does not have (every one when there is no CUDA)."""
    return f"cuda:{torch.cuda.device_count()}"


def save_as(directory: Path, state: dict[str, object], fmt: str) -> None:
    """Step 10 in ``fmt``: our container, or an earlier version's ``torch.save`` file
    holding a value our container does not store (now read, no longer written)."""
    if fmt == "state.pt":
        state["ratio"] = fractions.Fraction(1, 3)
        write_torch_checkpoint(directory, 10, state)
    else:
        CheckpointManager(directory).save(state, 10)


@pytest.mark.parametrize("fmt", ["state.bin", "state.pt"])
def test_a_device_missing_on_this_node_raises_and_every_checkpoint_stays(
    tmp_path: Path, fmt: str, no_run_id: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: every good checkpoint was logged as damaged, load_latest returned None (a
    first run) and the fresh run's first save replaced the good step_10."""
    state = state_for(10)
    save_as(tmp_path / "ckpt", state, fmt)
    assert (tmp_path / "ckpt" / "step_10" / fmt).exists()
    device = missing_device()
    restarted = CheckpointManager(tmp_path / "ckpt", weights_only=False)
    with (
        caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"),
        pytest.raises(CheckpointError, match=rf"{device}.*map_location='cpu'") as info,
    ):
        restarted.load_latest(map_location=device)
    assert not isinstance(info.value, CheckpointCorruptError)
    assert "damaged" not in caplog.text
    assert [i.step for i in restarted.list_checkpoints()] == [10]
    loaded = restarted.load_latest()  # the checkpoint is intact
    assert loaded is not None and loaded.step == 10
    assert torch.equal(loaded.state["w"], state["w"])


@pytest.mark.parametrize(
    ("fmt", "how"), [("state.pt", "load"), ("state.bin", "load"), ("state.bin", "verify")]
)
def test_out_of_memory_while_checksumming_raises_and_every_checkpoint_stays(
    tmp_path: Path, fmt: str, how: str, no_run_id: None
) -> None:
    """A real ENOMEM (an address-space limit in the child) while a checkpoint is mapped
    for its CRC32. Before: ``state.pt`` and every deep verification called it damaged and
    the child, finding "no checkpoint", started fresh and replaced step_10 (a ``state.bin``
    load raised a bare ``OSError``)."""
    directory = tmp_path / "ckpt"
    state: dict[str, object] = {"w": torch.arange(32 << 20, dtype=torch.float32)}  # 128 MiB
    save_as(directory, state, fmt)
    assert (directory / "step_10" / fmt).exists()
    _, lines = run_child("enomem", str(directory), how)
    (outcome,) = lines
    assert "raised" in outcome, f"the child did not get an error: {outcome}"
    raised = outcome["raised"]
    assert isinstance(raised, dict)
    assert raised["error"] == "CheckpointReadError", raised
    assert "out of memory" in str(raised["message"]) and "left in place" in str(raised["message"])
    loaded = CheckpointManager(directory, weights_only=False).load_latest()
    assert loaded is not None and loaded.step == 10
    assert torch.equal(loaded.state["w"], state["w"])  # the good step_10 was not replaced


@pytest.fixture
def fault_hook() -> Iterator[Callable[[Callable[[str], None]], None]]:
    """Install a hook at the checkpoint code's fault points (the ``_faults`` test seam)."""
    yield lambda hook: _faults.install(hook)
    _faults.install(None)


@pytest.mark.parametrize("fmt", ["state.bin", "state.pt"])
def test_an_io_error_while_reading_raises_and_every_checkpoint_stays(
    tmp_path: Path,
    fmt: str,
    fault_hook: Callable[[Callable[[str], None]], None],
    caplog: pytest.LogCaptureFixture,
    no_run_id: None,
) -> None:
    """Seam: EIO is injected where a data file has just been opened for reading (the
    ``read_file`` fault point); this machine has no failing disk to give a real one."""
    state = state_for(10)
    save_as(tmp_path / "ckpt", state, fmt)
    mgr = CheckpointManager(tmp_path / "ckpt", weights_only=False)
    calls: list[str] = []

    def eio(point: str) -> None:
        if point == "read_file":
            calls.append(point)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    fault_hook(eio)
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        for read in (mgr.load_latest, mgr.latest_verified):
            with pytest.raises(CheckpointError, match=r"I/O error.*not damage.*left in place") as e:
                read()
            assert not isinstance(e.value, CheckpointCorruptError)
    assert calls, "the read seam was never reached"
    assert "damaged" not in caplog.text
    fault_hook(lambda point: None)
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 10


def test_saving_over_a_different_good_step_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, no_run_id: None
) -> None:
    """Before: one generic "exists; replacing it" WARNING for every re-save, identical
    or not, which did not say that a good checkpoint was being replaced."""
    directory = tmp_path / "ckpt"
    CheckpointManager(directory).save(state_for(1), 10)
    fresh = CheckpointManager(directory)
    with caplog.at_level(logging.INFO, logger="slurm_elastic.checkpoint"):
        fresh.save(state_for(1), 10)  # the same state again: quietly
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        fresh.save(state_for(2), 10)  # a different state over a good step: said
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "step_10, which verifies" in warning.getMessage()
    assert "with a different state" in warning.getMessage()
    loaded = fresh.load(10)
    assert torch.equal(loaded.state["w"], state_for(2)["w"])
    assert fresh.incomplete() == []


# ================================================================ 2. retention and links


def test_retention_unlinks_a_symlinked_step_and_never_deletes_through_it(
    tmp_path: Path, no_run_id: None
) -> None:
    """An archived checkpoint linked back in. Before: retention deleted the archive's
    files through the link, and the ``.trash-`` link stayed forever."""
    archive = tmp_path / "archive"
    CheckpointManager(archive).save(state_for(1), 1)
    before = sorted(p.name for p in (archive / "step_1").iterdir())
    directory = tmp_path / "ckpt"
    mgr = CheckpointManager(directory, keep_last=2)
    mgr.save(state_for(2), 2)
    (directory / "step_1").symlink_to(archive / "step_1")
    mgr.save(state_for(3), 3)  # retention drops step 1: the link
    assert sorted(os.listdir(directory)) == ["step_2", "step_3"]  # no link, no .trash-
    assert sorted(p.name for p in (archive / "step_1").iterdir()) == before
    verify_checkpoint(archive / "step_1")  # the archive is whole


def test_a_leftover_trash_link_is_unlinked_and_its_target_kept(
    tmp_path: Path, no_run_id: None
) -> None:
    """Before: removing a dead writer's ``.trash-`` link failed (rmtree on a link) and
    the link stayed forever."""
    archive = tmp_path / "archive"
    CheckpointManager(archive).save(state_for(1), 1)
    directory = tmp_path / "ckpt"
    mgr = CheckpointManager(directory)
    mgr.save(state_for(2), 2)
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=60)
    trash = directory / f".trash-step_1-0123456789ab-{dead.pid}@{socket.gethostname()}"
    trash.symlink_to(archive / "step_1")
    mgr.save(state_for(3), 3)  # removes dead writers' leftovers first
    assert not os.path.lexists(trash)
    verify_checkpoint(archive / "step_1")


# ================================================================ 3. a run owns its checkpoints


def test_a_swapped_run_directory_is_never_resumed_from_or_pruned(
    project: Path, neighbour: Other
) -> None:
    """The reproduced attack: a group member swaps two of the victim's run directories
    (three renames; every path stays the victim's and 0700). Before: run r1 resumed from
    step 300 of run r0, and its next saves (keep_last=3) deleted r0's steps."""
    r0, r1 = project / "r0", project / "r1"
    assert run_child("save", str(r0), "100", "200", "300", run_id="r0")[1] == [
        {"saved": [100, 200, 300]}
    ]
    assert run_child("save", str(r1), "10", "20", run_id="r1")[1] == [{"saved": [10, 20]}]
    r0_state = {p.name: p.read_bytes() for p in r0.rglob("*") if p.is_file()}

    def three_renames() -> None:
        os.rename(r0, project / "x")
        os.rename(r1, r0)
        os.rename(project / "x", r1)

    neighbour.run(three_renames)
    rc, lines = run_child("resume", str(r1), run_id="r1")  # r1 restarts: r0's data there
    assert rc == 3, lines
    refused, save_refused = lines[0]["refused"], lines[1]["save_refused"]
    assert isinstance(refused, dict) and isinstance(save_refused, dict)
    assert refused["error"] == "ForeignRunError"
    assert "belongs to run 'r0', but this is run 'r1'" in str(refused["message"])
    assert "refusing to save" in str(save_refused["message"])
    assert sorted(os.listdir(r1)) == ["step_100", "step_200", "step_300"]  # nothing pruned
    assert {p.name: p.read_bytes() for p in r1.rglob("*") if p.is_file()} == r0_state
    assert sorted(os.listdir(r0)) == ["step_10", "step_20"]


def test_a_run_refuses_to_load_save_or_prune_another_runs_directory(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    theirs = CheckpointManager(directory, run_id="r7", keep_last=1)
    theirs.save(state_for(1), 1)
    assert theirs.load_latest() is not None
    ours = CheckpointManager(directory, run_id="r8", keep_last=1)
    both = r"belongs to run 'r7', but this is run 'r8'.*run id"
    with pytest.raises(CheckpointError, match=both):
        ours.load_latest()
    with pytest.raises(CheckpointError, match=both):
        ours.load(1)
    with pytest.raises(CheckpointError, match=both):
        ours.latest_verified()
    with pytest.raises(CheckpointError, match=both) as info:
        ours.save(state_for(2), 2)
    assert "refusing to save" in str(info.value)
    with pytest.raises(CheckpointError, match=both) as info:
        ours.store.apply_retention(5)
    assert "refusing to prune checkpoints" in str(info.value)
    assert [i.step for i in theirs.list_checkpoints()] == [1]
    assert ours.incomplete() == []


def test_the_run_id_comes_from_the_agents_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUN_ID_ENV, "job-42")
    mgr = CheckpointManager.from_env(tmp_path / "ckpt")
    mgr.save(state_for(1), 1)
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.manifest.run == "job-42"
    monkeypatch.delenv(RUN_ID_ENV)
    plain = CheckpointManager(tmp_path / "ckpt")  # no run id: records none, accepts all
    assert plain.run_id is None
    assert plain.load_latest() is not None


def _rewrite_as_format_2(step_dir: Path) -> None:
    """The manifest as written before manifests named their run (format 2, no run)."""
    old = Manifest.from_json((step_dir / "manifest.json").read_text(), source=step_dir)
    legacy = Manifest(
        old.step,
        old.kind,
        old.world_size,
        old.files,
        created=old.created,
        metadata=old.metadata,
        format_version=2,
    )
    text = legacy.to_json()
    assert '"run"' not in text
    (step_dir / "manifest.json").write_text(text)


def test_manifests_from_before_run_binding_still_load_and_a_run_never_prunes_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "ckpt"
    CheckpointManager(directory, run_id="", keep_last=None).save(state_for(1), 1)
    _rewrite_as_format_2(directory / "step_1")
    mgr = CheckpointManager(directory, run_id="r1", keep_last=1)
    loaded = mgr.load_latest()  # backward compatible: a manifest naming no run loads
    assert loaded is not None and loaded.step == 1 and loaded.manifest.run is None
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        mgr.save(state_for(2), 2)
    assert [i.step for i in mgr.list_checkpoints()] == [1, 2]  # not provably r1's: kept
    assert "step_1" in caplog.text and "naming no run" in caplog.text
    assert mgr.load_latest().manifest.run == "r1"  # type: ignore[union-attr]
    # outside a run (no run id) retention prunes run-less checkpoints as it always did
    plain = CheckpointManager(directory, run_id="", keep_last=1)
    plain.save(state_for(3), 3)
    assert 1 not in [i.step for i in plain.list_checkpoints()]


# ================================================================ 4. descriptors, not paths


def test_every_directory_created_is_0700_under_umask_002_in_a_setgid_project(
    tmp_path: Path, no_run_id: None
) -> None:
    """Before: missing parents were made with the umask (2775 under a setgid parent)."""
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o2775)
    leaf = project / ".slurm_elastic" / "checkpoints" / "r1"
    old = os.umask(0o002)
    try:
        CheckpointManager(leaf).save(state_for(1), 1)
    finally:
        os.umask(old)
    created = [project / ".slurm_elastic", project / ".slurm_elastic" / "checkpoints", leaf]
    created.append(leaf / "step_1")
    modes = {str(p.relative_to(project)): oct(stat.S_IMODE(p.stat().st_mode)) for p in created}
    assert set(modes.values()) == {"0o700"}, modes
    for f in (leaf / "step_1").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_a_replicated_load_under_a_directory_swap_race_reads_only_what_it_checked(
    project: Path, neighbour: Other, tmp_path: Path, no_run_id: None
) -> None:
    """The neighbour swaps the run directory with a look-alike of theirs (same names,
    different tensors, manifest CRCs fixed) as fast as they can while the run loads.
    Before: a load that checked ours and then opened theirs called the checkpoint
    damaged and resumed from nothing (None)."""
    real = project / "r1"
    CheckpointManager(real).save(state_for(5), 5)

    def forge(lookalike: Path) -> None:
        CheckpointManager(tmp_path / "theirs").save(state_for(666), 5)
        shutil.copyfile(
            tmp_path / "theirs" / "step_5" / "state.bin", lookalike / "step_5" / "state.bin"
        )
        reforge_manifest(lookalike / "step_5", "state.bin")

    plant_lookalike(real, project / "x", neighbour, forge)
    stop = project.parent / "stop"  # where the neighbour can see it
    swapper = start_swapping(neighbour, real, project / "x", stop, 60)
    ok, refused, findings = 0, 0, []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                loaded = CheckpointManager(real).load_latest()
            except CheckpointCorruptError as exc:
                findings.append(f"called damaged: {exc}")
                continue
            except CheckpointError as exc:  # failing safe, with our clear message
                assert "refusing to read" in str(exc), exc
                refused += 1
                continue
            if loaded is None or loaded.step != 5:
                findings.append(f"resumed from {loaded and loaded.step}")
            elif not torch.equal(loaded.state["w"], state_for(5)["w"]):
                findings.append("read the look-alike's tensors")
            else:
                ok += 1
    finally:
        stop_swapping(swapper, stop)
    assert findings == [], (
        f"{len(findings)} unsafe loads of {ok + refused + len(findings)}: {findings[:3]}"
    )
    assert ok > 0, f"no load succeeded ({refused} refused)"


@pytest.mark.slow
def test_a_sharded_load_under_a_directory_swap_race_never_reads_a_foreign_metadata(
    project: Path, neighbour: Other, tmp_path: Path
) -> None:
    """The reproduced race: the neighbour swaps the checkpoint directory with a
    look-alike whose DCP ``.metadata`` is their pickle (it would create a marker file).
    Before: DCP unpickled it in about 1 % of loads (checks by path, DCP re-opens by path);
    now DCP reads ``/proc/self/fd/<fd>`` of the directory that was checked."""
    real = project / "r1"
    init = tmp_path / "init-save"
    save = subprocess.run(
        [sys.executable, str(SHARDED_WORKER), "save", str(init), str(real)],
        env={**child_env(), "RANK": "0", "WORLD_SIZE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert save.returncode == 0, save.stdout + save.stderr
    marker = tmp_path / "pwned"

    def forge(lookalike: Path) -> None:
        (lookalike / "step_5" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        reforge_manifest(lookalike / "step_5", ".metadata")

    plant_lookalike(real, project / "x", neighbour, forge)
    stop = project.parent / "stop"  # where the neighbour can see it
    loader = subprocess.Popen(
        [sys.executable, str(SHARDED_WORKER), "race", str(tmp_path / "init-race"), str(real), "4"],
        env={**child_env(), "RANK": "0", "WORLD_SIZE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        swapper = start_swapping(neighbour, real, project / "x", stop, 120)
        try:
            out = loader.communicate(timeout=300)[0]
        finally:
            stop_swapping(swapper, stop)
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.wait(timeout=60)
    assert not marker.exists(), "DCP unpickled the neighbour's .metadata: their code ran"
    (line,) = [x for x in out.splitlines() if x.startswith("RACE ")]
    result = json.loads(line[5:])
    assert result["unclear"] == [], result["unclear"][:3]
    assert result["wrong"] == 0
    for message in result["refused"]:
        assert "refusing to read" in message or "changed after rank 0 verified" in message, message
    assert result["ok"] > 0, result
