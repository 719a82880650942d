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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slurm_elastic.checkpoint.exchange import TensorSpec
from slurm_elastic.errors import ShardsLostError, ShardsNotKeptError, StateExchangeError

__all__ = [
    "KeptShards",
    "Plan",
    "assemble",
    "check_full",
    "check_piece",
    "chunk_bounds",
    "full_parts",
    "local_parts",
    "make_pieces",
    "plan",
    "spec_of",
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


def local_parts(
    module: Any, mesh: Any, optimizer: Any, groups: list[list[str]], params: Shapes
) -> tuple[int, int, dict[str, Any], dict[str, Any]]:
    """Local (no collective): this rank's shard index, the mesh's shard count and host
    copies of its values (:func:`make_pieces`' ``sharded`` and ``unsharded``).

    Args:
        module: the module sharded by ``fully_shard`` (parameters resharded first: a
            failure in the middle of a forward may have left them gathered).
        mesh: its device mesh (1-D, or 2-D ``(replicate, shard)``).
        optimizer: its optimizer (or ``None``), on the sharded parameters.
        groups: the FQNs of each of the optimizer's parameter groups.
        params: the model's parameters by FQN.

    Raises:
        ShardsNotKeptError: a parameter or optimizer tensor is not sharded as FSDP2 shards it.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if module is None or mesh is None:
        raise ShardsNotKeptError("the model is not sharded")
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))

    def local(where: str, value: Any) -> torch.Tensor:
        if not isinstance(value, DTensor) or tuple(value.placements) != placements:
            raise ShardsNotKeptError(f"{where} is not a DTensor sharded as {placements}")
        return value.to_local().detach().to("cpu", copy=True)

    live = module.state_dict()
    model = {key: local(key, live[key]) for key in params}
    buffers = {}
    for key, value in live.items():
        if key not in params:
            if isinstance(value, DTensor):
                raise ShardsNotKeptError(f"buffer {key} is a DTensor")
            buffers[key] = value.detach().to("cpu", copy=True)
    sharded: dict[str, dict[str, Any]] = {}
    unsharded: dict[str, dict[str, Any]] = {}
    hyper: list[dict[str, Any]] = []
    for group, fqns in zip(optimizer.param_groups if optimizer else [], groups, strict=True):
        hyper.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
        for param, fqn in zip(group["params"], fqns, strict=True):
            for key, value in (optimizer.state.get(param) or {}).items():
                if isinstance(value, DTensor):
                    sharded.setdefault(fqn, {})[key] = local(f"{fqn}.{key}", value)
                elif isinstance(value, torch.Tensor):
                    unsharded.setdefault(fqn, {})[key] = value.detach().to("cpu", copy=True)
                else:
                    unsharded.setdefault(fqn, {})[key] = value
    return (
        int(mesh.get_coordinate()[-1]),
        int(mesh.size(mesh.ndim - 1)),
        {"model": model, "state": sharded},
        {"model": buffers, "state": unsharded, "groups": hyper},
    )


def full_parts(full: Mapping[str, Any], params: Shapes) -> tuple[dict[str, Any], dict[str, Any]]:
    """A full state (:meth:`~slurm_elastic.live.fsdp.ShardedModel.gather`'s layout) as
    :func:`make_pieces`' ``sharded`` (full tensors) and ``unsharded``."""
    opt = full["optimizer"]
    shapes = {fqn: shape for fqn, (_, shape) in params.items()}
    sharded: dict[str, dict[str, Any]] = {}
    unsharded: dict[str, dict[str, Any]] = {}
    for fqn, entry in opt["state"].items():
        for key, value in entry.items():
            into = sharded if is_sharded(value, shapes[fqn]) else unsharded
            into.setdefault(fqn, {})[key] = value
    return (
        {"model": {k: full["model"][k] for k in params}, "state": sharded},
        {
            "model": {k: v for k, v in full["model"].items() if k not in params},
            "state": unsharded,
            "groups": opt["param_groups"],
        },
    )


def make_pieces(
    sharded: Mapping[str, Any],
    unsharded: Mapping[str, Any],
    covers: tuple[int, ...],
    shards: int,
    whole: bool,
) -> dict[int, dict[str, Any]]:
    """The pieces to send for the shard indices ``covers`` (index 0 also carries the
    unsharded values).

    Args:
        sharded: ``{"model": {fqn: tensor}, "state": {fqn: {key: tensor}}}``: the local
            shard of each parameter and of its sharded optimizer state (one index in
            ``covers``), or full tensors (``whole``: sliced into each index's rows).
        unsharded: ``{"model": {key: tensor}, "state": {fqn: {key: value}},
            "groups": [...]}``: buffers, scalar optimizer state (Adam's ``step``) and the
            parameter groups (hyperparameters and FQNs), the same on every rank.
        covers: the shard indices the values are (all of them when ``whole``).
        shards: the mesh's shard count ``S``.
        whole: the sharded values are full tensors.
    """

    def piece(index: int) -> dict[str, Any]:
        def cut(value: torch.Tensor) -> torch.Tensor:
            if not whole:
                return value
            start, stop = chunk_bounds(value.shape[0], index, shards)
            return value[start:stop]

        out: dict[str, Any] = {
            "model": {k: cut(v) for k, v in sharded["model"].items()},
            "state": {
                fqn: {key: cut(v) for key, v in entry.items()}
                for fqn, entry in sharded["state"].items()
            },
        }
        if index == 0:
            out["unsharded"] = unsharded
        return out

    return {index: piece(index) for index in covers}


@dataclass
class KeptShards:
    """What one rank holds of the old world's sharded state, by step and shard index.

    Attributes:
        round: the rendezvous round of the old world.
        shards: the old mesh's shard count ``S``.
        held: ``{step: {shard index: piece}}`` (:func:`make_pieces`): its live shard at
            the failure, a full state gathered since the last step (every index), and
            a periodic copy (its own shard and its neighbour's, of an older step).
        saved: the step of the newest checkpoint this rank saved or resumed from (-1:
            none): a step older than that is not rebuilt.
    """

    round: int
    shards: int
    held: dict[int, dict[int, dict[str, Any]]]
    saved: int = -1

    def info(self) -> dict[str, Any]:
        """What the plan needs of this rank (a small JSON value)."""
        return {
            "round": self.round,
            "shards": self.shards,
            "held": [[step, sorted(pieces)] for step, pieces in sorted(self.held.items())],
            "saved": self.saved,
        }

    def piece(self, step: int, index: int) -> dict[str, Any]:
        """The piece of shard ``index`` at ``step`` (one this rank holds), to send."""
        pieces = self.held.get(step, {})
        if index not in pieces:  # an internal invariant: the plan picks holders
            raise ValueError(f"shard {index} of step {step} is not kept here")
        return pieces[index]


@dataclass(frozen=True)
class Plan:
    """The step to rebuild and, per shard index, the new rank that sends it."""

    step: int
    round: int
    shards: int
    sources: tuple[int, ...]


def plan(infos: list[Any]) -> Plan:
    """The newest step at which every shard index is held, and who sends each.

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
    counts = {info["shards"] for _, info in kept}
    if len(counts) != 1:
        raise StateExchangeError(f"ranks of round {newest} disagree on the shard count: {counts}")
    (count,) = counts
    holders: dict[int, dict[int, int]] = {}  # step -> index -> lowest rank holding it
    for rank, info in kept:
        for step, indices in info["held"]:
            for index in indices:
                holders.setdefault(step, {}).setdefault(index, rank)
    saved = max(info["saved"] for _, info in kept)
    for step in sorted(holders, reverse=True):
        if len(holders[step]) == count:
            if step < saved:
                raise ShardsLostError(
                    f"the newest step the survivors hold whole in memory is {step}, the newest "
                    f"checkpoint is of step {saved}: restart from the checkpoint"
                )
            return Plan(step, newest, count, tuple(holders[step][i] for i in range(count)))
    have = {step: sorted(by) for step, by in sorted(holders.items())}
    raise ShardsLostError(
        f"shards of round {newest} are lost: the survivors hold shard indices {have} (by "
        f"step) of {count} shards, no step has them all (plain FSDP2 keeps each shard on one "
        "rank: use HSDP, FSDPConfig(replicate=R), or a neighbour's copy, "
        "FSDPConfig(copy_every=K)): restart from the newest checkpoint"
    )


def _valid(info: Any) -> dict[str, Any]:
    def held_ok(entry: Any, count: int) -> bool:
        return (
            type(entry) is list
            and len(entry) == 2
            and type(entry[0]) is int
            and type(entry[1]) is list
            and all(type(c) is int and 0 <= c < count for c in entry[1])
        )

    ok = (
        type(info) is dict
        and set(info) == {"round", "shards", "held", "saved"}
        and type(info["saved"]) is int
        and type(info["round"]) is int
        and type(info["shards"]) is int
        and info["shards"] >= 1
        and type(info["held"]) is list
        and all(held_ok(entry, info["shards"]) for entry in info["held"])
    )
    if not ok:
        raise StateExchangeError(f"a peer's shard info is malformed: {info!r:.120}")
    return info


def spec_of(tree: Any) -> Any:
    """``tree`` with a :class:`TensorSpec` in place of each tensor (for :func:`check_piece`
    on a value already received)."""
    if isinstance(tree, torch.Tensor):
        return TensorSpec(tree.dtype, tuple(tree.shape))
    if type(tree) is dict:
        return {k: spec_of(v) for k, v in tree.items()}
    if type(tree) is list:
        return [spec_of(v) for v in tree]
    return tree


def _refuse(where: str, why: str) -> StateExchangeError:
    return StateExchangeError(f"refused a peer's shard: {where}: {why}; nothing was replaced")


def _check_tensor(where: str, got: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(got, TensorSpec) or (got.dtype, got.shape) != (dtype, shape):
        raise _refuse(where, f"{got!r:.80}, expected {dtype} {list(shape)}")


def _entries(
    state: Any, params: Shapes, where: str, refuse: Callable[[str, str], StateExchangeError]
) -> Iterator[tuple[str, Any, torch.dtype, tuple[int, ...]]]:
    """Each ``(where, value, dtype, shape)`` of an optimizer state tree whose entries must
    name parameters (their dtype and full shape given)."""
    if type(state) is not dict:
        raise refuse(where, "not a mapping")
    for fqn, entry in state.items():
        if fqn not in params or type(entry) is not dict:
            raise refuse(f"{where}[{fqn!r}]", "not a parameter of this model")
        dtype, shape = params[fqn]
        for key, value in entry.items():
            yield f"{where}[{fqn!r}][{key!r}]", value, dtype, shape


def _check_groups(
    got: Any, groups: list[list[str]], where: str, refuse: Callable[[str, str], StateExchangeError]
) -> None:
    """The optimizer's parameter groups: the same FQNs each, no tensor hyperparameter."""
    if type(got) is not list or len(got) != len(groups):
        raise refuse(where, f"expected {len(groups)} groups")
    for i, (group, names) in enumerate(zip(got, groups, strict=True)):
        if type(group) is not dict or group.get("params") != names:
            raise refuse(f"{where}[{i}]", "different parameters")
        if any(isinstance(v, TensorSpec) for v in group.values()):
            raise refuse(f"{where}[{i}]", "a tensor hyperparameter")


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
    for where, value, dtype, shape in _entries(spec["state"], params, "state", _refuse):
        _check_tensor(where, value, dtype, _chunk_shape(shape, index, shards))
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
    for where, value, _, _ in _entries(spec["state"], params, "unsharded.state", _refuse):
        if isinstance(value, TensorSpec) and value.shape != ():
            raise _refuse(where, "not a scalar")
    _check_groups(spec["groups"], groups, "param_groups", _refuse)


def check_full(
    spec: Any,
    template: Shapes,
    params: Shapes,
    groups: list[list[str]],
    refuse: Callable[[str, str], StateExchangeError],
) -> None:
    """Refuse an announced full state (``{"model", "optimizer"}``, a :class:`TensorSpec`
    per tensor) unless it has this model's structure: exactly ``template``'s keys with
    their full shapes and dtypes; the parameter groups ``groups`` (same FQNs, no tensor
    among the hyperparameters); optimizer state entries naming parameters, each tensor of
    its parameter's shape and dtype or a scalar.

    Raises:
        StateExchangeError: ``refuse(where, why)`` for the first difference.
    """
    if type(spec) is not dict or set(spec) != {"model", "optimizer"}:
        raise refuse("parts", "expected ['model', 'optimizer']")
    model = spec["model"]
    if type(model) is not dict or set(model) != set(template):
        have = sorted(model)[:5] if type(model) is dict else type(model).__name__
        raise refuse("model", f"keys {have}, this model has {sorted(template)[:5]}")
    for key, (dtype, shape) in template.items():
        got = model[key]
        if not isinstance(got, TensorSpec) or (got.dtype, got.shape) != (dtype, shape):
            raise refuse(f"model[{key!r}]", f"{got!r:.80}, this rank has {dtype} {shape}")
    opt = spec["optimizer"]
    if type(opt) is not dict or set(opt) != {"state", "param_groups"}:
        raise refuse("optimizer", "expected ['state', 'param_groups']")
    _check_groups(opt["param_groups"], groups, "optimizer.param_groups", refuse)
    for where, value, dtype, shape in _entries(opt["state"], params, "optimizer.state", refuse):
        if (
            isinstance(value, TensorSpec)
            and value.shape != ()
            and (value.shape != shape or value.dtype != dtype)
        ):
            raise refuse(
                where, f"{value.dtype} {list(value.shape)}, the parameter is {dtype} {list(shape)}"
            )


def assemble(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """The full state (:meth:`~slurm_elastic.live.fsdp.ShardedModel.gather`'s layout)
    from checked pieces ``0..S-1``: each sharded tensor is its chunks concatenated."""
    first = pieces[0]
    unsharded = _own_copy(first["unsharded"])  # the sender's own tensors, on the sender
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


def _own_copy(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _own_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_own_copy(v) for v in tree]
    return tree
