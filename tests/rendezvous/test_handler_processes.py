"""Membership scenarios with real processes, real handlers and gloo all_reduce.

Each "node" is a forked process with its own handler (see harness.py); the rendezvous
directory is a real directory, the stores are real TCPStores, the collectives real gloo.
Heartbeat window in these tests: 4 x 0.25 s = 1 s; last call 0.5 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.rendezvous.harness import NodeProc, check_world, rdzv_all

WINDOW_S = 1.0


@pytest.fixture
def nodes() -> Iterator[list[NodeProc]]:
    made: list[NodeProc] = []
    yield made
    for n in made:
        n.close()


def _spawn(made: list[NodeProc], count: int, *args: object, **kwargs: object) -> list[NodeProc]:
    new = [NodeProc(*args, **kwargs) for _ in range(count)]  # type: ignore[arg-type]
    made.extend(new)
    for n in new:
        n.call("create")
    return new


def _newcomers_arrive_members_rejoin(
    members: list[NodeProc], newcomers: list[NodeProc], rejoin: str
) -> None:
    """Newcomers start joining; once each member sees the change, it re-joins (``rejoin``)."""
    for n in newcomers:
        n.send("rdzv")
    for m in members:
        m.call("wait_change", 10)
    for m in members:
        m.send(rejoin)


def test_three_nodes_form_one_world_and_all_reduce(tmp_path: Path, nodes: list[NodeProc]) -> None:
    group = _spawn(nodes, 3, tmp_path, "run", 3, 3)
    results = rdzv_all(group)
    check_world(results, 3)


def test_min_nodes_forms_after_last_call_and_max_bounds_world(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    group = _spawn(nodes, 2, tmp_path, "run", 2, 3)
    results = rdzv_all(group)
    check_world(results, 2)  # formed with min after last call, not waiting for max
    # Two more arrive: the next round fills up to max (3), the 4th waits as a spare.
    extra = _spawn(nodes, 2, tmp_path, "run", 2, 3)
    _newcomers_arrive_members_rejoin(group, extra, "rdzv")
    everyone = group + extra
    wait_for(lambda: sum(n.ready() for n in everyone) >= 3, 30, "a world of 3")
    spares = [n for n in everyone if not n.ready()]
    results = [n.result() for n in everyone if n.ready()]
    check_world(results, 3)
    assert len(spares) == 1, "a 4th node above max_nodes must wait as a spare"
    assert not spares[0]._conn.poll(1.0) and spares[0].proc.is_alive()


def test_late_joiner_grows_world_from_min_to_max(tmp_path: Path, nodes: list[NodeProc]) -> None:
    group = _spawn(nodes, 2, tmp_path, "run", 2, 3)
    check_world(rdzv_all(group), 2)
    (late,) = _spawn(nodes, 1, tmp_path, "run", 2, 3)
    late.send("rdzv")
    for n in group:
        n.call("wait_change", 10)
    results = [*rdzv_all(group), late.result()]
    check_world(results, 3)


def test_graceful_leave_is_seen_before_any_heartbeat_expiry(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    group = _spawn(
        nodes, 3, tmp_path, "run", 2, 3,
        conf={"heartbeat_miss_limit": "40", "last_call_timeout": "5"},
    )  # fmt: skip
    first = rdzv_all(group)
    check_world(first, 3)
    leaver = group[2]
    leaver.call("leave")
    # The window is 40 x 0.25 s = 10 s: noticing within 2 s proves the removal was
    # written by the leaver, not inferred from missing heartbeats.
    noticed = [n.call("wait_change", 10) for n in group[:2]]
    assert max(noticed) < 2.0, noticed
    second = rdzv_all(group[:2])
    check_world(second, 2)
    # A re-formation completes once nobody else is expected, not after the 5 s last call.
    assert max(r["took"] for r in second) < 2.5, second


@pytest.mark.parametrize("victim_rank", [1, 0], ids=["non_zero_rank", "store_host"])
def test_sigkilled_node_is_evicted_and_survivors_reform(
    tmp_path: Path, nodes: list[NodeProc], victim_rank: int
) -> None:
    group = _spawn(nodes, 3, tmp_path, "run", 2, 3)
    first = rdzv_all(group)
    check_world(first, 3)
    victim = next(n for n, r in zip(group, first, strict=False) if r["rank"] == victim_rank)
    survivors = [n for n in group if n is not victim]
    victim.kill()
    noticed = [n.call("wait_change", 15) for n in survivors]
    # Eviction needs the window plus at most a couple of watcher intervals.
    assert max(noticed) < WINDOW_S + 2.0, noticed
    second = rdzv_all(survivors)
    check_world(second, 2)
    assert second[0]["round"] > first[0]["round"]
    if victim_rank == 0:
        assert second[0]["store"] != first[0]["store"], "survivors must use a new store"


def test_spare_above_max_takes_over_when_a_member_dies(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    group = _spawn(nodes, 2, tmp_path, "run", 2, 2)
    check_world(rdzv_all(group), 2)
    (spare,) = _spawn(nodes, 1, tmp_path, "run", 2, 2)
    spare.send("rdzv")
    # A spare does not make the members restart.
    assert all(n.call("waiting") == 0 for n in group)
    assert not spare._conn.poll(1.5), "the spare must wait while the world is full"
    group[1].kill()
    group[0].call("wait_change", 15)
    results = [*rdzv_all([group[0]]), spare.result()]
    check_world(results, 2)


def test_two_run_ids_sharing_a_root_stay_apart(tmp_path: Path, nodes: list[NodeProc]) -> None:
    a = _spawn(nodes, 2, tmp_path, "run-a", 2, 4)
    b = _spawn(nodes, 2, tmp_path, "run-b", 2, 4)
    for n in a + b:
        n.send("rdzv")
    ra = [n.result() for n in a]
    rb = [n.result() for n in b]
    check_world(ra, 2)
    check_world(rb, 2)
    assert ra[0]["store"] != rb[0]["store"]


def _job(job_id: int, restart: int = 0, array: tuple[int, int] | None = None) -> dict[str, str]:
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_RESTART_COUNT": str(restart)}
    if array is not None:
        env.update(SLURM_ARRAY_JOB_ID=str(array[0]), SLURM_ARRAY_TASK_ID=str(array[1]))
    return env


def test_requeued_job_with_same_run_id_starts_fresh_not_closed(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    first = _spawn(nodes, 2, tmp_path, "run", 2, 2, env=_job(100))
    r1 = rdzv_all(first)
    check_world(r1, 2)
    assert all(n.call("shutdown") for n in first)  # the job finished: run closed
    # A late agent of the same (finished) job is told the run is closed ...
    late = NodeProc(tmp_path, "run", 2, 2, env=_job(100))
    nodes.append(late)
    with pytest.raises(AssertionError, match="RendezvousClosedError"):
        late.call("create")
    # ... while the requeued job (SLURM_RESTART_COUNT=1) forms a new world.
    again = _spawn(nodes, 2, tmp_path, "run", 2, 2, env=_job(100, restart=1))
    r2 = rdzv_all(again)
    check_world(r2, 2)
    assert r2[0]["era"] > r1[0]["era"]


def test_stale_state_of_an_earlier_job_is_never_joined(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    old = _spawn(nodes, 2, tmp_path, "run", 2, 2, env=_job(200))
    check_world(rdzv_all(old), 2)
    for n in old:
        n.kill()  # died without closing: its members are still in the state
    (new,) = _spawn(nodes, 1, tmp_path, "run", 1, 2, env=_job(201))
    result = new.call("rdzv", timeout=20)
    # Joining the stale state would have put it on the wait list behind two dead nodes.
    check_world([result], 1)
    assert result["round"] == 0


def test_requeued_array_task_rejoins_the_running_array(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    t0 = _spawn(nodes, 1, tmp_path, "run", 1, 2, env=_job(301, array=(300, 0)))[0]
    t1 = _spawn(nodes, 1, tmp_path, "run", 1, 2, env=_job(302, array=(300, 1)))[0]
    r1 = rdzv_all([t0, t1])
    check_world(r1, 2)
    t1.kill()
    t0.call("wait_change", 15)
    t0.send("rdzv")
    requeued = _spawn(nodes, 1, tmp_path, "run", 1, 2, env=_job(302, restart=1, array=(300, 1)))
    # t0 may complete a world of one before the requeued task arrives; then the
    # newcomer waits and t0 sees it.
    r0 = t0.result()
    requeued[0].send("rdzv")
    if r0["world"] == 1:
        t0.call("wait_change", 15)
        r0 = t0.call("rdzv")
    r2 = [r0, requeued[0].result()]
    check_world(r2, 2)
    assert {r["era"] for r in r2} == {r1[0]["era"]}, "the running run must not be reset"


def test_members_are_seated_before_newcomers_that_fill_max_nodes(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    # Members' addresses sort after the newcomers' (all loopback): a merge of join
    # intents takes nodes in name order, so with torch's exit-then-join the newcomers
    # would take every seat while the members (whose workers still train) wait.
    members = _spawn(nodes, 2, tmp_path, "run", 1, 4, local_addr="127.0.0.9")
    check_world(rdzv_all(members), 2)
    newcomers = _spawn(nodes, 4, tmp_path, "run", 1, 4)
    # in place: the members' workers still train
    _newcomers_arrive_members_rejoin(members, newcomers, "rdzv_seated")
    everyone = members + newcomers
    wait_for(lambda: sum(n.ready() for n in everyone) >= 4, 30, "a world of 4")
    assert all(m.ready() for m in members), "a member was left out by the newcomers"
    spares = [n for n in newcomers if not n.ready()]
    results = [n.result() for n in everyone if n not in spares]
    check_world(results, 4)
    assert len(spares) == 2 and all(s.proc.is_alive() for s in spares)
    # the newcomers left over wait as spares: the members see no one waiting (no churn)
    wait_for(lambda: all(m.call("waiting") == 0 for m in members), 10, "spares, not waiters")


def test_a_restarting_member_keeps_the_seat_another_member_kept_for_it(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    # Two members; one re-joins in place (keeping seats), the other restarts its
    # workers (exit-then-join). When the first reopens the round with both seated before
    # the second exits, the second must take that seat, not leave the new round: leaving
    # a completed round left its members waiting 120 s for its rank in the round's store
    # (seen in CI: two agents failed with DistStoreError).
    m1, m2 = _spawn(nodes, 2, tmp_path, "run", 1, 4)
    first = rdzv_all([m1, m2])
    check_world(first, 2)
    m1.send("rdzv_seated")
    reseated = (first[0]["round"] + 1, True, 2)
    wait_for(lambda: m2.call("state") == reseated, 20, "m1 to reopen the round with m2 seated")
    m2.send("rdzv")
    results = [m1.result(), m2.result()]
    check_world(results, 2)
    assert results[0]["round"] == first[0]["round"] + 1, results


def test_a_waiter_of_a_complete_full_round_is_not_a_membership_change(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    # A newcomer left on the wait list of a round that completed full moves itself to
    # the spares (redundancy list) on its next poll. Until then the members must not
    # count it as waiting: no seat is free for it, and restarting for it made every
    # newcomer of a full round restart its workers right after starting them (CI).
    # The waiter is planted by one compare-and-set (a test seam: a real one moves to
    # the spares within milliseconds); a long heartbeat window keeps it from eviction.
    conf = {"heartbeat_miss_limit": "200"}
    members = _spawn(nodes, 2, tmp_path, "run", 1, 2, conf=conf)
    check_world(rdzv_all(members), 2)
    members[0].call("plant_waiter", "10.9.9.9")
    assert [m.call("waiting") for m in members] == [0, 0]
    # with a free seat the same waiter is a membership change, as in torch
    small = _spawn(nodes, 1, tmp_path, "run2", 1, 2, conf=conf)
    check_world(rdzv_all(small), 1)
    small[0].call("plant_waiter", "10.9.9.9")
    assert small[0].call("waiting") == 1
