"""A crafted ``state.bin`` is a CheckpointCorruptError, never a crash (issue 21, item 7).

The file is our own container, written by the real CheckpointManager, then edited the
way someone who can write the file (or a bit flip that matches its CRC) would: the
header names a quantized dtype (before: a tensor without a quantizer, SIGSEGV on
``repr`` or ``load_state_dict``), a negative offset, string or float shape dimensions, a
``meta`` device, overlapping tensors. The manifest is rewritten to match, so the edit
passes the CRC checks and reaches the parser. Each load runs in a child process, so a
crash fails the test instead of killing the suite.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.checkpoint.manifest import FileRecord, read_manifest, write_manifest

ROOT = Path(__file__).resolve().parents[2]
_PREFIX = struct.Struct("<8sQ")


def crafted(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory, run_id="")
    manager.save({"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(4)}, step=1)
    manager.close()
    step = directory / "step_1"
    path = step / "state.bin"
    raw = bytearray(path.read_bytes())
    magic, hlen = _PREFIX.unpack_from(raw)
    header = json.loads(raw[_PREFIX.size : _PREFIX.size + hlen])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    room = header["data_start"] - _PREFIX.size
    assert len(text) <= room, "the edit must fit before the data"
    raw[: header["data_start"]] = _PREFIX.pack(magic, len(text)) + text + bytes(room - len(text))
    path.write_bytes(bytes(raw))

    manifest = read_manifest(step)
    (step / "manifest.json").unlink()
    record = FileRecord("state.bin", len(raw), zlib.crc32(bytes(raw)))
    write_manifest(step, dataclasses.replace(manifest, files=(record,)))
    return directory


CHILD = textwrap.dedent(
    """
    import sys, torch
    from slurm_elastic.checkpoint import CheckpointManager
    from slurm_elastic.errors import CheckpointCorruptError
    m = CheckpointManager(sys.argv[1], run_id="")
    try:
        got = m.load(1)
    except CheckpointCorruptError as exc:
        print("CORRUPT", exc)
        sys.exit(0)
    for k, v in got.state.items():
        print(k, repr(v))  # a quantized tensor made from bytes crashes here
    print("LOADED")
    """
)


def tensor0(header: dict[str, Any]) -> dict[str, Any]:
    return header["tensors"][0]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda h: tensor0(h).update(dtype="qint8", nbytes=8, shape=[8]), "dtype 'qint8'"),
        (lambda h: tensor0(h).update(dtype="quint8", nbytes=8, shape=[8]), "dtype 'quint8'"),
        (lambda h: tensor0(h).update(dtype="qint32"), "dtype 'qint32'"),
        (lambda h: tensor0(h).update(offset=-64), "bad tensor record"),
        (lambda h: tensor0(h).update(shape=["8"]), "not an integer"),
        (lambda h: tensor0(h).update(shape=[8.0]), "not an integer"),
        (lambda h: tensor0(h).update(device="meta"), "device 'meta'"),
        (lambda h: h["tensors"][1].update(offset=tensor0(h)["offset"]), "overlapping"),
    ],
)
def test_a_crafted_state_file_is_corrupt_never_a_crash(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], words: str
) -> None:
    directory = crafted(tmp_path, edit)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, f"rc {done.returncode}: {done.stdout}{done.stderr}"
    assert done.stdout.startswith("CORRUPT"), done.stdout + done.stderr
    assert words in done.stdout
