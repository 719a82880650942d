"""The smallest public rendezvous handler, for agents whose worker side is not run."""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousHandler


class IdleHandler(RendezvousHandler):
    """Never asked to form a round; ``num_nodes_waiting`` answers from ``waiting`` in turn
    (then 0)."""

    def __init__(self, waiting: list[int] | None = None) -> None:
        self.waiting = waiting if waiting is not None else []

    def get_backend(self) -> str:
        return "idle"

    def next_rendezvous(self) -> Any:
        raise AssertionError("not used")

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return self.waiting.pop(0) if self.waiting else 0

    def get_run_id(self) -> str:
        return "idle"

    def shutdown(self) -> bool:
        return True
