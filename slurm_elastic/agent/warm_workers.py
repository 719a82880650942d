"""Worker interpreters started ahead of need: a new node's workers skip ``import torch``.

Concept: most of a worker's start is its interpreter importing torch (2.5-4 s of CPU on
the test VM, and 2.3 s more for dynamo, which ``torch.use_deterministic_algorithms`` and
``torch.compile`` import), and a new node pays that twice in a row: its agent imports torch, joins the
rendezvous, then starts its workers, which import torch again. So the agent starts one
interpreter per local rank *first*, before importing torch itself; each imports
:data:`PRELOAD` and waits. When torch's agent starts the workers (``SubprocessHandler._popen``, see
:mod:`.warm_handler`), the worker's command line, environment, working directory, umask
and log files go to a waiting interpreter over a socket pair (JSON, the files as
descriptors; nothing is unpickled) and it runs the script as ``python -u script.py ...``
or ``python -u -m module ...`` would.

A waiting interpreter's command line ends with the worker's (``python -u -m
slurm_elastic.agent.warm_workers FD -- train.py --steps 10``): ``ps`` and ``pgrep -f
train.py`` show what it runs or will run. The started process is what torch expects: a child of the agent, the leader of its own
session (torch's ``start_new_session``, so ``killpg`` reaches it), with the worker's
``sys.argv``, ``sys.path[0]``, ``__main__``, environment, descriptors 1 and 2, and exit
status. What the interpreter printed while importing torch is copied into the worker's
stderr first.

A worker starts cold (torch's own ``Popen``), with the reason in the agent's log, when:

* ``worker_start: cold`` (``--worker-start cold``, ``SLURM_ELASTIC_WORKER_START=cold``);
* the command is not the one the interpreters were started for (e.g. torch wrapped it
  for NUMA binding);
* a variable differs from the one the interpreter started with, other than the ones a
  worker reads after start-up (:data:`RUNTIME_VARIABLES`, ``TORCHELASTIC_*`` and ours):
  ``PYTHONPATH``, ``LD_PRELOAD``, ``OMP_NUM_THREADS`` and the like are read at start-up or
  at ``import torch``;
* the waiting interpreter died, or the message does not fit the socket's buffer;
* it is not the agent's first start of its workers: each interpreter serves once, and a
  restart (rare: a failure, a hang) is not worth an idle torch held in memory meanwhile.

Interpreters not used are closed with the agent (end of file on their socket: they exit).
An idle interpreter holds what its imports allocate (about 300 MB of host memory per
local rank with the CPU build of torch 2.13).

This module does not import torch (the agent calls :func:`start` before it does); the
waiting side is :func:`main` (``python -u -m slurm_elastic.agent.warm_workers FD``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurm_elastic import envvars
from slurm_elastic.agent.worker_env import python_entrypoint, thread_environment
from slurm_elastic.config import ElasticConfig
from slurm_elastic.signals import EARLY_NOTICE_SIGNALS
from slurm_elastic.slurm.env import SlurmEnv

__all__ = ["PRELOAD", "RUNTIME_VARIABLES", "WarmStart", "WarmWorkers", "main", "start"]

log = logging.getLogger(__name__)

#: Variables torch's agent sets per worker, read after start-up. Together with the
#: ``TORCHELASTIC_*`` ones and ours (``SLURM_ELASTIC_*``), the only ones that may differ
#: between a waiting interpreter's environment and its worker's.
RUNTIME_VARIABLES = frozenset(
    {
        "LOCAL_RANK",
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
_RUNTIME_PREFIXES = ("TORCHELASTIC_", envvars.PREFIX)
#: What a waiting interpreter imports. ``torch._inductor.config`` pulls in dynamo (and
#: sympy): 2.3 s more on the test VM, paid by any script that calls
#: ``torch.use_deterministic_algorithms`` or ``torch.compile``.
PRELOAD = ("torch", "torch.distributed", "torch._inductor.config")
_HEADER = struct.Struct("!I")
#: The start message's bound: a message the socket cannot take at once means a cold start
#: (the interpreter may still be importing torch, and the agent must not block on it).
MAX_MESSAGE = 128 * 1024


@dataclass(frozen=True)
class WarmStart:
    """What a waiting interpreter needs to become one worker (sent as JSON)."""

    argv: list[str]  # sys.argv: the script (or the module's name) and its arguments
    module: bool  # ``-m``: argv[0] is a module name
    env: dict[str, str]
    cwd: str
    umask: int

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> WarmStart:
        raw = json.loads(data.decode())
        start = cls(
            argv=raw["argv"],
            module=raw["module"],
            env=raw["env"],
            cwd=raw["cwd"],
            umask=raw["umask"],
        )
        ok = (
            isinstance(start.argv, list)
            and start.argv
            and all(isinstance(a, str) for a in start.argv)
            and isinstance(start.module, bool)
            and isinstance(start.env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in start.env.items())
            and isinstance(start.cwd, str)
            and isinstance(start.umask, int)
        )
        if not ok:
            raise ValueError("malformed start message")
        return start


def import_time_differences(started: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """The variables (sorted) that differ and that a start-up or ``import torch`` may read."""
    keys = set(started) | set(wanted)
    return sorted(
        k
        for k in keys
        if started.get(k) != wanted.get(k)
        and k not in RUNTIME_VARIABLES
        and not k.startswith(_RUNTIME_PREFIXES)
    )


def parse_command(args: Sequence[str]) -> tuple[list[str], bool] | None:
    """``(sys.argv, module)`` of ``<this python> -u script|-m module ...``; else None."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return None
    if args[2] == "-m":
        return ([*args[3:]], True) if len(args) > 3 else None
    return [*args[2:]], False


class _Waiting:
    """One interpreter importing torch, or waiting for its worker."""

    def __init__(self, env: Mapping[str, str], command: Sequence[str]) -> None:
        self.env = dict(env)
        self.command = tuple(command)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Import-time output, replayed into the worker's stderr once there is one.
        early = tempfile.TemporaryFile()  # noqa: SIM115 - the child keeps it
        try:
            self.proc = subprocess.Popen(
                # The worker's command after "--": ps and pgrep -f show what it will run.
                [sys.executable, "-u", "-m", __name__, str(theirs.fileno()), "--", *command[2:]],
                env=self.env,
                stdout=early,
                stderr=early,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
            early.close()
        self.sock = ours

    def hand_over(self, message: bytes, fds: Sequence[int]) -> None:
        """Send the start message (raises ``OSError`` when it cannot go at once)."""
        self.sock.setblocking(False)
        sent = socket.send_fds(self.sock, [_HEADER.pack(len(message))], list(fds))
        if sent != _HEADER.size:
            raise OSError("the start message's header did not go at once")
        self.sock.sendall(message)  # non-blocking: BlockingIOError if the buffer is full

    def close(self) -> None:
        """End of file on its socket: a waiting interpreter exits when it reads it."""
        self.sock.close()

    def stop(self) -> None:
        self.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class WarmWorkers:
    """One waiting interpreter per local rank, each used at most once."""

    def __init__(self, nproc: int, env: Mapping[str, str], command: Sequence[str]) -> None:
        """Start ``nproc`` interpreters with ``env`` for workers that run ``command``
        (``<this python> -u script args...`` or ``... -u -m module args...``)."""
        if parse_command(command) is None:
            raise ValueError(f"not a command a warm interpreter can run: {list(command)!r}")
        self._waiting: dict[int, _Waiting] = {}
        for local_rank in range(nproc):
            try:
                self._waiting[local_rank] = _Waiting(env, [str(c) for c in command])
            except OSError as exc:  # no interpreter: the workers start cold
                log.warning("cannot start a warm worker interpreter: %s", exc)
                break

    def __len__(self) -> int:
        return len(self._waiting)

    def pids(self) -> list[int]:
        """The waiting interpreters' process ids (for tests and logs)."""
        return [w.proc.pid for w in self._waiting.values()]

    def take(
        self, local_rank: int, args: Sequence[str], env: Mapping[str, str], fds: Sequence[int]
    ) -> subprocess.Popen[bytes] | None:
        """The process now running ``args`` with ``env`` (stdout, stderr = ``fds``), or
        None: start this worker cold (the reason is logged)."""
        waiting = self._waiting.pop(local_rank, None)
        if waiting is None:
            return None
        command = parse_command(args)
        differences = import_time_differences(waiting.env, env)
        reason = ""
        if command is None:
            reason = f"the command {list(args[:3])!r} is not '{sys.executable} -u ...'"
        elif tuple(args) != waiting.command:
            reason = "the command differs from the one the interpreter was started for"
        elif differences:
            reason = f"{', '.join(differences)} differ from the interpreter's start"
        elif waiting.proc.poll() is not None:
            reason = f"the waiting interpreter exited ({waiting.proc.returncode})"
        if command is None or reason:  # (command is None sets a reason)
            log.info("local rank %d starts cold: %s", local_rank, reason)
            waiting.stop()
            return None
        argv, module = command
        message = WarmStart(
            argv=argv, module=module, env=dict(env), cwd=os.getcwd(), umask=_umask()
        ).encode()
        try:
            if len(message) > MAX_MESSAGE:
                raise OSError(f"the start message has {len(message)} bytes (> {MAX_MESSAGE})")
            waiting.hand_over(message, fds)
        except OSError as exc:
            log.info("local rank %d starts cold: %s", local_rank, exc)
            waiting.stop()
            return None
        waiting.close()
        log.info("local rank %d starts warm (pid %d)", local_rank, waiting.proc.pid)
        return waiting.proc

    def close(self) -> None:
        """Stop the interpreters that were not used."""
        while self._waiting:
            _, waiting = self._waiting.popitem()
            waiting.stop()


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def start(
    config: ElasticConfig,
    environ: Mapping[str, str],
    entrypoint: str,
    args: Sequence[str],
    module: bool,
) -> WarmWorkers | None:
    """The agent's waiting interpreters, one per local rank (None: ``worker_start: cold``).

    They start with ``environ`` and the workers' thread count (which ``import torch``
    reads); the agent's other additions to its workers' environment are read later.
    ``entrypoint``, ``args``, ``module``: the workers' script, as the agent got it.
    """
    if config.worker_start != "warm":
        return None
    slurm = SlurmEnv.from_environ(environ)
    env = {**environ, **thread_environment(config, slurm, environ)}
    cmd, cmd_args = python_entrypoint(entrypoint, args, module)
    return WarmWorkers(config.nproc_per_node or 1, env, (cmd, *cmd_args))


# -- the waiting side ------------------------------------------------------------------------


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    header, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 2)
    while header and len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            break
        header += more
    if len(header) < _HEADER.size:
        return b"", fds
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise ValueError(f"start message of {size} bytes")
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return b"", fds
        data += more
    return data, fds


def _become(start: WarmStart, fds: list[int]) -> None:
    """Turn this interpreter into the worker's process state (before its script runs)."""
    for sig in EARLY_NOTICE_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    os.umask(start.umask)
    os.chdir(start.cwd)
    os.environ.clear()
    os.environ.update(start.env)
    os.lseek(2, 0, os.SEEK_SET)
    early = b""
    while chunk := os.read(2, 65536):
        early += chunk
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in fds:
        os.close(fd)
    if early:
        os.write(2, early)
    sys.argv = list(start.argv)


def _watch_for_restart_path() -> None:
    """Tell the agent if this worker's script makes its process group itself (no
    ``ElasticSession`` in place): :func:`slurm_elastic.live.roster.watch_for_restart_path`.
    Without it the agent cannot tell such a script from ``ElasticSession`` workers still
    starting, and a newcomer waits ``shutdown_timeout_s`` after their start."""
    from slurm_elastic.channel import NodeChannel
    from slurm_elastic.live import roster

    channel = NodeChannel.from_environ()
    local_rank = os.environ.get("LOCAL_RANK", "")
    if channel is None or not local_rank.isdigit() or not roster.in_place_enabled():
        return

    def group_exists() -> bool:
        dist = sys.modules.get("torch.distributed")
        return bool(dist is not None and dist.is_available() and dist.is_initialized())

    roster.watch_for_restart_path(channel, int(local_rank), os.getpid(), group_exists)


def main(argv: Sequence[str] | None = None) -> None:
    """Import torch, wait for the start message, then run the worker's script."""
    args = list(sys.argv[1:] if argv is None else argv)
    # A notice sent to every process of the step (scancel --signal without --batch) is
    # the agent's business while this one waits; the worker gets the defaults back.
    for sig in EARLY_NOTICE_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(args[0]))
    for name in PRELOAD:  # the point: paid before the worker is needed
        with contextlib.suppress(ImportError):
            importlib.import_module(name)

    try:
        data, fds = _receive(sock)
    finally:
        sock.close()
    if not data or len(fds) != 2:  # the agent closed us: no worker to become
        for fd in fds:
            os.close(fd)
        return
    start = WarmStart.decode(data)
    _become(start, fds)
    _watch_for_restart_path()
    import runpy

    if start.module:
        sys.path[0] = start.cwd
        runpy.run_module(start.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(start.argv[0]))
        runpy.run_path(start.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
