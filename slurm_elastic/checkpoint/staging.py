"""Staging: a private host-memory copy of a state tree, so that training can go on.

An async save must not serialize live tensors (the next optimizer step changes them in
place), so it first copies every tensor into host memory. That copy is the only part of
an async save the training loop waits for. :class:`HostStager` keeps the host buffers
between saves and copies into them (``Tensor.copy_``), which avoids re-faulting fresh
pages for every save: for a 1 GiB state that is most of the staging time. The buffers are
reused only once the previous save has finished writing (the manager guarantees at most
one save in flight).

Containers (``dict``, ``list``, ``tuple``, ``OrderedDict``) are rebuilt; other leaves are
deep-copied (they are small: ints, floats, strings, RNG states). Tensors that share storage
are staged as independent copies.

Each buffer is keyed by the tensor's structural path: a tuple of ``(container type, key
type, key)`` steps, never a printed form, so the keys ``1`` and ``"1"``, ``"a/b"`` and a
nested ``a -> b``, or an optimizer's ``{0: ...}`` next to ``{"0": ...}`` each get their own
buffer.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["HostStager", "state_nbytes"]

_Path = tuple[tuple[str, type, Any], ...]
_Copy = tuple[torch.Tensor, torch.Tensor]  # (host buffer, source)
_PARALLEL_MIN_BYTES = 8 << 20  # below this one thread copies (thread hand-off costs more)
_CHUNK_BYTES = 16 << 20


def state_nbytes(state: Any) -> int:
    """Return the total size in bytes of the tensors in a state tree."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


class HostStager:
    """Copies state trees into reusable host (CPU) buffers.

    Args:
        pin_memory: allocate pinned buffers for CUDA tensors (faster device-to-host copies).
    """

    def __init__(self, *, pin_memory: bool = True, threads: int | None = None) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}
        self._pin = pin_memory
        self._threads = threads or min(4, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None

    def release(self) -> None:
        """Drop the cached buffers (frees host memory; the next stage reallocates)."""
        self._buffers.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def nbytes(self) -> int:
        """Host memory held by the cached buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """Return a copy of ``state`` whose tensors live in this stager's host buffers.

        Must not be called while a previous staged copy is still being written.
        """
        seen: set[_Path] = set()
        copies: list[_Copy] = []
        staged = self._stage(state, (), seen, copies)
        for key in list(self._buffers):
            if key not in seen:
                del self._buffers[key]
        self._copy_all(copies)
        if any(b.is_pinned() for b, _ in copies) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non_blocking device-to-host copies must land
        return staged

    def _copy_all(self, copies: list[_Copy]) -> None:
        """Copy into the buffers; large host copies run in parallel, in 16 MiB chunks
        (``Tensor.copy_`` releases the GIL; one thread copies at memory bandwidth)."""
        jobs: list[_Copy] = []
        for buf, src in copies:
            if buf.is_pinned() or not src.is_contiguous() or src.device.type != "cpu":
                buf.copy_(src, non_blocking=buf.is_pinned())
                continue
            flat_buf, flat_src = buf.view(-1), src.view(-1)
            step = max(1, _CHUNK_BYTES // max(1, src.element_size()))
            for a in range(0, flat_src.numel(), step):
                jobs.append((flat_buf[a : a + step], flat_src[a : a + step]))
        total = sum(b.numel() * b.element_size() for b, _ in jobs)
        if self._threads <= 1 or total < _PARALLEL_MIN_BYTES or len(jobs) < 2:
            for buf, src in jobs:
                buf.copy_(src)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="checkpoint-stage")
        for future in [self._pool.submit(b.copy_, s) for b, s in jobs]:
            future.result()

    def _stage(self, obj: Any, path: _Path, seen: set[_Path], copies: list[_Copy]) -> Any:
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._stage_tensor(obj.detach(), path, copies)
        if isinstance(obj, OrderedDict):
            return OrderedDict(
                (k, self._stage(v, (*path, ("o", type(k), k)), seen, copies))
                for k, v in obj.items()
            )
        if isinstance(obj, dict):
            return {
                k: self._stage(v, (*path, ("d", type(k), k)), seen, copies) for k, v in obj.items()
            }
        if isinstance(obj, list):
            return [self._stage(v, (*path, ("l", int, i)), seen, copies) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(
                self._stage(v, (*path, ("t", int, i)), seen, copies) for i, v in enumerate(obj)
            )
        return copy.deepcopy(obj)

    def _stage_tensor(self, tensor: torch.Tensor, path: _Path, copies: list[_Copy]) -> torch.Tensor:
        buf = self._buffers.get(path)
        if (
            buf is None
            or buf.shape != tensor.shape
            or buf.dtype != tensor.dtype
            or buf.layout != tensor.layout
        ):
            pin = self._pin and tensor.device.type == "cuda"
            if tensor.layout != torch.strided:
                buf = tensor.to("cpu", copy=True)
                self._buffers[path] = buf
                return buf
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        copies.append((buf, tensor))
        return buf
