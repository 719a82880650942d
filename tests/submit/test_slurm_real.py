"""End to end on the local Slurm cluster: the Python submission and the rendered templates.

Each job runs real node agents (``run_agent``) that train with gloo across two Slurm
nodes, and writes what every rank saw into tmp_path (shared by all nodes).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from slurm_elastic.cli.main import main
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.jobstate import JobState as SlurmState
from slurm_elastic.submit import JobState, plan_submission, render, submit
from slurm_elastic.yamlfile import load_mapping
from tests.conftest import SlurmCluster
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TRAIN = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}"), "w") as fh:
        fh.write(f"{dist.get_world_size()} {t.item():.0f} {os.environ['SLURMD_NODENAME']}")
    dist.destroy_process_group()
    """
)

FAST = {"last_call_timeout_s": 2, "join_timeout_s": 120, "heartbeat_interval_s": 0.5}


def _setup(tmp_path: Path) -> tuple[str, Path]:
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    return str(train), out


def _check_two_ranks(out: Path) -> None:
    results = sorted(p.read_text().split() for p in out.iterdir())
    assert [r[:2] for r in results] == [["2", "3"], ["2", "3"]], results
    assert len({r[2] for r in results}) == 2, f"both ranks on one node: {results}"


@pytest.mark.parametrize("mode", ["elastic_array", "elastic"])
def test_python_submission_agents_train_across_two_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path, mode: str
) -> None:
    train, out = _setup(tmp_path)
    job = submit(
        train,
        cluster="slurm",
        client=slurm_cluster.client,
        python=sys.executable,  # the launcher on the nodes: this venv's slurm-elastic
        mode=mode,
        nnodes="2:2",
        output_dir=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"),
        env={"OUT_DIR": str(out), "OMP_NUM_THREADS": "1"},
        exclusive=True,
        **FAST,
    )
    try:
        assert job.result(timeout_s=240, poll_s=1) == JobState.COMPLETED
    finally:
        if not job.done():
            job.cancel()
    assert all(p.is_file() for p in job.log_paths()), job.log_paths()
    assert len(job.task_refs) == (2 if mode == "elastic_array" else 1)
    _check_two_ranks(out)


@pytest.mark.parametrize("template", ["elastic_array", "elastic"])
def test_rendered_template_submitted_with_sbatch_trains_across_two_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path, template: str
) -> None:
    train, out = _setup(tmp_path)
    (tmp_path / "logs").mkdir()
    text = render.render_template(
        template,
        {
            "entrypoint": train,
            "nnodes": "2:2",
            "output_dir": str(tmp_path / "logs"),
            "launcher": str(Path(sys.executable).parent / "slurm-elastic"),
            "state_dir": str(tmp_path / "state"),
            "env": {"OUT_DIR": str(out), "OMP_NUM_THREADS": "1"},
            # nodes have 2 CPUs: without --exclusive two 1-CPU array tasks may share one
            "exclusive": True,
            **FAST,
        },
    )
    # Submit without the cluster script's own SLURM_ELASTIC_CLUSTER_* variables: sbatch
    # exports the submitter's environment, and the config rejects unknown SLURM_ELASTIC_*.
    env = {k: v for k, v in slurm_cluster.env.items() if not k.startswith("SLURM_ELASTIC_")}
    job = SlurmClient(env=env, timeout_s=60).submit(text, cwd=tmp_path)
    finished = {s for s in SlurmState if s.is_terminal}
    refs = [f"{job}_0", f"{job}_1"] if template == "elastic_array" else [job]
    try:
        infos = [slurm_cluster.wait_state(ref, finished, timeout=240) for ref in refs]
    finally:
        slurm_cluster.client.run(["scancel", job])
    logs = "\n".join(p.read_text()[-3000:] for p in (tmp_path / "logs").iterdir())
    assert all(i.state is SlurmState.COMPLETED for i in infos), f"{infos}\n{logs}"
    _check_two_ranks(out)


LOOP = textwrap.dedent(
    """
    import os, time, torch, torch.distributed as dist
    from slurm_elastic import notice
    torch.set_num_threads(1)
    notice.install_preemption_handler()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = os.environ["OUT_DIR"]
    open(os.path.join(out, f"started{rank}"), "w").close()
    step = 0
    while step < 3000:
        time.sleep(0.1)
        step += 1
        notice.report_progress(step)
        if notice.preemption_requested():
            with open(os.path.join(out, f"noticed{rank}"), "w") as fh:
                fh.write(str(step))
            break
    """
)


@pytest.mark.parametrize("template", ["elastic", "elastic_array"])
def test_batch_signal_reaches_every_worker_through_the_rendered_script(
    slurm_cluster: SlurmCluster, tmp_path: Path, template: str
) -> None:
    # Slurm's --signal=B:USR2@lead, sent now with scancel --batch (as the time limit would)
    train = tmp_path / "train.py"
    train.write_text(LOOP)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "logs").mkdir()
    text = render.render_template(
        template,
        {
            "entrypoint": str(train),
            "nnodes": "2:2",
            "output_dir": str(tmp_path / "logs"),
            "launcher": str(Path(sys.executable).parent / "slurm-elastic"),
            "state_dir": str(tmp_path / "state"),
            "env": {"OUT_DIR": str(out), "OMP_NUM_THREADS": "1"},
            "exclusive": True,
            "requeue": "never",
            "shutdown_timeout_s": 20,
            **FAST,
        },
    )
    env = {k: v for k, v in slurm_cluster.env.items() if not k.startswith("SLURM_ELASTIC_")}
    client = SlurmClient(env=env, timeout_s=60)
    job = client.submit(text, cwd=tmp_path)
    refs = [f"{job}_0", f"{job}_1"] if template == "elastic_array" else [job]
    finished = {s for s in SlurmState if s.is_terminal}
    try:
        wait_for(
            lambda: (out / "started0").exists() and (out / "started1").exists(),
            180,
            "both workers to train",
        )
        for ref in refs:
            client.cancel(ref, signal="USR2", batch=True)
        wait_for(
            lambda: (out / "noticed0").exists() and (out / "noticed1").exists(),
            60,
            "both workers to see the notice",
        )
        infos = [slurm_cluster.wait_state(ref, finished, timeout=90) for ref in refs]
    finally:
        client.run(["scancel", job])
    assert all(i.restarts == 0 for i in infos), "requeue: never must not requeue"


@pytest.mark.parametrize("mode", ["elastic_array", "elastic"])
def test_one_script_rendered_planned_and_sent_is_what_slurm_runs(
    slurm_cluster: SlurmCluster, tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One generator: for the same job file, `slurm-elastic render`, `submit --dry-run`,
    the Python plan and the Python submission give one script, byte for byte, and that
    script is the one Slurm holds for the job (`scontrol write batch_script`)."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        f"mode: {mode}\nentrypoint: train.py\nargs: [--lr, '0.1']\nnnodes: '1:2'\n"
        f"output_dir: {tmp_path / 'logs'}\nstate_dir: {tmp_path / 'state'}\n"
        "partition: low\ntime: '00:10:00'\n"
        "sbatch_args: [--hold]\n"  # never runs: only the script matters
    )
    assert main(["render", mode, "--config", str(job_file)]) == 0
    rendered = capsys.readouterr().out
    assert main(["submit", str(job_file), "--cluster", "slurm", "--dry-run"]) == 0
    assert capsys.readouterr().out == rendered
    values = load_mapping(job_file, "job file")
    assert plan_submission(cluster="slurm", **values).text == rendered
    job = submit(cluster="slurm", client=slurm_cluster.client, **values)
    try:
        held = slurm_cluster.client.run(["scontrol", "write", "batch_script", job.job_id, "-"])
    finally:
        slurm_cluster.client.cancel(job.job_id)
    assert job.sbatch_text == rendered
    assert held.stdout == rendered
    first = f"{job.job_id}_0" if mode == "elastic_array" else job.job_id
    assert job.log_paths()[0] == tmp_path / "logs" / f"slurm-elastic-{first}.out"
