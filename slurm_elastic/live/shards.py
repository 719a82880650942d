"""A sharded model's state rebuilt from the survivors' shards after a hard loss.

FSDP2 shards every parameter (and the optimizer's state of the same shape) along dim 0
over the mesh's ``shard`` dimension, with :func:`torch.chunk`'s sizes: over ``S`` shards,
shard ``s`` of a dim-0 size ``n`` is rows ``[s*c, min((s+1)*c, n))`` with
``c = ceil(n / S)`` (empty past the end). With HSDP every shard index lives on each of
the ``R`` replicas, so a node lost without notice (its collectives broken, nothing
gathered) leaves every shard index on some survivor as long as one replica is whole.

The recovery, on every rank of the new world (:meth:`~slurm_elastic.live.fsdp.
ShardedModel.recover`):

1. At the failure, before the old world's module is dropped, each rank keeps its own
   pieces (:class:`KeptShards`): the local shard of every parameter and of its
   optimizer state, the unsharded values (buffers, Adam's ``step``, the parameter
   groups), the step they belong to and the old mesh's shard index. A rank that holds a
   full state gathered after the last optimizer step keeps that instead: it covers every
   shard index.
2. In the new world the ranks exchange what they cover (:func:`exchange.all_gather`, a
   small JSON value) and pick the newest step at which every shard index is covered
   (:func:`plan`): the same decision on every rank. None: :class:`ShardsLostError` on
   every rank (plain FSDP2 keeps each shard on one rank only), and the worker exits for
   the restart path (newest checkpoint).
3. Each shard index is sent by one rank that covers it at that step
   (:func:`exchange.broadcast`: tensors plus a JSON description, no pickle); receivers
   check every announced piece against their own model (keys, chunk shapes, dtypes)
   before any byte arrives (:func:`check_piece`) and concatenate the pieces
   (:func:`assemble`) into the full state :meth:`~slurm_elastic.live.fsdp.
   ShardedModel.shard` loads on the new mesh.

Ranks that had stepped past the chosen step (their optimizer ran on a gradient whose
collectives finished on their side only) take that step's state like the others: at
most the step in flight is redone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slurm_elastic.checkpoint.exchange import TensorSpec
from slurm_elastic.errors import ShardsLostError, StateExchangeError

__all__ = [
    "KeptShards",
    "Plan",
    "assemble",
    "check_piece",
    "chunk_bounds",
    "plan",
]

Shapes = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


def chunk_bounds(rows: int, index: int, shards: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``index`` of ``shards`` along a dim of ``rows``
    (:func:`torch.chunk`'s sizes, as FSDP2 and DTensor's ``Shard(0)`` use)."""
    if not 0 <= index < shards:
        raise ValueError(f"shard index {index} is not in [0, {shards})")
    size = math.ceil(rows / shards) if rows else 0
    return min(index * size, rows), min((index + 1) * size, rows)


def _chunk_shape(shape: tuple[int, ...], index: int, shards: int) -> tuple[int, ...]:
    start, stop = chunk_bounds(shape[0], index, shards)
    return (stop - start, *shape[1:])


def is_sharded(value: Any, param_shape: tuple[int, ...]) -> bool:
    """Whether an optimizer state value of a parameter is sharded like it (FSDP2 keeps
    state of the parameter's shape as a DTensor with its placements; scalars whole)."""
    return (
        isinstance(value, torch.Tensor) and value.dim() > 0 and (tuple(value.shape) == param_shape)
    )


@dataclass
class KeptShards:
    """What one rank kept of the old world's state at a failure.

    Attributes:
        step: the step the values belong to (optimizer steps applied).
        round: the rendezvous round of the old world.
        shards: the old mesh's shard count ``S``.
        covers: the shard indices this rank can send: its own, or all of them when
            ``whole`` is a full state.
        sharded: ``{"model": {fqn: tensor}, "state": {fqn: {key: tensor}}}``: the local
            shard of each parameter and of its sharded optimizer state, or the full
            tensors when the rank covers every index.
        unsharded: ``{"model": {key: tensor}, "state": {fqn: {key: value}},
            "groups": [...]}``: buffers, scalar optimizer state (Adam's ``step``) and
            the parameter groups (hyperparameters and FQNs), the same on every rank.
        whole: ``sharded`` holds full tensors (a gathered state): pieces are sliced.
    """

    step: int
    round: int
    shards: int
    covers: tuple[int, ...]
    sharded: dict[str, Any]
    unsharded: dict[str, Any]
    whole: bool = False

    def info(self) -> dict[str, Any]:
        """What the plan needs of this rank (a small JSON value)."""
        return {
            "step": self.step,
            "round": self.round,
            "shards": self.shards,
            "covers": list(self.covers),
        }

    def piece(self, index: int) -> dict[str, Any]:
        """Shard ``index`` (one this rank covers) of the sharded values, with the
        unsharded ones for index 0: what this rank sends when the plan picks it."""
        if index not in self.covers:  # an internal invariant: the plan picks coverers
            raise ValueError(f"shard {index} is not kept here (covers {self.covers})")

        def cut(value: torch.Tensor) -> torch.Tensor:
            if not self.whole:
                return value
            start, stop = chunk_bounds(value.shape[0], index, self.shards)
            return value[start:stop]

        out: dict[str, Any] = {
            "model": {k: cut(v) for k, v in self.sharded["model"].items()},
            "state": {
                fqn: {key: cut(v) for key, v in entry.items()}
                for fqn, entry in self.sharded["state"].items()
            },
        }
        if index == 0:
            out["unsharded"] = self.unsharded
        return out


@dataclass(frozen=True)
class Plan:
    """The step to rebuild and, per shard index, the new rank that sends it."""

    step: int
    round: int
    shards: int
    sources: tuple[int, ...]


def plan(infos: list[Any]) -> Plan:
    """The newest step at which every shard index is covered, and who sends each.

    Args:
        infos: each new rank's :meth:`KeptShards.info`, or ``None`` (it kept nothing: a
            newcomer), in new-rank order.

    Raises:
        ShardsLostError: no step has every shard index (a shard lived only on lost ranks).
        StateExchangeError: a malformed info.
    """
    kept = [(rank, _valid(info)) for rank, info in enumerate(infos) if info is not None]
    if not kept:
        raise ShardsLostError("no surviving rank kept any shard of the sharded model")
    newest = max(info["round"] for _, info in kept)
    kept = [(rank, info) for rank, info in kept if info["round"] == newest]
    shards = {info["shards"] for _, info in kept}
    if len(shards) != 1:
        raise StateExchangeError(f"ranks of round {newest} disagree on the shard count: {shards}")
    (count,) = shards
    for step in sorted({info["step"] for _, info in kept}, reverse=True):
        sources: list[int] = []
        for index in range(count):
            holders = [r for r, i in kept if i["step"] == step and index in i["covers"]]
            if not holders:
                break
            sources.append(holders[0])
        else:
            return Plan(step, newest, count, tuple(sources))
    have = sorted({(i["step"], tuple(i["covers"])) for _, i in kept})
    raise ShardsLostError(
        f"shards of round {newest} are lost: the survivors hold (step, shard indices) "
        f"{have} of {count} shards, no step has them all (plain FSDP2 keeps each shard on "
        "one rank; use HSDP, FSDPConfig(replicate=R), to keep replicas): restart from the "
        "newest checkpoint"
    )


def _valid(info: Any) -> dict[str, Any]:
    ok = (
        type(info) is dict
        and set(info) == {"step", "round", "shards", "covers"}
        and all(type(info[k]) is int for k in ("step", "round", "shards"))
        and info["shards"] >= 1
        and type(info["covers"]) is list
        and all(type(c) is int and 0 <= c < info["shards"] for c in info["covers"])
    )
    if not ok:
        raise StateExchangeError(f"a peer's shard info is malformed: {info!r:.120}")
    return info


def _refuse(where: str, why: str) -> StateExchangeError:
    return StateExchangeError(f"refused a peer's shard: {where}: {why}; nothing was replaced")


def _check_tensor(where: str, got: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(got, TensorSpec) or (got.dtype, got.shape) != (dtype, shape):
        raise _refuse(where, f"{got!r:.80}, expected {dtype} {list(shape)}")


def check_piece(
    spec: Any, index: int, shards: int, template: Shapes, params: Shapes, groups: list[list[str]]
) -> None:
    """Refuse an announced piece unless it is shard ``index`` of this model's state.

    ``spec`` holds a :class:`TensorSpec` per tensor. Every parameter (``params``) has its
    chunk's shape and its dtype; optimizer state entries name parameters and their
    sharded tensors have the chunk's shape; index 0 also carries the buffers (the rest of
    ``template``, whole), scalar optimizer state and the parameter groups (``groups``:
    the FQNs of each).

    Raises:
        StateExchangeError: names the first difference.
    """
    want = {"model", "state", "unsharded"} if index == 0 else {"model", "state"}
    if type(spec) is not dict or set(spec) != want:
        raise _refuse("parts", f"expected {sorted(want)}")
    model = spec["model"]
    if type(model) is not dict or set(model) != set(params):
        raise _refuse("model", f"expected the parameters {sorted(params)[:5]}")
    for key, (dtype, shape) in params.items():
        _check_tensor(f"model[{key!r}]", model[key], dtype, _chunk_shape(shape, index, shards))
    state = spec["state"]
    if type(state) is not dict:
        raise _refuse("state", "not a mapping")
    for fqn, entry in state.items():
        if fqn not in params or type(entry) is not dict:
            raise _refuse(f"state[{fqn!r}]", "not a parameter of this model")
        dtype, shape = params[fqn]
        for key, value in entry.items():
            _check_tensor(
                f"state[{fqn!r}][{key!r}]", value, dtype, _chunk_shape(shape, index, shards)
            )
    if index == 0:
        _check_unsharded(spec["unsharded"], template, params, groups)


def _check_unsharded(spec: Any, template: Shapes, params: Shapes, groups: list[list[str]]) -> None:
    if type(spec) is not dict or set(spec) != {"model", "state", "groups"}:
        raise _refuse("unsharded", "expected ['groups', 'model', 'state']")
    buffers = {k: v for k, v in template.items() if k not in params}
    if type(spec["model"]) is not dict or set(spec["model"]) != set(buffers):
        raise _refuse("unsharded.model", f"expected the buffers {sorted(buffers)[:5]}")
    for key, (dtype, shape) in buffers.items():
        _check_tensor(f"buffer {key!r}", spec["model"][key], dtype, shape)
    state = spec["state"]
    if type(state) is not dict:
        raise _refuse("unsharded.state", "not a mapping")
    for fqn, entry in state.items():
        if fqn not in params or type(entry) is not dict:
            raise _refuse(f"unsharded.state[{fqn!r}]", "not a parameter of this model")
        for key, value in entry.items():
            if isinstance(value, TensorSpec) and value.shape != ():
                raise _refuse(f"unsharded.state[{fqn!r}][{key!r}]", "not a scalar")
    got = spec["groups"]
    if type(got) is not list or len(got) != len(groups):
        raise _refuse("param_groups", f"expected {len(groups)} groups")
    for i, (group, names) in enumerate(zip(got, groups, strict=True)):
        if type(group) is not dict or group.get("params") != names:
            raise _refuse(f"param_groups[{i}]", "different parameters")
        if any(isinstance(v, TensorSpec) for v in group.values()):
            raise _refuse(f"param_groups[{i}]", "a tensor hyperparameter")


def assemble(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """The full state (:meth:`~slurm_elastic.live.fsdp.ShardedModel.gather`'s layout)
    from checked pieces ``0..S-1``: each sharded tensor is its chunks concatenated."""
    first = pieces[0]
    unsharded = first["unsharded"]
    model = dict(unsharded["model"])
    for key in first["model"]:
        model[key] = torch.cat([p["model"][key] for p in pieces])
    state: dict[str, dict[str, Any]] = {
        fqn: dict(entry) for fqn, entry in unsharded["state"].items()
    }
    for fqn, entry in first["state"].items():
        for key in entry:
            if any(key not in p["state"].get(fqn, {}) for p in pieces):
                raise StateExchangeError(
                    f"refused a peer's shard: state[{fqn!r}][{key!r}] is missing from "
                    "some shards; nothing was replaced"
                )
            state.setdefault(fqn, {})[key] = torch.cat([p["state"][fqn][key] for p in pieces])
    return {"model": model, "optimizer": {"state": state, "param_groups": unsharded["groups"]}}
