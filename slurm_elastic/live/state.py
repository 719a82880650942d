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

__all__ = ["ElasticState"]


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
        counters: plain values that move with the state (e.g. ``step=0, epoch=0``);
            read and write them through :attr:`counters`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        **counters: Any,
    ) -> None:
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
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
        return snap

    def load(self, snap: Mapping[str, Any]) -> None:
        """Put a :meth:`snapshot` back into the live objects (the snapshot stays intact)."""
        self.model.load_state_dict(snap["model"])
        if self.optimizer is not None and "optimizer" in snap:
            self.optimizer.load_state_dict(_host_copy(snap["optimizer"]))
        if self.scheduler is not None and "scheduler" in snap:
            self.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
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
            self.optimizer.register_step_pre_hook(lambda *_: self.wait())
            self._hooked = True
        live = self.model.state_dict()
        buffers = {name for name, _ in self.model.named_buffers()}
        now = {k: _host_copy(v) for k, v in live.items() if k in buffers}
        optimizer = self.optimizer.state_dict()  # references the live state tensors
        snap: dict[str, Any] = {"counters": copy.deepcopy(self.counters)}
        if self.scheduler is not None:
            snap["scheduler"] = copy.deepcopy(self.scheduler.state_dict())

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

        Args:
            src: the rank whose commit is sent (it must have one).
            group: the process group (default: the world).
        """
        self.wait()
        payload: list[Any] = [None]
        if dist.get_rank(group) == src:
            if self._commit is None:
                raise RuntimeError(f"rank {src} has no commit to send; commit() first")
            payload[0] = {"state": self._commit, "id": self._commit_id}
        dist.broadcast_object_list(payload, src=src, group=group)
        received = payload[0]
        self._commit = received["state"]
        self._commit_id = (int(received["id"][0]), int(received["id"][1]))
        self.load(self._commit)
