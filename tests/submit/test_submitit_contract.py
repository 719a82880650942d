"""Contract with the installed submitit: the private function our dry run calls is the
one its executor renders a submission with. If this fails, submitit changed: check
``submitit_sbatch_string`` in slurm_elastic/submit/slurm_backend.py and the version bound
in pyproject.toml before widening it."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest

submitit = pytest.importorskip("submitit")

from slurm_elastic.submit import build_request  # noqa: E402
from slurm_elastic.submit.slurm_backend import (  # noqa: E402
    submitit_parameters,
    submitit_sbatch_string,
)

ROOT = Path(__file__).resolve().parents[2]


def test_submitit_version_is_in_the_declared_range() -> None:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("submitit"))
    assert spec == "submitit>=1.5,<1.6", spec
    major, minor = (int(x) for x in submitit.__version__.split(".")[:2])
    assert (major, minor) == (1, 5), (
        f"submitit {submitit.__version__} is outside the tested range 1.5.x"
    )


def test_make_sbatch_string_still_takes_what_we_pass() -> None:
    from submitit.slurm import slurm as submitit_slurm

    params = inspect.signature(submitit_slurm._make_sbatch_string).parameters
    request = build_request(
        {
            "nnodes": "1:3",
            "partition": "low",
            "time": "1:00:00",
            "exclusive": True,
            "cpus_per_task": 2,
            "mem": "4G",
            "sbatch_args": ["--hold"],
        },
        entrypoint="train.py",
        mode="elastic",
    )
    wanted = {"command", "folder", "map_count", *submitit_parameters(request)}
    missing = wanted - set(params)
    assert not missing, f"submitit's _make_sbatch_string lost parameters {missing}"


@pytest.mark.parametrize("mode", ["elastic_array", "elastic"])
def test_the_executor_renders_what_our_dry_run_renders(tmp_path: Path, mode: str) -> None:
    if shutil.which("srun") is None:
        pytest.skip(reason="submitit's SlurmExecutor needs srun on PATH")
    request = build_request(
        {"nnodes": "1:3", "partition": "low", "output_dir": str(tmp_path)},
        entrypoint="train.py",
        mode=mode,
    )
    params = submitit_parameters(request)
    folder = tmp_path / "%j"
    executor = submitit.SlurmExecutor(folder=folder, python="python3")
    executor.update_parameters(**params)
    map_count = request.max_nodes if mode == "elastic_array" else None
    if map_count is not None:
        # what SlurmExecutor._internal_process_submissions does for map_array
        executor.parameters["map_count"] = map_count
    sent = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    assert sent == submitit_sbatch_string(folder, "python3", map_count, params)
