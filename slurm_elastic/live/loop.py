"""``ElasticLoop``: a DDP training loop that survives membership changes in place.

The user gives the model, optimizer, scheduler and data size once, and a function that
runs one step on the rank's share of the global batch (:class:`Step`). The loop owns the
process group, the DDP wrapper, the sampler position, the in-memory commits, the
periodic checkpoints and the protocol below. This module decides *when* the world
changes; :mod:`~slurm_elastic.live.world` does the change (the process group, its
teardown order, the switch and the recovery after a failure).

**At every step boundary** the ranks agree with one ``all_reduce`` (MAX over five
integers): does any rank's node leave, does any rank stay, which new round (if any) every
staying rank has received *and* found ready (all its ranks announced in the round's
store), and has a leave waited too long. Then, the same decision on every rank:

* nothing pending: commit (every ``commit_every`` steps), maybe checkpoint, go on;
* every staying rank holds the same ready round: **switch** (graceful join, leave, spare
  promotion): leaving ranks return, the others commit, tear the group down in the safe
  order (keep the old group, drop the DDP wrapper, destroy, drop the group), init the
  new group on the round's store under a prefix never used before, take the newest
  commit from a survivor by broadcast (newcomers: no disk read), and wrap the model in
  a new DDP. Newcomers start training only after the switch; survivors keep stepping
  while the newcomer starts and while the round forms;
* every rank leaves (the whole job is preempted): save a checkpoint together, return;
* restart path (``$SLURM_ELASTIC_IN_PLACE=0``, or no agent control channel): as before,
  a notice makes all ranks save together, the leaving ranks return, the others wait for
  the agent to restart them.

**A failed collective** (a peer was SIGKILLed or its node is gone; gloo raises) makes the
survivors roll back to their last commit, wait for the agent's next assignment (it comes
once the rendezvous evicted the dead node) and re-form the same way; only the steps since
the last commit are redone. With no assignment within ``reform_timeout_s`` the error is
raised: the worker exits non-zero and the agent restarts the workers from the last
checkpoint (the fallback).

NCCL: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 2 (abort the communicator, keep
the process) so that a failed collective raises instead of ending the process, and every
group gets ``timeout_s`` (not NCCL's 30 minutes). Not verified on a GPU here.

Data order: :class:`~slurm_elastic.checkpoint.ElasticSampler` semantics (the global order
of an epoch depends only on the seed and the epoch; the position is one global sample
offset), fixed global batch: every sample is used exactly once per epoch across changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic import events, notice
from slurm_elastic.checkpoint import (
    CheckpointManager,
    ElasticSampler,
    loss_scale,
    restore_training_state,
    training_state,
)
from slurm_elastic.checkpoint.sampler import rank_share
from slurm_elastic.live import control
from slurm_elastic.live.state import ElasticState
from slurm_elastic.live.world import LiveWorld, ReformTimeoutError, is_peer_failure

__all__ = ["ElasticLoop", "ReformTimeoutError", "Step", "is_peer_failure"]

log = logging.getLogger(__name__)

_BIG = 1 << 62
# Rank 0 reports progress (a train.progress event) every this many steps.
_PROGRESS_EVERY = 10


@dataclass(frozen=True)
class Step:
    """One optimizer step as seen by one rank.

    Attributes:
        model: the DDP-wrapped model of the current world (do not keep a reference:
            it is replaced at every re-formation).
        indices: this rank's dataset indices (possibly empty at an epoch tail).
        global_size: samples in the step's global batch.
        loss_scale: multiply a *summed* loss by this so DDP's averaged gradient is the
            mean over the global batch.
        step: steps done before this one.
        epoch: the epoch.
        rank: this rank in the current world.
        world_size: ranks in the current world.
        round: the rendezvous round of the current world.
    """

    model: nn.Module
    indices: list[int]
    global_size: int
    loss_scale: float
    step: int
    epoch: int
    rank: int
    world_size: int
    round: int


class ElasticLoop:
    """A training loop whose workers survive joins, leaves and peer failures in place.

    Args:
        model: the bare model (already on ``device``).
        optimizer: its optimizer.
        scheduler: an LR scheduler stepped by the user's step function, if any.
        dataset_size: samples per epoch.
        global_batch_size: samples per step over all ranks (fixed at any world size).
        seed: the sample order of epoch ``e`` depends only on ``(seed, e)``.
        shuffle: shuffle each epoch.
        drop_last: skip the short last global batch of each epoch.
        checkpoint: where periodic and final checkpoints go (and the first start
            resumes from); ``None``: none.
        save_every: also checkpoint every N steps (0: only at the end and on leave).
        commit_every: commit to host memory every N steps (1: a hard loss redoes at most
            the step that failed).
        backend: process group backend (default: ``nccl`` with CUDA, else ``gloo``).
        ddp_kwargs: passed to :class:`DistributedDataParallel` (e.g. ``device_ids``).
        timeout_s: collective timeout of every process group.
        reform_timeout_s: after a failed collective, how long to wait for a new round.
        leave_wait_s: how long a leave may wait for the survivors' new round before
            everyone saves a checkpoint and the restart path takes over.
        extra: small JSON-like values stored in every checkpoint.
        save_each_epoch: also checkpoint after the last step of every epoch.
        async_commit: copy the periodic commits' parameters and optimizer state on a
            thread while the next step's forward and backward run (the optimizer's
            step waits for it); only for step functions that change parameters in
            ``optimizer.step()`` alone.
        stall_abort_s: in place with gloo, end a collective that has waited at least
            this long (and 3x the longest recent step) once the agent assigns a round
            formed after a member was lost, e.g. a node that froze without resetting
            its sockets (:mod:`~slurm_elastic.live.abort`); the survivors then roll
            back to their commit and re-form in place. ``None``: wait for ``timeout_s``.

    Raises:
        ValueError: ``commit_every`` < 1 or ``stall_abort_s`` not positive.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        dataset_size: int,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        checkpoint: CheckpointManager | None = None,
        save_every: int = 0,
        commit_every: int = 1,
        backend: str | None = None,
        ddp_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
        reform_timeout_s: float = 120.0,
        leave_wait_s: float = 30.0,
        extra: dict[str, Any] | None = None,
        save_each_epoch: bool = False,
        async_commit: bool = False,
        stall_abort_s: float | None = 1.0,
    ) -> None:
        if commit_every < 1:
            raise ValueError(f"commit_every={commit_every} must be >= 1")
        if stall_abort_s is not None and not stall_abort_s > 0:
            raise ValueError(f"stall_abort_s={stall_abort_s!r} must be > 0 seconds, or None")
        self.state = ElasticState(model, optimizer, scheduler, step=0, epoch=0, offset=0)
        self.sampler = ElasticSampler(
            dataset_size,
            global_batch_size,
            rank=0,
            world_size=1,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
        )
        self.checkpoint = checkpoint
        self.save_every = save_every
        self.commit_every = commit_every
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.backend == "nccl":
            # On a peer failure NCCL's watchdog aborts the communicator and the collective
            # raises, without killing the process (1, torch's default, kills it): the
            # survivors can then re-form. Unverified on hardware here: run
            # bench/gpu_reform_check.py on a GPU machine.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.timeout = timedelta(seconds=timeout_s)
        self.reform_timeout_s = reform_timeout_s
        self.leave_wait_s = leave_wait_s
        self.extra = dict(extra or {})
        self.save_each_epoch = save_each_epoch
        self.async_commit = async_commit
        #: the ``extra`` of the checkpoint resumed from (empty otherwise)
        self.resume_extra: dict[str, Any] = {}
        #: the world size the checkpoint resumed from was saved at (None: no checkpoint)
        self.resume_world_size: int | None = None
        self.in_place = (
            control.in_place_enabled()
            and bool(os.environ.get(control.CONTROL_DIR_ENV))
            and control.Assignment.from_environ() is not None
        )
        #: the process group and its re-formation (:mod:`~slurm_elastic.live.world`)
        self.world = LiveWorld(
            self.state,
            backend=self.backend,
            ddp_kwargs=self.ddp_kwargs,
            timeout=self.timeout,
            reform_timeout_s=reform_timeout_s,
            in_place=self.in_place,
            stall_abort_s=stall_abort_s,
        )
        self._order: tuple[int, list[int]] | None = None
        self._leave_seen_at: float | None = None
        self._not_in_round = False
        # In place, the agent that started this worker; if it dies (SIGKILL does not take
        # the children along), this worker leaves instead of training on as an orphan.
        self._agent_pid = os.getppid() if self.in_place else None
        self._orphaned = False
        self._saved_step = -1
        self._total_steps: int | None = None
        self._started = False
        self.resumed_from: str | None = None

    # -- public view ---------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The current DDP wrapper (replaced at every re-formation)."""
        return self.world.model

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return int(self.state.counters["step"])

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return int(self.state.counters["epoch"])

    @property
    def sample_offset(self) -> int:
        """Global samples consumed in the current epoch."""
        return int(self.state.counters["offset"])

    @property
    def rank(self) -> int:
        """This rank in the current world."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """Ranks in the current world."""
        return dist.get_world_size()

    @property
    def round(self) -> int:
        """The rendezvous round of the current world."""
        return self.world.round

    # -- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Join the process group, take the state (from a live peer, else the newest
        checkpoint, else the initial one) and wrap the model; idempotent."""
        if self._started:
            return
        self._started = True
        from_peer = self.world.open()
        if from_peer:
            self.resumed_from = "peer"
        else:
            self._resume_from_checkpoint()
            self.world.commit(self.step)
        self.world.wrap()
        self.world.register(int(os.environ.get("LOCAL_RANK", "0")))
        events.emit(
            events.LiveStart(
                rank=self.rank,
                world_size=self.world_size,
                step=self.step,
                in_place=self.in_place,
                resumed_from=self.resumed_from,
            )
        )

    def _resume_from_checkpoint(self) -> None:
        if self.checkpoint is None:
            return
        loaded = self.checkpoint.load_latest()
        if loaded is None:
            return
        info = restore_training_state(
            loaded.state,
            self.state.model,
            self.state.optimizer,
            self.state.scheduler,
            source=loaded.path,
        )
        self.state.counters.update(step=info.step, epoch=info.epoch, offset=info.sample_offset)
        self._saved_step = info.step
        self.resumed_from = str(loaded.path)
        self.resume_extra = dict(info.extra)
        self.resume_world_size = info.saved_world_size

    # -- the loop ---------------------------------------------------------------------------

    def run(
        self,
        train_step: Callable[[Step], Any],
        *,
        steps: int | None = None,
        epochs: int | None = None,
        on_epoch_end: Callable[[int], Any] | None = None,
    ) -> str:
        """Train until ``steps`` steps or ``epochs`` epochs are done, or this node leaves.

        Args:
            train_step: runs one step (forward, backward, optimizer and scheduler step)
                on ``step.model`` with ``step.indices``.
            steps: stop after this many steps in total.
            epochs: stop after this many epochs.
            on_epoch_end: called (on every rank) after the last step of each epoch,
                e.g. to validate; may use collectives.

        Returns:
            ``"done"`` (a final checkpoint is saved) or ``"left"`` (this node was told
            to stop; its state lives on in the survivors or in the checkpoint).

        Raises:
            ReformTimeoutError: a peer failed and no new round came in time.
        """
        if steps is None and epochs is None:
            raise ValueError("ElasticLoop.run needs steps=... or epochs=...")
        self.start()
        self._total_steps = steps
        # For slurm-elastic status / timeline / submit --wait: progress and throughput.
        events.emit(
            events.TrainStart(
                step=self.step, world_size=self.world_size, rank=self.rank, total_steps=steps
            )
        )
        while not self._done(steps, epochs):
            failure: str | None = None
            outcome: str | None = None
            try:
                outcome = self._one_step(train_step, on_epoch_end)
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                failure = f"{type(exc).__name__}: {exc}"
            # Outside the except block: its traceback would keep the broken group alive.
            if failure is not None:
                if self._leaving_here():
                    events.emit(events.LiveLeft(step=self.step, after="failure"))
                    events.emit(events.TrainPreempted(step=self.step, rank=self.rank))
                    return "left"
                self._recover(failure)
                continue
            if outcome == "left":
                events.emit(events.TrainPreempted(step=self.step, rank=self.rank))
                return "left"
        self.save(blocking=True)
        events.emit(events.LiveDone(step=self.step, rank=self.rank))
        events.emit(events.TrainDone(step=self.step, rank=self.rank))
        return "done"

    def close(self) -> None:
        """Flush checkpoints and leave the process group."""
        if self.checkpoint is not None:
            self.checkpoint.flush()
        self.world.close()

    def _done(self, steps: int | None, epochs: int | None) -> bool:
        return (steps is not None and self.step >= steps) or (
            epochs is not None and self.epoch >= epochs
        )

    def _slice(self) -> tuple[list[int], int, int]:
        epoch, start = self.epoch, self.sample_offset
        if self._order is None or self._order[0] != epoch:
            self.sampler.set_epoch(epoch, 0)
            self._order = (epoch, self.sampler.global_order(epoch))
        stop = min(start + self.sampler.global_batch_size, self.sampler.epoch_length)
        lo, hi = rank_share(start, stop, self.rank, self.world_size)
        return self._order[1][lo:hi], start, stop

    def _one_step(
        self, train_step: Callable[[Step], Any], on_epoch_end: Callable[[int], Any] | None
    ) -> str | None:
        self.world.beat()  # the previous step and its boundary are done
        indices, start, stop = self._slice()
        world = self.world_size
        self.world.dirty = True
        train_step(
            Step(
                model=self.model,
                indices=indices,
                global_size=stop - start,
                loss_scale=loss_scale(stop - start, world),
                step=self.step,
                epoch=self.epoch,
                rank=self.rank,
                world_size=world,
                round=self.world.round,
            )
        )
        counters = self.state.counters
        counters["step"] += 1
        counters["offset"] = stop
        if stop >= self.sampler.epoch_length:
            if on_epoch_end is not None:
                on_epoch_end(self.epoch)
            counters["epoch"] += 1
            counters["offset"] = 0
        notice.report_progress(self.step)
        if self.rank == 0 and self.step % _PROGRESS_EVERY == 0:
            events.emit(
                events.TrainProgress(
                    step=self.step,
                    rank=self.rank,
                    total_steps=self._total_steps,
                    samples=self.epoch * self.sampler.epoch_length + self.sample_offset,
                )
            )
        return self._boundary()

    # -- the agreement ------------------------------------------------------------------------

    def _leaving_here(self) -> bool:
        if self._agent_pid is not None and not self._orphaned and os.getppid() != self._agent_pid:
            log.warning("agent %d is gone: leaving at the switch", self._agent_pid)
            self._orphaned = True
        return self._orphaned or self._not_in_round or notice.preemption_requested()

    def _boundary(self) -> str | None:
        leaving = self._leaving_here()
        if self.in_place:
            ready = 0 if leaving else self.world.ready_round()
            give_up = (
                self._leave_seen_at is not None
                and time.monotonic() - self._leave_seen_at > self.leave_wait_s
            )
        else:
            ready, give_up = 0, leaving  # restart path: a notice stops everyone at once
        flags = torch.tensor(
            [int(leaving), int(not leaving), ready, -_BIG if leaving else -ready, int(give_up)],
            dtype=torch.int64,
            device=self.world.device(),
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_leave, any_stay, ready_max, neg_min, gave_up = (int(v) for v in flags.tolist())
        ready_min = -neg_min
        if any_leave and self._leave_seen_at is None:
            self._leave_seen_at = time.monotonic()
        if ready_max > 0 and not leaving and self.world.pending_round() != ready_max - 1:
            # A rank verified that every rank of round ready_max - 1 announced itself in
            # its store, and this one holds no assignment for it: its node has no place
            # in that round (the new round filled max_nodes and its agent waits as a
            # spare). Leave at the next boundary like a node with notice, so the others
            # switch without a rollback; the agent starts new workers if promoted. (No
            # early return: the rest of this boundary, a save included, is collective.)
            log.info("not a member of round %d: leaving at the switch", ready_max - 1)
            self._not_in_round = True
            self.world.unregister(int(os.environ.get("LOCAL_RANK", "0")))
        if any_leave and not any_stay:
            self.save(blocking=True)  # the whole job stops: nothing finished is lost
            events.emit(events.LiveLeft(step=self.step, after="everyone_leaves"))
            return "left"
        if ready_max > 0 and ready_min == ready_max:
            if leaving:
                events.emit(events.LiveLeft(step=self.step, after="switch"))
                return "left"
            self.world.switch(self.step)
            self._leave_seen_at = None
            return None
        if gave_up:
            self.save(blocking=True)  # together, now: nothing finished is lost
            if leaving:
                events.emit(events.LiveLeft(step=self.step, after="save"))
                return "left"
            if not self.in_place:
                # our agent stops these workers for the next round; if it does not,
                # the next collective fails and the worker exits for a restart
                if notice.await_new_round(self.leave_wait_s):
                    events.emit(events.LiveLeft(step=self.step, after="restart"))
                    return "left"
                return None
            self._commit()
            self._recover("a peer left and no new round formed")
            return None
        if self.step % self.commit_every == 0:
            self.world.commit(self.step, background=self.async_commit)
        epoch_done = self.save_each_epoch and self.sample_offset == 0 and self.step > 0
        if epoch_done or (self.save_every and self.step % self.save_every == 0):
            self.save(blocking=False)
        return None

    def _commit(self) -> None:
        self.world.commit(self.step)

    def _recover(self, reason: str) -> None:
        self.world.recover(reason)
        self._leave_seen_at = None

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, blocking: bool) -> None:
        """Collective: checkpoint the current state (skipped if this step is saved)."""
        if self.checkpoint is None:
            return
        if self._saved_step == self.step:
            if blocking:
                self.checkpoint.flush()
            return
        bundle = training_state(
            self.model,
            self.state.optimizer,
            self.state.scheduler,
            step=self.step,
            epoch=self.epoch,
            sample_offset=self.sample_offset,
            global_batch_size=self.sampler.global_batch_size,
            extra=self.extra or None,
        )
        self.checkpoint.save(bundle, self.step, blocking=blocking)
        self._saved_step = self.step
