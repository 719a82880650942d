"""Counter heartbeats: pure logic with an injected clock and counter reader."""

from __future__ import annotations

from pathlib import Path

from slurm_elastic.rendezvous.heartbeat import HeartbeatMonitor


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


def _monitor(me: str, clock: FakeClock, counters: Counters, **kw: object) -> HeartbeatMonitor:
    return HeartbeatMonitor(
        Path("/nonexistent"),
        me,
        interval_s=1.0,
        miss_limit=3,
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
