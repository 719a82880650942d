"""The agent's stop signals: a stop whose exception the interrupted code swallowed.

The handler raises ``SignalException`` in whatever the main thread was running; code
that catches ``Exception`` there swallows it. The logging module's handlers do
(``StreamHandler.emit``), and the agent then trained on, requeueing nothing (a CI run:
the restart-path USR2 case waited 120 s for a requeue). These tests deliver a real
signal to this process while a real ``StreamHandler`` writes a record, and run the real
agent's monitor tick afterwards.
"""

from __future__ import annotations

import io
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException

from slurm_elastic.agent.elastic_agent import SlurmElasticAgent
from slurm_elastic.agent.stop import Stop, install_stop_handlers
from slurm_elastic.agent.watchdog import ProgressWatch
from slurm_elastic.channel import NodeChannel
from tests.agent.idle_handler import IdleHandler

HANDLED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture
def stop(tmp_path: Path) -> Iterator[Stop]:
    """The agent's real stop handlers in this process (pytest's own restored after)."""
    before = {sig: signal.getsignal(sig) for sig in HANDLED}
    try:
        installed, early = install_stop_handlers(signal.SIGUSR2, NodeChannel(tmp_path))
        assert early == []
        yield installed
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class _SignallingStream(io.StringIO):
    """A log stream that delivers ``sig`` to this process while a record is written."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__()
        self.sig: signal.Signals | None = sig

    def write(self, text: str) -> int:
        sig, self.sig = self.sig, None
        if sig is not None:
            signal.raise_signal(sig)  # the handler runs here, inside StreamHandler.emit
        return super().write(text)


def _log_while_signalled(sig: signal.Signals) -> None:
    logger = logging.getLogger("tests.agent.test_stop.swallowing")
    logger.propagate = False
    handler = logging.StreamHandler(_SignallingStream(sig))
    logger.addHandler(handler)
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        logger.warning("a record the signal interrupts")  # returns: emit swallowed it
    finally:
        logging.raiseExceptions = raise_exceptions
        logger.removeHandler(handler)


def _agent(stop: Stop, channel: NodeChannel) -> SlurmElasticAgent:
    spec = WorkerSpec(
        role="trainer", local_world_size=1, rdzv_handler=IdleHandler(), entrypoint="true"
    )
    return SlurmElasticAgent(
        spec=spec,
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
        membership_grace_s=1.0,
        progress=ProgressWatch(channel.progress),
        hang_timeout_s=None,
        before_round=lambda group: None,
        channel=channel,
        notice_signal=stop.notice_signal,
        leave=lambda: None,
        leave_timeout_s=1.0,
        stop_check=stop.raise_if_lost,
    )


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_a_stop_swallowed_by_logging_is_raised_at_the_agents_next_monitor_tick(
    stop: Stop, tmp_path: Path, sig: signal.Signals
) -> None:
    agent = _agent(stop, stop.channel)
    group = WorkerGroup(agent._worker_group.spec)
    stop.raise_if_lost()  # nothing asked to stop yet: a no-op

    _log_while_signalled(sig)

    # the handler ran (the notice is up for the workers) but its exception was lost
    assert stop.signals == [sig.name] and stop.stopping
    assert stop.channel.notice.exists()
    with pytest.raises(SignalException) as raised:
        agent._monitor_workers(group)  # the tick: before looking at any worker
    assert raised.value.sigval == signal.SIGUSR2  # the workers get the notice to save


def test_the_handler_still_raises_where_nothing_catches_it(stop: Stop) -> None:
    with pytest.raises(SignalException):
        signal.raise_signal(signal.SIGUSR2)
    assert stop.noticed and stop.stopping
