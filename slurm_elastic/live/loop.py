"""``ElasticLoop``: a DDP training loop that survives membership changes in place.

The convenience over :class:`~slurm_elastic.live.session.ElasticSession` for the
simplest case: the user gives the model, optimizer, scheduler and data size once, and a
function that runs one step on the rank's share of the global batch (:class:`Step`);
the loop calls it inside ``with session.step():`` until ``steps`` or ``epochs`` are done
or this node leaves. Everything else (the step-boundary agreement, commits, switches,
recovery after a failed collective, checkpoints, the data position) is the session's;
see :mod:`~slurm_elastic.live.session` for the protocol. Keep your own loop (a
``DataLoader``, a ``GradScaler``, two optimizers, an EMA): use the session directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from slurm_elastic.live.session import ElasticSession, StepInfo
from slurm_elastic.live.state import ElasticState
from slurm_elastic.live.world import LiveWorld, ReformTimeoutError, is_peer_failure

__all__ = ["ElasticLoop", "ReformTimeoutError", "Step", "is_peer_failure"]


@dataclass(frozen=True)
class Step(StepInfo):
    """One optimizer step as seen by one rank: :class:`StepInfo` plus the model.

    Attributes:
        model: the DDP-wrapped model of the current world (do not keep a reference:
            it is replaced at every re-formation).
    """

    model: nn.Module


class ElasticLoop:
    """A training loop whose workers survive joins, leaves and peer failures in place.

    Args:
        model: the bare model (already on ``device``).
        optimizer: its optimizer.
        scheduler: an LR scheduler stepped by the user's step function, if any.
        options: every keyword of :class:`~slurm_elastic.live.session.ElasticSession`
            (``dataset_size`` and ``global_batch_size`` are required; ``checkpoint``,
            ``save_every``, ``commit_every``, ``stateful``, ``async_commit``, ...).

    Raises:
        ValueError, TypeError: see :class:`~slurm_elastic.live.session.ElasticSession`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        scheduler: Any = None,
        **options: Any,
    ) -> None:
        #: the session underneath (its options: see :class:`ElasticSession`)
        self.session = ElasticSession(model, optimizer, scheduler, **options)

    @property
    def model(self) -> nn.Module:
        """The current DDP wrapper (replaced at every re-formation)."""
        return self.session.model

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.session.epoch

    @property
    def sample_offset(self) -> int:
        """Global samples consumed in the current epoch."""
        return self.session.sample_offset

    @property
    def rank(self) -> int:
        """This rank in the current world."""
        return self.session.rank

    @property
    def world_size(self) -> int:
        """Ranks in the current world."""
        return self.session.world_size

    @property
    def round(self) -> int:
        """The rendezvous round of the current world."""
        return self.session.round

    @property
    def resumed_from(self) -> str | None:
        """ "peer", the checkpoint path resumed from, or None."""
        return self.session.resumed_from

    @property
    def resume_extra(self) -> dict[str, Any]:
        """The ``extra`` of the checkpoint resumed from (empty otherwise)."""
        return self.session.resume_extra

    @property
    def resume_world_size(self) -> int | None:
        """The world size the checkpoint resumed from was saved at."""
        return self.session.resume_world_size

    @property
    def in_place(self) -> bool:
        """Whether membership changes happen in place (else the restart path)."""
        return self.session.in_place

    @property
    def state(self) -> ElasticState:
        """The registered training state."""
        return self.session.state

    @property
    def world(self) -> LiveWorld:
        """The process group and its re-formation."""
        return self.session.world

    # -- public view ---------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.session.step_count

    def start(self) -> None:
        """Join the process group and take the state (see :meth:`ElasticSession.start`)."""
        self.session.start()

    def close(self) -> None:
        """Flush checkpoints and leave the process group."""
        self.session.close()

    def save(self, blocking: bool) -> None:
        """Collective: checkpoint the current state (skipped if this step is saved)."""
        self.session.save(blocking)

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
            ValueError: neither ``steps`` nor ``epochs`` given.
            ReformTimeoutError: a peer failed and no new round came in time.
        """
        if steps is None and epochs is None:
            raise ValueError("ElasticLoop.run needs steps=... or epochs=...")
        s = self.session
        while not s.finished(steps=steps, epochs=epochs):
            while not s.interrupted and not s.reached(steps, epochs):
                with s.step(on_epoch_end) as info:
                    train_step(Step(**vars(info), model=s.model))
        return s.finish()
