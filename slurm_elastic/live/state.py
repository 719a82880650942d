"""``ElasticState``: training state kept in host memory, rolled back and shared with peers.

The user registers the model, the optimizer, the LR scheduler and counters once.
:meth:`ElasticState.commit` copies them to host memory, :meth:`ElasticState.restore` puts the last commit back
(after a failed collective), :meth:`ElasticState.sync` sends the committed state of one
rank to all (newcomers get it from a survivor: no disk read, no restart).

A commit with ``background=True`` copies parameters and optimizer state on a thread,
off the critical path: they change only in ``optimizer.step()``, and a step pre-hook on
the optimizer waits for the copy first, so the next step's forward and backward overlap
it (buffers, scheduler and counters, which a forward may change, are copied at once).
Whoever changes parameters outside ``optimizer.step()`` must call :meth:`ElasticState.wait`
first, or commit in the foreground (the default).

The model keeps its ``Parameter`` objects across restore/sync (``load_state_dict`` copies
into them), so an optimizer built on them stays valid and is never rebuilt. The
optimizer's state is cloned on every load: ``Optimizer.load_state_dict`` keeps
same-device tensors, which would otherwise alias (and later overwrite) the commit.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from slurm_elastic.checkpoint import exchange
from slurm_elastic.errors import StateExchangeError

__all__ = ["ElasticState"]

_NO_LIMIT = 1 << 62  # a state's size is bounded by the receiver's check, not a constant


def _refuse(where: str, why: str) -> StateExchangeError:
    return StateExchangeError(f"refused a peer's state: {where}: {why}; nothing was replaced")


def _same_tensor(where: str, got: Any, own: torch.Tensor) -> None:
    if not isinstance(got, exchange.TensorSpec):
        raise _refuse(where, f"a {type(got).__name__}, expected a tensor")
    if got.dtype != own.dtype or tuple(got.shape) != tuple(own.shape):
        raise _refuse(
            where,
            f"{got.dtype} {list(got.shape)}, this rank has {own.dtype} {list(own.shape)}",
        )


def _match_keys(where: str, got: Any, own: Mapping[str, Any]) -> None:
    if not isinstance(got, Mapping) or set(got) != set(own):
        have = sorted(map(str, got)) if isinstance(got, Mapping) else type(got).__name__
        raise _refuse(where, f"keys {have}, this rank has {sorted(map(str, own))}")


def _match_tensors(where: str, got: Any, own: Mapping[str, Any]) -> None:
    _match_keys(where, got, own)
    for key, value in own.items():
        if isinstance(value, torch.Tensor):
            _same_tensor(f"{where}[{key!r}]", got[key], value)
        elif isinstance(got[key], exchange.TensorSpec):
            raise _refuse(f"{where}[{key!r}]", "a tensor where this rank has none")


def _match_optimizer(got: Any, optimizer: torch.optim.Optimizer, name: str = "optimizer") -> None:
    own = optimizer.state_dict()
    _match_keys(name, got, own)
    groups = got["param_groups"]
    if type(groups) is not list or len(groups) != len(own["param_groups"]):
        raise _refuse(f"{name}.param_groups", "a different number of parameter groups")
    params: dict[Any, torch.Tensor] = {}
    for i, (g, mine, live) in enumerate(
        zip(groups, own["param_groups"], optimizer.param_groups, strict=True)
    ):
        if not isinstance(g, Mapping) or g.get("params") != mine["params"]:
            raise _refuse(f"{name}.param_groups[{i}]", "different parameters")
        params.update(zip(mine["params"], live["params"], strict=True))
    entries = got["state"]
    if not isinstance(entries, Mapping):
        raise _refuse(f"{name}.state", "not a mapping")
    for index, entry in entries.items():
        where = f"{name}.state[{index!r}]"
        if index not in params or not isinstance(entry, Mapping):
            raise _refuse(where, "not a parameter of this optimizer")
        mine_entry = own["state"].get(index, {})
        for key, value in entry.items():
            if not isinstance(value, exchange.TensorSpec):
                continue
            if isinstance(mine_entry.get(key), torch.Tensor):
                _same_tensor(f"{where}[{key!r}]", value, mine_entry[key])
            elif value.shape != ():  # not created here yet: the parameter's own shape
                _same_tensor(f"{where}[{key!r}]", value, params[index])


def _match_tree(where: str, got: Any, own: Any) -> None:
    """``got`` (an announced state) has ``own``'s structure: keys, lengths, tensors."""
    if isinstance(own, torch.Tensor):
        _same_tensor(where, got, own)
    elif isinstance(own, Mapping):
        _match_keys(where, got, own)
        for key, value in own.items():
            _match_tree(f"{where}[{key!r}]", got[key], value)
    elif isinstance(own, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(own):
            raise _refuse(where, f"not a sequence of {len(own)}")
        for i, (g, o) in enumerate(zip(got, own, strict=True)):
            _match_tree(f"{where}[{i}]", g, o)
    elif isinstance(got, exchange.TensorSpec):
        raise _refuse(where, "a tensor where this rank has none")


def _host_copy(value: Any) -> Any:
    """Deep copy with every tensor copied to host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_host_copy(v) for v in value)
    return copy.deepcopy(value)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


class ElasticState:
    """The state a training loop needs to go on after a membership change.

    Args:
        model: the model (a DDP wrapper is unwrapped; register the bare module).
        optimizer: its optimizer, if any.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        stateful: more objects that move with the state, by name: anything with
            ``state_dict()``/``load_state_dict()`` (a second optimizer, a GradScaler,
            an EMA model). Copied with every commit, shared with newcomers, checked
            against the receiver's own structure like the rest.
        counters: plain values that move with the state (e.g. ``step=0, epoch=0``);
            read and write them through :attr:`counters`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        stateful: Mapping[str, Any] | None = None,
        **counters: Any,
    ) -> None:
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stateful: dict[str, Any] = dict(stateful or {})
        for name, obj in self.stateful.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):  # fmt: skip
                raise TypeError(
                    f"stateful[{name!r}] is a {type(obj).__name__}: it needs state_dict() and "
                    "load_state_dict() (wrap it, or keep it in the counters if it is a number)"
                )
        self.counters: dict[str, Any] = dict(counters)
        self._commit: dict[str, Any] | None = None
        self._commit_id: tuple[int, int] = (-1, -1)
        self._copying: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        self._hooked = False

    @property
    def committed(self) -> bool:
        """Whether a commit exists."""
        return self._commit is not None

    @property
    def commit_id(self) -> tuple[int, int]:
        """``(round, step)`` of the last commit (``(-1, -1)``: none); equal ids mean
        bitwise-equal commits (same history)."""
        return self._commit_id

    def snapshot(self) -> dict[str, Any]:
        """A host-memory copy of the current state."""
        snap: dict[str, Any] = {
            "model": _host_copy(self.model.state_dict()),
            "counters": copy.deepcopy(self.counters),
        }
        if self.optimizer is not None:
            snap["optimizer"] = _host_copy(self.optimizer.state_dict())
        if self.scheduler is not None:
            snap["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.stateful:
            snap["stateful"] = self._stateful_copy()
        return snap

    def _stateful_copy(self) -> dict[str, Any]:
        return {name: _host_copy(obj.state_dict()) for name, obj in self.stateful.items()}

    def load(self, snap: Mapping[str, Any]) -> None:
        """Put a :meth:`snapshot` back into the live objects (the snapshot stays intact)."""
        self.model.load_state_dict(snap["model"])
        if self.optimizer is not None and "optimizer" in snap:
            self.optimizer.load_state_dict(_host_copy(snap["optimizer"]))
        if self.scheduler is not None and "scheduler" in snap:
            self.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
        for name, obj in self.stateful.items():
            if name in snap.get("stateful", {}):
                obj.load_state_dict(_host_copy(snap["stateful"][name]))
        self.counters.update(copy.deepcopy(dict(snap["counters"])))

    def commit(self, commit_id: tuple[int, int] = (0, 0), *, background: bool = False) -> None:
        """Snapshot the current state as the one to roll back to and to share.

        Args:
            commit_id: ``(round, step)`` identifying the commit (see :attr:`commit_id`).
            background: copy parameters and optimizer state on a thread (see the module
                docstring); everything that reads the commit waits for it.
        """
        self.wait()
        if not background or self.optimizer is None:
            self._commit = self.snapshot()
            self._commit_id = commit_id
            return
        if not self._hooked:  # parameters and optimizer state change in step() only
            for opt in (self.optimizer, *self.stateful.values()):
                if isinstance(opt, torch.optim.Optimizer):
                    opt.register_step_pre_hook(lambda *_: self.wait())
            self._hooked = True
        live = self.model.state_dict()
        # every name a buffer has in state_dict(): a module used twice appears twice
        buffers = {name for name, _ in self.model.named_buffers(remove_duplicate=False)}
        now = {k: _host_copy(v) for k, v in live.items() if k in buffers}
        optimizer = self.optimizer.state_dict()  # references the live state tensors
        snap: dict[str, Any] = {"counters": copy.deepcopy(self.counters)}
        if self.scheduler is not None:
            snap["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.stateful:  # in the foreground: they may change outside optimizer.step()
            snap["stateful"] = self._stateful_copy()

        def copy_rest() -> None:
            try:
                snap["model"] = {k: now[k] if k in now else _host_copy(v) for k, v in live.items()}
                snap["optimizer"] = _host_copy(optimizer)
            except BaseException as exc:  # re-raised by wait()
                self._copy_error = exc

        self._commit = snap
        self._commit_id = commit_id
        self._copying = threading.Thread(target=copy_rest, name="elastic-commit", daemon=True)
        self._copying.start()

    def wait(self) -> None:
        """Wait for a background commit's copy to finish.

        Raises:
            RuntimeError: the copy failed (the commit is dropped).
        """
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.join()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            self._commit, self._commit_id = None, (-1, -1)
            raise RuntimeError(f"the background commit copy failed: {error}") from error

    def restore(self) -> None:
        """Roll back to the last commit.

        Raises:
            RuntimeError: nothing was committed.
        """
        self.wait()
        if self._commit is None:
            raise RuntimeError("ElasticState.restore() before any commit(): commit first")
        self.load(self._commit)

    def sync(self, src: int, group: Any = None) -> None:
        """Collective: every rank takes the commit of rank ``src`` (and commits it).

        Nothing is unpickled: the commit travels as tensors and a JSON description
        (:mod:`slurm_elastic.checkpoint.exchange`). Each receiver checks the description
        against its own state (keys, shapes, dtypes) before any byte arrives; a refused
        state raises on every rank and leaves each receiver's live state and commit as
        they were.

        Args:
            src: the rank whose commit is sent (it must have one).
            group: the process group (default: the world).

        Raises:
            StateExchangeError: a receiver refused the state (all ranks raise).
        """
        self.wait()
        payload: dict[str, Any] | None = None
        if dist.get_rank(group) == src:
            if self._commit is None:
                raise RuntimeError(f"rank {src} has no commit to send; commit() first")
            payload = {"state": self._commit, "id": list(self._commit_id)}
        received = exchange.broadcast(
            payload, src, group=group, check=self.check_received, limit=_NO_LIMIT
        )
        if dist.get_rank(group) == src:
            return
        previous = (self._commit, self._commit_id)
        try:
            self.load(received["state"])
        except Exception as exc:
            if previous[0] is not None:
                self.load(previous[0])
            raise StateExchangeError(
                f"the state from rank {src} could not be loaded ({type(exc).__name__}: {exc}); "
                "this rank's state is as it was"
            ) from exc
        self._commit = received["state"]
        self._commit_id = (int(received["id"][0]), int(received["id"][1]))

    def check_received(self, spec: Any) -> None:
        """Refuse a state a peer announces unless it has this rank's structure.

        ``spec`` is the announced ``{"state": ..., "id": [round, step]}`` with a
        :class:`~slurm_elastic.checkpoint.exchange.TensorSpec` per tensor. The model's
        keys, shapes and dtypes must be this rank's exactly; the optimizer's parameter
        groups must list the same parameters and each state tensor must have its
        parameter's shape and dtype (or be a scalar); scheduler and counters must have
        this rank's keys.

        Raises:
            StateExchangeError: names the first difference.
        """
        if type(spec) is not dict or set(spec) != {"state", "id"}:
            raise StateExchangeError("refused a peer's state: not a state message")
        ident = spec["id"]
        if type(ident) is not list or len(ident) != 2 or any(type(v) is not int for v in ident):
            raise StateExchangeError(f"refused a peer's state: bad commit id {ident!r:.40}")
        state = spec["state"]
        want = {"model", "counters"}
        if self.optimizer is not None:
            want.add("optimizer")
        if self.scheduler is not None:
            want.add("scheduler")
        if self.stateful:
            want.add("stateful")
        if type(state) is not dict or set(state) != want:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise StateExchangeError(
                f"refused a peer's state: parts {got}, expected {sorted(want)}"
            )
        _match_tensors("model", state["model"], self.model.state_dict())
        _match_keys("counters", state["counters"], self.counters)
        if self.scheduler is not None:
            _match_keys("scheduler", state["scheduler"], self.scheduler.state_dict())
        if self.optimizer is not None:
            _match_optimizer(state["optimizer"], self.optimizer)
        if self.stateful:
            _match_keys("stateful", state["stateful"], self.stateful)
            for name, obj in self.stateful.items():
                if isinstance(obj, torch.optim.Optimizer):
                    _match_optimizer(state["stateful"][name], obj, f"stateful[{name!r}]")
                elif callable(getattr(obj, "check_state", None)):  # it checks its own
                    obj.check_state(state["stateful"][name])
                else:
                    _match_tree(f"stateful[{name!r}]", state["stateful"][name], obj.state_dict())
