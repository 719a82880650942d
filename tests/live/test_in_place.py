"""Membership changes in place, on real agents (no Slurm): join, graceful leave, hard
loss, spare promotion, and the fallback to the restart path.

Each test asserts that the workers that should survive keep their PIDs, that no step is
lost (or only the rolled-back ones are redone, after a hard loss), that the ledger shows
every sample once per epoch, and that the final parameters match the uninterrupted math.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from slurm_elastic.envvars import TEST_PAUSE_AT_ENV, TEST_PAUSE_DIR_ENV
from slurm_elastic.events import read_events
from tests.helpers import wait_for
from tests.live.conftest import (
    TOGETHER_LAST_CALL_S,
    LiveRun,
    assert_close_to_reference,
    assert_each_sample_once,
    ledger,
    redone_steps,
    steps_done,
    wait_world_of_4,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def events(tmp: Path, run_id: str) -> list[dict]:
    return list(read_events(tmp / "state" / "events" / run_id))


def started_workers(tmp: Path, run_id: str, run: LiveRun) -> set[int]:
    """The agent's worker processes once it has started them (its ``agent.workers_started``
    event); empty before. Its children alone are no sign: with ``worker_start: warm`` the
    interpreters that become its workers are its children from its start."""
    started = any(
        e["kind"] == "agent.workers_started" and e["pid"] == run.proc.pid
        for e in events(tmp, run_id)
    )
    return run.worker_pids() if started else set()


def test_join_in_place_keeps_workers_and_loses_no_step(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    # node a trains slowly until b is in (a budget of 57 s for b to start), then at full
    # speed: it cannot finish before the join on a slow machine
    steps, slow = 300, {"step_time": 0.2}
    paced = ("--pace-until-world", "4")
    a = LiveRun(tmp_path, "join1", "1:2", "a", *paced, steps=steps, **slow)
    nodes.append(a)
    wait_for(lambda: steps_done(tmp_path) >= 15, 90, "node a to train alone")
    a_pids = {r["pid"] for r in ledger(tmp_path)}
    assert len(a_pids) == 2
    b = LiveRun(tmp_path, "join1", "1:2", "b", *paced, steps=steps, **slow)
    nodes.append(b)
    assert a.wait(180) == ExitCode.FINISHED, a.log()
    assert b.wait(60) == ExitCode.FINISHED, b.log()

    records = ledger(tmp_path)
    assert {r["world"] for r in records} == {2, 4}
    # node a's workers trained through the change: the same two processes from step 1
    # to the end, and they ran the last step in the world of 4
    last = [r for r in records if r["step"] == steps]
    assert {r["pid"] for r in last} >= a_pids and {r["world"] for r in last} == {4}
    assert {r["pid"] for r in records if r["step"] == 1} == a_pids
    assert redone_steps(records) == 0  # a join loses no step
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
    kinds = [e["kind"] for e in events(tmp_path, "join1")]
    assert "agent.reformed_in_place" in kinds and "live.reformed" in kinds
    newcomers = [e for e in events(tmp_path, "join1") if e["kind"] == "live.start"]
    assert {e["resumed_from"] for e in newcomers if e["world_size"] == 4} == {"peer"}
    # where each start's time went (live.start's phases_s): in place every start joins
    # its round's store and group; only a start that got no commit from a peer resumes
    for e in newcomers:
        peer = e["resumed_from"] == "peer"
        expected = {"connect_s", "join_s", "state_s", "wrap_s"} | (set() if peer else {"resume_s"})
        assert set(e["phases_s"]) == expected, e
        assert all(0 <= v < 60 for v in e["phases_s"].values()), e


def test_graceful_leave_in_place_keeps_survivors(tmp_path: Path, nodes: list[LiveRun]) -> None:
    steps = 300
    a = LiveRun(tmp_path, "leave1", "1:2", "a", steps=steps, last_call_s=TOGETHER_LAST_CALL_S)
    b = LiveRun(tmp_path, "leave1", "1:2", "b", steps=steps, last_call_s=TOGETHER_LAST_CALL_S)
    nodes += [a, b]
    wait_world_of_4(tmp_path, min_steps=20)
    b_pids = b.worker_pids()
    a_pids = a.worker_pids()
    b.signal(signal.SIGUSR2)
    assert b.wait(90) == ExitCode.PREEMPTED, b.log()
    assert a.wait(120) == ExitCode.FINISHED, a.log()

    records = ledger(tmp_path)
    world2 = [r for r in records if r["world"] == 2 and r["step"] > 20]
    assert world2 and {r["pid"] for r in world2} == a_pids  # survivors kept their processes
    assert not {r["pid"] for r in world2} & b_pids
    assert redone_steps(records) == 0  # a leave with notice loses no step
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
    assert "agent.leave_in_place" in [e["kind"] for e in events(tmp_path, "leave1")]


@pytest.mark.parametrize("commit_every", [0, 1], ids=["no-copy", "commit-every-step"])
def test_hard_loss_rolls_back_and_reforms_in_place(
    tmp_path: Path, nodes: list[LiveRun], commit_every: int
) -> None:
    """Default (no copy): the survivors go on from the newest live state among them; with
    commits every step: they roll back to it. Either way exact, at most the failed step
    redone."""
    steps = 300
    extra = ("--commit-every", str(commit_every))
    together = {"steps": steps, "last_call_s": TOGETHER_LAST_CALL_S}
    a = LiveRun(tmp_path, "hard1", "1:2", "a", *extra, **together)
    b = LiveRun(tmp_path, "hard1", "1:2", "b", *extra, **together)
    nodes += [a, b]
    wait_world_of_4(tmp_path, min_steps=20)
    a_pids = a.worker_pids()
    killed_at, kill_time = steps_done(tmp_path), time.time()
    b.kill_node()
    assert a.wait(150) == ExitCode.FINISHED, a.log()

    records = ledger(tmp_path)
    after = [r for r in records if r["step"] > killed_at + 2]
    assert after and {r["pid"] for r in after} == a_pids and {r["world"] for r in after} == {2}
    assert redone_steps(records) <= 2  # at most the failed step again
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
    # the loss is met by re-forming after the failed collective, and by nothing else
    changes = [e for e in events(tmp_path, "hard1") if e["kind"] == "live.reformed"]
    assert [e for e in changes if e["time"] < kill_time] == []  # round 0 held both nodes
    assert {e["cause"] for e in changes} == {"failure"}


def test_spare_is_promoted_in_place_when_a_member_leaves(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    # paced steps until the promoted spare's workers have started (they import torch
    # while the survivor keeps training; it must not finish first), then full speed
    steps, pace = 400, 0.1
    paced = ("--pace-until-file", str(tmp_path / "release"))
    together = {"steps": steps, "step_time": pace, "last_call_s": TOGETHER_LAST_CALL_S}
    a = LiveRun(tmp_path, "spare1", "1:2", "a", *paced, **together)
    b = LiveRun(tmp_path, "spare1", "1:2", "b", *paced, **together)
    nodes += [a, b]
    wait_world_of_4(tmp_path)
    spare = LiveRun(tmp_path, "spare1", "1:2", "c", *paced, steps=steps, step_time=pace)
    nodes.append(spare)
    # (the agent's log names the run, "spare1", from its first line: wait for the state)
    wait_for(lambda: "waiting as a spare" in spare.log(), 30, "the spare")
    a_pids = a.worker_pids()
    assert started_workers(tmp_path, "spare1", spare) == set()  # a spare runs no workers
    b.signal(signal.SIGUSR2)
    assert b.wait(90) == ExitCode.PREEMPTED, b.log()
    wait_for(
        lambda: len(started_workers(tmp_path, "spare1", spare)) == 2, 60, "the spare's workers"
    )
    c_pids = spare.worker_pids()
    wait_for(
        lambda: any(r["pid"] in c_pids for r in ledger(tmp_path)), 90, "the spare's workers' steps"
    )
    (tmp_path / "release").touch()  # the promoted spare trains: the rest at full speed
    assert a.wait(150) == ExitCode.FINISHED, a.log()
    assert spare.wait(60) == ExitCode.FINISHED, spare.log()

    records = ledger(tmp_path)
    last = [r for r in records if r["step"] == steps]
    assert {r["pid"] for r in last} == a_pids | c_pids and {r["world"] for r in last} == {4}
    assert redone_steps(records) == 0
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)


def test_failed_reform_falls_back_to_the_restart_path(tmp_path: Path, nodes: list[LiveRun]) -> None:
    # Node b's workers die (their sockets reset: a's collective fails at once) while its
    # agent is frozen: no link ends, so b is evicted only after its heartbeat window,
    # ~1.5-2.5 s. The workers wait only 0.5 s for a new round, so they exit and the agent
    # restarts them from the last checkpoint. (A killed agent is evicted at once by its
    # link, and the in-place re-formation would succeed.)
    steps = 300
    release = tmp_path / "release"  # paced until the restarted workers train
    args = ("--reform-timeout", "0.5", "--save-every", "10", "--pace-until-file", str(release))
    together = {"steps": steps, "last_call_s": TOGETHER_LAST_CALL_S}
    a = LiveRun(tmp_path, "fb1", "1:2", "a", *args, agent_args=("--max-restarts", "1"), **together)
    b = LiveRun(tmp_path, "fb1", "1:2", "b", *args, agent_args=("--max-restarts", "1"), **together)
    nodes += [a, b]
    wait_world_of_4(tmp_path, min_steps=25)
    a_pids = a.worker_pids()
    b_workers = b.worker_pids()
    os.killpg(b.proc.pid, signal.SIGSTOP)  # the agent (its workers run in their own sessions)
    for pid in b_workers:
        os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: any(r["pid"] not in a_pids | b_workers for r in ledger(tmp_path)),
        120,
        "the restarted workers to train",
    )
    release.touch()
    assert a.wait(150) == ExitCode.FINISHED, a.log()
    records = ledger(tmp_path)
    last = [r for r in records if r["step"] == steps]
    assert {r["world"] for r in last} == {2}
    assert not {r["pid"] for r in last} & a_pids  # restarted: new processes
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
    starts = [e for e in events(tmp_path, "fb1") if e["kind"] == "live.start"]
    assert any(str(e["resumed_from"]).endswith(tuple(f"step_{n}" for n in range(10, steps, 10)))
               for e in starts)  # fmt: skip


def test_join_on_the_restart_path_saves_first_and_loses_no_step(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    # SLURM_ELASTIC_IN_PLACE=0: the agent gives the workers the preemption notice before
    # restarting them for the newcomer, so they save the current step first.
    steps = 300
    env = {"SLURM_ELASTIC_IN_PLACE": "0"}
    # slow until b is in (57 s of budget), then at full speed (see the in-place join)
    args = ("--save-every", "1000", "--pace-until-world", "4")
    a = LiveRun(tmp_path, "rs1", "1:2", "a", *args, steps=steps, step_time=0.2, env=env)
    nodes.append(a)
    wait_for(lambda: steps_done(tmp_path) >= 15, 90, "node a to train alone")
    a_pids = {r["pid"] for r in ledger(tmp_path)}
    b = LiveRun(tmp_path, "rs1", "1:2", "b", *args, steps=steps, step_time=0.2, env=env)
    nodes.append(b)
    assert a.wait(180) == ExitCode.FINISHED, a.log()
    assert b.wait(60) == ExitCode.FINISHED, b.log()
    records = ledger(tmp_path)
    assert not {r["pid"] for r in records if r["world"] == 4} & a_pids  # restarted
    assert redone_steps(records) == 0  # saved at the notice: nothing redone
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)


def test_without_membership_change_in_place_equals_the_restart_path_bitwise(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    import torch

    outs = []
    for mode in ("1", "0"):
        tmp = tmp_path / f"in_place_{mode}"
        tmp.mkdir()
        run = LiveRun(
            tmp, f"bit{mode}", "1", "a", steps=60, step_time=0.0,
            env={"SLURM_ELASTIC_IN_PLACE": mode},
        )  # fmt: skip
        nodes.append(run)
        assert run.wait(180) == ExitCode.FINISHED, run.log()
        outs.append(torch.load(tmp / "out.pt"))
    assert outs[0].keys() == outs[1].keys()
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])


def test_workers_of_a_sigkilled_agent_leave_instead_of_training_on_as_orphans(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    # Finding 9 (docs/reliability.md): a SIGKILL of the agent alone leaves its workers
    # alive (reparented); they kept training in the old round and the survivors never
    # switched. They must leave at the survivors' switch (no rollback).
    steps, pace = 500, 0.05
    paced = ("--pace-until-file", str(tmp_path / "release"))  # until the orphans are gone
    together = {"steps": steps, "step_time": pace, "last_call_s": TOGETHER_LAST_CALL_S}
    a = LiveRun(tmp_path, "orphan1", "1:2", "a", *paced, **together)
    b = LiveRun(tmp_path, "orphan1", "1:2", "b", *paced, **together)
    nodes += [a, b]
    wait_world_of_4(tmp_path)
    a_pids, b_pids = a.worker_pids(), b.worker_pids()
    b.signal(signal.SIGKILL)  # the agent only: its workers live on
    b.wait(10)
    wait_for(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in b_pids),
        60,
        "the dead agent's workers to exit",
    )
    (tmp_path / "release").touch()
    assert a.wait(150) == ExitCode.FINISHED, a.log()

    records = ledger(tmp_path)
    last = [r for r in records if r["step"] == steps]
    assert {r["pid"] for r in last} == a_pids and {r["world"] for r in last} == {2}
    assert redone_steps(records) == 0  # they left at the switch: nothing rolled back
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)


def test_newcomers_filling_max_nodes_seat_the_training_member_first(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    # One node trains alone (1:4), then max_nodes (4) newcomers start at once. Before the
    # fix the newcomers could fill the next round while the member's agent re-joined
    # through the wait list: they resumed from the checkpoint while the member's
    # workers trained on in the old round (two trainings at once: steps run twice).
    # Starting 4 agents and 8 workers takes 15-35 s on an idle 2-core machine, and the
    # newcomers may come in two rounds (a loaded run grew 2 -> 6 -> 8 over 113 s; a CI
    # run was still at 4 after 80 s): node a trains slowly (0.4 s a step: 240 s of
    # budget) until the world has grown to 8, then at full speed, so it cannot finish
    # before the newcomers are in.
    steps, pace, paced = 600, 0.4, ("--pace-until-world", "8")
    # Node a's address sorts after the newcomers' (127.0.0.0/8 is all loopback): a
    # merge of join intents takes nodes in name order, so without seats kept for the
    # members a would be the one left out (on separate hosts the order is arbitrary).
    a = LiveRun(
        tmp_path, "seat1", "1:4", "a", *paced, steps=steps, step_time=pace,
        agent_args=("--local-addr", "127.0.0.9"),
    )  # fmt: skip
    nodes.append(a)
    wait_for(lambda: steps_done(tmp_path) >= 15, 90, "node a to train alone")
    a_pids = a.worker_pids()
    assert len(a_pids) == 2
    newcomers = [
        LiveRun(tmp_path, "seat1", "1:4", name, *paced, steps=steps, step_time=pace)
        for name in ("b", "c", "d", "e")
    ]
    nodes += newcomers
    assert a.wait(420) == ExitCode.FINISHED, a.log()
    for n in newcomers:
        n.wait(60)

    records = ledger(tmp_path)
    worlds = {
        r["round"]: (r["world"], r["step"]) for r in sorted(records, key=lambda r: -r["step"])
    }
    # never two trainings at once: no step ran in two rounds, and the member's workers
    # (the same processes) ran the last step in the grown world
    twice = sorted({r["step"] for r in records if r["round"] != first_round(records, r["step"])})
    assert redone_steps(records) == 0, f"steps run in two rounds (two trainings): {twice[:20]}"
    last = [r for r in records if r["step"] == steps]
    assert {r["pid"] for r in last} >= a_pids, (a_pids, last)
    tails = "\n".join(f"--- {n.node}\n{n.log()[-1500:]}" for n in newcomers)
    assert {r["world"] for r in last} == {8}, f"(world, first step) by round: {worlds}\n{tails}"
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
    started = [e for e in events(tmp_path, "seat1") if e["kind"] == "live.start"]
    assert {e["resumed_from"] for e in started if e["world_size"] > 2} == {"peer"}


def first_round(records: list[dict], step: int) -> int:
    return min(r["round"] for r in records if r["step"] == step)


def test_a_join_waits_for_workers_still_starting_and_re_forms_them_in_place(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    """Node b joins a's run; while b's workers are still starting (held before they
    register with their agent, by the test seam), node c comes. b's agent must not
    restart them for c: it gave them the notice, they joined a's round and trained in
    place, voting to leave, waiting for a round their agent (waiting for them to exit)
    never joined; after 60 s it killed them and a redid a step (a CI run of the seat test
    above). It waits for them to go live, then the change re-forms everyone in place."""
    steps, paced = 400, ("--pace-until-world", "6")
    a = LiveRun(tmp_path, "defer1", "1:3", "a", *paced, steps=steps, step_time=0.3)
    nodes.append(a)
    wait_for(lambda: steps_done(tmp_path) >= 15, 90, "node a to train alone")
    hold = tmp_path / "hold"
    hold.mkdir()
    seam = {TEST_PAUSE_AT_ENV: "worker_open", TEST_PAUSE_DIR_ENV: str(hold)}
    b = LiveRun(tmp_path, "defer1", "1:3", "b", *paced, steps=steps, step_time=0.3, env=seam)
    nodes.append(b)
    wait_for(lambda: (hold / "worker_open.reached").exists(), 90, "b's workers to start")

    def b_workers() -> set[int] | None:  # the event may come just after they reach the seam
        pids = started_workers(tmp_path, "defer1", b)
        return pids if len(pids) == 2 else None

    b_pids = wait_for(b_workers, 30, "b's agent to record its two workers")
    c = LiveRun(tmp_path, "defer1", "1:3", "c", *paced, steps=steps, step_time=0.3)
    nodes.append(c)
    wait_for(lambda: "waits for them to go live" in b.log(), 90, "b's agent to wait for them")
    (hold / "worker_open.go").touch()
    assert a.wait(200) == ExitCode.FINISHED, a.log()
    assert b.wait(60) == ExitCode.FINISHED, b.log()
    c.wait(60)

    records = ledger(tmp_path)
    assert redone_steps(records) == 0
    b_events = [e for e in events(tmp_path, "defer1") if e["pid"] == b.proc.pid]
    assert not [e for e in b_events if e["kind"] == "agent.restart"], b.log()[-3000:]
    assert any(e["kind"] == "agent.reformed_in_place" for e in b_events), b.log()[-3000:]
    last = [r for r in records if r["step"] == steps]
    assert {r["world"] for r in last} == {6}
    assert b_pids <= {r["pid"] for r in last}  # b's first workers trained to the end
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)


def test_workers_still_starting_are_restarted_at_once_when_a_member_is_lost(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    """Node b's new workers join a's round; a freezes before they are in (they block on
    its store, registered as starting). When a is evicted, b's agent restarts them at
    once: they trained no step, so the preemption notice and its wait for a save
    (``--shutdown-timeout``, 30 s) would only stall the job (seen in the goodput storm)."""
    steps = 200
    # a 12-s liveness window: b's workers are surely starting (torch imported) by then
    conf = ("--rdzv-conf", "heartbeat_interval=0.5,heartbeat_miss_limit=24,last_call_timeout=1")
    args = ("--save-every", "10")
    a = LiveRun(tmp_path, "st1", "1:2", "a", *args, steps=steps, step_time=0.1, agent_args=conf)
    nodes.append(a)
    wait_for(lambda: steps_done(tmp_path) >= 12, 90, "node a to train alone")
    agent_args = (*conf, "--shutdown-timeout", "30")
    b = LiveRun(tmp_path, "st1", "1:2", "b", *args, steps=steps, agent_args=agent_args)
    nodes.append(b)
    wait_for(lambda: len(started_workers(tmp_path, "st1", b)) == 2, 60, "node b's workers")
    first = b.worker_pids()
    a.freeze_node()
    assert b.wait(150) == ExitCode.FINISHED, b.log()

    b_events = [e for e in events(tmp_path, "st1") if e["pid"] == b.proc.pid]
    restart = next(e for e in b_events if e["kind"] == "agent.restart")
    assert restart["reason"] == "membership", restart
    started = [e for e in b_events if e["kind"] == "agent.workers_started"]
    assert started[-1].time - restart.time < 10, (restart, started)  # not the 30-s wait
    assert "workers still starting (no step trained): restarting them at once" in b.log()
    records = ledger(tmp_path)
    assert not {r["pid"] for r in records} & first  # the starting workers never stepped
    last = [r for r in records if r["step"] == steps]
    assert {r["world"] for r in last} == {2}
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
