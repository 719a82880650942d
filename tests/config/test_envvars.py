"""The table of our own SLURM_ELASTIC_* variables is the only place that spells them,
the README's reference is the table, and the config accepts exactly the table's names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from slurm_elastic import envvars
from slurm_elastic.config import load_config
from slurm_elastic.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "slurm_elastic"
_README_BLOCK = re.compile(r"<!-- envvars:begin[^>]*-->\n(.*?)<!-- envvars:end -->", flags=re.S)


def _string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_no_module_but_the_table_spells_a_variable_name() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envvars.py":
            continue
        for line, text in _string_constants(ast.parse(path.read_text())):
            if "SLURM_ELASTIC_" in text:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not offenders, "use slurm_elastic.envvars instead of literals:\n" + "\n".join(offenders)


def test_readme_reference_is_the_table() -> None:
    match = _README_BLOCK.search((ROOT / "README.md").read_text())
    assert match, "README.md lacks the <!-- envvars:begin --> ... <!-- envvars:end --> block"
    assert match.group(1) == envvars.markdown_table(), (
        "README's environment reference differs from slurm_elastic.envvars; paste "
        "`python -c 'from slurm_elastic import envvars; print(envvars.markdown_table())'`"
    )


def test_every_row_says_who_sets_and_who_reads() -> None:
    names = [v.name for v in envvars.VARIABLES]
    assert len(names) == len(set(names))
    for var in envvars.VARIABLES:
        assert var.name.startswith(envvars.PREFIX)
        assert var.meaning and var.set_by and var.read_by, var


def test_the_workers_environment_is_in_the_table() -> None:
    from slurm_elastic.agent import WORKER_ENV

    for name in WORKER_ENV:
        var = envvars.lookup(name)
        assert var is not None and not var.is_family, name
        assert "agent" in var.set_by


@pytest.mark.parametrize(
    "name",
    [
        envvars.NODE_DIR_ENV,
        envvars.REQUEUE_COUNT_ENV,
        envvars.LOG_LEVEL_ENV,
        "SLURM_ELASTIC_CLUSTER",
        "SLURM_ELASTIC_CLUSTER_DIR",
        "SLURM_ELASTIC_TEST_X",
    ],
)
def test_config_ignores_the_tables_non_config_variables(name: str) -> None:
    # e.g. a worker that resolves a config inherits the agent's node channel variable
    assert load_config(environ={name: "x"}).max_nodes == 1


def test_config_rejects_a_variable_outside_the_table() -> None:
    with pytest.raises(ConfigError, match=r"SLURM_ELASTIC_NOTICEFILE='x'.*fix the name"):
        load_config(environ={"SLURM_ELASTIC_NOTICEFILE": "x"})


def test_config_reads_the_variables_that_are_config_keys() -> None:
    env = {envvars.RUN_ID_ENV: "r1", envvars.PREEMPT_SIGNAL_ENV: "usr1"}
    cfg = load_config(environ=env)
    assert (cfg.run_id, cfg.preempt_signal) == ("r1", "USR1")
    for var in envvars.VARIABLES:
        if var.config_key is not None:
            assert envvars.config_key_variable(var.config_key) == var.name
