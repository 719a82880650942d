"""Values between ranks without pickle (slurm_elastic.checkpoint.exchange, ElasticState.sync).

Real processes in a real gloo group over TCP (tests/checkpoint/exchange_worker.py). In the
attack cases rank 0 is a hostile process that took the sender's seat in the round (the
round's TCPStore is reachable by other users): it may speak torch's pickle protocol or
ours with forged contents. Nothing it sends may run code in a receiver or replace anything
of the receiver's.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_elastic.checkpoint import container, exchange
from slurm_elastic.errors import CheckpointCorruptError, StateExchangeError
from tests import helpers

WORKER = Path(__file__).with_name("exchange_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    case: str, world: int, tmp_path: Path, deadline_s: float = 240
) -> list[dict[str, Any]]:
    port = free_port()
    argvs = [
        [str(WORKER), case, str(r), str(world), str(port), str(tmp_path)] for r in range(world)
    ]
    return helpers.run_ranks(argvs, tmp_path, deadline_s)


def test_values_cross_ranks_intact(tmp_path: Path) -> None:
    results = run_ranks("round_trip", 3, tmp_path)
    for r in results:
        assert r["broadcast_equal"] and r["gather_equal"], r
        assert r["int"] == 12345 and r["none"] is None


def test_a_pickle_from_a_hostile_sender_never_runs_in_the_receivers(tmp_path: Path) -> None:
    """The reproduced hole: a newcomer's sync unpickled what rank 0 sent."""
    results = run_ranks("pickle_attack", 3, tmp_path)
    assert not (tmp_path / "pwned").exists(), "the sender's pickle ran in a receiver"
    for victim in results[1:]:
        assert victim["victim"] != "accepted", victim
        assert victim["state_unchanged"], victim
        assert victim["commit_id"] == [1, 1], victim


@pytest.mark.parametrize(
    ("case", "words"),
    [
        (
            "wrong_shape",
            "model['weight']: torch.float32 [2, 5], this rank has torch.float32 [2, 4]",
        ),
        ("float64", "model['weight']: torch.float64 [2, 4], this rank has torch.float32 [2, 4]"),
        ("qint8_header", "dtype 'qint8'"),
        ("huge", "data bytes announced"),
    ],
)
def test_a_state_that_is_not_the_receivers_is_refused_before_anything_is_replaced(
    tmp_path: Path, case: str, words: str
) -> None:
    """Wrong shapes, a float64 state for float32 parameters, a forged dtype or padding:
    refused on every rank (the sender too, so nobody waits in a collective); the
    receivers' live state and commit are as they were and restore() still works."""
    results = run_ranks(case, 3, tmp_path)
    for r in results:
        assert r["result"] == "StateExchangeError", r
        assert r["state_unchanged"], r
    for victim in results[1:]:
        assert words in victim["message"], victim
        assert victim["commit_id"] == [1, 1] and victim["restore_ok"], victim
    assert results[0]["commit_id"] == [5, 99]


# ------------------------------------------------------------------ pack/unpack, one process


def test_pack_unpack_round_trip_and_no_pickle_fallback() -> None:
    value = {"a": torch.arange(5), "b": [1, "x", None, (2.5,)], "c": {"d": torch.ones(2, 2)}}
    got = exchange.unpack(exchange.pack(value))
    assert torch.equal(got["a"], value["a"]) and torch.equal(got["c"]["d"], value["c"]["d"])
    assert got["b"] == [1, "x", None, (2.5,)]

    class Custom:
        pass

    with pytest.raises(StateExchangeError, match="without pickle"):
        exchange.pack({"x": Custom()})


def _forged_blob(mutate: Any) -> bytes:
    header, data = exchange.encode({"w": torch.ones(4), "v": torch.zeros(2, dtype=torch.int64)})
    body = json.loads(header)
    mutate(body)
    text = json.dumps(body).encode()
    start = exchange._BLOB.size + len(text)
    pad = -start % 64
    return (
        exchange._BLOB.pack(exchange._BLOB_MAGIC, len(text), data.numel())
        + text
        + bytes(pad)
        + data.numpy().tobytes()
    )


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda b: b["tensors"][0].update(dtype="qint8"), "not one this format writes"),
        (lambda b: b["tensors"][0].update(dtype="quint4x2"), "not one this format writes"),
        (lambda b: b["tensors"][0].update(offset=-64), "bad tensor record"),
        (lambda b: b["tensors"][0].update(shape=["4"]), "not an integer"),
        (lambda b: b["tensors"][0].update(shape=[4.0]), "not an integer"),
        (lambda b: b["tensors"][0].update(shape=[True, 4]), "not an integer"),
        (lambda b: b["tensors"][0].update(device="meta"), "device 'meta'"),
        (lambda b: b["tensors"][1].update(offset=0), "overlapping"),
        (lambda b: b.update(tree={"T": 7}), "bad tensor reference"),
        (lambda b: b.update(tree={"Z": 1}), "bad tree node"),
        (lambda b: b.update(tree={"d": [[[1], 2]]}), "bad tree"),
    ],
)
def test_forged_descriptions_are_refused_with_a_clear_error(mutate: Any, words: str) -> None:
    with pytest.raises(StateExchangeError, match="malformed") as info:
        exchange.unpack(_forged_blob(mutate))
    assert words in str(info.value)


def test_unpack_refuses_more_than_its_limit() -> None:
    blob = exchange.pack({"w": torch.ones(1000)})
    with pytest.raises(StateExchangeError, match="at most 100 allowed"):
        exchange.unpack(blob, limit=100)


def test_container_writer_and_reader_agree_on_dtypes() -> None:
    """Every dtype the reader accepts is one the writer emits, and the writer refuses the
    rest (quantized dtypes: a tensor made from bytes alone crashes on use)."""
    for name, dtype in container.DTYPES.items():
        t = torch.zeros(3, dtype=dtype)
        got = exchange.unpack(exchange.pack({"t": t}))["t"]
        assert got.dtype == dtype and got.shape == t.shape, name
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(container.Unsupported):
        container.encode_tree({"q": q})
    with pytest.raises(CheckpointCorruptError, match="not one this format writes"):
        container.check_records(
            [{"dtype": "qint8", "shape": [1], "offset": 0, "nbytes": 1, "device": "cpu"}], 64
        )
