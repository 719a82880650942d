"""One rank of an exchange test (tests/checkpoint/test_exchange.py): real processes, real
gloo over TCP. Usage: exchange_worker.py CASE RANK WORLD PORT OUTDIR.

Writes ``OUTDIR/rank<R>.json`` with what this rank saw. Rank 0 is the sender; in the
attack cases it is the hostile peer (a process that took rank 0's seat in the round).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from slurm_elastic.checkpoint import exchange
from slurm_elastic.live import ElasticState


class Evil:
    """Unpickling this creates the marker file: proof that code of the sender ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def victim_state() -> tuple[ElasticState, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    state = ElasticState(model, opt, step=1)
    state.commit((1, 1))
    return state, model


def snapshot(model: torch.nn.Module) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def sample_value(rank: int) -> Any:
    return {
        "f32": torch.arange(6, dtype=torch.float32).view(2, 3) + rank,
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "i64": torch.tensor(7 + rank),
        "bool": torch.tensor([True, False]),
        "empty": torch.empty(0, 5),
        "nested": OrderedDict(a=(1, 2.5, None, "x"), b=[b"\x00\x01", torch.Size([2, 3])]),
        3: torch.float16,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def main() -> None:
    case, rank, world, port, outdir = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        pathlib.Path(sys.argv[5]),
    )
    marker = str(outdir / "pwned")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        # generous: ranks start seconds apart on a loaded 2-core machine
        timeout=timedelta(seconds=60),
    )
    out: dict[str, Any] = {"rank": rank}
    try:
        if case == "round_trip":
            got = exchange.broadcast(sample_value(0) if rank == 0 else None, 0)
            out["broadcast_equal"] = same(got, sample_value(0))
            gathered = exchange.all_gather(sample_value(rank))
            out["gather_equal"] = all(same(g, sample_value(r)) for r, g in enumerate(gathered))
            out["int"] = exchange.broadcast_int(12345 if rank == 0 else None)
            out["none"] = exchange.broadcast_int(None)
        elif case == "pickle_attack":
            # The hostile peer speaks torch's object protocol: a pickle whose loading
            # runs its code. The victims take their state from it. Every rank is up
            # (the barrier): the victims' mismatched collectives end at the short
            # timeout of the group the attack runs on.
            dist.barrier()
            attack = dist.new_group(timeout=timedelta(seconds=5))
            if rank == 0:
                payload: list[Any] = [{"state": Evil(marker), "id": (9, 9)}]
                try:
                    dist.broadcast_object_list(payload, src=0, group=attack)
                except Exception as exc:  # the victims do not play along
                    out["attacker_error"] = type(exc).__name__
            else:
                state, model = victim_state()
                before = snapshot(model)
                try:
                    state.sync(0, group=attack)
                    out["victim"] = "accepted"
                except Exception as exc:
                    out["victim"] = type(exc).__name__
                out["state_unchanged"] = snapshot(model) == before
                out["commit_id"] = list(state.commit_id)
        elif case in ("wrong_shape", "float64", "qint8_header", "huge"):
            if rank == 0:
                # A peer (hostile or just a different model) announces a state that is not
                # the receivers'.
                torch.manual_seed(1)
                width = 5 if case == "wrong_shape" else 4
                model = torch.nn.Linear(width, 2)
                if case == "float64":
                    model = model.double()
                opt = torch.optim.Adam(model.parameters(), lr=0.1)
                model(torch.ones(1, width, dtype=next(model.parameters()).dtype)).sum().backward()
                opt.step()
                state = ElasticState(model, opt, step=99)
                state.commit((5, 99))
                if case in ("qint8_header", "huge"):
                    real = exchange.encode  # the attacker edits what it sends

                    def forged(value: Any) -> tuple[bytes, torch.Tensor]:
                        header, data = real(value)
                        body = json.loads(header)
                        if case == "qint8_header":
                            body["tensors"][0]["dtype"] = "qint8"
                            return json.dumps(body).encode(), data
                        return header, torch.zeros(1 << 24, dtype=torch.uint8)  # 16 MiB

                    exchange.encode = forged  # type: ignore[assignment]
            else:
                state, model = victim_state()
            before = snapshot(model)
            try:
                state.sync(0)
                out["result"] = "accepted"
            except Exception as exc:
                out["result"] = type(exc).__name__
                out["message"] = str(exc)
            out["state_unchanged"] = snapshot(model) == before
            out["commit_id"] = list(state.commit_id)
            if rank != 0:
                state.restore()  # its own commit is still there to roll back to
                out["restore_ok"] = True
        else:
            raise SystemExit(f"unknown case {case}")
    finally:
        (outdir / f"rank{rank}.json").write_text(json.dumps(out))
        os._exit(0)  # no teardown: a failed exchange may have left the group unusable


if __name__ == "__main__":
    main()
