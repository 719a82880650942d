"""``ElasticSession``: keep your own training loop; membership changes happen in place.

The user keeps ``for batch in loader:`` and marks each optimizer step with
``with session.step():``. The session owns the process group, the DDP wrapper, the data
position, the in-memory commits, the periodic checkpoints and the protocol below; the
state it moves is registered once: the model, its optimizer and scheduler, and any
number of other objects with ``state_dict``/``load_state_dict`` (a second optimizer, a
``GradScaler``, an EMA model: ``stateful={...}``)::

    session = ElasticSession(model, opt, sched, stateful={"scaler": scaler},
                             dataset_size=len(ds), global_batch_size=256, checkpoint=ckpt)
    session.start()
    while not session.finished(steps=10_000):
        loader = DataLoader(ds, batch_sampler=session.batches(), num_workers=4)
        for batch in loader:
            with session.step() as step:
                loss = loss_fn(session.model(batch.x), batch.y) * step.loss_scale
                scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); sched.step()
                opt.zero_grad()
            if session.interrupted:   # the world changed, the epoch ended, or this node left
                break
        if session.left:
            break
    session.finish(); session.close()   # the final checkpoint unless this node left

:meth:`batches` is the loader's batch sampler: this rank's share of each global batch,
from the current position, for the current world; a world change ends the loop over
the loader (``interrupted``) and the next loader starts where the committed position is,
so every sample is used exactly once per epoch (:class:`~slurm_elastic.checkpoint.
ElasticSampler` semantics, fixed global batch). :class:`~slurm_elastic.live.loop.
ElasticLoop` is this session driven by a step function.

**At step boundaries** (the end of a ``with session.step():`` block), about every
``vote_interval_s`` of training and at the first boundary of every round, the ranks vote
with one collective and act alike on the outcome: go on (commit, maybe checkpoint),
switch to a new round in place, leave, or save together for the restart path; each vote
fixes the step of the next, so the boundaries between cost nothing (:mod:`.boundary`).

**A failed collective** inside the block or at the boundary (a peer was SIGKILLed or its
node is gone) makes the survivors roll back to their last commit (every registered
object), wait for the agent's next assignment and re-form the same way; the block's
exception is swallowed and ``interrupted`` is set; only the steps since the last commit
are redone. With no assignment within ``reform_timeout_s`` the error is raised.

NCCL: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 2 (abort the communicator, keep the
process): a failed collective raises (abort and re-init checked on one GPU, no peer loss).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from slurm_elastic import _startup_seam, events, notice
from slurm_elastic.channel import NodeChannel
from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.live import roster
from slurm_elastic.live.boundary import Ballot, Cadence, Departure, cast_vote
from slurm_elastic.live.checkpointing import resume_latest, to_bundle
from slurm_elastic.live.fsdp import FSDPConfig, ShardedModel, sharded_parts
from slurm_elastic.live.position import DataPosition, StepInfo
from slurm_elastic.live.state import ElasticState
from slurm_elastic.live.world import LiveWorld, is_peer_failure
from slurm_elastic.training.policy import loss_scale

__all__ = ["ElasticSession", "StepInfo"]

log = logging.getLogger(__name__)

_PROGRESS_EVERY = 10  # rank 0 reports progress (a train.progress event) every N steps


class ElasticSession:
    """Training state, data position and process group that survive membership changes.

    Args:
        model: the bare model (already on ``device``).
        optimizer: its optimizer.
        scheduler: an LR scheduler stepped by the user, if any.
        stateful: more objects with ``state_dict()``/``load_state_dict()``, by name (a
            second optimizer, a ``GradScaler``, an EMA model): committed, shared with
            newcomers and checkpointed with the rest.
        dataset_size: samples per epoch.
        global_batch_size: samples per step over all ranks (fixed at any world size).
        seed: the sample order of epoch ``e`` depends only on ``(seed, e)``.
        shuffle: shuffle each epoch.
        drop_last: skip the short last global batch of each epoch.
        checkpoint: where periodic and final checkpoints go (and the first start
            resumes from); ``None``: none.
        save_every: also checkpoint every N steps (0: only at the end and on leave).
        commit_every: 0 (default): no copy of the state at step boundaries. DDP keeps
            every replica identical, so after a failed collective the survivors re-form
            and take the newest live state among them (a rank that finished the step
            gives it to one that did not); the state is copied only when the world
            changes. N > 0: also copy it to host memory every N steps and roll back to
            that copy after a failure (exact also when a collective *inside* the step
            fails after the optimizer stepped, e.g. a loss all-reduce for logging).
        backend: process group backend (default: ``nccl`` with CUDA, else ``gloo``).
        ddp_kwargs: passed to :class:`DistributedDataParallel` (e.g. ``device_ids``).
        timeout_s: collective timeout of every process group.
        reform_timeout_s: after a failed collective, how long to wait for a new round.
        leave_wait_s: how long a leave may wait for the survivors' new round before
            everyone saves a checkpoint and the restart path takes over.
        extra: small JSON-like values stored in every checkpoint.
        save_each_epoch: also checkpoint after the last step of every epoch.
        async_commit: copy the periodic commits' parameters and optimizer state on a
            thread while the next step's forward and backward run (the optimizers'
            steps wait for it); only for loops that change parameters in the
            optimizers' ``step()`` alone.
        stall_abort_s: in place with gloo, end a collective that has waited at least
            this long (and 3x the longest recent step) once the agent assigns a round
            formed after a member was lost (:mod:`~slurm_elastic.live.abort`).
            ``None``: wait for ``timeout_s``.
        fsdp: shard the model with FSDP2 (or HSDP) instead of wrapping it in DDP, and
            re-shard it in place on every change (:mod:`~slurm_elastic.live.fsdp`);
            ``model`` is the unsharded model, ``optimizer`` built on its parameters.
        vote_interval_s: the ranks agree on membership changes and notices (one small
            collective) at about this many seconds of training apart, not at every
            step; a leave, a join or a notice waits at most this long more. 0: at
            every step boundary.

    Raises:
        ValueError: ``commit_every`` < 0, ``stall_abort_s`` not positive,
            ``vote_interval_s`` < 0, or ``fsdp``
            with ``commit_every`` or ``async_commit``.
        TypeError: a ``stateful`` object without ``state_dict``/``load_state_dict``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        stateful: Mapping[str, Any] | None = None,
        dataset_size: int,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        checkpoint: CheckpointManager | None = None,
        save_every: int = 0,
        commit_every: int = 0,
        backend: str | None = None,
        ddp_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
        reform_timeout_s: float = 120.0,
        leave_wait_s: float = 30.0,
        extra: dict[str, Any] | None = None,
        save_each_epoch: bool = False,
        async_commit: bool = False,
        stall_abort_s: float | None = 1.0,
        fsdp: FSDPConfig | None = None,
        vote_interval_s: float = 0.25,
    ) -> None:
        _check_options(commit_every, stall_abort_s)
        # Now, before the script forks DataLoader workers: they inherit the handler.
        notice.ensure_preemption_handler()
        self._register_state(
            model, optimizer, scheduler, stateful, fsdp, commit_every, async_commit
        )
        #: the data position's meaning: each epoch's order, each rank's share of a step
        self.position = DataPosition(
            dataset_size, global_batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last
        )
        self.sampler = self.position.sampler
        self.checkpoint = checkpoint
        self.save_every = save_every
        self.commit_every = commit_every
        self.backend = _process_group_backend(backend)
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
        self.in_place = _in_place_available()
        #: the process group and its re-formation (:mod:`~slurm_elastic.live.world`)
        self.world = LiveWorld(
            self.state,
            backend=self.backend,
            ddp_kwargs=self.ddp_kwargs,
            timeout=self.timeout,
            reform_timeout_s=reform_timeout_s,
            in_place=self.in_place,
            stall_abort_s=stall_abort_s,
            sharding=self.sharded,
        )
        #: the loop over the current loader must end: the world changed (a switch or a
        #: recovery), the epoch ended, or this node left (:attr:`left`)
        self.interrupted = False
        #: this node stopped: its state lives on in the survivors or in the checkpoint
        self.left = False
        #: whether this rank leaves, and how long a leave has waited
        self.departure = Departure(self.in_place, leave_wait_s)
        #: which step boundaries vote
        self.cadence = Cadence(vote_interval_s)
        self._saved_step = -1
        self._total_steps: int | None = None
        self._started = False
        self._announced = False
        self.resumed_from: str | None = None

    def _register_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        stateful: Mapping[str, Any] | None,
        fsdp: FSDPConfig | None,
        commit_every: int,
        async_commit: bool,
    ) -> None:
        """The state the session moves (sharded with FSDP), and a watch on its optimizers."""
        #: FSDP2/HSDP: the sharded model and its full state across worlds (else None)
        self.sharded: ShardedModel | None = None
        if fsdp is not None:
            self.sharded, model, optimizer, stateful = sharded_parts(
                fsdp, model, optimizer, stateful, commit_every, async_commit
            )
        self.state = ElasticState(
            model, optimizer, scheduler, stateful=stateful, step=0, epoch=0, sample_offset=0
        )
        # Whether an optimizer stepped inside the current ``with step():`` block: without
        # periodic commits, a failure after that counts the step as done (see _failed).
        self._stepped = False
        for opt in (optimizer, self.sharded and self.sharded.optimizer, *(stateful or {}).values()):
            if isinstance(opt, torch.optim.Optimizer):
                opt.register_step_post_hook(self._on_optimizer_step)

    # -- public view ---------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The current DDP wrapper (replaced at every re-formation: do not keep it)."""
        return self.world.model

    @property
    def step_count(self) -> int:
        """Optimizer steps done."""
        return int(self.state.progress["step"])

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return int(self.state.progress["epoch"])

    @property
    def sample_offset(self) -> int:
        """Global samples consumed in the current epoch."""
        return int(self.state.progress["sample_offset"])

    @property
    def rank(self) -> int:
        """This rank in the current world."""
        return self.world.rank

    @property
    def world_size(self) -> int:
        """Ranks in the current world."""
        return self.world.world_size

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
        _startup_seam.pause("worker_open")  # tests only: a worker that has not registered
        from_peer = self.world.open()
        t0 = time.monotonic()
        if from_peer:
            self.resumed_from = "peer"
        else:
            self._resume_from_checkpoint()
            self.world.commit(self.step_count)
        t1 = time.monotonic()
        self.world.wrap()
        self.world.register(int(os.environ.get("LOCAL_RANK", "0")))
        resumed = {} if from_peer else {"resume_s": t1 - t0}
        phases = {**self.world.start_phases, **resumed, "wrap_s": time.monotonic() - t1}
        events.emit(
            events.LiveStart(
                rank=self.rank,
                world_size=self.world_size,
                step=self.step_count,
                in_place=self.in_place,
                resumed_from=self.resumed_from,
                phases_s={k: round(v, 4) for k, v in phases.items()},
            )
        )

    def _resume_from_checkpoint(self) -> None:
        resumed = None if self.checkpoint is None else resume_latest(self.checkpoint, self.state)
        if resumed is None:
            return
        path, info = resumed
        self._saved_step = self.world.saved_step = info.step
        self.resumed_from = str(path)
        self.resume_extra = dict(info.extra)
        self.resume_world_size = info.saved_world_size

    # -- the user's loop --------------------------------------------------------------------

    def finished(self, steps: int | None = None, epochs: int | None = None) -> bool:
        """Whether training is over: ``steps`` or ``epochs`` done, or this node left.

        Starts the session on first use. Also clears :attr:`interrupted` (call it before
        building each loader).

        Raises:
            ValueError: neither ``steps`` nor ``epochs`` given.
        """
        if steps is None and epochs is None:
            raise ValueError("finished() needs steps=... or epochs=... (when to stop)")
        self.start()
        self._total_steps = steps
        if not self._announced:
            self._announced = True
            # For slurm-elastic status / timeline / submit --wait: progress and throughput.
            events.emit(
                events.TrainStart(
                    step=self.step_count, world_size=self.world_size, rank=self.rank,
                    total_steps=steps,
                )
            )  # fmt: skip
        self.interrupted = False
        return self.left or self.reached(steps, epochs)

    def reached(self, steps: int | None = None, epochs: int | None = None) -> bool:
        """Whether ``steps`` steps or ``epochs`` epochs are done."""
        return (steps is not None and self.step_count >= steps) or (
            epochs is not None and self.epoch >= epochs
        )

    def batches(self) -> Iterator[list[int]]:
        """This rank's dataset indices for each step, from the current position.

        A batch sampler for ``DataLoader(dataset, batch_sampler=session.batches())`` (or
        iterate it directly). It ends at the end of the epoch; a world change makes
        :attr:`interrupted` true, and the next call starts from the committed position.
        Indices are computed when the loader asks for them (a loader may prefetch):
        the position and the world are the ones of this call.
        """
        self.start()
        yield from self.position.rest_of_epoch(
            self.epoch, self.sample_offset, self.rank, self.world_size
        )

    def next_indices(self) -> tuple[list[int], int, int]:
        """This rank's indices of the next step, and the step's global ``(start, stop)``."""
        return self.position.step(self.epoch, self.sample_offset, self.rank, self.world_size)

    @contextmanager
    def step(self, on_epoch_end: Callable[[int], Any] | None = None) -> Iterator[StepInfo]:
        """One optimizer step; at its end the step boundary (commit, switch or leave).

        A peer failure inside the block (or at the boundary) is handled here: the state
        rolls back to the last commit, the world re-forms and :attr:`interrupted` is set
        (the exception does not propagate). Any other exception propagates.

        Args:
            on_epoch_end: called (on every rank) after the last step of each epoch, before
                the boundary, e.g. to validate; may use collectives.

        Yields:
            The step's :class:`StepInfo`.

        Raises:
            ReformTimeoutError: a peer failed and no new round came in time.
        """
        self.start()
        if self.left:
            raise RuntimeError("this node left the run: stop training (session.left)")
        self.world.beat()  # the previous step and its boundary are done
        indices, start, stop = self.next_indices()
        world = self.world_size
        self.world.dirty = True
        info = StepInfo(
            indices=indices,
            global_size=stop - start,
            loss_scale=loss_scale(stop - start, world),
            step=self.step_count,
            epoch=self.epoch,
            rank=self.rank,
            world_size=world,
            round=self.world.round,
        )
        failure: str | None = None
        self._stepped = advanced = False
        # this step's boundary vote, cast now (its collective runs during the step)
        ballot = cast_vote(
            self.step_count + 1, self.in_place, self.departure, self.cadence, self.world
        )
        try:
            yield info
            self._advance(stop, on_epoch_end)
            advanced = True
            outcome = self._boundary(ballot)
        except BaseException as exc:
            if ballot is not None:
                ballot.abandon()  # referenced until its collective ends (Ballot.abandon)
            if not isinstance(exc, Exception) or not is_peer_failure(exc):
                raise
            failure = f"{type(exc).__name__}: {exc}"
            outcome = None
            if self._stepped and not advanced and not self.commit_every:
                # The optimizer stepped on the full all-reduced gradient before a later
                # collective of the block failed: without a commit to roll back to, the
                # step is done (what followed it in the block may be missed once).
                self._advance(stop, None)
        # Outside the except block: its traceback would keep the broken group alive.
        if failure is not None:
            self.interrupted = True
            if self.departure.leaving_here():
                events.emit(events.LiveLeft(step=self.step_count, after="failure"))
                self._mark_left()
                return
            self._recover(failure)
            return
        if outcome == "left":
            self._mark_left()
        elif outcome == "switched":
            self.interrupted = True

    def _on_optimizer_step(self, *_: Any) -> None:
        self._stepped = True

    def _mark_left(self) -> None:
        self.left = self.interrupted = True
        events.emit(events.TrainPreempted(step=self.step_count, rank=self.rank))

    def _advance(self, stop: int, on_epoch_end: Callable[[int], Any] | None) -> None:
        progress = self.state.progress
        progress["step"] += 1
        progress["sample_offset"] = stop
        if stop >= self.sampler.epoch_length:
            if on_epoch_end is not None:
                on_epoch_end(self.epoch)
            progress["epoch"] += 1
            progress["sample_offset"] = 0
            self.interrupted = True  # the loader of this epoch is done
        notice.report_progress(self.step_count)
        if self.rank == 0 and self.step_count % _PROGRESS_EVERY == 0:
            events.emit(
                events.TrainProgress(
                    step=self.step_count,
                    rank=self.rank,
                    total_steps=self._total_steps,
                    samples=self.epoch * self.sampler.epoch_length + self.sample_offset,
                )
            )

    def finish(self) -> str:
        """End training: the final checkpoint (collective) unless this node left.

        Returns:
            ``"done"`` or ``"left"``.
        """
        if self.left:
            return "left"
        self.save(blocking=True)
        events.emit(events.LiveDone(step=self.step_count, rank=self.rank))
        events.emit(events.TrainDone(step=self.step_count, rank=self.rank))
        self.world.finished = True
        return "done"

    def close(self) -> None:
        """Flush checkpoints and leave the process group (after :meth:`finish`: its agent
        counts this worker as finished even if torch aborts the interpreter's exit)."""
        if self.checkpoint is not None:
            self.checkpoint.flush()
        self.world.close()

    # -- the agreement ------------------------------------------------------------------------

    def _boundary(self, ballot: Ballot | None) -> str | None:
        """The step boundary: ``None`` (go on), ``"switched"`` or ``"left"``."""
        if ballot is None:
            self._periodic()
            return None
        agreed, leaving = ballot.result(), ballot.leaving
        self.cadence.agreed(self.step_count, self.world.round, agreed.next_in)
        if agreed.any_leave:
            self.departure.saw_leave()
        new = agreed.ready_max - 1  # the round every rank announced itself in, if any
        if agreed.ready_max > 0 and not leaving and self.world.pending_round() != new:
            # Every rank of round `new` announced itself, and this one holds no
            # assignment for it: its node is a spare (the round filled max_nodes). Leave
            # at the next boundary like a node with notice, so the others switch with no
            # rollback. (No early return: the rest of this boundary is collective.)
            log.info("not a member of round %d: leaving at the switch", new)
            self.departure.not_in_round = True
            self.world.unregister(int(os.environ.get("LOCAL_RANK", "0")))
        if agreed.everyone_leaves:
            self.save(blocking=True)  # the whole job stops: nothing finished is lost
            events.emit(events.LiveLeft(step=self.step_count, after="everyone_leaves"))
            return "left"
        if agreed.switch:
            if self.sharded is not None:  # every rank of the old world, leavers too
                self.sharded.gather()
            if leaving:
                events.emit(events.LiveLeft(step=self.step_count, after="switch"))
                return "left"
            self.world.switch(self.step_count)
            self.departure.reset()
            return "switched"
        if agreed.gave_up:
            self.save(blocking=True)  # together, now: nothing finished is lost
            if leaving:
                events.emit(events.LiveLeft(step=self.step_count, after="save"))
                return "left"
            if not self.in_place:  # the agent stops us for the next round (or a collective fails)
                if notice.await_new_round(self.leave_wait_s, parent_pid=self.departure.parent_pid):
                    events.emit(events.LiveLeft(step=self.step_count, after="restart"))
                    return "left"
                return None
            self.world.commit(self.step_count)
            self._recover("a peer left and no new round formed")
            return "switched"
        self._periodic()
        return None

    def _periodic(self) -> None:
        """A boundary's commit and checkpoint, when their step has come (collective)."""
        if self.commit_every and self.step_count % self.commit_every == 0:
            self.world.commit(self.step_count, background=self.async_commit)
        self.world.copy_shards(self.step_count)  # FSDP2's neighbour copy, when one is due
        epoch_done = self.save_each_epoch and self.sample_offset == 0 and self.step_count > 0
        if epoch_done or (self.save_every and self.step_count % self.save_every == 0):
            self.save(blocking=False)

    def _recover(self, reason: str) -> None:
        self.world.recover(reason, keep_live=not self.commit_every)
        self.departure.reset()

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, blocking: bool) -> None:
        """Collective: checkpoint the current state (skipped if this step is saved)."""
        if self.checkpoint is None:
            return
        if self._saved_step == self.step_count:
            if blocking:
                self.checkpoint.flush()
            return
        if self.sharded is not None:
            self.sharded.gather()  # collective: the full state goes into the bundle
        bundle = to_bundle(self.state, self.sampler.global_batch_size, self.extra or None)
        self.checkpoint.save(bundle, self.step_count, blocking=blocking)
        self._saved_step = self.world.saved_step = self.step_count


def _check_options(commit_every: int, stall_abort_s: float | None) -> None:
    """Refuse option values no session can run with (``ValueError`` naming the value)."""
    if commit_every < 0:
        raise ValueError(f"commit_every={commit_every} must be >= 0 (0: no periodic copy)")
    if stall_abort_s is not None and not stall_abort_s > 0:
        raise ValueError(f"stall_abort_s={stall_abort_s!r} must be > 0 seconds, or None")


def _in_place_available() -> bool:
    """In place is on, and this worker's agent gave it a node channel and a round."""
    return (
        roster.in_place_enabled()
        and NodeChannel.from_environ() is not None
        and roster.Assignment.from_environ() is not None
    )


def _process_group_backend(backend: str | None) -> str:
    """The backend asked for, else ``nccl`` with CUDA and ``gloo`` without."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        # On a peer failure NCCL's watchdog aborts the communicator and the collective
        # raises without killing the process (1, torch's default, kills it): survivors
        # re-form. Unverified on hardware here: run bench/gpu_reform_check.py on a GPU.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    return backend
