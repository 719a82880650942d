"""Worker-side preemption notice and progress heartbeat, and the agent's side of both.

Two small files connect a node's agent with the training processes (workers) it starts;
their paths reach the workers through the environment:

* ``SLURM_ELASTIC_NOTICE_FILE``: when the node is being preempted or stopped, the agent
  creates this file (:func:`raise_notice`) **and** sends the preempt signal (``SIGUSR2``
  by default) to its workers. A worker asks :func:`preemption_requested` at each step
  boundary; it returns True once either happened, and the training loop checkpoints and
  leaves. The signal handler (:func:`install_preemption_handler`) only sets a flag: saving
  a checkpoint inside a handler can run mid-backward and never finish (Lightning #21406).
  The file covers what the signal cannot: a worker that had not installed the handler yet,
  or a notice raised while the worker was being (re)started.
  Slurm may signal every process of the step itself (a notice that is not batch-only),
  ``DataLoader`` workers included: see :func:`ensure_preemption_handler` and
  :func:`loader_worker_init`.
* ``SLURM_ELASTIC_HEARTBEAT_FILE``: :func:`report_progress` records the last finished step
  so the agent's hang watchdog (:func:`last_progress`) can tell a slow job from a stuck one.

Heartbeat format and cost: one line of fixed width, ``"<step:20d> <unix time:20.6f>\\n"``
(42 bytes), rewritten in place with ``pwrite`` at offset 0 through a descriptor kept open,
at most every :data:`PROGRESS_MIN_INTERVAL_S` seconds (the first call and a call after a
longer pause always write). A call that does not write costs one ``time.monotonic()`` and
a comparison. Same-length in-place writes of one small block never show a reader a line of
the wrong length; a reader that still gets an unparsable line falls back to the file's
mtime. Several workers of one node may share one heartbeat file: the last writer wins, so
the watchdog sees "some local worker made progress" - in a collective job a hung rank
stalls its peers too. The time is the writer's wall clock; the reader is the agent of the
same node, so there is no clock skew to worry about. Keep both files on a node-local
filesystem (the agent's choice); they hold no state worth keeping.

Notice file check cost: :func:`preemption_requested` stats the notice file at most every
:data:`NOTICE_POLL_INTERVAL_S` seconds; the signal path is immediate. Both helpers read
``SLURM_ELASTIC_NOTICE_FILE``/``SLURM_ELASTIC_HEARTBEAT_FILE`` once per process (a worker's
environment is fixed at start); :func:`reload_environment` forgets them.

Node files on hostile ground: every file of the node's agent <-> worker channel (this
module's notice and heartbeat, and the control files of :mod:`slurm_elastic.live.control`)
is read through :func:`read_node_file` and written through :func:`write_node_file`. A
reader never blocks and never follows a link: it opens with ``O_NONBLOCK | O_NOFOLLOW``,
refuses what ``fstat`` says is not a regular file (a FIFO, a directory, a device) and a
file larger than its bound, and reads at most that bound. What it refuses is ignored with
a warning naming the file (:func:`warn_ignored`: one per file per
:data:`IGNORED_WARNING_INTERVAL_S`, so a poll loop does not flood the log). A writer
creates its temporary file exclusively (``O_EXCL | O_NOFOLLOW``, a stale one removed
first) and renames it into place, so a reader sees the old or the new file, never a torn
one, and a FIFO planted at the temporary name cannot block the writer.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal as _signal
import stat
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from slurm_elastic.envvars import HEARTBEAT_FILE_ENV, NOTICE_FILE_ENV, PREEMPT_SIGNAL_ENV
from slurm_elastic.errors import ConfigError, UnsafeFileError
from slurm_elastic.privatefs import ensure_private_dir
from slurm_elastic.signals import DEFAULT_PREEMPT_SIGNAL, parse_signal

__all__ = [
    "DEFAULT_PREEMPT_SIGNAL",
    "HEARTBEAT_FILE_ENV",
    "IGNORED_WARNING_INTERVAL_S",
    "NOTICE_FILE_ENV",
    "NOTICE_POLL_INTERVAL_S",
    "PREEMPT_SIGNAL_ENV",
    "PROGRESS_MIN_INTERVAL_S",
    "NodeFile",
    "Progress",
    "await_new_round",
    "clear_notice",
    "ensure_preemption_handler",
    "install_preemption_handler",
    "last_progress",
    "loader_worker_init",
    "notice_raised",
    "parse_signal",
    "preemption_agreed",
    "preemption_requested",
    "raise_notice",
    "read_node_file",
    "reload_environment",
    "report_progress",
    "warn_ignored",
    "write_node_file",
]

log = logging.getLogger(__name__)


PROGRESS_MIN_INTERVAL_S = 0.5
NOTICE_POLL_INTERVAL_S = 0.2

_LINE_FORMAT = "{step:20d} {time:20.6f}\n"
_LINE_LENGTH = 42
# A heartbeat file larger than this is not ours (the line is 42 bytes): not read at all.
_HEARTBEAT_MAX_BYTES = 4096


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
# node files: bounded, non-blocking reads and crash-safe writes

IGNORED_WARNING_INTERVAL_S = 60.0
_WARNED_MAX = 256  # files remembered by the rate limit (a flood of names cannot grow it)
_warned: dict[str, tuple[float, int]] = {}  # path -> (time of the warning, suppressed since)
_warned_lock = threading.Lock()


def warn_ignored(logger: logging.Logger, path: str | os.PathLike[str], reason: str) -> None:
    """Log that a node file was ignored, at most once per file per interval.

    Repeats within :data:`IGNORED_WARNING_INTERVAL_S` go to DEBUG and are counted in the
    next warning: a poll loop meeting the same bad file does not flood the log.

    Args:
        logger: the reader's logger.
        path: the file ignored.
        reason: why, e.g. ``"not a regular file"``.
    """
    key = os.fspath(path)
    now = time.monotonic()
    with _warned_lock:
        last = _warned.get(key)
        if last is not None and now - last[0] < IGNORED_WARNING_INTERVAL_S:
            _warned[key] = (last[0], last[1] + 1)
            logger.debug("ignored %s: %s", key, reason)
            return
        if last is None and len(_warned) >= _WARNED_MAX:
            _warned.pop(next(iter(_warned)))  # the oldest entry
        _warned[key] = (now, 0)
    suppressed = 0 if last is None else last[1]
    if suppressed:
        logger.warning("ignored %s: %s (%d similar warnings suppressed)", key, reason, suppressed)
    else:
        logger.warning("ignored %s: %s", key, reason)


class NodeFile(NamedTuple):
    """What :func:`read_node_file` read.

    Attributes:
        data: the whole content (at most the bound given).
        mtime: the file's modification time (Unix time).
    """

    data: bytes
    mtime: float


def read_node_file(
    path: str | os.PathLike[str], max_bytes: int, logger: logging.Logger
) -> NodeFile | None:
    """Read a small node file without blocking, following a link or reading unbounded.

    Args:
        path: the file.
        max_bytes: a larger file is refused unread.
        logger: where a refusal is reported (:func:`warn_ignored`).

    Returns:
        The content, or ``None`` when the file does not exist or was refused: not a
        regular file (a FIFO, a directory, a device), a symbolic link, larger than
        ``max_bytes``, or not readable.
    """
    try:
        # O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for
        # a writer; it changes nothing for a regular file.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link; EACCES; ENOTDIR
        warn_ignored(logger, path, f"cannot open it ({exc.strerror or exc})")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            warn_ignored(logger, path, "not a regular file")
            return None
        if st.st_size > max_bytes:
            warn_ignored(logger, path, f"{st.st_size} bytes, more than {max_bytes}")
            return None
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # it grew after the fstat
            warn_ignored(logger, path, f"more than {max_bytes} bytes")
            return None
        return NodeFile(b"".join(chunks), st.st_mtime)
    except OSError as exc:  # EIO, or a file system that refuses the read
        warn_ignored(logger, path, f"cannot read it ({exc.strerror or exc})")
        return None
    finally:
        os.close(fd)


def write_node_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary file, then ``rename``).

    The temporary file (``.<name>.<pid>.tmp`` beside ``path``) is created exclusively
    and without following a link, after removing a stale one: whatever was planted at
    that name (a FIFO, a link) is never opened, so the writer cannot block on it.

    Raises:
        OSError: the directory cannot be written, or the temporary name is taken by
            something that cannot be removed (a directory).
    """
    target = Path(path)
    ensure_private_dir(target.parent)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(tmp, target)


def _is_notice(path: str | os.PathLike[str]) -> bool:
    """Whether the notice file exists (only a regular file counts: the agent's rename
    always leaves one; anything else at that name is ignored with a warning)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        warn_ignored(log, path, f"cannot stat it ({exc.strerror or exc})")
        return False
    if not stat.S_ISREG(st.st_mode):
        warn_ignored(log, path, "not a regular file")
        return False
    return True


# ---------------------------------------------------------------------------------------
# the environment, read once: the helpers run every step, and a worker's environment is
# fixed when the agent starts it (os.environ.get costs ~0.5 us, a dict lookup ~30 ns)

_env_cache: dict[str, str | None] = {}


def _env(name: str) -> str | None:
    try:
        return _env_cache[name]
    except KeyError:
        value = _env_cache[name] = os.environ.get(name) or None
        return value


def reload_environment() -> None:
    """Forget the notice/heartbeat paths read from the environment (tests, notebooks)."""
    _env_cache.clear()


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
    path = _env(NOTICE_FILE_ENV)
    if path:
        now = time.monotonic()
        if now - _notice_checked_at >= NOTICE_POLL_INTERVAL_S:
            _notice_checked_at = now
            if _is_notice(path):
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


def await_new_round(timeout_s: float = 60.0, poll_s: float = 0.1) -> bool:
    """After a peer's preemption save, idle until the agent stops these workers.

    The departing node's agent leaves the rendezvous; this node's agent then starts a new
    round and stops these workers, which resume from the checkpoint just saved. Training
    on meanwhile would only fail in the next collective.

    Args:
        timeout_s: give up waiting after this long (the caller then goes on; a failing
            collective tells the agent instead).
        poll_s: how often to look for this node's own notice.

    Returns:
        True if this node got its own notice meanwhile (the caller should exit: the
        checkpoint is current), False after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if preemption_requested():
            return True
        time.sleep(poll_s)
    return preemption_requested()


# ---------------------------------------------------------------------------------------
# preemption notice: agent side


def raise_notice(path: str | os.PathLike[str], reason: str = "preempt") -> None:
    """Create the notice file atomically (write a temporary file, then rename).

    Args:
        path: the notice file (``SLURM_ELASTIC_NOTICE_FILE`` of the workers).
        reason: a word recorded in the file, e.g. ``"preempt"``, ``"stop"``.
    """
    write_node_file(path, f"{reason} {time.time():.6f}\n".encode())
    log.debug("notice %s raised at %s", reason, path)


def notice_raised(path: str | os.PathLike[str]) -> bool:
    """Return whether the notice file exists (a regular file; anything else is ignored)."""
    return _is_notice(path)


def clear_notice(path: str | os.PathLike[str]) -> None:
    """Remove the notice file if present (e.g. before starting a fresh set of workers).

    Something that cannot be unlinked at its name (a directory) is left with a warning:
    it is no notice (:func:`notice_raised`) and must not stop the agent's round start.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        warn_ignored(log, path, f"cannot remove it ({exc.strerror or exc})")


# ---------------------------------------------------------------------------------------
# progress heartbeat


def _open_heartbeat(path: str) -> int:
    # O_NONBLOCK: opening a FIFO for writing fails (ENXIO) instead of waiting for a
    # reader; O_NOFOLLOW: a link at the name is not ours (the launcher creates a file).
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)  # a FIFO that has a reader: never write progress into a pipe
        raise UnsafeFileError(f"{path} is not a regular file")
    return fd


class _HeartbeatWriter:
    """Keeps the heartbeat file open and rate-limits writes."""

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
            self.fd = _open_heartbeat(path)
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


_writer = _HeartbeatWriter()
_writer_lock = threading.Lock()


def report_progress(
    step: int, *, path: str | os.PathLike[str] | None = None, force: bool = False
) -> bool:
    """Record that ``step`` finished, for the agent's hang watchdog; cheap enough per step.

    Args:
        step: a counter that grows while training makes progress (e.g. the global step).
        path: the heartbeat file; default ``$SLURM_ELASTIC_HEARTBEAT_FILE``. Without
            either this is a no-op, so training scripts may call it unconditionally.
        force: write even if the last write is younger than ``PROGRESS_MIN_INTERVAL_S``.

    Returns:
        Whether the file was written by this call.
    """
    target = os.fspath(path) if path is not None else _env(HEARTBEAT_FILE_ENV)
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
                log.debug("cannot write heartbeat %s: %s", target, exc)
            _writer.close()
            return False


def last_progress(path: str | os.PathLike[str]) -> Progress | None:
    """Read the last progress reported to ``path``.

    Returns:
        ``None`` when nothing was reported yet (no file) or the file was refused (not a
        regular file, a link, larger than a heartbeat can be: see :func:`read_node_file`),
        else the :class:`Progress`. An unreadable or torn line, or one whose time is not
        a finite number, gives ``Progress(-1, <file mtime>)``.
    """
    found = read_node_file(path, _HEARTBEAT_MAX_BYTES, log)
    if found is None:
        return None
    try:
        text = found.data.decode("ascii")
        if len(text) != _LINE_LENGTH or not text.endswith("\n"):
            raise ValueError(f"heartbeat line of length {len(text)}")
        step_s, time_s = text.split()
        progress = Progress(int(step_s), float(time_s))
        if not math.isfinite(progress.time):
            warn_ignored(log, path, f"time {time_s!r} is not a finite number")
            return Progress(-1, found.mtime)
        return progress
    except ValueError:
        return Progress(-1, found.mtime)
