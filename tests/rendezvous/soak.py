"""Churn soak with a linearizability check (issue #9.2); used by a test and by the bench.

:func:`run_soak` starts ``agents`` real agent processes on one rendezvous directory.
Each joins rounds, sometimes leaves gracefully and rejoins, sometimes just waits for
the next change; the driver SIGKILLs one at random every ``kill_every_s`` and starts a
replacement. Every agent logs (one JSON line each, to its own file) every state it
read and every compare-and-set it attempted, with the token and a digest of the
state, and every round it completed (rank, world size, members, store address).

:func:`check` then proves there was one linear history:

* **no fork**: a token always names the same state digest, in every log;
* **no lost update**: every generation was won by exactly one write, whose base was
  the generation just before it (so writes form one chain from the first). A writer
  SIGKILLed after winning but before logging its win is accounted for by its ``try``
  record (logged before every attempt): a generation without a logged winner must
  match an unfinished attempt from the generation before it, of the state every
  reader of that generation saw;
* **agreement**: all members of a round report the same world size, members and
  workers' store address, with distinct ranks ``0..world-1``.

The logging backend is a test seam over the real backend (a subclass that only
records); everything else is the production code path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

_CTX = mp.get_context("fork")

CONF = {
    "heartbeat_interval": "0.25",
    "heartbeat_miss_limit": "4",
    "last_call_timeout": "0.3",
    "join_timeout": "60",
    "close_timeout": "10",
    "reform_grace": "0.2",
}


def _digest(blob: bytes) -> str:
    return hashlib.sha1(blob).hexdigest()[:16]


def _agent(root: str, run_id: str, log_path: str, stop_at: float, seed: int, n_max: int) -> None:
    logging.disable(logging.CRITICAL)
    rng = random.Random(seed)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives until os._exit

    def emit(**rec: Any) -> None:
        log.write(json.dumps(rec) + "\n")

    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from slurm_elastic.rendezvous import backend as backend_mod
    from slurm_elastic.rendezvous import run_directory

    class Logged(backend_mod.FileRendezvousBackend):
        """The real backend, recording what it returned."""

        _last: Any = None

        def get_state(self) -> Any:
            cur = super().get_state()
            if cur is not None and cur[1] != self._last:
                self._last = cur[1]
                emit(ev="get", tok=cur[1], d=_digest(cur[0]))
            return cur

        def set_state(self, state: bytes, token: Any = None) -> Any:
            # Logged before the attempt too: a writer SIGKILLed between winning and
            # logging its win still shows what it tried (see check()).
            th = threading.get_native_id()
            emit(ev="try", th=th, base=token, mine=_digest(state))
            res = super().set_state(state, token)
            if res is not None:
                emit(ev="set", th=th, base=token, tok=res[1], ok=res[2], d=_digest(res[0]),
                     mine=_digest(state))  # fmt: skip
            else:
                emit(ev="set", th=th, base=token, tok=None, ok=False, d=None, mine=None)
            return res

    run_directory.FileRendezvousBackend = Logged  # type: ignore[misc]
    from slurm_elastic.rendezvous import create_handler

    params = RendezvousParameters("slurm", root, run_id, 2, n_max, local_addr="127.0.0.1", **CONF)
    try:
        h = create_handler(params, environ={})
        while time.monotonic() < stop_at:
            info = h.next_rendezvous()
            si = info.bootstrap_store_info
            seat = h.seat
            formed = None if seat is None else h.era.backend().read_state(seat.formed)
            emit(ev="round", round=h.current_round, rank=info.rank, world=info.world_size,
                 store=f"{si.master_addr}:{si.master_port}",
                 members=None if formed is None else sorted(n.name for n in formed.participants))  # fmt: skip
            if rng.random() < 0.25:
                h.leave()
                emit(ev="left")
                time.sleep(rng.uniform(0.0, 0.3))
                continue
            until = time.monotonic() + rng.uniform(0.3, 1.5)
            while time.monotonic() < until and h.num_nodes_waiting() == 0:
                time.sleep(0.05)
        h.leave()
    except Exception as exc:
        # After the stop time, a lone agent whose peers all left may time out: benign.
        emit(ev="error", error=f"{type(exc).__name__}: {exc}", late=time.monotonic() > stop_at)
    log.close()
    os._exit(0)


def run_soak(
    work: Path, *, agents: int = 6, seconds: float = 20.0, kill_every_s: float = 2.0
) -> dict[str, Any]:
    """Run the churn soak in ``work`` (a private directory) and check the logs."""
    # Import torch and the rendezvous once here: forked agents start at once.
    import slurm_elastic.rendezvous.factory  # noqa: F401

    root = work / "rdzv"
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stop_at = time.monotonic() + seconds
    rng = random.Random(1)
    procs: list[mp.Process] = []
    serial = 0

    def spawn() -> mp.Process:
        nonlocal serial
        serial += 1
        p = _CTX.Process(
            target=_agent,
            args=(str(root), "soak", str(logs / f"agent{serial}.jsonl"), stop_at, serial,
                  agents),
            daemon=True,
        )  # fmt: skip
        p.start()
        return p

    procs = [spawn() for _ in range(agents)]
    kills = 0
    next_kill = time.monotonic() + kill_every_s
    while time.monotonic() < stop_at:
        time.sleep(0.1)
        if time.monotonic() >= next_kill:
            next_kill += kill_every_s
            live = [p for p in procs if p.is_alive()]
            if live:
                victim = rng.choice(live)
                os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
                victim.join(5)
                kills += 1
                procs.append(spawn())
    deadline = time.monotonic() + 10  # then the leftovers are idle waiters: kill them
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            p.join(5)
    result = check(logs)
    result["kills"] = kills
    result["agents_started"] = serial
    result["dirs"] = directory_sizes(root / "soak")
    return result


def directory_sizes(run_dir: Path) -> dict[str, int]:
    """The largest entry counts of the run's era directories (they must stay bounded).

    ``keys``/``hb``/``intents``: files; ``segments``: state segment directories;
    ``merge_claims``: ``.merge.*`` claims; ``tmp``: ``.tmp.*`` leftovers (a writer
    SIGKILLed between writing and publishing); ``eras``: era directories.
    """
    sizes = dict.fromkeys(("eras", "keys", "hb", "intents", "segments", "merge_claims", "tmp"), 0)
    eras = [p for p in run_dir.glob("era.*") if p.is_dir()]
    sizes["eras"] = len(eras)
    for era in eras:
        for sub in ("keys", "hb", "intents"):
            names = [p.name for p in (era / sub).iterdir()]
            sizes[sub] = max(sizes[sub], len([n for n in names if not n.startswith(".")]))
            if sub == "intents":
                claims = len([n for n in names if n.startswith(".merge.")])
                sizes["merge_claims"] = max(sizes["merge_claims"], claims)
        segs = [p for p in era.iterdir() if p.name.startswith("seg.")]
        sizes["segments"] = max(sizes["segments"], len(segs))
        tmp = [p for p in era.rglob(".tmp.*")]
        sizes["tmp"] = max(sizes["tmp"], len(tmp))
    return sizes


def _records(logs: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(logs.glob("*.jsonl")):
        recs = []
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:  # the last line of a SIGKILLed agent may be torn
                continue
        out[path.name] = recs
    return out


def _unfinished_attempts(records: dict[str, list[dict[str, Any]]]) -> list[tuple[int, str]]:
    """``(base, digest)`` of every write attempt whose thread logged no result after it."""
    out = []
    for recs in records.values():
        open_try: dict[Any, dict[str, Any]] = {}
        for r in recs:
            if r["ev"] == "try":
                open_try[r.get("th")] = r
            elif r["ev"] == "set":
                open_try.pop(r.get("th"), None)
        out += [(r["base"] or 0, r["mine"]) for r in open_try.values()]
    return out


def check(logs: Path) -> dict[str, Any]:
    """Check the agents' logs for one linear history; return a summary with problems."""
    problems: list[str] = []
    by_token: dict[int, set[str]] = defaultdict(set)
    wins: dict[int, list[dict[str, Any]]] = defaultdict(list)
    rounds: dict[int, list[dict[str, Any]]] = defaultdict(list)
    errors = []
    for name, recs in _records(logs).items():
        for r in recs:
            if r["ev"] == "get":
                by_token[r["tok"]].add(r["d"])
            elif r["ev"] == "set" and r["tok"] is not None:
                by_token[r["tok"]].add(r["d"])
                if r["ok"]:
                    wins[r["tok"]].append(r)
                    if r["d"] != r["mine"]:
                        problems.append(f"{name}: a win returned a state it did not write")
            elif r["ev"] == "round":
                rounds[r["round"]].append(r)
            elif r["ev"] == "error":
                errors.append(f"{name}: {r['error']}")
                if not r.get("late"):
                    problems.append(f"{name}: agent failed during the soak: {r['error']}")
    unfinished = _unfinished_attempts(_records(logs))
    forks = {t: ds for t, ds in by_token.items() if len(ds) > 1}
    if forks:
        problems.append(f"fork: tokens with several states: {sorted(forks)[:5]}")
    for tok, ws in wins.items():
        if len(ws) > 1:
            problems.append(f"generation {tok} won {len(ws)} times")
        for w in ws:
            if (w["base"] or 0) != tok - 1:
                problems.append(f"generation {tok} won from base {w['base']}")
    killed_mid_write = 0
    if wins:
        missing = set(range(1, max(wins) + 1)) - set(wins)
        unexplained = []
        for tok in sorted(missing):
            seen = by_token.get(tok, set())
            if any(base == tok - 1 and (not seen or seen == {mine}) for base, mine in unfinished):
                killed_mid_write += 1
            else:
                unexplained.append(tok)
        if unexplained:
            problems.append(f"generations with no recorded winner: {unexplained[:5]}")
    for rnd, reports in rounds.items():
        worlds = {r["world"] for r in reports}
        stores = {r["store"] for r in reports}
        members = {tuple(r["members"]) for r in reports if r["members"] is not None}
        ranks = [r["rank"] for r in reports]
        if (
            len(worlds) != 1
            or len(stores) != 1
            or len(members) > 1
            or any(len(m) not in worlds for m in members)
        ):
            problems.append(f"round {rnd}: members disagree ({worlds}, {stores})")
        if len(set(ranks)) != len(ranks) or not all(0 <= k < min(worlds) for k in ranks):
            problems.append(f"round {rnd}: ranks {sorted(ranks)} of world {worlds}")
    return {
        "transitions": len(wins),
        "reads_checked": sum(len(v) for v in by_token.values()),
        "rounds": len(rounds),
        "killed_mid_write": killed_mid_write,
        "linear": not problems,
        "problems": problems[:20],
        "agent_errors": errors[:10],
    }
