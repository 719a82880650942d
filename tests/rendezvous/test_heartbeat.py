"""Counter heartbeats: pure logic with an injected clock and counter reader."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from slurm_elastic.rendezvous.heartbeat import HeartbeatMonitor, Tick, WatchSchedule


class FakeClock:
    def __init__(self, start: float = 0.0, rate: float = 1.0) -> None:
        self.t = start
        self.rate = rate

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt * self.rate


class Counters:
    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.reads: list[str] = []

    def __call__(self, node: str) -> int | None:
        self.reads.append(node)
        return self.values.get(node)

    def bump(self, *nodes: str) -> None:
        for n in nodes:
            self.values[n] = self.values.get(n, 0) + 1


def _monitor(
    me: str, clock: FakeClock, counters: Counters, miss_limit: int = 3, **kw: object
) -> HeartbeatMonitor:
    return HeartbeatMonitor(
        Path("/nonexistent"),
        me,
        interval_s=1.0,
        miss_limit=miss_limit,
        clock=clock,
        reader=counters,
        **kw,  # type: ignore[arg-type]
    )


def test_a_stalled_successor_is_dead_after_the_window_not_before() -> None:
    clock, counters = FakeClock(), Counters()
    m = _monitor("a", clock, counters)
    members = ["a", "b", "c", "d"]
    counters.bump("b", "c", "d")
    assert m.observe(members) == []
    for _ in range(2):  # b stalls, c and d keep beating
        clock.advance(1.0)
        counters.bump("c", "d")
        assert m.observe(members) == []
    clock.advance(1.0)
    counters.bump("c", "d")
    assert m.observe(members) == ["b"]


def test_verdicts_do_not_depend_on_the_watchers_clock_offset_or_rate() -> None:
    # Two watchers with wildly different clocks (offset 1e6 s, one running 1.05x fast)
    # judge the same counters the same way: only observed changes count.
    verdicts = []
    for clock in (FakeClock(0.0), FakeClock(1e6, rate=1.05)):
        counters = Counters()
        m = _monitor("a", clock, counters)
        history = []
        for step in range(6):
            counters.bump("c")
            if step < 2:
                counters.bump("b")
            history.append(m.observe(["a", "b", "c"]))
            clock.advance(1.0)
        verdicts.append(history)
    assert verdicts[0] == verdicts[1]
    assert verdicts[0][-1] == ["b"]


def test_steady_state_reads_are_independent_of_the_number_of_nodes() -> None:
    reads = {}
    for n in (8, 32):
        clock, counters = FakeClock(), Counters()
        members = [f"n{i:02d}" for i in range(n)]
        m = _monitor("n00", clock, counters, successors=2)
        for _ in range(5):
            counters.bump(*members)
            m.observe(members)
            clock.advance(1.0)
        counters.reads.clear()
        counters.bump(*members)
        m.observe(members)
        reads[n] = len(counters.reads)
    assert reads == {8: 2, 32: 2}


def test_the_walk_extends_past_stalled_nodes_so_a_dead_block_is_evicted() -> None:
    clock, counters = FakeClock(), Counters()
    members = [f"n{i}" for i in range(6)]
    m = _monitor("n0", clock, counters, successors=1)
    counters.bump(*members)
    dead: set[str] = set()
    for _ in range(12):
        counters.bump("n0", "n4", "n5")  # n1..n3 died together
        dead |= set(m.observe([x for x in members if x not in dead]))
        clock.advance(1.0)
    assert dead == {"n1", "n2", "n3"}


def test_a_node_back_in_view_gets_a_fresh_baseline() -> None:
    clock, counters = FakeClock(), Counters()
    m = _monitor("a", clock, counters, successors=1)
    counters.bump("b", "c")
    m.observe(["a", "b", "c"])  # watches b only
    clock.advance(10.0)  # c not watched meanwhile; its counter also stood still
    counters.bump("b")
    assert m.observe(["a", "c"]) == []  # b left; c is new in view, not "stale for 10 s"


def test_beat_writes_a_counter_file_read_by_another_monitor(tmp_path: Path) -> None:
    writer = HeartbeatMonitor(tmp_path, "10.0.0.1_12_0", interval_s=1.0, miss_limit=3)
    clock = FakeClock()
    reader = HeartbeatMonitor(tmp_path, "10.0.0.2_13_0", interval_s=1.0, miss_limit=3, clock=clock)
    members = [writer.node, reader.node]
    for _ in range(5):
        writer.beat()
        assert reader.observe(members) == []
        clock.advance(1.0)
    verdicts = []
    for _ in range(4):  # the writer stopped: dead once its counter stood still for 3 s
        verdicts.append(reader.observe(members))
        clock.advance(1.0)
    assert verdicts == [[], [], [writer.node], [writer.node]]
    assert (tmp_path / "10.0.0.1_12_0").stat().st_mode & 0o777 == 0o600


def test_a_paused_watcher_does_not_judge_across_its_pause() -> None:
    clock, counters = FakeClock(), Counters()
    m = _monitor("a", clock, counters)
    counters.bump("b")
    m.observe(["a", "b"])
    clock.advance(30.0)  # the watcher was stalled (or out of the ring) for 30 s
    assert m.observe(["a", "b"]) == []  # b's counter did not move, but we did not watch
    clock.advance(1.0)
    counters.bump("b")
    assert m.observe(["a", "b"]) == []


def _drive(
    monitor: HeartbeatMonitor,
    clock: FakeClock,
    counters: Counters,
    beats: dict[str, list[float]],
    until: float,
) -> list[tuple[float, list[str]]]:
    """Run the watcher's real schedule on the fake clock for ``until`` seconds: the nodes
    beat at the given times; return (time, verdict) for every observation."""
    members = [monitor.node, *beats]
    schedule = WatchSchedule(1.0, clock=clock)
    pending = {node: sorted(times) for node, times in beats.items()}
    observations = []
    while clock.t < until:
        clock.advance(0.01)
        for node, times in pending.items():
            while times and times[0] <= clock.t:
                times.pop(0)
                counters.bump(node)
        if schedule.tick() is not None:
            observations.append((clock.t, monitor.observe(members)))
            schedule.observed(monitor.calm)
    return observations


def test_a_calm_watcher_observes_once_per_interval_and_reads_half_as_often() -> None:
    clock, counters = FakeClock(), Counters()
    m = _monitor("a", clock, counters, miss_limit=5, successors=2)
    beats = {"b": [0.3 + k for k in range(60)], "c": [0.7 + k for k in range(60)]}
    observations = _drive(m, clock, counters, beats, until=30.0)
    assert all(verdict == [] for _, verdict in observations)
    late = [t for t, _ in observations if t >= 10.0]
    assert 19 <= len(late) <= 21  # once per interval, not twice
    assert m.calm
    # Two heartbeat files per observation: about 2 reads per interval over the 30 s
    # (4 when every half interval observed).
    assert len(counters.reads) == 2 * len(observations)
    assert len(counters.reads) <= 2 * 31


def test_a_stopped_node_is_judged_within_half_an_interval_of_the_window_while_calm() -> None:
    # The verdict's lag is what it was with an observation every half interval: a
    # stalled counter makes the watcher observe twice per interval again.
    for phase in (0.05, 0.3, 0.55, 0.8):
        clock, counters = FakeClock(), Counters()
        m = _monitor("a", clock, counters, miss_limit=5, successors=1)
        last = 10 + phase
        beats = {"b": [phase + k for k in range(11)]}  # b's last beat: at ``last``
        observations = _drive(m, clock, counters, beats, until=25.0)
        first_dead = next(t for t, verdict in observations if verdict == ["b"])
        assert last + 5.0 - 0.5 <= first_dead <= last + 5.0 + 1.0, (phase, first_dead)
        stalled = [t for t, _ in observations if last + 3.0 <= t <= first_dead]
        gaps = [b - a for a, b in itertools.pairwise(stalled)]
        assert gaps and max(gaps) <= 0.5 + 0.02, (phase, gaps)


def test_jittery_beats_are_never_judged_dead_by_a_calm_watcher() -> None:
    import random

    rng = random.Random(7)
    clock, counters = FakeClock(), Counters()
    m = _monitor("a", clock, counters, miss_limit=4, successors=1)
    times, t = [], 0.0
    while t < 120:
        t += rng.uniform(0.6, 1.4)  # beats held up by a loaded node
        times.append(t)
    observations = _drive(m, clock, counters, {"b": times}, until=120.0)
    assert all(verdict == [] for _, verdict in observations)


def test_a_short_window_keeps_two_observations_per_interval() -> None:
    clock, counters = FakeClock(), Counters()
    m = _monitor("a", clock, counters, miss_limit=3, successors=1)
    observations = _drive(m, clock, counters, {"b": [0.5 + k for k in range(30)]}, until=20.0)
    assert not m.calm
    assert len([t for t, _ in observations if t >= 10.0]) >= 19  # every half interval


def test_a_calm_watcher_allows_its_own_longer_gap_before_calling_it_a_pause() -> None:
    clock, counters = FakeClock(), Counters()
    m = _monitor("a", clock, counters, miss_limit=5, successors=1)
    counters.bump("b")
    m.observe(["a", "b"])  # b's baseline at t=0; b beats no more
    assert m.calm
    clock.advance(1.8)  # a whole interval, held up by 0.8 s: not a pause of the watcher
    assert m.observe(["a", "b"]) == []
    assert not m.calm  # b is suspect (a re-baseline would have called it fresh)
    verdicts = []
    while clock.t < 8.0:
        clock.advance(0.5)
        verdicts.append((clock.t, m.observe(["a", "b"])))
    first_dead = next(t for t, verdict in verdicts if verdict == ["b"])
    assert first_dead == pytest.approx(5.3)  # judged from t=0, not from t=1.8


def test_the_first_tick_is_the_first_beat_one_interval_after_the_start() -> None:
    # Nothing is suspect before the first observation: the watcher starts as a calm one
    # goes on (it observed half an interval after the start before).
    clock = FakeClock()
    schedule = WatchSchedule(1.0, clock=clock)
    assert schedule.wait_s() == 1.0
    clock.advance(0.99)
    assert schedule.tick() is None
    clock.advance(0.01)
    assert schedule.tick() == Tick(beat=True, probe=False)
    schedule.observed(calm=False)  # something looks stalled: observe every half interval
    assert schedule.wait_s() == 0.5
    clock.advance(0.5)
    assert schedule.tick() == Tick(beat=False, probe=False)
    clock.advance(0.5)
    assert schedule.tick() == Tick(beat=True, probe=True)


def test_hurry_takes_back_the_skipped_tick() -> None:
    clock = FakeClock()
    schedule = WatchSchedule(1.0, clock=clock)
    clock.advance(1.0)
    assert schedule.tick() == Tick(beat=True, probe=False)
    schedule.observed(calm=False)
    clock.advance(0.5)
    assert schedule.tick() == Tick(beat=False, probe=False)
    schedule.observed(calm=True)  # an odd tick: the next (a beat) is not skipped
    assert schedule.wait_s() == 0.5
    clock.advance(0.5)
    assert schedule.tick() == Tick(beat=True, probe=True)
    schedule.observed(calm=True)
    assert schedule.wait_s() == 1.0  # the beatless tick is skipped
    schedule.hurry()
    assert schedule.wait_s() == 0.5
    clock.advance(0.5)
    assert schedule.tick() == Tick(beat=False, probe=False)
    clock.advance(0.5)
    assert schedule.tick() == Tick(beat=True, probe=False)
