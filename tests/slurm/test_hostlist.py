"""Hostlist expansion: every form Slurm prints (compared with scontrol in tests/slurm)."""

import pytest

from slurm_elastic.errors import SlurmEnvError
from slurm_elastic.slurm.hostlist import expand_hostlist

CASES = {
    "node1": ["node1"],
    "n[1-3,5]": ["n1", "n2", "n3", "n5"],
    "n[001-003]": ["n001", "n002", "n003"],
    "n[08-11]": ["n08", "n09", "n10", "n11"],
    "n[9-11]": ["n9", "n10", "n11"],
    "r[1-2]n[3-4]": ["r1n3", "r1n4", "r2n3", "r2n4"],
    "a[01-02]b": ["a01b", "a02b"],
    "x[1-2]-y[3-4]": ["x1-y3", "x1-y4", "x2-y3", "x2-y4"],
    "login,gpu[1-2],cpu[7]": ["login", "gpu1", "gpu2", "cpu7"],
    "n[1-2],n[1-2]": ["n1", "n2", "n1", "n2"],
    "node-a.b,c": ["node-a.b", "c"],
    "": [],
}


@pytest.mark.parametrize(("expr", "hosts"), list(CASES.items()))
def test_expands_every_slurm_form(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("n[1-3", "unbalanced '\\['"),
        ("n1-3]", "unbalanced '\\]'"),
        ("n[3-1]", "descending range '3-1'"),
        ("n[a-b]", "bad range 'a-b'"),
        ("n[[1]]", "nested"),
        ("n[1-99999999]", "too large"),
    ],
)
def test_malformed_hostlist_names_the_part(expr: str, message: str) -> None:
    with pytest.raises(SlurmEnvError, match=message):
        expand_hostlist(expr)
