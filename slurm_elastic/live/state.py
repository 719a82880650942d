"""``ElasticState``: training state kept in host memory, rolled back and shared with peers.

An :class:`ElasticState` is a :class:`~slurm_elastic.training.TrainingState` (the
registered objects and the progress counters, in the layout checkpoints use) with an
in-memory commit. :meth:`ElasticState.commit` copies the state to host memory,
:meth:`ElasticState.restore` puts the last commit back (after a failed collective),
:meth:`ElasticState.sync` sends the committed state of one rank to all (newcomers get it
from a survivor: no disk read, no restart).

A commit with ``background=True`` copies parameters, buffers and optimizer state with the
checkpoints' host stager (:class:`~slurm_elastic.checkpoint.staging.HostStager`), off the
critical path, under its guards: an optimizer's ``step()`` waits for the copy first, and a
module's forward pass copies that module's buffers before it runs (a module used twice in
a forward is copied before its first use). Scheduler, stateful objects and counters, which
change outside those two, are copied at once. A tensor changed in place by other means
while it was being copied is detected (its version counter) and the commit refused with
an error that names it: no torn commit is ever restored or sent. Whoever changes
parameters outside ``optimizer.step()`` calls :meth:`ElasticState.wait` first, or commits
in the foreground (the default). Two sets of host buffers alternate, so the commit in
force stays whole while the next one is copied. A foreground commit copies into one set
of buffers of its own, reused from one commit to the next (pinned for CUDA tensors, on a
side stream): the previous commit is given up before it is overwritten.

The model keeps its ``Parameter`` objects across restore/sync (``load_state_dict`` copies
into them), so an optimizer built on them stays valid and is never rebuilt. The
optimizer's state is cloned on every load: ``Optimizer.load_state_dict`` keeps
same-device tensors, which would otherwise alias (and later overwrite) the commit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from slurm_elastic.checkpoint import exchange
from slurm_elastic.checkpoint.staging import HostStager, StagingRound, retire
from slurm_elastic.errors import StagingConflict, StateExchangeError
from slurm_elastic.training.state import TrainingState, host_copy

__all__ = ["ElasticState"]

_NO_LIMIT = 1 << 62  # a state's size is bounded by the receiver's check, not a constant
_AT_ONCE = ("scheduler", "stateful", "progress")  # may change outside step() and forward
_TORN = (
    "the background commit was dropped. Change state tensors only in optimizer.step() and "
    "forward passes, call ElasticState.wait() before other in-place changes, or commit in "
    "the foreground (async_commit=False)"
)


def _refuse(where: str, why: str) -> StateExchangeError:
    return StateExchangeError(f"refused a peer's state: {where}: {why}; nothing was replaced")


class ElasticState(TrainingState):
    """The state a training loop needs to go on after a membership change.

    Args:
        model: the model (a DDP wrapper is unwrapped; register the bare module).
        optimizer: its optimizer, if any.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        stateful: more objects that move with the state, by name: anything with
            ``state_dict()``/``load_state_dict()`` (a second optimizer, a GradScaler,
            an EMA model). Copied with every commit, shared with newcomers, checked
            against the receiver's own structure like the rest.
        progress: plain values that move with the state (e.g. ``step=0, epoch=0,
            sample_offset=0``); read and write them through :attr:`progress`.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        scheduler: Any = None,
        *,
        stateful: Mapping[str, Any] | None = None,
        **progress: Any,
    ) -> None:
        super().__init__(model, optimizer, scheduler, stateful=stateful, **progress)
        self._commit: dict[str, Any] | None = None
        self._commit_id: tuple[int, int] = (-1, -1)
        self._stagers: list[HostStager] = []  # created on the first background commit
        self._foreground: HostStager | None = None  # the foreground commits' buffers
        self._round: StagingRound | None = None

    @property
    def committed(self) -> bool:
        """Whether a commit exists."""
        return self._commit is not None

    @property
    def commit_id(self) -> tuple[int, int]:
        """``(round, step)`` of the last commit (``(-1, -1)``: none); equal ids mean
        bitwise-equal commits (same history)."""
        return self._commit_id

    def last_commit(self) -> tuple[int, dict[str, Any]] | None:
        """The step and tree of the last commit (read only: do not change it), if any."""
        self.wait()
        if self._commit is None:
            return None
        return self._commit_id[1], self._commit

    def snapshot(self) -> dict[str, Any]:
        """A host-memory copy of the current state (:meth:`state_dict`'s layout)."""
        return host_copy(self.state_dict())

    def load(self, snap: Mapping[str, Any]) -> None:
        """Put a :meth:`snapshot` back into the live objects (the snapshot stays intact)."""
        self.load_state_dict(snap)

    def commit(self, commit_id: tuple[int, int] = (0, 0), *, background: bool = False) -> None:
        """Snapshot the current state as the one to roll back to and to share.

        Args:
            commit_id: ``(round, step)`` identifying the commit (see :attr:`commit_id`).
            background: copy parameters, buffers and optimizer state in the background
                (see the module docstring); everything that reads the commit waits for it.

        Raises:
            StagingConflict: the previous background commit was changed while it was
                copied (see :meth:`wait`).
        """
        self.wait()
        if not background or self.optimizer is None:
            self._commit_now(commit_id)
            return
        if not self._stagers:
            self._stagers = [HostStager(), HostStager()]
        self._stagers.reverse()  # the other buffers: the commit in force stays whole
        live = self.state_dict()
        at_once = host_copy({part: live.pop(part) for part in _AT_ONCE if part in live})
        snap, self._round = self._stagers[0].begin(live)
        snap.update(at_once)
        self._commit = snap
        self._commit_id = commit_id

    def _commit_now(self, commit_id: tuple[int, int]) -> None:
        """A foreground commit into host buffers reused from one commit to the next
        (pinned for CUDA tensors): no fresh allocation to fault in each time (measured on
        an H200, 6.4 GB: 6.1 s into fresh pageable tensors, bench/gpu_copy_check.py)."""
        if self._foreground is None:
            self._foreground = HostStager()
        self._commit, self._commit_id = None, (-1, -1)  # its buffers are rewritten now
        self._commit = self._foreground.stage(self.state_dict())
        self._commit_id = commit_id

    def wait(self) -> None:
        """Wait for a background commit's copy to finish.

        Raises:
            StagingConflict: a tensor was changed in place while it was being copied
                (the commit is dropped; it names the tensor and the fix).
            CheckpointWriteError: the copy failed (the commit is dropped).
        """
        round_, self._round = self._round, None
        if round_ is None:
            return
        try:
            round_.wait()
            round_.check(_TORN)
        except StagingConflict:
            self._commit, self._commit_id = None, (-1, -1)
            raise
        except BaseException:
            self._commit, self._commit_id = None, (-1, -1)
            raise
        finally:
            retire(round_)

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
        parameter's shape and dtype (or be a scalar); scheduler and progress must have
        this rank's keys (:meth:`~slurm_elastic.training.TrainingState.check`).

        Raises:
            StateExchangeError: names the first difference.
        """
        if type(spec) is not dict or set(spec) != {"state", "id"}:
            raise StateExchangeError("refused a peer's state: not a state message")
        ident = spec["id"]
        if type(ident) is not list or len(ident) != 2 or any(type(v) is not int for v in ident):
            raise StateExchangeError(f"refused a peer's state: bad commit id {ident!r:.40}")
        self.check(spec["state"], _refuse)
