"""``TrainingState``: the one model of what training must carry across a change.

The same type and the same layout serve a checkpoint on the parallel filesystem
(:func:`slurm_elastic.checkpoint.training_state`) and an in-place commit kept in host
memory and sent to peers (:class:`slurm_elastic.live.ElasticState`, a subclass). Layout::

    model        model.state_dict() (a DDP/FSDP wrapper's ``.module`` is unwrapped)
    optimizer    optimizer.state_dict()                   (if registered)
    scheduler    lr_scheduler.state_dict()                (if registered)
    stateful     {name: obj.state_dict()} of any other registered objects (a second
                 optimizer, a GradScaler, an EMA model, ...; if registered)
    progress     {step, epoch, sample_offset, ...}: plain counters

A checkpoint adds ``rng`` (one entry per rank), ``extra`` (the user's small values) and, in
``progress``, the ``world_size`` and ``global_batch_size`` it was saved at.

Before anything is loaded, :meth:`TrainingState.check` compares a tree (live tensors, or
the :class:`TensorSpec` a peer announces before sending any byte) with this state's own
structure: part names, keys, tensor shapes and dtypes, optimizer parameter groups. So a
state that does not fit is refused whole, and nothing of the receiver's is replaced.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = [
    "PROGRESS_KEYS",
    "Refuse",
    "TensorSpec",
    "TrainingState",
    "capture_rng",
    "host_copy",
    "restore_rng",
    "unwrap",
]

#: the counters every training state carries (more may be registered)
PROGRESS_KEYS = ("step", "epoch", "sample_offset")

#: builds the error to raise for a refused tree: ``refuse(where, why)``
Refuse = Callable[[str, str], Exception]


class TensorSpec(NamedTuple):
    """What a received tensor will be, shown to a check before its bytes arrive."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP/FSDP-style wrapper (``.module``), else the model."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def host_copy(value: Any) -> Any:
    """Deep copy with every tensor copied to host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [host_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(host_copy(v) for v in value)
    return copy.deepcopy(value)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as plain values/tensors (weights-only loadable)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`capture_rng` (missing parts are left alone)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            (
                s["name"],
                s["keys"].numpy().astype("uint32"),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )


# -- structural checks: a tree against this rank's own ----------------------------------


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, TensorSpec))


def _same_tensor(refuse: Refuse, where: str, got: Any, own: torch.Tensor) -> None:
    if not _is_tensor(got):
        raise refuse(where, f"a {type(got).__name__}, expected a tensor")
    if got.dtype != own.dtype or tuple(got.shape) != tuple(own.shape):
        raise refuse(
            where, f"{got.dtype} {list(got.shape)}, this rank has {own.dtype} {list(own.shape)}"
        )


def _match_keys(refuse: Refuse, where: str, got: Any, own: Mapping[str, Any]) -> None:
    if not isinstance(got, Mapping) or set(got) != set(own):
        have = sorted(map(str, got)) if isinstance(got, Mapping) else type(got).__name__
        raise refuse(where, f"keys {have}, this rank has {sorted(map(str, own))}")


def _match_tensors(refuse: Refuse, where: str, got: Any, own: Mapping[str, Any]) -> None:
    _match_keys(refuse, where, got, own)
    for key, value in own.items():
        if isinstance(value, torch.Tensor):
            _same_tensor(refuse, f"{where}[{key!r}]", got[key], value)
        elif _is_tensor(got[key]):
            raise refuse(f"{where}[{key!r}]", "a tensor where this rank has none")


def _match_optimizer(
    refuse: Refuse, got: Any, optimizer: torch.optim.Optimizer, name: str = "optimizer"
) -> None:
    own = optimizer.state_dict()
    _match_keys(refuse, name, got, own)
    groups = got["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(own["param_groups"]):
        raise refuse(f"{name}.param_groups", "a different number of parameter groups")
    params: dict[Any, torch.Tensor] = {}
    for i, (g, mine, live) in enumerate(
        zip(groups, own["param_groups"], optimizer.param_groups, strict=True)
    ):
        if not isinstance(g, Mapping) or g.get("params") != mine["params"]:
            raise refuse(f"{name}.param_groups[{i}]", "different parameters")
        params.update(zip(mine["params"], live["params"], strict=True))
    entries = got["state"]
    if not isinstance(entries, Mapping):
        raise refuse(f"{name}.state", "not a mapping")
    for index, entry in entries.items():
        where = f"{name}.state[{index!r}]"
        if index not in params or not isinstance(entry, Mapping):
            raise refuse(where, "not a parameter of this optimizer")
        mine_entry = own["state"].get(index, {})
        for key, value in entry.items():
            if not _is_tensor(value):
                continue
            if isinstance(mine_entry.get(key), torch.Tensor):
                _same_tensor(refuse, f"{where}[{key!r}]", value, mine_entry[key])
            elif tuple(value.shape) != ():  # not created here yet: the parameter's shape
                _same_tensor(refuse, f"{where}[{key!r}]", value, params[index])


def _match_tree(refuse: Refuse, where: str, got: Any, own: Any) -> None:
    """``got`` has ``own``'s structure: keys, lengths, tensors."""
    if isinstance(own, torch.Tensor):
        _same_tensor(refuse, where, got, own)
    elif isinstance(own, Mapping):
        _match_keys(refuse, where, got, own)
        for key, value in own.items():
            _match_tree(refuse, f"{where}[{key!r}]", got[key], value)
    elif isinstance(own, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(own):
            raise refuse(where, f"not a sequence of {len(own)}")
        for i, (g, o) in enumerate(zip(got, own, strict=True)):
            _match_tree(refuse, f"{where}[{i}]", g, o)
    elif _is_tensor(got):
        raise refuse(where, "a tensor where this rank has none")


class TrainingState:
    """The objects and counters training carries across a change (see the module docstring).

    Args:
        model: the model (a DDP/FSDP wrapper is unwrapped).
        optimizer: its optimizer, if any.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        stateful: more objects that move with the state, by name: anything with
            ``state_dict()``/``load_state_dict()`` (a second optimizer, a GradScaler,
            an EMA model).
        progress: plain counters (``step=0, epoch=0, sample_offset=0``, and any of your
            own); read and write them through :attr:`progress`.

    Raises:
        TypeError: a ``stateful`` object without ``state_dict``/``load_state_dict``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        stateful: Mapping[str, Any] | None = None,
        **progress: Any,
    ) -> None:
        self.model = unwrap(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stateful: dict[str, Any] = dict(stateful or {})
        for name, obj in self.stateful.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):  # fmt: skip
                raise TypeError(
                    f"stateful[{name!r}] is a {type(obj).__name__}: it needs state_dict() and "
                    "load_state_dict() (wrap it, or keep it in the progress counters if it "
                    "is a number)"
                )
        self.progress: dict[str, Any] = dict(progress)

    def parts(self) -> set[str]:
        """The top-level keys of :meth:`state_dict`."""
        parts = {"model", "progress"}
        if self.optimizer is not None:
            parts.add("optimizer")
        if self.scheduler is not None:
            parts.add("scheduler")
        if self.stateful:
            parts.add("stateful")
        return parts

    def state_dict(self) -> dict[str, Any]:
        """The state in the one layout; tensors are the live ones (copy before keeping)."""
        tree: dict[str, Any] = {
            "model": self.model.state_dict(),
            "progress": copy.deepcopy(self.progress),
        }
        if self.optimizer is not None:
            tree["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            tree["scheduler"] = self.scheduler.state_dict()
        if self.stateful:
            tree["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        return tree

    def check(self, tree: Any, refuse: Refuse, *, exact: bool = True) -> None:
        """Refuse ``tree`` unless it has this state's structure.

        The model's keys, shapes and dtypes must be this state's exactly; the optimizer's
        parameter groups must list the same parameters and each state tensor must have its
        parameter's shape and dtype (or be a scalar); the scheduler must have the same
        keys; a stateful object with ``check_state(tree)`` checks its own part, the others
        must match structure and tensors; progress must hold this state's counters.

        Args:
            tree: a :meth:`state_dict`-shaped tree of tensors or :class:`TensorSpec`.
            refuse: builds the error for ``(where, why)``.
            exact: a peer's tree (same code, same torch): the parts, the scheduler's keys
                and every stateful object's structure must be exactly this state's.
                ``False`` for a checkpoint (it holds more parts, ``rng`` and ``extra``,
                and may come from another torch version): the scheduler and the stateful
                objects that cannot check themselves are left to their
                ``load_state_dict``.

        Raises:
            whatever ``refuse`` builds, naming the first difference.
        """
        want = self.parts()
        if not isinstance(tree, Mapping) or not (set(tree) == want if exact else want <= set(tree)):
            got = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
            raise refuse("parts", f"{got}, expected {sorted(want)}")
        _match_tensors(refuse, "model", tree["model"], self.model.state_dict())
        progress = tree["progress"]
        if not isinstance(progress, Mapping) or not (
            set(progress) == set(self.progress) if exact else set(self.progress) <= set(progress)
        ):
            have = sorted(progress) if isinstance(progress, Mapping) else type(progress).__name__
            raise refuse("progress", f"keys {have}, this rank has {sorted(self.progress)}")
        if self.scheduler is not None and exact:
            _match_keys(refuse, "scheduler", tree["scheduler"], self.scheduler.state_dict())
        if self.optimizer is not None:
            _match_optimizer(refuse, tree["optimizer"], self.optimizer)
        if self.stateful:
            saved = tree["stateful"]
            if exact:
                _match_keys(refuse, "stateful", saved, self.stateful)
            elif not isinstance(saved, Mapping) or not set(self.stateful) <= set(saved):
                have = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
                raise refuse("stateful", f"names {have}, registered {sorted(self.stateful)}")
            for name, obj in self.stateful.items():
                if isinstance(obj, torch.optim.Optimizer):
                    _match_optimizer(refuse, saved[name], obj, f"stateful[{name!r}]")
                elif not exact:  # a checkpoint's: left to the object's load_state_dict
                    continue
                elif callable(getattr(obj, "check_state", None)):  # it checks its own
                    obj.check_state(saved[name])
                else:
                    _match_tree(refuse, f"stateful[{name!r}]", saved[name], obj.state_dict())

    def load_state_dict(self, tree: Mapping[str, Any], *, copy_tensors: bool = True) -> None:
        """Put a (checked) tree back into the live objects.

        Args:
            tree: a :meth:`state_dict`-shaped tree; check it first (:meth:`check`).
            copy_tensors: clone the optimizer's and stateful objects' tensors first
                (``Optimizer.load_state_dict`` keeps same-device tensors, which would
                alias the tree); ``False`` hands them over (a tree loaded once and dropped).
        """
        own = host_copy if copy_tensors else (lambda value: value)
        self.model.load_state_dict(tree["model"], strict=True)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(own(tree["optimizer"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(tree["scheduler"]))
        for name, obj in self.stateful.items():
            obj.load_state_dict(own(tree["stateful"][name]))
        saved = tree["progress"]
        self.progress.update({key: copy.deepcopy(saved[key]) for key in self.progress})
