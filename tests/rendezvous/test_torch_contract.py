"""What the rendezvous takes from torch: public names only, pinned here (issue #18).

The handler implements torch's public ``RendezvousHandler`` ABC and the backend its
public ``RendezvousBackend``; the state and the rules are ours. These tests fail when a
private torch name (or pickle) comes back into ``slurm_elastic/rendezvous/``, when torch
changes the public interface we implement, and check the tested version range (an
older torch is refused, a newer minor warned about).
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import api
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from slurm_elastic.rendezvous import torch_compat as tc
from slurm_elastic.rendezvous.backend import FileRendezvousBackend
from slurm_elastic.rendezvous.handler import SlurmRendezvousHandler

_RDZV = Path(__file__).resolve().parents[2] / "slurm_elastic" / "rendezvous"


def _imports(path: Path) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names]
    return found


def test_no_private_torch_name_and_no_pickle_in_the_rendezvous() -> None:
    offenders = []
    for path in sorted(_RDZV.glob("*.py")):
        for module, name in _imports(path):
            private = name.startswith("_") or any(p.startswith("_") for p in module.split("."))
            if module.startswith("torch") and private:
                offenders.append(f"{path.name}: {module}.{name}")
            if module.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle"):
                offenders.append(f"{path.name}: imports {module}")
        text = path.read_text()
        for attr in ("_state_holder", "_RendezvousState", "_NodeDesc", "_settings."):
            if attr in text:
                offenders.append(f"{path.name}: mentions {attr}")
    assert not offenders, offenders


def test_the_handler_implements_torchs_public_abc_and_nothing_else_of_torch() -> None:
    abstract = set(api.RendezvousHandler.__abstractmethods__)
    assert abstract == {
        "get_backend", "next_rendezvous", "is_closed", "set_closed",
        "num_nodes_waiting", "get_run_id", "shutdown",
    }  # fmt: skip
    assert SlurmRendezvousHandler.__mro__[1] is api.RendezvousHandler
    assert not SlurmRendezvousHandler.__abstractmethods__
    for name in abstract:  # same parameters as torch's (none besides self)
        ours = inspect.signature(getattr(SlurmRendezvousHandler, name))
        theirs = inspect.signature(getattr(api.RendezvousHandler, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    assert isinstance(api.RendezvousHandler.__dict__["use_agent_store"], property)


def test_the_backend_implements_torchs_public_backend() -> None:
    assert (
        "RendezvousBackend"
        in __import__(
            "torch.distributed.elastic.rendezvous.dynamic_rendezvous", fromlist=["__all__"]
        ).__all__
    )
    assert set(RendezvousBackend.__abstractmethods__) == {"name", "get_state", "set_state"}
    assert issubclass(FileRendezvousBackend, RendezvousBackend)
    assert list(inspect.signature(RendezvousBackend.set_state).parameters) == [
        "self", "state", "token"
    ]  # fmt: skip


def test_the_public_types_we_build() -> None:
    params = list(inspect.signature(api.RendezvousInfo).parameters)
    assert params == ["store", "rank", "world_size", "bootstrap_store_info"]
    info = api.RendezvousStoreInfo("10.0.0.1", 29400)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29400)
    for error in ("RendezvousClosedError", "RendezvousTimeoutError", "RendezvousStateError",
                  "RendezvousConnectionError", "RendezvousGracefulExitError"):  # fmt: skip
        assert issubclass(getattr(api, error), api.RendezvousError), error
    params = list(inspect.signature(api.RendezvousParameters).parameters)
    assert params[:6] == ["backend", "endpoint", "run_id", "min_nodes", "max_nodes",
                          "local_addr"]  # fmt: skip


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
def test_supported_versions_pass_silently(version: str, minor: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tc.check_torch_version(version) == (2, minor)


@pytest.mark.parametrize("version", ["2.12.1", "1.13.0", "garbage"])
def test_older_versions_fail_naming_version_and_fix(version: str) -> None:
    with pytest.raises(tc.UnsupportedTorchError, match=r"Install a supported torch") as info:
        tc.check_torch_version(version)
    assert "torch 2.13 to 2.14" in str(info.value) and version in str(info.value)
    assert "pip install 'torch>=2.13,<2.15'" in str(info.value)
    with pytest.raises(ImportError):  # an import-time failure, as users will see it
        tc.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.15.0", "2.16.1+cu131", "3.0.0"])
def test_a_newer_untested_minor_is_a_warning_not_a_refusal(version: str) -> None:
    with pytest.warns(
        tc.UntestedTorchWarning, match=rf"torch {re.escape(version)} is newer.*2\.13 to 2\.14"
    ):
        found = tc.check_torch_version(version)
    assert found >= (2, 15)
