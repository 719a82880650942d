"""A sharded model's state rebuilt from the survivors' shards after a hard loss
(slurm_elastic.live.shards, ShardedModel.keep_shards/recover).

The plan and the chunk arithmetic are pure; the rebuild runs in real processes: a real
gloo group of 4 trains a small model under HSDP or FSDP2, some ranks die without a word
(``os._exit``), and the survivors form a new group and rebuild (tests/live/shards_worker.py).
The agents and the session around it are in test_fsdp.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_elastic.checkpoint.exchange import TensorSpec
from slurm_elastic.errors import ShardsLostError, StateExchangeError
from slurm_elastic.live import shards
from tests.checkpoint.test_exchange import free_port
from tests.helpers import run_ranks

WORKER = Path(__file__).with_name("shards_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("rows", "count"), [(7, 2), (3, 2), (2, 4), (0, 3), (9, 3), (1, 1)])
def test_chunk_bounds_are_torch_chunks(rows: int, count: int) -> None:
    chunks = list(torch.arange(rows).chunk(count)) if rows else []
    for index in range(count):
        start, stop = shards.chunk_bounds(rows, index, count)
        want = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == want, (rows, count, index)


def _info(step: int, covers: list[int], shards_: int = 2, round_: int = 5) -> dict[str, Any]:
    return {"round": round_, "shards": shards_, "held": [[step, covers]], "saved": -1}


def test_the_plan_takes_the_newest_step_that_has_every_shard() -> None:
    infos = [
        _info(8, [0]),  # stepped ahead; shard 1 of step 8 died with its rank
        _info(7, [1]),
        None,  # a newcomer
        _info(7, [0]),
        _info(7, [1]),
    ]
    plan = shards.plan(infos)
    assert (plan.step, plan.round, plan.shards) == (7, 5, 2)
    assert plan.sources == (3, 1)  # the lowest rank holding each index at step 7


def test_a_full_state_covers_every_shard() -> None:
    plan = shards.plan([_info(4, [1]), _info(4, [0, 1])])
    assert plan.step == 4 and plan.sources == (1, 0)


def test_a_neighbour_copy_of_an_older_step_is_used_when_the_live_shards_are_not_enough() -> None:
    # plain FSDP2 over 4, ranks 2 and 3 lost: the live shards of step 9 have indices 0, 1;
    # the copies of step 5 on ranks 0 and 1 hold their own and their neighbours' (2, 3)
    infos = [
        {"round": 5, "shards": 4, "held": [[5, [0, 2]], [9, [0]]], "saved": -1},
        {"round": 5, "shards": 4, "held": [[5, [1, 3]], [9, [1]]], "saved": 3},
    ]
    plan = shards.plan(infos)
    assert plan.step == 5 and plan.sources == (0, 1, 0, 1)


def test_a_checkpoint_newer_than_every_whole_step_in_memory_wins() -> None:
    infos = [
        {"round": 5, "shards": 2, "held": [[0, [0, 1]], [14, [0]]], "saved": 10},
        {"round": 5, "shards": 2, "held": [[0, [0, 1]], [14, [0]]], "saved": 10},
    ]
    with pytest.raises(
        ShardsLostError, match="in memory is 0, the newest checkpoint is of step 10"
    ):
        shards.plan(infos)
    infos[0]["saved"] = infos[1]["saved"] = -1
    assert shards.plan(infos).step == 0


def test_an_older_rounds_shards_are_not_mixed_in() -> None:
    plan = shards.plan([_info(9, [0, 1], round_=4), _info(3, [0], round_=5), _info(3, [1])])
    assert plan.round == 5 and plan.step == 3


def test_lost_shards_are_named_and_the_fix_is_said() -> None:
    with pytest.raises(ShardsLostError, match=r"of 4 shards.*replicate=R.*copy_every=K"):
        shards.plan([_info(6, [0], 4), _info(6, [1], 4), None])


@pytest.mark.parametrize(
    "bad",
    [
        {"round": 1, "shards": 2, "held": [[1, [2]]], "saved": -1},
        {"round": 1, "shards": 2, "held": [["1", [0]]], "saved": -1},
        {"round": 1, "shards": 2, "held": [[1, [0]]], "saved": -1, "more": 1},
        {"round": 1, "shards": 0, "held": [], "saved": -1},
        {"round": 1, "shards": 2, "held": [[1, [0]]]},
        [1, 2],
    ],
)
def test_a_malformed_info_is_refused(bad: Any) -> None:
    with pytest.raises(StateExchangeError, match="malformed"):
        shards.plan([bad])


def _piece_spec(index: int, count: int, rows: int = 7) -> dict[str, Any]:
    start, stop = shards.chunk_bounds(rows, index, count)
    spec: dict[str, Any] = {
        "model": {"w": TensorSpec(torch.float32, (stop - start, 5))},
        "state": {"w": {"exp_avg": TensorSpec(torch.float32, (stop - start, 5))}},
    }
    if index == 0:
        spec["unsharded"] = {
            "model": {"buf": TensorSpec(torch.float32, (4,))},
            "state": {"w": {"step": TensorSpec(torch.float32, ())}},
            "groups": [{"lr": 0.1, "params": ["w"]}],
        }
    return spec


TEMPLATE = {"w": (torch.float32, (7, 5)), "buf": (torch.float32, (4,))}
PARAMS = {"w": (torch.float32, (7, 5))}


def test_a_piece_of_this_model_passes_the_check() -> None:
    for index in range(3):
        shards.check_piece(_piece_spec(index, 3), index, 3, TEMPLATE, PARAMS, [["w"]])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s["model"].update(w=TensorSpec(torch.float32, (4, 5))), r"model\['w'\]"),
        (lambda s: s["model"].update(w=TensorSpec(torch.float64, (3, 5))), r"model\['w'\]"),
        (lambda s: s["state"].update(v={}), r"state\['v'\]: not a parameter"),
        (lambda s: s["model"].pop("w"), "expected the parameters"),
        (lambda s: s.update(unsharded={}), "parts"),
    ],
)
def test_a_piece_of_another_shape_is_refused_before_any_byte(change: Any, words: str) -> None:
    spec = _piece_spec(1, 2)
    change(spec)
    with pytest.raises(StateExchangeError, match=words):
        shards.check_piece(spec, 1, 2, TEMPLATE, PARAMS, [["w"]])


def test_a_piece_zero_with_other_buffers_or_groups_is_refused() -> None:
    spec = _piece_spec(0, 2)
    spec["unsharded"]["groups"][0]["params"] = ["v"]
    with pytest.raises(StateExchangeError, match=r"param_groups\[0\]: different parameters"):
        shards.check_piece(spec, 0, 2, TEMPLATE, PARAMS, [["w"]])
    spec = _piece_spec(0, 2)
    spec["unsharded"]["state"]["w"]["step"] = TensorSpec(torch.float32, (7, 5))
    with pytest.raises(StateExchangeError, match="not a scalar"):
        shards.check_piece(spec, 0, 2, TEMPLATE, PARAMS, [["w"]])


def test_pieces_assemble_into_the_full_tensors() -> None:
    full = torch.arange(35.0).view(7, 5)
    pieces = shards.make_pieces(
        {"model": {"w": full}, "state": {"w": {"exp_avg": full * 2}}},
        {"model": {"buf": torch.ones(4)}, "state": {"w": {"step": torch.tensor(3.0)}},
         "groups": [{"lr": 0.1, "params": ["w"]}]},
        (0, 1, 2), 3, whole=True,
    )  # fmt: skip
    for index, piece in pieces.items():  # each piece passes the receiver's check
        shards.check_piece(shards.spec_of(piece), index, 3, {**PARAMS, "buf": (torch.float32, (4,))},
                           PARAMS, [["w"]])  # fmt: skip
    rebuilt = shards.assemble([pieces[i] for i in range(3)])
    assert torch.equal(rebuilt["model"]["w"], full)
    assert torch.equal(rebuilt["model"]["buf"], torch.ones(4))
    assert torch.equal(rebuilt["optimizer"]["state"]["w"]["exp_avg"], full * 2)
    assert float(rebuilt["optimizer"]["state"]["w"]["step"]) == 3.0
    assert rebuilt["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    kept = shards.KeptShards(1, 3, {4: pieces})
    assert kept.info() == {"round": 1, "shards": 3, "held": [[4, [0, 1, 2]]], "saved": -1}
    with pytest.raises(ValueError, match="not kept here"):
        kept.piece(3, 0)


def _run(case: str, tmp: Path, deadline_s: float = 180) -> list[dict[str, Any]]:
    port = new_port = free_port()
    while new_port == port:  # the new group's store must not meet the old one's
        new_port = free_port()
    argvs = [[str(WORKER), case, str(r), str(port), str(new_port), str(tmp)] for r in range(4)]
    return run_ranks(argvs, tmp, deadline_s)


def test_a_lost_hsdp_replica_is_rebuilt_from_the_other_bitwise(tmp_path: Path) -> None:
    """Ranks 2 and 3 (replica 1 of a 2 x 2 mesh) die; 0 and 1 hold shards 0 and 1 of
    replica 0 and rebuild every parameter and optimizer tensor exactly."""
    results = _run("hsdp_replica_lost", tmp_path)
    for r in results[:2]:
        assert r["recovered"] == [3, "live"], r
        assert r["keys_equal"] and not r["unequal"], r
        assert r["lr"] == [0.01] and r["trained_on"], r


def test_survivors_of_both_replicas_and_a_newcomer_get_the_same_state(tmp_path: Path) -> None:
    """Rank 3 dies; rank 2 (shard 0 of replica 1) acts as a newcomer that kept nothing:
    shards 0 and 1 come from ranks 0 and 1, and all three rebuild the same state."""
    results = _run("hsdp_one_rank_lost_and_a_newcomer", tmp_path)
    assert results[3].get("lost")
    for r in results[:3]:
        assert r["keys_equal"] and not r["unequal"] and r["trained_on"], r
    assert [r["recovered"] for r in results[:3]] == [[3, "live"], [3, "live"], [3, None]]


def test_lost_fsdp_shards_raise_on_every_survivor(tmp_path: Path) -> None:
    """Plain FSDP2 keeps each shard on one rank: the survivors of a loss of ranks 2, 3
    cannot rebuild and say so alike (the restart path takes over)."""
    results = _run("fsdp_shards_lost", tmp_path)
    for r in results[:2]:
        assert "lost_error" in r, r
        assert "indices {3: [0, 1]} (by step) of 4 shards" in r["lost_error"], r


def test_lost_fsdp_shards_come_back_from_the_neighbours_copies(tmp_path: Path) -> None:
    """Plain FSDP2 over two "nodes" of 2 ranks, a neighbour copy at step 2 (each rank's
    shards went to rank + 2 and came from rank - 2), taken in the background: ranks 2
    and 3 start their side only after ranks 0 and 1 returned from the boundary (a copy
    that waited for its neighbour would never return). Ranks 2 and 3 die after step 3:
    ranks 0 and 1 rebuild step 2 bitwise from their own copies and their neighbours',
    with the session's other state of step 2 kept beside them."""
    results = _run("fsdp_neighbour_copy", tmp_path)
    for r in results[:2]:
        assert r["recovered"] == [2, "copy"], r
        assert r["keys_equal"] and not r["unequal"] and r["trained_on"], r
        assert r["rest_progress"] == {"step": 2} and r["rest_has_model"], r


def test_a_neighbour_copy_in_flight_at_the_loss_is_abandoned_for_the_previous(
    tmp_path: Path,
) -> None:
    """Copies at steps 1 and 3; ranks 2 and 3 freeze (alive, connections open) before
    answering the copy of step 3, so it is still in flight on ranks 0 and 1 when they
    give up on them: letting the mesh go ends its thread at once (its group's
    connections are shut down) and the survivors rebuild step 1 from the previous copy."""
    results = _run("fsdp_copy_in_flight", tmp_path)
    for r in results[:2]:
        assert r["copy_threads_before"] == 1, r  # the copy of step 3 was in flight
        assert r["copy_threads_after"] == 0 and r["release_s"] < 5.0, r
        assert r["recovered"] == [1, "copy"], r
        assert r["keys_equal"] and not r["unequal"] and r["trained_on"], r
        assert r["rest_progress"] == {"step": 1} and r["rest_has_model"], r


COPIES_WORKER = Path(__file__).with_name("copies_worker.py")


def _swap(case: str, tmp: Path) -> list[dict[str, Any]]:
    port = free_port()
    return run_ranks([[str(COPIES_WORKER), case, str(r), str(port), str(tmp)] for r in (0, 1)],
                     tmp, 60)  # fmt: skip


def test_a_swap_moves_tensors_and_plain_values_checked_before_decoding(tmp_path: Path) -> None:
    r0, r1 = _swap("ok", tmp_path)
    assert r0["got"] == {"w": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], "step": 1, "name": "rank1"}
    assert r1["got"]["name"] == "rank0" and r1["got"]["w"][0] == [0.0, 1.0, 2.0]
    assert "TensorSpec" in r0["spec"] and "(2, 3)" in r0["spec"]  # the check saw no tensor


@pytest.mark.parametrize(("case", "refuser", "words"), [
    ("over_limit", 0, "rank 1 announced a shard copy of .* bytes; at most 100 allowed"),
    ("other_step", 0, "rank 1 sent the copy of step 4, not 5"),
])  # fmt: skip
def test_a_swap_refuses_an_oversized_or_stale_copy_before_allocating(
    tmp_path: Path, case: str, refuser: int, words: str
) -> None:
    results = _swap(case, tmp_path)
    assert re.search(words, results[refuser].get("refused", "")), results
