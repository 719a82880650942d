"""``expedited_requeue: true``: ``--requeue=expedite`` only on a Slurm that has it (>= 25.11).

The local Slurm is 22.05, so the rendering of the option is tested with an *injected*
version: every rendering function takes a ``slurm_version`` probe (the seam; by default
it runs ``sbatch --version``), and these tests pass ``lambda: SlurmVersion(25, 11, 0)``.
The refusal is tested both with an injected old version and, in the last test, against
the real local Slurm 22.05 through the CLI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurm_elastic.cli.main import main
from slurm_elastic.errors import ConfigError, SlurmCommandNotFoundError
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.site import EXPEDITED_REQUEUE_SINCE, SlurmVersion, parse_version
from slurm_elastic.submit import (
    build_request,
    plan_submission,
    render,
    requeue_option,
    slurm_backend,
)
from tests.conftest import SlurmCluster

DATA = Path(__file__).resolve().parent.parent / "data" / "slurm"
VALUES = {"entrypoint": "train.py", "expedited_requeue": True}


def _injected(version: SlurmVersion | None):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    def probe() -> SlurmVersion | None:
        calls.append(1)
        return version

    return probe, calls


def _requeue_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"#SBATCH --requeue\b", line)]


def test_the_version_is_read_from_recorded_sbatch_output_and_new_release_forms() -> None:
    assert parse_version((DATA / "sbatch_version.txt").read_text()) == SlurmVersion(22, 5, 8)
    assert parse_version("slurm 25.11.0\n") == SlurmVersion(25, 11, 0)
    assert parse_version("slurm 26.05\n") == SlurmVersion(26, 5, 0)
    assert str(SlurmVersion(22, 5, 8)) == "22.05.8"
    assert SlurmVersion(25, 5, 3) < EXPEDITED_REQUEUE_SINCE <= SlurmVersion(25, 11, 1)


@pytest.mark.parametrize("template", render.list_templates())
def test_every_template_renders_expedite_on_slurm_25_11(template: str) -> None:
    probe, calls = _injected(SlurmVersion(25, 11, 0))  # injected: the local Slurm is 22.05
    text = render.render_template(template, VALUES, slurm_version=probe)
    assert _requeue_lines(text) == ["#SBATCH --requeue=expedite"]
    assert calls == [1]


def test_without_the_option_the_version_is_never_asked_and_plain_requeue_renders() -> None:
    def probe() -> SlurmVersion:
        raise AssertionError("the Slurm version must not be probed")

    text = render.render_template("elastic_array", {"entrypoint": "t.py"}, slurm_version=probe)
    assert _requeue_lines(text) == ["#SBATCH --requeue"]
    off = {"entrypoint": "t.py", "expedited_requeue": "false"}  # --set gives text
    assert _requeue_lines(render.render_template("elastic", off, slurm_version=probe)) == [
        "#SBATCH --requeue"
    ]


def test_an_older_slurm_is_refused_naming_its_version_and_the_fix() -> None:
    probe, _ = _injected(SlurmVersion(25, 5, 4))
    with pytest.raises(ConfigError) as err:
        render.render_template("elastic_array", VALUES, slurm_version=probe)
    message = str(err.value)
    assert "needs Slurm >= 25.11" in message
    assert "the Slurm here is 25.05.4" in message
    assert "drop expedited_requeue" in message


def test_a_slurm_that_cannot_be_asked_is_refused_with_the_reason() -> None:
    def probe() -> SlurmVersion:
        raise SlurmCommandNotFoundError("'sbatch' was not found on PATH='/nowhere'")

    with pytest.raises(ConfigError, match=r"cannot tell whether this Slurm supports.*'sbatch' was"):
        render.render_template("elastic_array", VALUES, slurm_version=probe)


def test_a_non_boolean_value_names_the_key() -> None:
    values = {"entrypoint": "t.py", "expedited_requeue": "expedite"}
    with pytest.raises(
        ConfigError, match=r"'expedited_requeue' = 'expedite': expected true or false"
    ):
        render.render_template("elastic_array", values)


def test_requeue_expedite_in_our_own_requeue_key_points_to_the_template_key() -> None:
    with pytest.raises(ConfigError, match=r"'requeue' = 'expedite'.*expedited_requeue: true"):
        render.render_template("elastic_array", {"entrypoint": "t.py", "requeue": "expedite"})


def test_the_python_submission_carries_expedite_too(monkeypatch: pytest.MonkeyPatch) -> None:
    probe, _ = _injected(SlurmVersion(25, 11, 0))  # injected, as above
    request = build_request(VALUES, slurm_version=probe)
    assert request.requeue_option == "--requeue=expedite"
    # the submission renders the template again: the same probe answers
    monkeypatch.setattr(requeue_option, "installed_slurm_version", probe)
    text = slurm_backend.sbatch_text(request, python="python3")
    assert _requeue_lines(text) == ["#SBATCH --requeue=expedite"]
    plain = build_request({"entrypoint": "t.py"})
    assert _requeue_lines(slurm_backend.sbatch_text(plain, python="python3")) == [
        "#SBATCH --requeue"
    ]


def test_a_local_run_ignores_the_option_without_asking_slurm(tmp_path: Path) -> None:
    plan = plan_submission(cluster="local", folder=tmp_path, **VALUES)
    assert plan.cluster == "local"
    assert plan.request.requeue_option == "--requeue"


@pytest.mark.slurm
def test_the_real_local_slurm_22_05_is_refused(
    slurm_cluster: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = SlurmClient(env=slurm_cluster.env).version()
    if version >= EXPEDITED_REQUEUE_SINCE:
        pytest.skip(reason=f"this Slurm ({version}) supports --requeue=expedite")
    code = main(
        [
            "render",
            "elastic_array",
            "--set",
            "entrypoint=train.py",
            "--set",
            "expedited_requeue=true",
            "-o",
            str(tmp_path / "job.sbatch"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"the Slurm here is {version}" in err, err
    assert "needs Slurm >= 25.11" in err and "drop expedited_requeue" in err
    assert not (tmp_path / "job.sbatch").exists()
    with pytest.raises(ConfigError, match=rf"the Slurm here is {re.escape(str(version))}"):
        plan_submission(cluster="slurm", **VALUES)
