"""Checkpoints as earlier versions wrote them, for the tests that load them.

Before issue #19 item 4, a manager with ``weights_only=False`` wrote a state the
container does not store with ``torch.save`` (``state.pt``). The package no longer writes
that format but still reads it; this writes one the way those versions did: the store's
own begin/commit (a private temporary, a manifest with the file's size and CRC32, the
rename), and ``torch.save`` for the data file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.checkpoint.manifest import FileRecord, Manifest, crc32_file
from slurm_elastic.checkpoint.serializer import TORCH_FILE


def write_torch_checkpoint(directory: Path, step: int, state: Any, run: str | None = None) -> Path:
    """Commit ``state`` as ``directory/step_<step>/state.pt``; return the step directory."""
    store = CheckpointManager(directory, run_id=run or "").store
    tmp = store.begin(step)
    torch.save(state, tmp / TORCH_FILE)
    size, crc = crc32_file(tmp / TORCH_FILE)
    return store.commit(
        tmp, Manifest(step, "replicated", 1, (FileRecord(TORCH_FILE, size, crc),), run=run)
    )
