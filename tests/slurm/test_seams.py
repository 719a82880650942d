"""Typed seams: the Slurm control Protocol and the rendezvous' leave()."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.control import SlurmControl, default_control

ROOT = Path(__file__).resolve().parents[2]


def test_slurm_client_implements_slurm_control() -> None:
    assert isinstance(SlurmClient(), SlurmControl)
    assert isinstance(default_control(), SlurmClient)
    # the same keyword-only options (cancel with a state filter, requeue held)
    for name in ("submit", "cancel", "requeue", "job_infos", "job_state", "ping"):
        ours = inspect.signature(getattr(SlurmControl, name))
        real = inspect.signature(getattr(SlurmClient, name))
        assert list(ours.parameters) == list(real.parameters), name


def test_our_rendezvous_is_leavable_and_torchs_is_not() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    from slurm_elastic.rendezvous.handler import SlurmRendezvousHandler
    from slurm_elastic.rendezvous.protocols import LeavableRendezvous

    assert issubclass(SlurmRendezvousHandler, LeavableRendezvous)
    assert not issubclass(DynamicRendezvousHandler, LeavableRendezvous)


def test_no_slurm_client_is_typed_any() -> None:
    offenders = []
    for path in sorted((ROOT / "slurm_elastic").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ("client: Any" in line or "handler: Any" in line) and not line.lstrip().startswith(
                "#"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, offenders
    hints = typing.get_type_hints(SlurmControl.cancel)
    assert hints["state"] == str | None
