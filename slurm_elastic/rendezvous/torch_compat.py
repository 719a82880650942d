"""The torch versions this package is tested with, checked at import.

Nothing here (or anywhere in :mod:`slurm_elastic.rendezvous`) uses a private torch
name: the handler implements torch's public ``RendezvousHandler`` and the backend
torch's public ``RendezvousBackend``. The agent overrides protected hooks of torch's
``LocalElasticAgent``; each has a contract test (``tests/agent/test_torch_agent_contract.py``).

* below :data:`SUPPORTED_TORCH`: :class:`UnsupportedTorchError` naming the installed
  and supported versions and the pip line;
* a newer minor than tested: a warning (:class:`UntestedTorchWarning`), not a refusal.
"""

from __future__ import annotations

import re
import warnings

import torch

from slurm_elastic.errors import UnsupportedTorchError, UntestedTorchWarning

__all__ = ["SUPPORTED_TORCH", "UnsupportedTorchError", "UntestedTorchWarning",
           "check_torch_version"]  # fmt: skip

#: The tested torch range: ``low <= (major, minor) < high``.
SUPPORTED_TORCH = ((2, 13), (2, 15))


def check_torch_version(version: str) -> tuple[int, int]:
    """Return ``(major, minor)`` of ``version``; refuse an older torch, warn on a newer.

    Raises:
        UnsupportedTorchError: the version is older than :data:`SUPPORTED_TORCH` or
            cannot be parsed.
    """
    low, high = SUPPORTED_TORCH
    tested = f"{low[0]}.{low[1]} to {high[0]}.{high[1] - 1}"
    pip = f"pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}'"
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorchError(
            f"cannot parse torch version {version!r}; slurm_elastic supports torch "
            f"{tested}. Install a supported torch ({pip})"
        )
    found = (int(match.group(1)), int(match.group(2)))
    if found < low:
        raise UnsupportedTorchError(
            f"torch {version} is older than slurm_elastic supports (torch {tested}). "
            f"Install a supported torch ({pip})"
        )
    if found >= high:
        warnings.warn(
            f"torch {version} is newer than the versions slurm_elastic was tested with "
            f"({tested}); it should work (only public rendezvous APIs are used), but "
            f"report problems, or install a tested torch ({pip})",
            UntestedTorchWarning,
            stacklevel=2,
        )
    return found


check_torch_version(torch.__version__)
