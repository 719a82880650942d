"""Multi-process harness for rendezvous tests: one real process per "node".

Each :class:`NodeProc` is a forked process that builds a real
:class:`~slurm_elastic.rendezvous.SlurmRendezvousHandler` and obeys commands sent over
its own ``Pipe`` (no shared multiprocessing locks: SIGKILLing a process that shares an
``mp.Queue``/``mp.Event`` lock wedges the others). After each rendezvous it does what a
worker does: connects a TCPStore client to the advertised ``addr:port``, forms a gloo
group and runs an ``all_reduce``, so tests assert that collectives work after a change.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

# Fast timeouts: heartbeat window 4 x 0.25 s = 1 s, last call 0.5 s.
FAST_CONF = {
    "heartbeat_interval": "0.25",
    "heartbeat_miss_limit": "4",
    "last_call_timeout": "0.5",
    "join_timeout": "60",
    "close_timeout": "10",
}

_CTX = mp.get_context("fork")


def _all_reduce(addr: str, port: int, rank: int, world: int, round_: int) -> float:
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30))
    pg_store = dist.PrefixStore(f"harness/{round_}", store)
    dist.init_process_group(
        "gloo", store=pg_store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return float(t.item())
    finally:
        dist.destroy_process_group()


def enter_netns(path: str) -> None:
    """Move this (single-threaded) process into the network namespace at ``path``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


def _serve(
    conn: Connection, params: RendezvousParameters, env: dict[str, str], netns: str | None
) -> None:
    if netns is not None:
        enter_netns(netns)
    torch.set_num_threads(1)
    os.environ.update(env)
    from slurm_elastic.rendezvous import create_handler

    handler = None
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "create":
                handler = create_handler(params)
                conn.send(("ok", {"node": handler.node, "era": handler.era.number}))
            elif cmd in ("rdzv", "rdzv_seated"):
                assert handler is not None
                t0 = time.monotonic()
                if cmd == "rdzv_seated":  # an in-place re-join: the workers still train
                    with handler.keeping_seat():
                        info = handler.next_rendezvous()
                else:
                    info = handler.next_rendezvous()
                took = time.monotonic() - t0
                si = info.bootstrap_store_info
                info.store.set(f"agent{info.rank}", "x")  # the agent control-plane store
                total = _all_reduce(si.master_addr, si.master_port, info.rank, info.world_size, 0)
                conn.send(
                    (
                        "ok",
                        {
                            "rank": info.rank,
                            "world": info.world_size,
                            "round": handler.current_round,
                            "store": f"{si.master_addr}:{si.master_port}",
                            "sum": total,
                            "took": took,
                            "era": handler.era.number,
                        },
                    )
                )
            elif cmd == "rdzv_only":  # join a round, then do nothing in it (no agent work)
                assert handler is not None
                info = handler.next_rendezvous()
                conn.send(("ok", {"rank": info.rank, "world": info.world_size}))
            elif cmd == "wait_change":
                t0 = time.monotonic()
                deadline = t0 + float(arg)
                while handler.num_nodes_waiting() == 0:  # type: ignore[union-attr]
                    if time.monotonic() > deadline:
                        raise TimeoutError("num_nodes_waiting stayed 0")
                    time.sleep(0.05)
                conn.send(("ok", time.monotonic() - t0))
            elif cmd == "plant_waiter":
                # Test seam: put a node named ``arg`` on the wait list as one CAS, as a
                # newcomer left over by a merge is before it moves itself to the spares.
                from slurm_elastic.rendezvous.state import Node, encode_state

                assert handler is not None
                backend = handler.era.backend()
                for _ in range(100):
                    gen, st = backend.read_full()
                    st.waiting.add(Node(arg, 1, 0))
                    won = backend.set_state(encode_state(st), gen)
                    if won is not None and won[2]:
                        break
                else:
                    raise RuntimeError("could not plant a waiter in 100 tries")
                conn.send(("ok", None))
            elif cmd == "state":  # the shared state as read now: round, complete, members
                assert handler is not None
                _, st = handler.era.backend().read_full()
                conn.send(("ok", (st.round, st.complete, len(st.participants))))
            elif cmd == "linked":  # the nodes this one holds a verified link to
                conn.send(("ok", sorted(handler.verified_links())))  # type: ignore[union-attr]
            elif cmd == "stop":  # SIGSTOP this process (a frozen node); the test CONTs it
                conn.send(("ok", None))
                os.kill(os.getpid(), signal.SIGSTOP)
            elif cmd == "waiting":
                conn.send(("ok", handler.num_nodes_waiting()))  # type: ignore[union-attr]
            elif cmd == "leave":
                handler.leave()  # type: ignore[union-attr]
                conn.send(("ok", None))
            elif cmd == "shutdown":
                conn.send(("ok", handler.shutdown()))  # type: ignore[union-attr]
            elif cmd == "exit":
                conn.send(("ok", None))
                os._exit(0)
        except BaseException as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class NodeProc:
    """A forked process acting as one node's agent (handler only, no workers)."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        *,
        conf: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        local_addr: str = "127.0.0.1",
        netns: str | None = None,
    ) -> None:
        params = RendezvousParameters(
            "slurm",
            str(root),
            run_id,
            min_nodes,
            max_nodes,
            local_addr=local_addr,
            **{**FAST_CONF, **(conf or {})},
        )
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_serve, args=(child, params, env or {}, netns), daemon=True)
        self.proc.start()
        self._pending: str | None = None

    def send(self, cmd: str, arg: Any = None) -> None:
        """Start a command without waiting for its answer."""
        self._conn.send((cmd, arg))
        self._pending = cmd

    def result(self, timeout: float = 60.0) -> Any:
        """Wait for the answer of the last command; raise if it failed."""
        if not self._conn.poll(timeout):
            raise AssertionError(
                f"node {self.proc.pid}: no answer to {self._pending!r} in {timeout} s"
            )
        status, value = self._conn.recv()
        if status != "ok":
            raise AssertionError(f"node {self.proc.pid}: {self._pending!r} failed: {value}")
        return value

    def call(self, cmd: str, arg: Any = None, timeout: float = 60.0) -> Any:
        """Run a command and return its answer."""
        self.send(cmd, arg)
        return self.result(timeout)

    def ready(self) -> bool:
        """Whether an answer is waiting."""
        return self._conn.poll(0)

    def kill(self) -> None:
        """SIGKILL the process (a node dying hard) and reap it."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        """Stop the process, however it is."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


def rdzv_all(nodes: list[NodeProc], timeout: float = 60.0) -> list[dict[str, Any]]:
    """Start a rendezvous on every node and collect the results (in node order)."""
    for n in nodes:
        n.send("rdzv")
    return [n.result(timeout) for n in nodes]


def check_world(results: list[dict[str, Any]], world: int) -> None:
    """Assert one consistent world of ``world`` ranks whose all_reduce succeeded."""
    assert sorted(r["rank"] for r in results) == list(range(world)), results
    assert {r["world"] for r in results} == {world}, results
    assert len({r["store"] for r in results}) == 1, results
    assert len({r["round"] for r in results}) == 1, results
    assert {r["sum"] for r in results} == {world * (world + 1) / 2}, results
