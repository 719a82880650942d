"""The error tree: every exception class of the package in it, and its drawing true.

``slurm_elastic/errors.py`` draws the tree in its docstring (as httpx's
``_exceptions.py`` does). These tests import every module of the package, collect the
exception classes it defines, and check that each one derives from
:class:`SlurmElasticError`, is defined in ``errors.py`` (one named exception excepted,
whose other base is torch's), and sits in the drawing under the parent it really has.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import slurm_elastic
from slurm_elastic import errors
from slurm_elastic.errors import SlurmElasticError

# Defined beside torch's base class (errors.py imports no torch): the one exception.
_OUTSIDE_ERRORS_PY = {"slurm_elastic.rendezvous.state.MalformedRecordError"}
_WARNINGS = {"UntestedTorchWarning"}


def _package_exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(slurm_elastic.__path__, "slurm_elastic."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("slurm_elastic")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _drawn_tree() -> dict[str, str | None]:
    """``{name: drawn parent}`` from the docstring's drawing (its box-drawing lines)."""
    assert errors.__doc__ is not None
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in errors.__doc__.splitlines():
        if line == "    SlurmElasticError":
            depth, name = 0, "SlurmElasticError"
        else:
            match = re.match(r"^    ([│ ]*)[├└]── ([A-Za-z]+)", line)
            if match is None:
                continue  # prose, or a description continued on the next line
            depth, name = len(match.group(1)) // 4 + 1, match.group(2)
        del stack[depth:]
        parents[name] = stack[-1] if stack else None
        stack.append(name)
    return parents


CLASSES = _package_exception_classes()


def test_every_exception_class_derives_from_the_base() -> None:
    outside = sorted(
        path
        for path, cls in CLASSES.items()
        if not issubclass(cls, SlurmElasticError) and cls.__name__ not in _WARNINGS
    )
    assert outside == []


def test_every_exception_class_is_defined_in_errors_py() -> None:
    elsewhere = sorted(
        path
        for path, cls in CLASSES.items()
        if cls.__module__ != "slurm_elastic.errors" and path not in _OUTSIDE_ERRORS_PY
    )
    assert elsewhere == []


def test_the_drawing_is_complete_and_true() -> None:
    drawn = _drawn_tree()
    errors_in_package = {
        cls.__name__: cls for cls in CLASSES.values() if issubclass(cls, SlurmElasticError)
    }
    assert sorted(drawn) == sorted(errors_in_package)
    for name, parent in drawn.items():
        cls = errors_in_package[name]
        if parent is None:
            assert cls is SlurmElasticError
        else:
            # the drawn parent is the class's base in the tree (other bases are mixins)
            tree_bases = [b for b in cls.__bases__ if issubclass(b, SlurmElasticError)]
            assert [b.__name__ for b in tree_bases] == [parent], name


def test_the_old_names_still_import_from_their_old_modules() -> None:
    from slurm_elastic.agent.round_store import RoundBrokenError
    from slurm_elastic.checkpoint.container import Unsupported
    from slurm_elastic.checkpoint.saver import CheckpointFlushTimeout
    from slurm_elastic.checkpoint.staging import StagingConflict
    from slurm_elastic.checkpoint.trust import UntrustedCheckpointError
    from slurm_elastic.cli.runs import RunNotFoundError
    from slurm_elastic.cli.untrusted import UnsafeFileError
    from slurm_elastic.live import ReformTimeoutError
    from slurm_elastic.live.fsdp import ShardsLostError
    from slurm_elastic.rendezvous.filesystem import MissingDirectoryError
    from slurm_elastic.rendezvous.run_directory import RunIdInUseError
    from slurm_elastic.rendezvous.torch_compat import UnsupportedTorchError, UntestedTorchWarning
    from slurm_elastic.rendezvous.worker_store import RoundLostError
    from slurm_elastic.slurm.commands import SlurmJobNotFoundError
    from slurm_elastic.slurm.parse import SlurmParseError
    from slurm_elastic.submit.job import JobTimeoutError

    assert RoundBrokenError is RoundLostError is errors.RoundLostError
    assert Unsupported is errors.UnsupportedStateError
    for old in (
        CheckpointFlushTimeout,
        StagingConflict,
        UntrustedCheckpointError,
        RunNotFoundError,
        UnsafeFileError,
        ReformTimeoutError,
        ShardsLostError,
        MissingDirectoryError,
        RunIdInUseError,
        UnsupportedTorchError,
        UntestedTorchWarning,
        SlurmJobNotFoundError,
        SlurmParseError,
        JobTimeoutError,
    ):
        assert getattr(errors, old.__name__) is old


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (errors.ConfigError, ValueError),
        (errors.SlurmParseError, ValueError),
        (errors.JobTimeoutError, TimeoutError),
        (errors.CheckpointFlushTimeout, TimeoutError),
        (errors.UnsupportedTorchError, ImportError),
        (errors.UnsupportedStateError, TypeError),
        (errors.ReformTimeoutError, RuntimeError),
        (errors.UnsafeDirectoryError, PermissionError),
    ],
)
def test_mixins_keep_the_builtin_callers_catch(
    error: type[Exception], builtin: type[Exception]
) -> None:
    with pytest.raises(builtin):
        raise error("x")


def test_malformed_record_is_also_torchs_rendezvous_state_error() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    from slurm_elastic.rendezvous.state import MalformedRecordError

    assert issubclass(MalformedRecordError, SlurmElasticError)
    assert issubclass(MalformedRecordError, RendezvousStateError)
