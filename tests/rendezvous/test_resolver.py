"""The reverse-DNS start-up check (slurm_elastic/rendezvous/resolver.py).

The resolver is faked at one seam, the lookup function: a DNS server that is slow or
drops queries on demand cannot be run here. The address mapping uses the real resolver.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest

from slurm_elastic.rendezvous import resolver
from tests.helpers import wait_for


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolver, "_checked", False)


def test_ipv4_addresses_are_looked_up_in_their_v4_mapped_form() -> None:
    assert resolver.mapped_address("127.0.0.1") == "::ffff:127.0.0.1"
    assert resolver.mapped_address("10.213.0.11") == "::ffff:10.213.0.11"
    assert resolver.mapped_address("::1") == "::1"
    assert resolver.mapped_address("localhost") in {"::ffff:127.0.0.1", "::1"}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == resolver.__name__]


def test_a_slow_lookup_is_reported_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[Any, ...]] = []

    def slow(addr: tuple[Any, ...], flags: int) -> tuple[str, str]:
        seen.append(addr)
        time.sleep(resolver.SLOW_LOOKUP_S + 0.1)
        return addr[0], "0"

    caplog.set_level(logging.WARNING, logger=resolver.__name__)
    t0 = time.monotonic()
    assert resolver.check_reverse_lookup_once("127.0.0.1", lookup=slow)
    assert time.monotonic() - t0 < resolver.SLOW_LOOKUP_S  # start-up does not wait
    (msg,) = wait_for(lambda: _warnings(caplog), 10, "the warning")
    assert seen == [("::ffff:127.0.0.1", 0, 0, 0)]
    assert "::ffff:127.0.0.1" in msg and "/etc/hosts" in msg and "RES_OPTIONS" in msg


def test_an_unanswered_lookup_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    def unanswered(addr: tuple[Any, ...], flags: int) -> tuple[str, str]:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    caplog.set_level(logging.WARNING, logger=resolver.__name__)
    resolver.check_reverse_lookup_once("10.213.0.11", lookup=unanswered)
    (msg,) = wait_for(lambda: _warnings(caplog), 10, "the warning")
    assert "EAI_AGAIN" in msg and "::ffff:10.213.0.11" in msg


def test_a_fast_lookup_or_a_missing_name_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    done: list[str] = []

    def no_name(addr: tuple[Any, ...], flags: int) -> tuple[str, str]:
        done.append(addr[0])
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    caplog.set_level(logging.WARNING, logger=resolver.__name__)
    resolver.check_reverse_lookup_once("127.0.0.1", lookup=no_name)
    for thread in threading.enumerate():
        if thread.name == "slurm-elastic-dns-check":
            thread.join(10)
    assert done == ["::ffff:127.0.0.1"]
    assert _warnings(caplog) == []


def test_the_check_runs_once_per_process() -> None:
    calls: list[int] = []

    def count(addr: tuple[Any, ...], flags: int) -> tuple[str, str]:
        calls.append(1)
        return addr[0], "0"

    assert resolver.check_reverse_lookup_once("127.0.0.1", lookup=count)
    assert not resolver.check_reverse_lookup_once("127.0.0.1", lookup=count)
    wait_for(lambda: calls, 10, "the lookup")
    assert calls == [1]
