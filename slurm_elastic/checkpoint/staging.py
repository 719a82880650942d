"""Staging: a private host-memory copy of a state tree, made while training goes on.

An async save must not serialize live tensors (the next optimizer step changes them in
place), so it copies every tensor into host buffers first. :meth:`HostStager.begin` does
only the cheap part synchronously (walk the tree, copy the small non-tensor leaves, find
or allocate the buffers) and returns a :class:`StagingRound` whose tensor copies run on
background threads (``Tensor.copy_`` releases the GIL; 16 MiB chunks on up to 4 threads).
The training loop is blocked only for that walk, plus whatever a guard makes it wait:

* **optimizer guard**: a global ``torch.optim`` step pre-hook makes every copy of every
  round in flight finish (copying what no staging thread has started yet itself) before
  any optimizer's ``step()`` mutates parameters or optimizer state;
* **forward guard**: a global module forward pre-hook copies, in the calling thread and
  before the module runs, the pending buffers of that module and its children (what a
  forward pass mutates in place: batch-norm statistics, DDP's buffer broadcast), so
  staging overlaps the next forward pass;
* **explicit**: :meth:`StagingRound.wait` (``CheckpointManager.wait_staged()``) for code
  that mutates state tensors in place by other means.

Safety net: each tensor's version counter (``Tensor._version``, bumped by every in-place
operation) is recorded at :meth:`HostStager.begin` and again right after its copy; if a
tensor copied in the background changed in between, :meth:`StagingRound.check` raises and
the checkpoint is not written (a torn copy is never committed). This detects unguarded
in-place changes that completed before the copy did (not changes made through ``.data``,
which has its own counter, nor one still running on another thread when the copy ends).

CUDA tensors are copied into pinned buffers on a side stream (enqueued at ``begin``, after
the work already queued on the current stream); the guards make the current stream wait
for that copy (no CPU wait), and the writer waits for it before reading the buffers.
This path has not been measured on a GPU.

The host buffers are kept between saves (no page faults after the first save) and reused
only once the previous save has finished writing (the manager keeps at most one save in
flight). Containers (``dict``, ``list``, ``tuple``, ``OrderedDict``) are rebuilt; other
leaves are deep-copied. Tensors that share storage are staged as independent copies. Each
buffer is keyed by the tensor's structural path, a tuple of ``(container type, key type,
key)`` steps, never a printed form, so the keys ``1`` and ``"1"``, ``"a/b"`` and a nested
``a -> b``, or ``{0: ...}`` next to ``{"0": ...}`` each get their own buffer.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from slurm_elastic.checkpoint import _faults
from slurm_elastic.errors import CheckpointWriteError, StagingConflict

__all__ = [
    "HostStager",
    "StagingConflict",
    "StagingRound",
    "remove_idle_guards",
    "retire",
    "state_nbytes",
]

_Path = tuple[tuple[str, type, Any], ...]
_CHUNK_BYTES = 16 << 20
_PENDING, _RUNNING, _DONE = 0, 1, 2


def state_nbytes(state: Any) -> int:
    """Return the total size in bytes of the tensors in a state tree."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


def _describe(path: _Path) -> str:
    return "state" + "".join(f"[{key!r}]" for _, _, key in path)


class _Entry:
    """One source tensor: its path, version at begin, chunks left to copy."""

    __slots__ = ("chunks_left", "cuda", "path", "ptr", "src", "touched", "version", "version_after")

    def __init__(self, path: _Path, src: torch.Tensor, chunks: int, *, cuda: bool = False) -> None:
        self.path = path
        self.src = src
        self.ptr = src.data_ptr()
        self.cuda = cuda
        self.version = src._version
        self.version_after = self.version
        self.chunks_left = chunks
        self.touched = False  # copied by a guard, just before its mutator ran


class _Job:
    """Copies ``srcs`` into ``dsts``: one chunk of a large tensor, or several small ones."""

    __slots__ = ("dsts", "entries", "srcs", "state")

    def __init__(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], entries: list[_Entry]
    ) -> None:
        self.dsts, self.srcs, self.entries, self.state = dsts, srcs, entries, _PENDING


class StagingRound:
    """The copies of one async save: run by background threads, claimable by guards."""

    def __init__(self, jobs: list[_Job], entries: list[_Entry], cuda_events: list[Any]) -> None:
        self._jobs = jobs
        self._entries = entries
        self._cuda_events = cuda_events
        self._cond = threading.Condition()
        self._next = 0
        self._left = len(jobs)
        self._error: BaseException | None = None
        self._by_ptr: dict[int, list[_Job]] = {}
        for job in jobs:
            for entry in job.entries:
                self._by_ptr.setdefault(entry.ptr, []).append(job)
        self._cuda_ptrs = {e.ptr for e in entries if e.cuda}
        self._cleared: set[int] = set()
        self._cuda_waited = False
        #: seconds the training loop spent blocked in guards (optimizer, forward, wait)
        self.guard_seconds = 0.0

    # -------------------------------------------------------------- copying
    def _copy(self, job: _Job, touched: bool) -> None:
        try:
            with torch.no_grad():
                if len(job.dsts) == 1:
                    job.dsts[0].copy_(job.srcs[0])
                else:
                    torch._foreach_copy_(job.dsts, job.srcs)  # one call, GIL released
        except BaseException as exc:  # surfaced by check(); never leave waiters hanging
            self._error = self._error or exc
        with self._cond:
            job.state = _DONE
            for entry in job.entries:
                entry.chunks_left -= 1
                entry.touched |= touched
                if entry.chunks_left == 0:
                    entry.version_after = entry.src._version
            self._left -= 1
            self._cond.notify_all()

    def work(self) -> None:
        """Copy pending chunks until none is left (run on the staging threads)."""
        _faults.point("staging")
        self._drain()

    def _drain(self) -> None:
        """Copy pending chunks in this thread until none is left to claim."""
        while True:
            with self._cond:
                while self._next < len(self._jobs) and self._jobs[self._next].state != _PENDING:
                    self._next += 1
                if self._next >= len(self._jobs):
                    return
                job = self._jobs[self._next]
                job.state = _RUNNING
            self._copy(job, touched=False)

    def _copy_now(self, jobs: list[_Job]) -> None:
        mine = []
        with self._cond:
            for job in jobs:
                if job.state == _PENDING:
                    job.state = _RUNNING
                    mine.append(job)
        for job in mine:
            self._copy(job, touched=True)
        with self._cond:
            self._cond.wait_for(lambda: all(j.state == _DONE for j in jobs))

    @property
    def done(self) -> bool:
        """Whether every host copy has finished (CUDA copies may still be running)."""
        return self._left == 0

    # -------------------------------------------------------------- guards
    def _wait_cuda_on_current_stream(self) -> None:
        if self._cuda_events and not self._cuda_waited:
            self._cuda_waited = True
            for event in self._cuda_events:
                torch.cuda.current_stream(event.device).wait_event(event)

    def guard_optimizer(self) -> None:
        """Before an optimizer step: wait for every copy (CUDA: the stream waits)."""
        _faults.point("guard_wait")
        start = time.perf_counter()
        self._wait_cuda_on_current_stream()
        self._drain()  # help: copy what no staging thread has started yet
        with self._cond:
            self._cond.wait_for(lambda: self._left == 0)
        self.guard_seconds += time.perf_counter() - start

    def guard_module(self, module: torch.nn.Module) -> None:
        """Before ``module`` runs: stage its (and its children's) pending buffers now."""
        if id(module) in self._cleared or (
            self._left == 0 and (self._cuda_waited or not self._cuda_events)
        ):
            return
        start = time.perf_counter()
        jobs: list[_Job] = []
        cuda = False
        for buf in module.buffers():
            ptr = buf.data_ptr()
            jobs.extend(self._by_ptr.get(ptr, ()))
            cuda = cuda or ptr in self._cuda_ptrs
        if cuda:
            self._wait_cuda_on_current_stream()
        if jobs:
            self._copy_now(jobs)
        self._cleared.add(id(module))
        self.guard_seconds += time.perf_counter() - start

    def wait(self, *, help_copy: bool = True) -> None:
        """Block until every copy has landed (host and CUDA); ``help_copy``: copy what no
        staging thread has started yet in this thread (the writer only waits)."""
        start = time.perf_counter()
        if help_copy:
            self._drain()
        with self._cond:
            self._cond.wait_for(lambda: self._left == 0)
        for event in self._cuda_events:
            event.synchronize()
        if help_copy:  # the training loop's wait (wait_staged), not the writer's
            self.guard_seconds += time.perf_counter() - start

    def check(self, fix: str | None = None) -> None:
        """After :meth:`wait`: raise if a copy failed or a tensor changed while staged.

        Args:
            fix: what the error tells the user (default: the async checkpoint's).

        Raises:
            StagingConflict: naming the tensor and the fix; nothing may be written.
        """
        if self._error is not None:
            raise CheckpointWriteError(f"staging the checkpoint failed: {self._error}")
        for entry in self._entries:
            if entry.touched or entry.cuda:
                continue
            if entry.version_after != entry.version:
                raise StagingConflict(
                    f"tensor {_describe(entry.path)} was modified in place while it was "
                    "being copied, so the copy may mix two steps; " + (fix or _CHECKPOINT_FIX)
                )


_CHECKPOINT_FIX = (
    "this checkpoint was not written (previous ones are intact). Modify state tensors only "
    "through torch.optim optimizers and forward passes, call "
    "CheckpointManager.wait_staged() before other in-place changes, or save with blocking=True"
)

# ---------------------------------------------------------------- global guard hooks
_active: list[StagingRound] = []
_handles: list[Any] = []
_hooks_lock = threading.Lock()


def _optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    for round_ in list(_active):
        round_.guard_optimizer()


def _forward_pre_hook(module: torch.nn.Module, args: Any) -> None:
    rounds = list(_active)
    for round_ in rounds:
        round_.guard_module(module)
    if not rounds:
        remove_idle_guards()  # safe here: torch iterates over a copy of the forward hooks


def _activate(round_: StagingRound) -> None:
    with _hooks_lock:
        _active.append(round_)
        if not _handles:
            _handles.append(register_optimizer_step_pre_hook(_optimizer_pre_hook))
            _handles.append(register_module_forward_pre_hook(_forward_pre_hook))


def remove_idle_guards() -> None:
    """Remove the global guard hooks once no round is staging (call from the training
    thread: torch iterates over the optimizer hooks without copying them)."""
    with _hooks_lock:
        if not _active:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def retire(round_: StagingRound) -> None:
    """The writer has waited for the copies: stop guarding for this round (the hooks go
    at the next forward pass or :func:`remove_idle_guards`)."""
    with _hooks_lock:
        if round_ in _active:
            _active.remove(round_)


class HostStager:
    """Copies state trees into reusable host (CPU) buffers, in the background.

    Args:
        pin_memory: allocate pinned buffers for CUDA tensors (faster device-to-host copies).
        threads: background copy threads (default: up to 4).
    """

    def __init__(self, *, pin_memory: bool = True, threads: int | None = None) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}
        self._pin = pin_memory
        self._threads = threads or min(4, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}

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
        """Return a staged copy of ``state`` once every copy has landed (blocking).

        Raises:
            StagingConflict: a tensor changed in place meanwhile (another thread).
        """
        staged, round_ = self.begin(state)
        round_.wait()
        retire(round_)
        remove_idle_guards()
        round_.check()
        return staged

    def begin(self, state: Any) -> tuple[Any, StagingRound]:
        """Start staging ``state``; return the staged tree and its running round.

        The tree's tensors are valid only after ``round.wait()``. Installs the guards.
        Must not be called while a previous staged copy is still being written.
        """
        seen: set[_Path] = set()
        pairs: list[tuple[_Path, torch.Tensor, torch.Tensor]] = []
        staged = self._stage(state, (), seen, pairs)
        for key in list(self._buffers):
            if key not in seen:
                del self._buffers[key]
        jobs: list[_Job] = []
        entries: list[_Entry] = []
        cuda: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        group = _Job([], [], [])  # small tensors, copied together (one foreach call)
        group_bytes = 0
        for path, buf, src in pairs:
            if src.is_cuda:
                cuda.setdefault(src.device, []).append((buf, src))
                entries.append(_Entry(path, src, 0, cuda=True))
                continue
            nbytes = src.nbytes
            if nbytes <= _CHUNK_BYTES or not src.is_contiguous():
                entry = _Entry(path, src, 1)
                group.dsts.append(buf)
                group.srcs.append(src)
                group.entries.append(entry)
                group_bytes += nbytes
                if group_bytes >= _CHUNK_BYTES:
                    jobs.append(group)
                    group, group_bytes = _Job([], [], []), 0
            else:
                flat_buf, flat_src = buf.view(-1), src.view(-1)
                step = max(1, _CHUNK_BYTES // max(1, src.element_size()))
                starts = range(0, flat_src.numel(), step)
                entry = _Entry(path, src, len(starts))
                jobs.extend(
                    _Job([flat_buf[a : a + step]], [flat_src[a : a + step]], [entry])
                    for a in starts
                )
            entries.append(entry)
        if group.dsts:
            jobs.append(group)
        round_ = StagingRound(jobs, entries, self._enqueue_cuda(cuda))
        _activate(round_)
        if jobs:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._threads, thread_name_prefix="checkpoint-stage"
                )
            try:
                for _ in range(min(self._threads, len(jobs))):
                    self._pool.submit(round_.work)
            except RuntimeError:  # the interpreter is shutting down: copy here
                round_.work()
        return staged, round_

    def _enqueue_cuda(self, cuda: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]]) -> list[Any]:
        events = []
        for device, copies in cuda.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for buf, src in copies:
                    buf.copy_(src, non_blocking=True)
                    src.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
            events.append(event)
        return events

    def _stage(
        self,
        obj: Any,
        path: _Path,
        seen: set[_Path],
        pairs: list[tuple[_Path, torch.Tensor, torch.Tensor]],
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._stage_tensor(obj, path, pairs)
        if isinstance(obj, OrderedDict):
            return OrderedDict(
                (k, self._stage(v, (*path, ("o", type(k), k)), seen, pairs)) for k, v in obj.items()
            )
        if isinstance(obj, dict):
            return {
                k: self._stage(v, (*path, ("d", type(k), k)), seen, pairs) for k, v in obj.items()
            }
        if isinstance(obj, list):
            return [self._stage(v, (*path, ("l", int, i)), seen, pairs) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(
                self._stage(v, (*path, ("t", int, i)), seen, pairs) for i, v in enumerate(obj)
            )
        return copy.deepcopy(obj)

    def _stage_tensor(
        self,
        tensor: torch.Tensor,
        path: _Path,
        pairs: list[tuple[_Path, torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        if tensor.layout != torch.strided:  # sparse & co: copied now (rare, small)
            buf = tensor.detach().to("cpu", copy=True)
            self._buffers[path] = buf
            return buf
        cached = self._buffers.get(path)
        if cached is not None and cached.shape == tensor.shape and cached.dtype == tensor.dtype:
            buf = cached
        else:
            pin = self._pin and tensor.device.type == "cuda"
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        pairs.append((path, buf, tensor))
        return buf
