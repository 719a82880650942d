"""Worker-side preemption notice and progress report, and the agent's side of both.

Two messages of the node channel (:mod:`slurm_elastic.channel`, which lists them all;
its directory reaches the workers as ``$SLURM_ELASTIC_NODE_DIR``):

* the **notice** (file ``notice``): when the node is being preempted or stopped, the
  agent creates it (:func:`raise_notice`) **and** sends the preempt signal (``SIGUSR2``
  by default) to its workers. A worker asks :func:`preemption_requested` at each step
  boundary; it returns True once either happened, and the training loop checkpoints and
  leaves. The signal handler (:func:`install_preemption_handler`) only sets a flag: saving
  a checkpoint inside a handler can run mid-backward and never finish (Lightning #21406).
  The file covers what the signal cannot: a worker that had not installed the handler yet,
  or a notice raised while the worker was being (re)started.
  Slurm may signal every process of the step itself (a notice that is not batch-only),
  ``DataLoader`` workers included: see :func:`ensure_preemption_handler` and
  :func:`loader_worker_init`.
* the **progress** report (file ``progress``): :func:`report_progress` records the last
  finished step so the agent's hang watchdog (:func:`last_progress`) can tell a slow job
  from a stuck one.

Progress format and cost: one line of fixed width, ``"<step:20d> <unix time:20.6f>\\n"``
(42 bytes), rewritten in place with ``pwrite`` at offset 0 through a descriptor kept open,
at most every :data:`PROGRESS_MIN_INTERVAL_S` seconds (the first call and a call after a
longer pause always write). A call that does not write costs one ``time.monotonic()`` and
a comparison. Same-length in-place writes of one small block never show a reader a line of
the wrong length; a reader that still gets an unparsable line falls back to the file's
mtime. Several workers of one node share the file: the last writer wins, so the watchdog
sees "some local worker made progress" - in a collective job a hung rank stalls its peers
too. The time is the writer's wall clock; the reader is the agent of the same node, so
there is no clock skew to worry about. The node directory is node-local (the agent's
choice); it holds no state worth keeping.

Notice check cost: :func:`preemption_requested` stats the notice file at most every
:data:`NOTICE_POLL_INTERVAL_S` seconds; the signal path is immediate. Both helpers read
``$SLURM_ELASTIC_NODE_DIR`` once per process (a worker's environment is fixed at start);
:func:`reload_environment` forgets it. Every read and write goes through the channel's
hostile-ground helpers (:func:`slurm_elastic.channel.read_node_file`,
:func:`~slurm_elastic.channel.write_node_file`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal as _signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from slurm_elastic.channel import (
    NODE_DIR_ENV,
    NOTICE,
    PROGRESS,
    NodeChannel,
    file_present,
    read_node_file,
    warn_ignored,
    write_node_file,
)
from slurm_elastic.envvars import PREEMPT_SIGNAL_ENV
from slurm_elastic.errors import ConfigError, UnsafeFileError
from slurm_elastic.privatefs import ensure_private_dir, open_writable
from slurm_elastic.signals import DEFAULT_PREEMPT_SIGNAL, parse_signal

__all__ = [
    "DEFAULT_PREEMPT_SIGNAL",
    "NODE_DIR_ENV",
    "NOTICE_POLL_INTERVAL_S",
    "PREEMPT_SIGNAL_ENV",
    "PROGRESS_MIN_INTERVAL_S",
    "Progress",
    "await_new_round",
    "ensure_preemption_handler",
    "install_preemption_handler",
    "last_progress",
    "loader_worker_init",
    "notice_raised",
    "parse_signal",
    "preemption_agreed",
    "preemption_requested",
    "raise_notice",
    "reload_environment",
    "report_progress",
]

log = logging.getLogger(__name__)


PROGRESS_MIN_INTERVAL_S = 0.5
NOTICE_POLL_INTERVAL_S = 0.2

_LINE_FORMAT = "{step:20d} {time:20.6f}\n"
_LINE_LENGTH = 42
# A progress file larger than this is not ours (the line is 42 bytes): not read at all.
_PROGRESS_MAX_BYTES = 4096


class Progress(NamedTuple):
    """The last progress a worker reported.

    Attributes:
        step: the step number passed to :func:`report_progress` (-1 when the file exists
            but its content could not be parsed).
        time: Unix time of that report (wall clock of the same node).
    """

    step: int
    time: float


# ---------------------------------------------------------------------------------------
# the environment, read once: the helpers run every step, and a worker's environment is
# fixed when the agent starts it (os.environ.get costs ~0.5 us, a dict lookup ~30 ns)

_paths: dict[str, str | None] = {}


def _node_path(name: str) -> str | None:
    """``$SLURM_ELASTIC_NODE_DIR/<name>`` (``None`` without an agent), read once."""
    try:
        return _paths[name]
    except KeyError:
        node = NodeChannel.from_environ()
        value = _paths[name] = None if node is None else os.fspath(node.directory / name)
        return value


def reload_environment() -> None:
    """Forget the node channel read from the environment (tests, notebooks)."""
    _paths.clear()


# ---------------------------------------------------------------------------------------
# preemption notice: worker side

_flag = False  # set by the signal handler (which runs in the main thread)
_handled_signal: _signal.Signals | None = None
_notice_checked_at = -float("inf")
_notice_seen = False


def _on_preempt_signal(signum: int, frame: FrameType | None) -> None:
    # Only set a flag: anything heavier (a checkpoint) may run in the middle of a step.
    global _flag
    _flag = True


def install_preemption_handler(
    signal: str | int | _signal.Signals | None = None,
) -> _signal.Signals:
    """Install a handler that records the preempt signal; idempotent.

    Args:
        signal: the signal to handle; default ``$SLURM_ELASTIC_PREEMPT_SIGNAL`` or ``USR2``
            (the agent sends the one in its config, which it also exports).

    Returns:
        The signal now handled.

    Raises:
        ConfigError: ``signal`` is not a signal.
        ValueError: called outside the main thread (Python only lets the main thread
            install signal handlers).
    """
    global _handled_signal
    resolved = parse_signal(
        signal if signal is not None else os.environ.get(PREEMPT_SIGNAL_ENV, DEFAULT_PREEMPT_SIGNAL)
    )
    _signal.signal(resolved, _on_preempt_signal)
    _handled_signal = resolved
    log.debug("preemption handler installed for %s", resolved.name)
    return resolved


def ensure_preemption_handler() -> _signal.Signals | None:
    """Install the preemption handler now, unless the preempt signal is handled already.

    ``ElasticSession`` calls it when created: ``DataLoader`` workers forked afterwards
    inherit the handler instead of the default action (terminate), for Slurm signals
    every process of the step when the notice is not batch-only (``scancel --signal``
    without ``--batch``, ``--signal=USR2@lead`` without ``B:``). A script's own handler
    (or ``SIG_IGN``) is left alone.

    Returns:
        The signal this module handles, or ``None`` when nothing was installed (not the
        main thread, another handler in place, an invalid ``$SLURM_ELASTIC_PREEMPT_SIGNAL``).
    """
    if _handled_signal is not None:
        return _handled_signal
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        sig = parse_signal(os.environ.get(PREEMPT_SIGNAL_ENV, DEFAULT_PREEMPT_SIGNAL))
    except ConfigError:
        return None
    if _signal.getsignal(sig) in (_signal.SIG_DFL, None):
        return install_preemption_handler(sig)
    return None


def loader_worker_init(worker_id: int = 0) -> None:
    """Make a helper process of a training worker (a ``DataLoader`` worker) ignore the notice.

    ``DataLoader(..., worker_init_fn=notice.loader_worker_init)``, or call it in your own
    ``worker_init_fn``. The notice is for the training process; a loader worker must keep
    serving batches until its next step boundary. Forked workers inherit the session's
    handler; ``spawn``/``forkserver`` workers start with the default action (terminate)
    and need this, and are exposed while they start (before ``worker_init_fn``). A preempt
    signal ``TERM`` is left alone: it must still end torch's loader workers.

    Args:
        worker_id: the loader's worker index (unused; ``worker_init_fn``'s signature).
    """
    del worker_id
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        sig = parse_signal(os.environ.get(PREEMPT_SIGNAL_ENV, DEFAULT_PREEMPT_SIGNAL))
    except ConfigError:
        return
    if sig != _signal.SIGTERM:
        _signal.signal(sig, _signal.SIG_IGN)


def preemption_requested() -> bool:
    """Return True once this node was told to stop (signal received or notice file raised).

    Call it at step boundaries; when it returns True, save a checkpoint and exit. It stays
    True for the rest of the process. The first call installs the signal handler if none
    is installed for the preempt signal yet (main thread only).
    """
    global _notice_checked_at, _notice_seen
    if _flag or _notice_seen:
        return True
    if _handled_signal is None:  # else SIGUSR2's default action would kill this worker
        ensure_preemption_handler()
    path = _node_path(NOTICE)
    if path:
        now = time.monotonic()
        if now - _notice_checked_at >= NOTICE_POLL_INTERVAL_S:
            _notice_checked_at = now
            if file_present(path, log):
                _notice_seen = True
                log.info("preemption notice file %s found", path)
                return True
    return _flag


def preemption_agreed(device: Any = None, group: Any = None) -> tuple[bool, bool]:
    """Agree across ranks on the notice: ``(any rank's node was told to stop, this one was)``.

    Collective (one 1-element ``all_reduce``, MAX): call it on every rank at the same step
    boundary. When the first value is True, all ranks save one checkpoint together (nothing
    finished is lost); the ranks whose own node got the notice (second value) then exit,
    the others wait for their agent to start the next round without the departing node.

    Args:
        device: where the flag tensor lives (``"cuda"`` for NCCL); default CPU.
        group: the process group (default: the world).
    """
    import torch
    import torch.distributed as dist

    local = preemption_requested()
    flag = torch.tensor([1 if local else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item()), local


def await_new_round(
    timeout_s: float = 60.0, poll_s: float = 0.1, *, parent_pid: int | None = None
) -> bool:
    """After a peer's preemption save, idle until the agent stops these workers.

    The departing node's agent leaves the rendezvous; this node's agent then starts a new
    round and stops these workers, which resume from the checkpoint just saved. Training
    on meanwhile would only fail in the next collective.

    Args:
        timeout_s: give up waiting after this long (the caller then goes on; a failing
            collective tells the agent instead).
        poll_s: how often to look for this node's own notice.
        parent_pid: the agent that started this worker: once it is gone (SIGKILL does not
            take its workers along) no agent will stop this worker, and a step it started
            would run long after its peers moved on: stop waiting, the caller exits.

    Returns:
        True if this node got its own notice meanwhile, or its agent is gone (the caller
        should exit: the checkpoint is current), False after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    orphaned = lambda: parent_pid is not None and os.getppid() != parent_pid  # noqa: E731
    while time.monotonic() < deadline:
        if preemption_requested() or orphaned():
            return True
        time.sleep(poll_s)
    return preemption_requested() or orphaned()


# ---------------------------------------------------------------------------------------
# preemption notice: agent side


def raise_notice(channel: NodeChannel, reason: str = "preempt") -> None:
    """Create the notice file atomically (write a temporary file, then rename).

    Args:
        channel: the node channel of the workers to notify.
        reason: a word recorded in the file, e.g. ``"preempt"``, ``"stop"``.
    """
    write_node_file(channel.notice, f"{reason} {time.time():.6f}\n".encode())
    log.debug("notice %s raised at %s", reason, channel.notice)


def notice_raised(channel: NodeChannel) -> bool:
    """Return whether the notice file exists (a regular file; anything else is ignored)."""
    return file_present(channel.notice, log)


# ---------------------------------------------------------------------------------------
# progress report


def _open_progress(path: str) -> int:
    # A FIFO (with a reader or not), a link or another user's file at the name is
    # refused: the launcher creates a file of ours.
    try:
        return open_writable(path)
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.EPERM):
            raise UnsafeFileError(f"{path} is {exc.strerror}") from exc
        raise


class _ProgressWriter:
    """Keeps the progress file open and rate-limits writes."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.fd: int | None = None
        self.last_write = -float("inf")

    def write(self, path: str, step: int, force: bool) -> bool:
        now = time.monotonic()
        if not force and path == self.path and now - self.last_write < PROGRESS_MIN_INTERVAL_S:
            return False
        if path != self.path or self.fd is None:
            self.close()
            ensure_private_dir(Path(path).parent)
            self.fd = _open_progress(path)
            self.path = path
        line = _LINE_FORMAT.format(step=step, time=time.time())
        os.pwrite(self.fd, line.encode("ascii"), 0)
        self.last_write = now
        return True

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.fd = None
        self.path = None


_writer = _ProgressWriter()
_writer_lock = threading.Lock()


def report_progress(
    step: int, *, path: str | os.PathLike[str] | None = None, force: bool = False
) -> bool:
    """Record that ``step`` finished, for the agent's hang watchdog; cheap enough per step.

    Args:
        step: a counter that grows while training makes progress (e.g. the global step).
        path: the progress file; default ``$SLURM_ELASTIC_NODE_DIR/progress``. Without
            either this is a no-op, so training scripts may call it unconditionally.
        force: write even if the last write is younger than ``PROGRESS_MIN_INTERVAL_S``.

    Returns:
        Whether the file was written by this call.
    """
    target = os.fspath(path) if path is not None else _node_path(PROGRESS)
    if not target:
        return False
    # the fast path, without taking the lock
    if (
        not force
        and target == _writer.path
        and time.monotonic() - _writer.last_write < PROGRESS_MIN_INTERVAL_S
    ):
        return False
    with _writer_lock:
        try:
            return _writer.write(target, int(step), force)
        except (OSError, UnsafeFileError) as exc:
            # a full or vanished disk must not kill training; the watchdog will notice
            if isinstance(exc, UnsafeFileError) or exc.errno in (
                errno.ELOOP,
                errno.ENXIO,
                errno.EISDIR,
            ):
                warn_ignored(log, target, "not a regular file: no progress written")
            else:
                log.debug("cannot write progress %s: %s", target, exc)
            _writer.close()
            return False


def last_progress(path: str | os.PathLike[str]) -> Progress | None:
    """Read the last progress reported to ``path``.

    Returns:
        ``None`` when nothing was reported yet (no file) or the file was refused (not a
        regular file, a link, larger than a progress line can be: see :func:`read_node_file`),
        else the :class:`Progress`. An unreadable or torn line, or one whose time is not
        a finite number, gives ``Progress(-1, <file mtime>)``.
    """
    found = read_node_file(path, _PROGRESS_MAX_BYTES, log)
    if found is None:
        return None
    try:
        text = found.data.decode("ascii")
        if len(text) != _LINE_LENGTH or not text.endswith("\n"):
            raise ValueError(f"progress line of length {len(text)}")
        step_s, time_s = text.split()
        progress = Progress(int(step_s), float(time_s))
        if not math.isfinite(progress.time):
            warn_ignored(log, path, f"time {time_s!r} is not a finite number")
            return Progress(-1, found.mtime)
        return progress
    except ValueError:
        return Progress(-1, found.mtime)
