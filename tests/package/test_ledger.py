"""The one ledger checker (``slurm_elastic.ledger``) that the tests and benches use.

Pure: records are built here; each rule is shown to catch the defect it is for.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from slurm_elastic import ledger

N = 8  # samples per epoch


def run(
    steps: int,
    world: int = 2,
    attempt: str = "round0",
    start: int = 1,
    t0: float = 0.0,
    per_rank: int = 2,
) -> list[ledger.Record]:
    """Records of ``steps`` steps from ``start``: each epoch is N samples in order."""
    out = []
    per_step = world * per_rank
    for step in range(start, start + steps):
        first = (step - 1) * per_step
        epoch, offset = divmod(first, N)
        for rank in range(world):
            lo = offset + rank * per_rank
            out.append({
                "epoch": epoch, "step": step, "rank": rank, "world": world,
                "indices": list(range(lo, lo + per_rank)), "attempt": attempt,
                "time": t0 + step,
            })  # fmt: skip
    return out


def test_an_uninterrupted_run_passes() -> None:
    assert ledger.check(run(6), N, steps=6) == []
    assert ledger.redone_steps(run(6)) == 0
    assert ledger.samples_per_epoch(run(6))[0] == list(range(N))


def test_a_rolled_back_attempt_is_superseded_by_its_redo() -> None:
    # round0 ran steps 1..5, was rolled back to step 3; round1 redid 4..6 later.
    records = run(5, attempt="round0") + run(3, attempt="round1", start=4, t0=10)
    assert ledger.check(records, N, steps=6) == []
    assert ledger.redone_steps(records) == 2
    assert {
        r["attempt"] for rs in ledger.effective(records).values() for r in rs if r["step"] >= 4
    } == {"round1"}


def test_a_sample_used_twice_a_missing_step_and_a_missing_rank_are_named() -> None:
    records = run(6)
    records[2]["indices"] = [0, 1]  # step 2, rank 0 repeats step 1's samples
    problems = ledger.check(records, N, steps=6)
    assert any("epoch 0: 2 samples used twice" in p for p in problems), problems
    assert any("epoch 0: 2 of 8 samples missing" in p for p in problems), problems
    gaps = [r for r in run(6) if r["step"] != 3]
    assert any("1 steps missing" in p and "[3]" in p for p in ledger.check(gaps, N, steps=6))
    one_rank = [r for r in run(6) if not (r["step"] == 5 and r["rank"] == 1)]
    assert any("step 5: ranks [0] ran it, its world is 2" in p for p in ledger.check(one_rank, N))


def test_the_last_epoch_is_judged_complete_only_when_the_epoch_count_is_given() -> None:
    partial = run(5)  # 20 samples: epochs 0, 1 complete, epoch 2 half
    assert ledger.check(partial, N) == []
    assert any("epoch 2: 4 of 8 samples missing" in p for p in ledger.check(partial, N, epochs=3))
    assert any("expected 0..3" in p for p in ledger.check(run(4), N, epochs=4))


def test_so_far_ignores_steps_still_to_be_redone_and_the_newest_partial_step() -> None:
    # round0 got to step 6 and was rolled back to 2; round1 is at step 3 now, and only
    # rank 0 has appended step 4's record yet.
    records = run(6, attempt="round0") + run(1, attempt="round1", start=3, t0=10)
    records.append(run(1, attempt="round1", start=4, t0=10)[0])
    assert ledger.check(records, N, so_far=True) == []
    assert max(ledger.effective(records, so_far=True))[1] == 4
    assert ledger.check(records, N) != []  # not so far: step 4 misses rank 1


def test_read_counts_complete_lines_and_names_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    assert ledger.read(path) == []
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "ind')  # a write in flight
    assert ledger.read(path) == [{"step": 1}]
    path.write_text(json.dumps({"step": 1}) + "\n{oops}\n")
    with pytest.raises(ValueError, match=r"ledger.jsonl:2: not a ledger record"):
        ledger.read(path)


def _append_many(path: str, rank: int) -> None:
    for step in range(1, 201):
        ledger.append(path, epoch=0, step=step, rank=rank, world=4, indices=range(64),
                      attempt="round0")  # fmt: skip


def test_concurrent_appends_from_processes_never_interleave(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.jsonl")
    procs = [mp.get_context("spawn").Process(target=_append_many, args=(path, r)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    records = ledger.read(path)
    assert len(records) == 800 and all(r["indices"] == list(range(64)) for r in records)
    assert ledger.check(records, 64 * 4 * 200, whole_steps=True) == [
        f"epoch 0: {64 * 4 * 200 - 64} samples used twice"
    ]
