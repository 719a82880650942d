"""``LiveWorld``: one worker's process group, and how it is re-formed in place.

The loop (:mod:`~slurm_elastic.live.loop`) decides *when* the world changes; this module
does the change. A :class:`LiveWorld` owns the process group, the DDP wrapper around the
registered model, the round the group belongs to, and the worker's view of the node
channel (:class:`~slurm_elastic.live.roster.AssignmentWatch`):

* :meth:`LiveWorld.open`: the first group (in place: from the assignment in the
  environment, taking the newest commit of a live peer; else torch's ``env://``);
* :meth:`LiveWorld.ready_round`: whether every rank of a pending round announced itself;
* :meth:`LiveWorld.switch`: a graceful change at a step boundary (commit, tear down in
  the safe order, init on a fresh store prefix, newest commit from a survivor, new DDP);
* :meth:`LiveWorld.recover`: after a failed collective (roll back, wait for the next
  round, re-form; :class:`ReformTimeoutError` when none comes in time).

Why this order (facts in the project notes on torch 2.13): a gloo group freed from DDP's
reducer can deadlock (hold the group, drop the wrapper, destroy, drop the group);
``destroy_process_group`` frees nothing while a reference (a traceback) remains (callers
tear down outside their ``except`` block); a reused store prefix reads stale addresses
(``slurm_elastic.live.<round>``, a new round every time); DDP's private
``_update_process_group`` corrupts gradients on a grow (a new wrapper on every rank).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_elastic import events, notice
from slurm_elastic.channel import NodeChannel
from slurm_elastic.errors import PeerLostError, ReformTimeoutError, RoundSupersededError
from slurm_elastic.live import auth, links, roster
from slurm_elastic.live.abort import StallGuard, connected_sockets
from slurm_elastic.live.fsdp import ShardedModel
from slurm_elastic.live.links import is_peer_failure
from slurm_elastic.live.state import ElasticState
from slurm_elastic.rendezvous.bounded_call import StoreUnansweredError, call_bounded

__all__ = ["LiveWorld", "ReformTimeoutError", "form_group", "is_peer_failure"]

log = logging.getLogger(__name__)


#: A round's store connect is tried this long before a newer assignment is looked for.
_CONNECT_SLICE_S = 1.0
#: and given up after this long (or the collective timeout, if shorter).
_CONNECT_BUDGET_S = 10.0


def form_group(backend: str, store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
    """``init_process_group`` on ``store``; a failed one leaves the next one's name as a
    fresh process's.

    torch names the default group by a process-wide counter, part of every store key
    of the group's formation (``<name>/``). A failed ``init_process_group`` advances it
    and only destroying the default group resets it: a survivor whose formation failed
    (its round was superseded under it, a peer died) would form the next round as group
    ``1`` while a newcomer (a fresh process) forms it as ``0``, and both would wait for
    each other's keys for the whole ``timeout`` (tests/live/test_group_name.py; torch
    2.13). After a failure this forms and destroys a one-rank group on a private store,
    public API only, which resets the counter, then raises the failure.
    """
    try:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    except BaseException:
        if not dist.is_initialized():
            try:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                dist.destroy_process_group()
            except Exception as exc:  # the original failure is what the caller needs
                log.warning("could not reset the process group name after a failure: %s", exc)
        raise


@dataclass
class _Pending:
    assignment: roster.Assignment
    store: Any
    sealed_ready: set[str] = field(default_factory=set)


class LiveWorld:
    """The process group of one worker, re-formed in place on membership changes.

    Args:
        state: the registered training state (committed, restored and shared here).
        backend: the process group backend.
        ddp_kwargs: passed to :class:`DistributedDataParallel`.
        timeout: collective timeout of every process group.
        reform_timeout_s: after a failed collective, how long to wait for a new round.
        in_place: whether the agent's node channel is there (else ``env://`` and the
            restart path).
        stall_abort_s: in place with gloo, a collective blocked this long (at least;
            see :class:`~slurm_elastic.live.abort.StallGuard`) is aborted once the agent
            assigns a round formed after a member was lost; ``None``: never (the
            collective then waits for ``timeout``).

    Attributes:
        round: the rendezvous round of the current group.
        dirty: the live state moved past the last commit (a step ran since).
    """

    def __init__(
        self,
        state: ElasticState,
        *,
        backend: str,
        ddp_kwargs: dict[str, Any],
        timeout: timedelta,
        reform_timeout_s: float,
        in_place: bool,
        stall_abort_s: float | None = 1.0,
        sharding: ShardedModel | None = None,
    ) -> None:
        self.state = state
        self.sharding = sharding  # FSDP2/HSDP (live/fsdp.py) in place of DDP, if given
        self.backend = backend
        self.ddp_kwargs = ddp_kwargs
        self.timeout = timeout
        self.reform_timeout_s = reform_timeout_s
        self.in_place = in_place
        self.round = int(os.environ.get(roster.ROUND_ENV, "0"))
        self.dirty = False
        self.finished = False  # training ended (session.finish): close() marks it closed
        self.saved_step = -1  # the newest checkpoint's step this rank saved/resumed (-1: none)
        self._ddp: nn.Module | None = None
        self._watch: roster.AssignmentWatch | None = None
        self._pending: _Pending | None = None
        self._store: Any = None  # the current group's store (see _join)
        self._group_sockets: frozenset[int] = frozenset()  # this process's, before the group
        self._failed_rounds: set[int] = set()
        self.start_phases: dict[str, float] = {}  # open()'s phases in place, in seconds
        # gloo cannot abort a collective waiting on a silently dead peer: the guard ends
        # it once the agent assigns a round without that peer (live/abort.py).
        self._guard: StallGuard | None = None
        channel = NodeChannel.from_environ()
        self._channel = channel
        if in_place and backend == "gloo" and stall_abort_s is not None and channel:
            self._guard = StallGuard(
                channel,
                int(os.environ.get("LOCAL_RANK", "0")),
                min_stall_s=stall_abort_s,
            )
        # The run key seals the round's store (only the run's processes take a seat); the
        # agent always gives it. Without it (a worker started by hand) values are plain.
        self._run_key = auth.worker_key() if in_place else None
        if in_place and self._run_key is None:
            log.warning(
                "no run key (%s unset): the round's store is not sealed, so any process "
                "that reaches it could take a seat; start workers with `slurm-elastic agent`",
                auth.KEY_FILE_ENV,
            )

    # -- view -------------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The current DDP wrapper or sharded model (replaced at every re-formation)."""
        if self._ddp is None:
            raise RuntimeError("ElasticLoop.start() first")
        return self._ddp

    @property
    def rank(self) -> int:
        """This rank in the current group."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """Ranks in the current group."""
        return dist.get_world_size()

    def device(self) -> torch.device:
        """Where collective tensors live (the current CUDA device with NCCL)."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def commit(self, step: int, *, background: bool = False) -> None:
        """Commit the live state as ``(round, step)`` (see :meth:`ElasticState.commit`)."""
        self.state.commit((self.round, step), background=background)
        self.dirty = False

    # -- start ------------------------------------------------------------------------------

    def open(self) -> bool:
        """Join the first group; return whether the state came from a live peer.

        In place, the assignment comes from the environment (torch's variables plus the
        round) and the newest commit among the ranks is taken (a newcomer among
        survivors receives it); otherwise torch's ``env://``.
        """
        if not self.in_place:
            self._group_sockets = connected_sockets()
            dist.init_process_group(self.backend, timeout=self.timeout)
            self._record_links()
            return False
        first = roster.Assignment.from_environ()
        if first is None:  # checked by the caller; the environment changed since
            raise RuntimeError("in-place mode without an assignment in the environment")
        channel = self._channel
        if channel is None:  # checked by the caller; the environment changed since
            raise RuntimeError("in-place mode without a node channel in the environment")
        # starting: a restart before the first step loses nothing (the agent need not
        # wait for a save that a join blocked on a lost peer could never make)
        roster.register_worker(channel, first.local_rank, os.getpid(), live=False)
        self._watch = roster.AssignmentWatch(channel, first.local_rank, first.round)
        t0 = time.monotonic()
        try:
            store = self._connect(first)
            t1 = time.monotonic()
            self._join(first, store)  # waits for every rank of the round (survivors switch)
        except RoundSupersededError as exc:
            # A newer round came while this worker starts: its agent restarts starting
            # workers for it (they trained nothing). Failing now would be charged to the
            # restart budget as a worker failure; wait for that restart instead.
            log.info("%s: waiting for the agent to restart this starting worker", exc)
            deadline = time.monotonic() + self.reform_timeout_s
            while time.monotonic() < deadline:
                time.sleep(0.1)
            raise
        t2 = time.monotonic()
        from_peer = self.sync_state()
        self.start_phases = dict(connect_s=t1 - t0, join_s=t2 - t1, state_s=time.monotonic() - t2)
        return from_peer

    def register(self, local_rank: int) -> None:
        """Tell the agent this worker can re-form in place (after the first wrap)."""
        if self.in_place and self._channel is not None:
            roster.register_worker(self._channel, local_rank, os.getpid())

    # -- readiness --------------------------------------------------------------------------

    def ready_round(self) -> int:
        """``round + 1`` of a pending assignment whose ranks are all ready, else 0."""
        if self._watch is None:
            return 0
        latest = self._watch.poll()
        fresh = latest is not None and latest.round not in self._failed_rounds
        if (
            latest is not None
            and fresh
            and (self._pending is None or self._pending.assignment != latest)
        ):
            try:
                self._pending = _Pending(latest, self._connect(latest))
            except Exception as exc:  # a superseded round's store is gone
                log.info("round %d store unreachable (%s); waiting", latest.round, exc)
                self._failed_rounds.add(latest.round)
                self._pending = None
        pending = self._pending
        if pending is None:
            return 0
        keys = [f"ready/{r}" for r in range(pending.assignment.world_size)]
        if not pending.store.check(keys):
            return 0
        if isinstance(pending.store, auth.SealedStore):  # a mark an outsider set is no mark
            unsure = [k for k in keys if k not in pending.sealed_ready]
            for key in unsure:
                if pending.store.opened(key) is None:
                    return 0
                pending.sealed_ready.add(key)
        return pending.assignment.round + 1

    def pending_round(self) -> int | None:
        """The round of the assignment this worker holds and announced itself in, if any."""
        return None if self._pending is None else self._pending.assignment.round

    def unregister(self, local_rank: int) -> None:
        """Withdraw the registration (this worker leaves; see :meth:`register`)."""
        if self.in_place and self._channel is not None:
            roster.unregister_worker(self._channel, local_rank)

    # -- building blocks --------------------------------------------------------------------

    def _connect(self, a: roster.Assignment) -> Any:
        """Connect to round ``a``'s store and announce this rank ready in it.

        Tried in slices of :data:`_CONNECT_SLICE_S` within :data:`_CONNECT_BUDGET_S`;
        between slices a newer assignment supersedes ``a`` (:class:`RoundSupersededError`):
        a worker back from a freeze finds the rounds it missed gone, and torch retries a
        refused connect until its timeout (the storm of ``bench/goodput.py``, live.md).
        A frozen host accepts the connection and never answers torch's ping, which has no
        timeout: that connect is waited for until a newer assignment supersedes ``a``
        (rendezvous/bounded_call.py), or until the agent restarts workers still starting.
        """
        budget_end = time.monotonic() + min(_CONNECT_BUDGET_S, self.timeout.total_seconds())
        while True:
            slice_s = max(0.1, min(_CONNECT_SLICE_S, budget_end - time.monotonic()))
            try:
                client = call_bounded(
                    lambda: dist.TCPStore(
                        a.master_addr,
                        a.master_port,
                        is_master=False,
                        timeout=timedelta(seconds=slice_s),  # noqa: B023 (waited for here)
                        use_libuv=True,
                    ),
                    limit_s=math.inf,
                    give_up=lambda: self._superseded(a),
                )
                break
            except StoreUnansweredError as exc:  # a frozen host, and a newer round is there
                raise RoundSupersededError(
                    f"round {a.round}'s store at {a.master_addr}:{a.master_port}: {exc}: "
                    "skipping it"
                ) from None
            except dist.DistError:
                if time.monotonic() >= budget_end:
                    raise
                reason = self._superseded(a)
                if reason is not None:
                    raise RoundSupersededError(
                        f"round {a.round}'s store at {a.master_addr}:{a.master_port} is "
                        f"unreachable and {reason}: skipping it"
                    ) from None
        client.set_timeout(self.timeout)
        store: Any = dist.PrefixStore(f"slurm_elastic.live.{a.round}", client)
        if self._run_key is not None:  # only the run's processes can take a seat
            store = auth.SealedStore(
                store,
                auth.round_key(self._run_key, a.round),
                self.timeout,
                abandon=lambda: self._superseded(a),
            )
        store.set(f"ready/{a.rank}", "1")
        return store

    def _superseded(self, a: roster.Assignment) -> str | None:
        """Why round ``a`` is no longer worth waiting for (a newer round is assigned to
        this worker), else ``None``. Its store's waits ask it (:class:`auth.SealedStore`):
        a worker that switched to a round whose peers have gone on to a newer one (a
        peer that announced itself ready and then restarted, or skipped to the newer
        round) stops waiting for them there instead of waiting the whole timeout."""
        newer = self._watch.poll(force=True) if self._watch is not None else None
        if newer is None or newer.round <= a.round:
            return None
        return f"round {newer.round} is assigned"

    def _join(self, a: roster.Assignment, store: Any) -> None:
        before = self._group_sockets = connected_sockets()
        # Keep the Python store alive as long as the group: torch holds only its C++
        # half, so a later new_group (an HSDP mesh's subgroups) would call a store whose
        # Python methods are gone ("Not implemented" from PythonStore::set).
        self._store = store
        try:
            form_group(
                self.backend, dist.PrefixStore("pg", store), a.rank, a.world_size, self.timeout
            )
        except RuntimeError as exc:
            # init_process_group -> ProcessGroupGloo's constructor -> connectFullMesh
            # raises a plain RuntimeError ("Gloo connectFullMesh failed with ... Connect
            # timeout"; torch 2.13 and 2.14.1, tests/live/test_peer_failure.py) when a
            # peer that published its address is gone; a peer that never published it
            # is a DistStoreError already. Plain RuntimeError only: its subclasses
            # (torch's DistError family included) pass unchanged.
            if type(exc) is not RuntimeError or not links.is_gloo(self.backend):
                raise
            raise PeerLostError(
                f"the gloo group of round {a.round} ({a.world_size} ranks) did not form: "
                f"{exc}; a peer is gone, waiting for the next round"
            ) from exc
        self._record_links()
        if self._guard is not None:  # the group's own connections: gloo's pairs
            self._guard.arm(a.round, connected_sockets() - before)
        self.round = a.round
        if self._watch is not None:
            self._watch.current_round = a.round
        self._pending = None

    def teardown(self, failed: bool = False) -> None:
        """Leave the current group in the safe order (idempotent); a ``failed`` gloo
        group's objects are kept for its timeout (:func:`links.bury`)."""
        # A gloo group freed from DDP's reducer can deadlock: hold the group, drop the
        # wrapper, destroy, then drop the group.
        if self._guard is not None:
            self._guard.disarm()  # before the group goes: its sockets are never reused
        group = dist.group.WORLD if dist.is_initialized() else None
        # FSDP: the mesh's groups, held like the world's (the module references them)
        held = self.sharding.release() if self.sharding is not None else []
        if failed and links.is_gloo(self.backend) and (group is not None or held):
            links.bury((group, held), self.timeout.total_seconds() + 5.0)
        self._ddp = None
        if group is not None:
            dist.destroy_process_group()
        del group, held
        self._store = None
        links.forget()

    def beat(self) -> None:
        """A step boundary passed on the current group (for the stall guard)."""
        if self._guard is not None:
            self._guard.beat()
        links.prune()  # failed groups kept past their timeout (links.bury)

    def close(self) -> None:
        """Leave the group and stop the stall guard's thread; after a finished training,
        tell the agent only this interpreter's exit remains (:func:`roster.mark_closed`)."""
        self.teardown()
        if self._guard is not None:
            self._guard.close()
        if self.finished and self._channel is not None:
            roster.mark_closed(self._channel, int(os.environ.get("LOCAL_RANK", "0")), os.getpid())

    def wrap(self) -> None:
        """Wrap the model in a new DDP for the current group (broadcasts from rank 0), or
        shard it on a new mesh (FSDP2/HSDP: :mod:`~slurm_elastic.live.fsdp`)."""
        if self.sharding is not None:
            self._ddp = self.sharding.shard(self.device().type, self.world_size)
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            self.sharding.open_copies(self.backend, local_world, self.device())
            self._record_links()  # the mesh's subgroups have pairs of their own
            if self._guard is not None:  # and a collective may block on them
                self._guard.arm(self.round, connected_sockets() - self._group_sockets)
            return
        self._ddp = DistributedDataParallel(self.state.model, **self.ddp_kwargs)

    def _record_links(self) -> None:
        """Record the current gloo group's connections (see :func:`is_peer_failure`)."""
        if links.is_gloo(self.backend):
            links.record(connected_sockets() - self._group_sockets)

    def sync_state(self) -> bool:
        """Collective: all ranks take the newest commit; False if nobody has one. A sharded
        state lost with ranks is rebuilt first (:meth:`ShardedModel.recover`) and committed."""
        if self.sharding is not None:
            rebuilt = self.sharding.recover()
            if rebuilt is not None and rebuilt[1] is not None:
                step, own = rebuilt
                if isinstance(own, dict):  # kept with a neighbour copy of that step
                    self.state.load(own)
                if self.state.progress["step"] == step:
                    self.state.commit((self.round, step))
        mine = self.state.commit_id if self.state.committed else (-1, -1)
        local = torch.tensor([mine[1], mine[0]], dtype=torch.int64, device=self.device())
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        ids = [(int(t[0]), int(t[1])) for t in gathered]  # (step, round)
        best = max(ids)
        if best[0] < 0:
            return False
        if all(i == best for i in ids):
            if self.dirty:
                self.state.restore()
        else:
            self.state.sync(ids.index(best))
        self.dirty = False
        return True

    def copy_shards(self, step: int) -> None:
        """At the step boundary ``step``: adopt a finished neighbour copy (FSDP2), start the
        next when one is due (:meth:`ShardedModel.take_copy`: pairs, in the background)."""
        if self.sharding is None or not self.sharding.copy_due(step):
            return
        with self.sharding.without_state():
            rest = self.state.snapshot()
        self.sharding.take_copy(step, self.round, rest)

    # -- changes ----------------------------------------------------------------------------

    def switch(self, step: int) -> None:
        """Collective over the new world: a graceful change at the step boundary ``step``."""
        pending = self._pending
        if pending is None:  # an internal invariant: the loop decided to switch
            raise RuntimeError("switch without a pending assignment")
        started = time.monotonic()
        self.commit(step)
        old_world = self.world_size
        self.teardown()
        self._join(pending.assignment, pending.store)
        self.sync_state()
        self.wrap()
        took = time.monotonic() - started
        log.info(
            "re-formed in place: round %d, rank %d of %d (was %d) in %.3f s",
            self.round,
            self.rank,
            self.world_size,
            old_world,
            took,
        )
        events.emit(
            events.LiveReformed(
                cause="graceful",
                round=self.round,
                rank=self.rank,
                world_size=self.world_size,
                old_world_size=old_world,
                step=step,
                switch_s=took,
            )
        )

    def recover(self, reason: str, *, keep_live: bool = False) -> None:
        """After a failed collective: roll back, wait for the next round, re-form.

        Args:
            reason: the failure, for the log and the event.
            keep_live: no rollback: the live state (consistent at a step: DDP replicas
                stepped on the same all-reduced gradient or not at all) is committed now
                and the newest one among the survivors is taken by all.

        Raises:
            ReformTimeoutError: no usable round within ``reform_timeout_s``.
        """
        if self._guard is not None:
            self._guard.disarm()  # out of the collective (not stuck in it: live/abort.py)
        # end the failed group's other collectives at once (see links.abandon)
        links.abandon()
        started = time.monotonic()
        deadline = started + self.reform_timeout_s
        failed_step = int(self.state.progress["step"])
        log.warning("collective failed at step %d (%s): re-forming in place", failed_step, reason)
        events.emit(events.LivePeerFailure(step=failed_step, error=reason[:500]))
        if self.sharding is not None:
            # The live state is in shards: keep this rank's before they go; the new
            # world rebuilds the whole from the survivors' (sync_state).
            self.sharding.keep_shards(
                failed_step, self.round, self.world_size, self.state.last_commit(),
                saved=self.saved_step,
            )  # fmt: skip
        self.teardown(failed=True)
        if self.sharding is None and keep_live:
            self.state.commit((self.round, failed_step))
        elif self.sharding is None:
            self.state.restore()
        self.state.model.zero_grad(set_to_none=True)  # no partial gradient carries over
        self.dirty = False
        if self._pending is not None:
            self._failed_rounds.discard(self._pending.assignment.round)
        self._pending = None
        while True:
            latest = self._await_assignment(deadline, reason)
            failure = None
            try:
                self._join(latest, self._connect(latest))
                self.sync_state()
                self.wrap()
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                failure = f"{type(exc).__name__}: {exc}"
            if failure is None:
                if self.sharding is not None:
                    self.sharding.forget_kept()
                break
            log.warning("re-forming round %d failed (%s); waiting again", latest.round, failure)
            self._failed_rounds.add(latest.round)
            self.teardown(failed=True)
            self.state.restore()
        took = time.monotonic() - started
        step = int(self.state.progress["step"])
        log.info(
            "re-formed after a failure: round %d, rank %d of %d, step %d (redo %d) in %.2f s",
            self.round,
            self.rank,
            self.world_size,
            step,
            failed_step - step,
            took,
        )
        events.emit(
            events.LiveReformed(
                cause="failure",
                round=self.round,
                rank=self.rank,
                world_size=self.world_size,
                step=step,
                redone_steps=failed_step - step,
                switch_s=took,
            )
        )

    def _await_assignment(self, deadline: float, reason: str) -> roster.Assignment:
        if self._watch is None:
            raise ReformTimeoutError(f"collective failed ({reason}) and the restart path is on")
        while True:
            latest = self._watch.poll()
            if latest is not None and latest.round not in self._failed_rounds:
                return latest
            if time.monotonic() > deadline:
                raise ReformTimeoutError(
                    f"collective failed ({reason}) and no new round came within "
                    f"{self.reform_timeout_s:.0f} s: falling back to a restart"
                )
            notice.report_progress(int(self.state.progress["step"]))  # alive, not hung
            time.sleep(0.02)
