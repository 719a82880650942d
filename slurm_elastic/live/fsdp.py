"""FSDP2 and HSDP in the live session: the model is re-sharded in place on a change.

With ``ElasticSession(..., fsdp=FSDPConfig(build=...))`` the session wraps the model with
``torch.distributed.fsdp.fully_shard`` (FSDP2) on a device mesh over the current world
instead of DDP: a 1-D ``("shard",)`` mesh, or with ``replicate=R`` a 2-D
``("replicate", "shard")`` mesh (HSDP: ``R`` replicas, each sharded over ``world / R``
ranks). :class:`ShardedModel` is the piece the session and
:class:`~slurm_elastic.live.world.LiveWorld` call:

* :meth:`ShardedModel.gather` (collective over the *old* world, on every rank, the
  leaving ones included, at the step boundary that switches): every DTensor of the model
  and of the optimizer's state becomes a full host tensor (``full_tensor()``), keyed by
  parameter name (FQN) as ``torch.distributed.checkpoint.state_dict`` does;
* the session commits that full state like any registered object
  (:meth:`state_dict`) and a newcomer receives it from a survivor over the network as
  tensors plus a JSON description (:mod:`slurm_elastic.checkpoint.exchange`, never
  pickle), checked first against its own structure (:meth:`check_state`);
* :meth:`release` (in the group teardown) drops the sharded module and the optimizer's
  references to the old mesh and hands back the old groups so the caller holds them
  across ``destroy_process_group`` (the safe order of the DDP path);
* :meth:`shard` (in the new world): a fresh module from ``build()``, ``fully_shard`` on
  the new mesh, the full state loaded (each rank keeps its slice), the *same* optimizer
  object re-pointed at the new parameters (a scheduler built on it stays valid).

Limits (``docs/live.md``): the full state is materialized in host memory on every rank
at a switch and at each checkpoint (rank 0 writes it; a load reshards to any world). A
peer lost without notice is recovered in place when the survivors hold every shard of
one step (:meth:`ShardedModel.keep_shards`, :meth:`ShardedModel.recover`,
:mod:`~slurm_elastic.live.shards`; neighbour copies: :mod:`~slurm_elastic.live.copies`),
else :class:`ShardsLostError` sends the worker to the restart path. Hooks on the user's
module do not move to the rebuilt one; use :attr:`ElasticSession.model` at every step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slurm_elastic.checkpoint import exchange
from slurm_elastic.errors import ShardsLostError, ShardsNotKeptError, StateExchangeError
from slurm_elastic.live import copies, shards
from slurm_elastic.live.shards import KeptShards

__all__ = [
    "STATE_KEY",
    "FSDPConfig",
    "ShardedModel",
    "ShardsLostError",
    "mesh_shape",
    "sharded_parts",
]

log = logging.getLogger(__name__)

STATE_KEY = "_fsdp"
"""The name the sharded state is registered under in the session's ``stateful``."""


@dataclass(frozen=True)
class FSDPConfig:
    """How the session shards the model.

    Attributes:
        build: returns a fresh, unsharded model of the same architecture as the one given
            to the session (its values are overwritten); called on every re-shard.
        shard_modules: the submodules to ``fully_shard`` before the root (e.g. the
            transformer blocks), given the model; ``None``: the root only.
        replicate: HSDP replicas (``1``: plain FSDP2). A world of ``W`` ranks uses
            ``gcd(replicate, W)`` replicas of ``W / gcd`` ranks each.
        reshard_after_forward: passed to ``fully_shard``; ``None`` (torch's default):
            all but the root reshard after forward (``True`` for the root too: less
            memory, one more all-gather per step, ~2 % of the example's step on CPU).
        copy_every: with one replica (plain FSDP2), every this many steps each rank
            swaps its shards with its neighbours in the background (the same local
            rank of the next and the previous node): a node lost without notice is
            rebuilt in place, redoing at most this many steps; costs two shards of host
            memory per rank and one shard sent per copy.
            ``None``: 50; ``0``: never (a hard loss restarts from the checkpoint).
            With HSDP (two replicas or more) the replicas hold every shard: no copy.
    """

    build: Callable[[], nn.Module]
    shard_modules: Callable[[nn.Module], Iterable[nn.Module]] | None = None
    replicate: int = 1
    reshard_after_forward: bool | int | None = None
    copy_every: int | None = None

    def __post_init__(self) -> None:
        if not callable(self.build):
            raise TypeError(
                f"FSDPConfig.build={self.build!r} is not callable: pass a function that "
                "returns a fresh unsharded model"
            )
        if type(self.replicate) is not int or self.replicate < 1:
            raise ValueError(
                f"FSDPConfig.replicate={self.replicate!r} must be an integer >= 1 "
                "(1: FSDP2 over all ranks; R: HSDP with R replicas)"
            )
        if self.copy_every is not None and (
            type(self.copy_every) is not int or self.copy_every < 0
        ):
            raise ValueError(
                f"FSDPConfig.copy_every={self.copy_every!r} must be an integer >= 0 steps "
                "(0: no neighbour copies) or None (the default, 50)"
            )


def mesh_shape(world_size: int, replicate: int) -> tuple[int, int]:
    """``(replicas, shards)`` for a world: ``gcd(replicate, world_size)`` replicas."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    replicas = math.gcd(replicate, world_size)
    return replicas, world_size // replicas


def _full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()  # collective over the value's mesh
    return value.detach().to("cpu", copy=True)


def _refuse(where: str, why: str) -> StateExchangeError:
    return StateExchangeError(f"refused a peer's sharded state: {where}: {why}")


_NO_LIMIT = 1 << 62  # a piece's size is bounded by the receiver's check, not a constant


LIVE = "live"
"""Returned by :meth:`ShardedModel.recover`: this rank's live state is of the rebuilt step."""

DEFAULT_COPY_EVERY = 50
"""Steps between neighbour copies with plain FSDP2 (:attr:`FSDPConfig.copy_every`)."""


class ShardedModel:
    """The model under FSDP2/HSDP, its optimizer, and their full state across worlds.

    Registered in the session's :class:`~slurm_elastic.live.state.ElasticState` as the
    stateful object :data:`STATE_KEY`; its :meth:`state_dict` is the full state of the
    last :meth:`gather` (plain CPU tensors: model by FQN, optimizer state by FQN and its
    parameter groups).

    Args:
        config: how to shard.
        model: the unsharded model (sharded in place by the first :meth:`shard`).
        optimizer: built on ``model.parameters()``; it is re-pointed at the sharded
            parameters at every :meth:`shard`.

    Raises:
        ValueError: the optimizer holds a parameter that is not the model's.
    """

    def __init__(
        self, config: FSDPConfig, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> None:
        self.config = config
        self.module: nn.Module | None = model
        self.optimizer = optimizer
        self._sharded = False
        self._mesh: Any = None
        names = {id(p): n for n, p in model.named_parameters()}
        self._groups: list[list[str]] = []
        for i, group in enumerate(optimizer.param_groups if optimizer is not None else []):
            missing = [n for n, p in enumerate(group["params"]) if id(p) not in names]
            if missing:
                raise ValueError(
                    f"optimizer param_groups[{i}] holds parameters {missing} that are not the "
                    "model's: build the optimizer on model.parameters() before the session"
                )
            self._groups.append([names[id(p)] for p in group["params"]])
        self._template = {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
        self._params = {n: (p.dtype, tuple(p.shape)) for n, p in model.named_parameters()}
        # The newest full state (gathered here or received) and whether no optimizer
        # step happened since (else it is history, not the live state).
        self._full: dict[str, Any] | None = None
        self._fresh = False
        self._loading = False
        # What this rank kept of the old world at a hard loss (live/shards.py): the
        # pieces, and by step its own state of that step (None: the live one)
        self._kept: KeptShards | None = None
        self._own: dict[int, dict[str, Any] | None] = {}
        self._copies: copies.NeighbourCopies | None = None  # of the current mesh
        self._placeholder = False
        if optimizer is not None:
            optimizer.register_step_post_hook(self._on_step)

    def _on_step(self, *_: Any) -> None:
        if not self._loading:
            # history now: state_dict() refuses it, so free its memory (a full state)
            self._full, self._fresh = None, False

    # -- sharding ------------------------------------------------------------------------

    def shard(self, device_type: str, world_size: int) -> nn.Module:
        """Collective over the current world: shard a model on a new mesh and load the
        newest full state into it; return the sharded module."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        replicas, shards = mesh_shape(world_size, self.config.replicate)
        if replicas > 1:
            mesh = init_device_mesh(
                device_type, (replicas, shards), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh(device_type, (shards,), mesh_dim_names=("shard",))
        if self._sharded or self.module is None:
            module = self.config.build()
            got = {k: (v.dtype, tuple(v.shape)) for k, v in module.state_dict().items()}
            if got != self._template:
                raise ValueError(
                    "FSDPConfig.build() returned a model whose state differs from the "
                    f"session's model ({sorted(set(got) ^ set(self._template))[:5]} or "
                    "shapes/dtypes): it must build the same architecture every call"
                )
        else:
            module = self.module
        for sub in self.config.shard_modules(module) if self.config.shard_modules else ():
            fully_shard(sub, mesh=mesh, reshard_after_forward=self.config.reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=self.config.reshard_after_forward)
        self.module, self._mesh, self._sharded = module, mesh, True
        params = dict(module.named_parameters())
        if self.optimizer is not None:
            for group, names in zip(self.optimizer.param_groups, self._groups, strict=True):
                group["params"] = [params[n] for n in names]
            self.optimizer.state.clear()
        if self._full is not None:
            self._load(module, self._full)
        log.info("model sharded: %d replica(s) x %d shard(s)", replicas, shards)
        return module

    def _load(self, module: nn.Module, full: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )
        from torch.distributed.tensor import DTensor, distribute_tensor

        self._loading = True
        try:
            set_model_state_dict(
                module, dict(full["model"]), options=StateDictOptions(full_state_dict=True)
            )
            if self.optimizer is None:
                return
            params = dict(module.named_parameters())
            saved = full["optimizer"]
            for group, old in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
                for key, value in old.items():
                    if key == "params":
                        continue
                    if isinstance(group.get(key), tuple) and isinstance(value, list):
                        value = tuple(value)  # a JSON list on the wire
                    group[key] = value
            for name, entry in saved["state"].items():
                param = params[name]
                state: dict[str, Any] = {}
                for key, value in entry.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and isinstance(param, DTensor)
                        and (tuple(value.shape) == tuple(param.shape) and value.dim() > 0)
                    ):
                        state[key] = distribute_tensor(
                            value,
                            param.device_mesh,
                            param.placements,
                            src_data_rank=None,  # every rank holds the full value
                        )
                    elif isinstance(value, torch.Tensor):
                        state[key] = value.detach().clone()
                    else:
                        state[key] = value
                self.optimizer.state[param] = state
        finally:
            self._loading = False

    def gather(self) -> None:
        """Collective over the current world (every rank): take the full state now."""
        if self.module is None:
            raise ShardsLostError("gather() after release(): the sharded model is gone")
        model = {k: _full(v) for k, v in self.module.state_dict().items()}
        optimizer: dict[str, Any] = {"state": {}, "param_groups": []}
        if self.optimizer is not None:
            names = {id(p): n for n, p in self.module.named_parameters()}
            for group, fqns in zip(self.optimizer.param_groups, self._groups, strict=True):
                hyper = {k: v for k, v in group.items() if k != "params"}
                optimizer["param_groups"].append({**hyper, "params": list(fqns)})
                for param in group["params"]:  # the same order on every rank
                    entry = self.optimizer.state.get(param)
                    if not entry:
                        continue
                    optimizer["state"][names[id(param)]] = {
                        k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()
                    }
        self._full, self._fresh = {"model": model, "optimizer": optimizer}, True

    def release(self) -> list[Any]:
        """Drop the sharded module and the optimizer's references to the current mesh;
        return the mesh's process groups (hold them until the group is destroyed)."""
        held: list[Any] = []
        if self._mesh is not None:
            try:
                held = list(self._mesh.get_all_groups())
            except Exception:  # a mesh over a broken world: nothing more to hold
                held = []
        if self._copies is not None:  # a copy in flight is abandoned; its group is held
            self._copies.close()
            held.append(self._copies.group)
            self._copies = None
        self.module = None
        self._mesh = None
        if self.optimizer is not None:
            self.optimizer.state.clear()
            for group in self.optimizer.param_groups:
                group["params"] = []
        return held

    # -- a hard loss: the state rebuilt from the survivors' shards (live/shards.py) -------

    def open_copies(self, backend: str, local_world: int, device: Any) -> None:
        """Collective, after :meth:`shard`: the neighbour copies' group, if copies are on,
        the mesh 1-D (HSDP: replicas hold every shard) and spans >1 node of ``local_world``."""
        import torch.distributed as dist

        n = self._mesh.size() if self._mesh is not None and self._mesh.ndim == 1 else 0
        if self._copy_every() > 0 and n > local_world:
            me = dist.get_rank()
            dest, src = (me + local_world) % n, (me - local_world) % n
            self._copies = copies.NeighbourCopies(backend, dest, src, self._piece_limit(), device)

    def _copy_every(self) -> int:
        return DEFAULT_COPY_EVERY if self.config.copy_every is None else self.config.copy_every

    def copy_due(self, step: int) -> bool:
        """Whether the step boundary ``step`` takes a neighbour copy (the same on every
        rank); a finished copy is adopted here (its failure raised)."""
        if self._copies is None:
            return False
        self._copies.poll()
        return step > 0 and step % self._copy_every() == 0

    @property
    def copy_step(self) -> int | None:
        """The step of the newest finished neighbour copy on this mesh (``None``: none)."""
        newest = self._copies.newest if self._copies is not None else None
        return newest.step if newest is not None else None

    def wait_copy(self) -> None:
        """Wait for the neighbour copy in flight and adopt it (its failure raised)."""
        if self._copies:
            self._copies.poll(wait=True)

    @contextmanager
    def without_state(self) -> Iterator[None]:
        """:meth:`state_dict` is an empty placeholder inside (the rest of a session's state
        is snapshotted beside a neighbour copy; the sharded part is rebuilt later)."""
        self._placeholder = True
        try:
            yield
        finally:
            self._placeholder = False

    def take_copy(self, step: int, round_: int, rest: dict[str, Any]) -> None:
        """At the step boundary ``step`` (due on every rank): copy this rank's shards to
        host memory and start swapping them with the neighbours in the background
        (:mod:`~slurm_elastic.live.copies`; the previous copy is waited for first).
        ``rest``: the session's other state at ``step``, kept beside them."""
        if self._copies is None:
            raise RuntimeError("take_copy() on a mesh without neighbour copies")
        index, count, sharded, unsharded = shards.local_parts(
            self.module, self._mesh, self.optimizer, self._groups, self._params
        )
        peer = self._copies.src % count  # a 1-D mesh: the rank is its shard index

        def check(spec: Any) -> None:
            shards.check_piece(spec, peer, count, self._template, self._params, self._groups)

        pieces = shards.make_pieces(sharded, unsharded, (index,), count, whole=False)
        self._copies.start(copies.Copy(step, round_, count, pieces, rest), index, peer, check)

    def _piece_limit(self) -> int:
        """Bytes a piece may have: the model's state, its optimizer's and room to spare."""
        nbytes = sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for dtype, shape in self._template.values()
        )
        return 8 * nbytes + (1 << 20)

    def keep_shards(
        self,
        step: int,
        round_: int,
        world_size: int,
        commit: tuple[int, dict[str, Any]] | None = None,
        *,
        saved: int = -1,
    ) -> None:
        """Local, at a failed collective, before :meth:`release`: keep what this rank
        holds of the state for :meth:`recover`: its live shard at ``step`` (round
        ``round_``, a world of ``world_size``) or a full state gathered since the last
        optimizer step, the neighbour copy with the session's other state of its step,
        and the session's last commit (``(step, tree)``: a full state taken at a change
        or at the start, with everything else of that step). ``saved``: the step of the
        newest checkpoint (an older step is not rebuilt: the checkpoint is newer)."""
        count = mesh_shape(world_size, self.config.replicate)[1]
        held: dict[int, dict[int, dict[str, Any]]] = {}
        if self._fresh and self._full is not None:
            sharded, unsharded = shards.full_parts(self._full, self._params)
            held[step] = shards.make_pieces(
                sharded, unsharded, tuple(range(count)), count, whole=True
            )
        else:
            try:
                index, count, sharded, unsharded = shards.local_parts(
                    self.module, self._mesh, self.optimizer, self._groups, self._params
                )
                held[step] = shards.make_pieces(sharded, unsharded, (index,), count, False)
            except ShardsNotKeptError as exc:
                log.warning("this rank keeps no live shard for a recovery in place: %s", exc)
        self._own = {step: None} if held else {}
        copy = self._copies.take_newest() if self._copies is not None else None
        if copy is not None and copy.round == round_ and copy.shards == count:
            for index, piece in copy.pieces.items():
                held.setdefault(copy.step, {}).setdefault(index, piece)
            self._own.setdefault(copy.step, copy.rest)
        full = (commit[1].get("stateful") or {}).get(STATE_KEY) if commit else None
        if commit is not None and full and full.get("model"):  # not a copy's placeholder
            sharded, unsharded = shards.full_parts(full, self._params)
            every = tuple(range(count))
            for index, piece in shards.make_pieces(sharded, unsharded, every, count, True).items():
                held.setdefault(commit[0], {}).setdefault(index, piece)
            self._own.setdefault(commit[0], commit[1])
        self._kept = KeptShards(round_, count, held, saved) if held else None

    def recover(self) -> tuple[int, str | dict[str, Any] | None] | None:
        """Collective over the new world (every rank, newcomers too): rebuild the full
        state from the pieces the ranks kept at a hard loss (:mod:`~slurm_elastic.live.
        shards`); it is what :meth:`shard` loads next.

        Returns:
            ``None`` when no rank kept anything (a graceful change: nothing to rebuild);
            else the step the rebuilt state belongs to and this rank's own state of that
            step: :data:`LIVE` (its live state is of that step), the session's state kept
            with a neighbour copy (its sharded part filled in with the rebuilt one), or
            ``None`` (it has none: it takes the state from a peer).

        Raises:
            ShardsLostError: on every rank, when no step has every shard index (restart
                from the newest checkpoint).
            StateExchangeError: on every rank, when a piece was refused.
        """
        import torch.distributed as dist

        kept = self._kept
        infos = exchange.all_gather(kept.info() if kept is not None else None)
        if all(info is None for info in infos):
            return None
        plan = shards.plan(infos)
        me = dist.get_rank()
        pieces = []
        for index, src in enumerate(plan.sources):
            payload = kept.piece(plan.step, index) if me == src and kept is not None else None

            def check(spec: Any, index: int = index) -> None:
                shards.check_piece(
                    spec, index, plan.shards, self._template, self._params, self._groups
                )

            pieces.append(exchange.broadcast(payload, src, check=check, limit=_NO_LIMIT))
        full = shards.assemble(pieces)
        own: str | dict[str, Any] | None = None
        if plan.step in self._own:
            rest = self._own[plan.step]
            own = LIVE if rest is None else {
                **rest, "stateful": {**rest["stateful"], STATE_KEY: full}
            }  # fmt: skip
        self._full, self._fresh = full, True
        # a retry of the re-formation starts from the rebuilt state
        sharded, unsharded = shards.full_parts(full, self._params)
        every = tuple(range(plan.shards))
        self._kept = KeptShards(
            plan.round,
            plan.shards,
            {plan.step: shards.make_pieces(sharded, unsharded, every, plan.shards, True)},
            plan.step,
        )
        self._own = {plan.step: None} if own is not None else {}
        log.info(
            "rebuilt the sharded state of step %d from %d shard(s) of round %d (senders %s)",
            plan.step,
            plan.shards,
            plan.round,
            list(plan.sources),
        )
        return plan.step, own

    def forget_kept(self) -> None:
        """Drop what :meth:`keep_shards` kept (the recovery is done)."""
        self._kept, self._own = None, {}

    # -- the stateful protocol (ElasticState) ----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full state of the last :meth:`gather` (or what was loaded), if it is the
        live state (no optimizer step since).

        Raises:
            ShardsLostError: the model is sharded and the full state is older than the
                live one (a peer was lost between gathers: its shards are gone).
        """
        if self._placeholder:
            return {"model": {}, "optimizer": {"state": {}, "param_groups": []}}
        if not self._sharded and not (self._fresh and self._full is not None):
            self.gather_unsharded()
        if not self._fresh or self._full is None:
            raise ShardsLostError(
                "the sharded model's full state is older than the last optimizer step and "
                "the world is gone (a peer was lost without notice): its shards come back "
                "through recover(), else restart from the newest checkpoint"
            )
        return self._full

    def gather_unsharded(self) -> None:
        """The full state of the model before its first :meth:`shard` (local)."""
        if self.module is None:
            raise ShardsLostError("no model to take the state of")
        self.gather()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep ``state`` (a full state) for the next :meth:`shard` to load."""
        if not isinstance(state, Mapping) or set(state) != {"model", "optimizer"}:
            raise ValueError(
                f"a sharded model's state has parts ['model', 'optimizer'], got "
                f"{sorted(state) if isinstance(state, Mapping) else type(state).__name__}"
            )
        self._full, self._fresh = {"model": state["model"], "optimizer": state["optimizer"]}, True
        if self._sharded and self.module is not None:  # a live world: load now
            self._load(self.module, self._full)

    def check_state(self, spec: Any) -> None:
        """Refuse an announced full state unless it has this model's structure.

        ``spec`` holds an :class:`~slurm_elastic.checkpoint.exchange.TensorSpec` per
        tensor. Model: exactly this model's keys, each with its full shape and dtype.
        Optimizer: this optimizer's parameter groups (same FQNs, no tensors among the
        hyperparameters); each state entry names one of its parameters and each tensor
        has that parameter's shape and dtype (a scalar, e.g. Adam's ``step``, is allowed).

        Raises:
            StateExchangeError: names the first difference.
        """
        want = self._groups if self.optimizer is not None else []
        shards.check_full(spec, self._template, self._params, want, _refuse)


def sharded_parts(
    config: FSDPConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: Mapping[str, Any] | None,
    commit_every: int,
    async_commit: bool,
) -> tuple[ShardedModel, nn.Module, None, dict[str, Any]]:
    """The session's parts with FSDP: the sharded model's full state is one registered
    object; the session's state holds an empty module and no optimizer (both live in the
    :class:`ShardedModel`).

    Returns:
        The sharded model, and the model, optimizer and ``stateful`` for the session's
        :class:`~slurm_elastic.live.state.ElasticState`.

    Raises:
        ValueError: ``commit_every`` or ``async_commit`` set, or ``stateful`` already
            holds :data:`STATE_KEY`.
    """
    if commit_every or async_commit:
        raise ValueError(
            f"commit_every={commit_every}, async_commit={async_commit}: with fsdp=... the "
            "state is gathered only at changes and checkpoints; use commit_every=0, "
            "async_commit=False"
        )
    if STATE_KEY in (stateful or {}):
        raise ValueError(f"stateful[{STATE_KEY!r}] is reserved with fsdp=...: rename it")
    sharded = ShardedModel(config, model, optimizer)
    return sharded, nn.Module(), None, {**(stateful or {}), STATE_KEY: sharded}
