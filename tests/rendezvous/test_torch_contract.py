"""Contract tests for every private torch hook the rendezvous relies on (issue #8.5).

``slurm_elastic/rendezvous/torch_compat.py`` is the only module that imports torch's
private rendezvous names; each test here pins one hook (its name, signature, or the
behaviour we build on) so that a torch release that changes it fails here, loudly, and
not in a running job.
"""

from __future__ import annotations

import ast
import inspect
import io
import pickle
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch.distributed as dist

from slurm_elastic.rendezvous import torch_compat as tc

_PACKAGE = Path(__file__).resolve().parents[2] / "slurm_elastic"


def _params(obj: object) -> list[str]:
    return list(inspect.signature(obj).parameters)  # type: ignore[arg-type]


def _settings(min_nodes: int = 1, max_nodes: int = 3) -> tc.RendezvousSettings:
    timeout = tc.RendezvousTimeout(
        join=timedelta(seconds=60),
        last_call=timedelta(seconds=5),
        close=timedelta(seconds=5),
        heartbeat=timedelta(seconds=5),
    )
    return tc.RendezvousSettings("run", min_nodes, max_nodes, timeout, timedelta(days=1), 3)


def test_only_the_compat_module_imports_private_rendezvous_names() -> None:
    offenders = []
    for path in _PACKAGE.rglob("*.py"):
        if path.name == "torch_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                private = [a.name for a in node.names if a.name.startswith("_")]
                if node.module.endswith("dynamic_rendezvous") or (
                    node.module.startswith("torch.distributed.elastic") and private
                ):
                    offenders.append(f"{path.relative_to(_PACKAGE)}: {node.module}")
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("version", "minor"),
    [
        ("2.13.0", 13),
        ("2.13.0+cpu", 13),
        ("2.13.1a0+git", 13),
        ("2.14.1+cu130", 14),
        ("2.14.0", 14),
    ],
)
def test_supported_versions_pass(version: str, minor: int) -> None:
    assert tc.check_torch_version(version) == (2, minor)


@pytest.mark.parametrize("version", ["2.12.1", "2.15.0", "3.0.0", "garbage"])
def test_unsupported_versions_fail_naming_version_and_fix(version: str) -> None:
    with pytest.raises(tc.UnsupportedTorchError, match=r"Install a supported torch") as info:
        tc.check_torch_version(version)
    assert "torch 2.13 or 2.14" in str(info.value) and version in str(info.value)
    with pytest.raises(ImportError):  # an import-time failure, as users will see it
        tc.check_torch_version(version)


def test_state_fields_and_pickle_globals() -> None:
    s = tc._RendezvousState()
    assert vars(s).keys() == {
        "round", "complete", "deadline", "closed", "participants", "wait_list",
        "redundancy_list", "last_heartbeats",
    }  # fmt: skip
    node = tc._NodeDesc("host", 12, 0)
    s.participants[node] = 0
    s.wait_list.add(tc._NodeDesc("b", 1, 0))
    s.redundancy_list.add(tc._NodeDesc("c", 1, 0))
    s.last_heartbeats[node] = datetime.now(timezone.utc)
    s.deadline = datetime.now(timezone.utc) + timedelta(seconds=3)
    used: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            used.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(pickle.dumps(s))).load()
    assert used
    assert used <= tc.STATE_PICKLE_GLOBALS, used - tc.STATE_PICKLE_GLOBALS


def test_node_desc_and_its_generator() -> None:
    assert [f for f in tc._NodeDesc.__dataclass_fields__] == ["addr", "pid", "local_id"]
    node = tc.DynamicRendezvousHandler._node_desc_generator.generate("10.0.0.1")
    assert isinstance(node, tc._NodeDesc) and node.addr == "10.0.0.1"
    assert tc._NodeDesc("a", 2, 0) < tc._NodeDesc("b", 1, 0)  # ranks follow this order
    assert repr(node).startswith("10.0.0.1_")


def test_actions_we_dispatch_exist() -> None:
    names = {a.name for a in tc._Action}
    assert names >= {
        "KEEP_ALIVE", "ADD_TO_PARTICIPANTS", "ADD_TO_WAIT_LIST", "ADD_TO_REDUNDANCY_LIST",
        "REMOVE_FROM_PARTICIPANTS", "REMOVE_FROM_WAIT_LIST", "REMOVE_FROM_REDUNDANCY_LIST",
        "MARK_RENDEZVOUS_COMPLETE", "MARK_RENDEZVOUS_CLOSED", "SYNC", "ERROR_CLOSED",
        "ERROR_TIMEOUT", "FINISH",
    }  # fmt: skip


class _MemoryBackend(tc.RendezvousBackend):
    def __init__(self) -> None:
        self.value: tuple[bytes, int] | None = None

    @property
    def name(self) -> str:
        return "memory"

    def get_state(self):  # type: ignore[no-untyped-def]
        return self.value

    def set_state(self, state, token=None):  # type: ignore[no-untyped-def]
        current = None if self.value is None else self.value[1]
        if token == current:
            self.value = (state, (token or 0) + 1)
            return state, self.value[1], True
        return self.value[0], self.value[1], False  # type: ignore[index]


def test_state_holder_hooks() -> None:
    assert _params(tc._BackendRendezvousStateHolder.__init__) == [
        "self", "backend", "settings", "cache_duration",
    ]  # fmt: skip
    holder = tc._BackendRendezvousStateHolder(_MemoryBackend(), _settings(), 0)
    # CounterStateHolder.sync replaces torch's and uses these attributes too.
    for attr in (
        "_token", "_last_sync_time", "_state", "_dirty", "_dead_nodes", "_backend",
        "_cache_duration",
    ):  # fmt: skip
        assert hasattr(holder, attr), attr
    for method in ("sync", "mark_dirty", "_sanitize"):
        assert callable(getattr(holder, method)), method
    holder.state.round = 4
    holder.mark_dirty()
    assert holder.sync() is True and holder._token == 1  # our token property reads it
    holder._last_sync_time = -1  # our invalidate() writes it
    assert holder.sync() is None and holder.state.round == 4


def test_our_state_holder_syncs_like_torchs() -> None:
    """CounterStateHolder.sync (decoding through our cache) keeps torch's contract."""
    from slurm_elastic.rendezvous.executor import CounterStateHolder

    outcomes = []
    for cls in (tc._BackendRendezvousStateHolder, CounterStateHolder):
        backend = _MemoryBackend()
        a, b = cls(backend, _settings(), 0), cls(backend, _settings(), 0)
        trace: list[object] = [a.sync(), a._token, a.state.round]  # no state yet
        a.state.round = 4
        a.mark_dirty()
        trace += [a.sync(), a._token, a.state.round]  # a write wins
        b.state.round = 9
        b.mark_dirty()
        trace += [b.sync(), b._token, b.state.round]  # a stale write loses, gets a's
        b.state.round = 5
        b.mark_dirty()
        trace += [b.sync(), a.sync(), a._token, a.state.round]  # then wins; a reads it
        a.state.round = 99  # a local mutation not written: the next read replaces it
        trace += [a.sync(), a.state.round]
        outcomes.append(trace)
    assert outcomes[0] == outcomes[1]
    assert outcomes[1] == [None, None, 0, True, 1, 4, False, 1, 4, True, None, 2, 5, None, 5]


def test_op_executor_hooks() -> None:
    assert _params(tc._DistributedRendezvousOpExecutor.__init__) == [
        "self", "node", "state_holder", "settings",
    ]  # fmt: skip
    assert _params(tc._DistributedRendezvousOpExecutor.run) == [
        "self", "state_handler", "deadline", "update_deadline",
    ]  # fmt: skip
    for method in (
        "_keep_alive", "_add_to_participants", "_add_to_wait_list", "_add_to_redundancy_list",
        "_remove_from_participants", "_remove_from_wait_list", "_remove_from_redundancy_list",
        "_mark_rendezvous_complete", "_mark_rendezvous_closed", "_record",
    ):  # fmt: skip
        assert callable(getattr(tc._DistributedRendezvousOpExecutor, method)), method
    node = tc._NodeDesc("a", 1, 0)
    holder = tc._BackendRendezvousStateHolder(_MemoryBackend(), _settings(2, 3), 0)
    ex = tc._DistributedRendezvousOpExecutor(node, holder, _settings(2, 3))
    assert ex._node is node and ex._settings.min_nodes == 2
    ex._state = holder.state
    ex._add_to_participants()
    # The last call starts when participants reach min_nodes: torch sets a deadline,
    # whose *value* we only use to identify the last call (timed on our own clock).
    assert ex._state.participants == {node: 0} and ex._state.deadline is None
    ex2 = tc._DistributedRendezvousOpExecutor(tc._NodeDesc("b", 1, 0), holder, _settings(2, 3))
    ex2._state = ex._state
    ex2._add_to_participants()
    assert isinstance(ex._state.deadline, datetime)


def test_join_op_compares_the_deadline_we_substitute() -> None:
    node = tc._NodeDesc("a", 1, 0)
    state = tc._RendezvousState()
    state.participants = {node: 0, tc._NodeDesc("b", 1, 0): 0}
    settings = _settings(min_nodes=2, max_nodes=3)
    far = 10**9  # monotonic operation deadline far away
    state.deadline = datetime.min.replace(tzinfo=timezone.utc)
    ctx = tc._RendezvousContext(node, state, settings)
    assert tc._RendezvousJoinOp()(ctx, far) == tc._Action.MARK_RENDEZVOUS_COMPLETE
    state.deadline = datetime.max.replace(tzinfo=timezone.utc)
    assert tc._RendezvousJoinOp()(ctx, far) == tc._Action.SYNC
    assert tc._RendezvousExitOp()(ctx, far) == tc._Action.REMOVE_FROM_PARTICIPANTS


def test_remove_participant_epilogue_moves_to_the_next_round() -> None:
    assert _params(tc._remove_participant_epilogue) == ["state", "settings"]
    state = tc._RendezvousState()
    state.complete = True
    tc._remove_participant_epilogue(state, _settings())
    assert state.round == 1 and state.complete is False


def test_handler_hooks() -> None:
    assert _params(tc.DynamicRendezvousHandler.__init__) == [
        "self", "node", "settings", "backend_name", "store", "state_holder",
    ]  # fmt: skip
    for method in ("_close", "_get_deadline", "_start_heartbeats", "_stop_heartbeats",
                   "_record", "next_rendezvous", "num_nodes_waiting", "shutdown"):  # fmt: skip
        assert callable(getattr(tc.DynamicRendezvousHandler, method)), method
    node = tc._NodeDesc("a", 1, 0)
    settings = _settings()
    holder = tc._BackendRendezvousStateHolder(_MemoryBackend(), settings, 0)
    h = tc.DynamicRendezvousHandler(node, settings, "memory", dist.HashStore(), holder)
    for attr in ("_heartbeat_lock", "_this_node", "_op_executor", "_settings"):
        assert hasattr(h, attr), attr
    assert h._this_node is node and h.get_backend() == "memory"
    assert _params(tc.RendezvousSettings) == [
        "run_id", "min_nodes", "max_nodes", "timeout", "keep_alive_interval",
        "keep_alive_max_attempt",
    ]  # fmt: skip
