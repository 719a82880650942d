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
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["HostStager", "state_nbytes"]

_Path = tuple[tuple[str, type, Any], ...]


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

    def __init__(self, *, pin_memory: bool = True) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}
        self._pin = pin_memory

    def release(self) -> None:
        """Drop the cached buffers (frees host memory; the next stage reallocates)."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        """Host memory held by the cached buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """Return a copy of ``state`` whose tensors live in this stager's host buffers.

        Must not be called while a previous staged copy is still being written.
        """
        seen: set[_Path] = set()
        staged = self._stage(state, (), seen)
        for key in list(self._buffers):
            if key not in seen:
                del self._buffers[key]
        if any(b.is_pinned() for b in self._buffers.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non_blocking device-to-host copies must land
        return staged

    def _stage(self, obj: Any, path: _Path, seen: set[_Path]) -> Any:
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._stage_tensor(obj.detach(), path)
        if isinstance(obj, OrderedDict):
            return OrderedDict(
                (k, self._stage(v, (*path, ("o", type(k), k)), seen)) for k, v in obj.items()
            )
        if isinstance(obj, dict):
            return {k: self._stage(v, (*path, ("d", type(k), k)), seen) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._stage(v, (*path, ("l", int, i)), seen) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._stage(v, (*path, ("t", int, i)), seen) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _stage_tensor(self, tensor: torch.Tensor, path: _Path) -> torch.Tensor:
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
        buf.copy_(tensor, non_blocking=buf.is_pinned())
        return buf
