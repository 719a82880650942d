"""``slurm-elastic``: the command line. The only module that configures logging.

Subcommands:

* ``agent``  run this node's agent (torchrun's flag names): ``slurm-elastic agent
  --nnodes 1:4 --nproc-per-node 2 train.py --lr 0.1``
* ``render`` print an sbatch template filled from a config (a dry run of ``sbatch``)
* ``submit`` submit a config to Slurm (the rendered template, sent as is) or run it locally
* ``config`` print the resolved configuration (defaults, Slurm, YAML, env, flags)
* ``status``/``logs``/``timeline`` a run's state, per-rank logs, picture (docs/operability.md)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from slurm_elastic import __version__
from slurm_elastic.cli.untrusted import printable
from slurm_elastic.config import ElasticConfig, cli_flags, field_type, load_config
from slurm_elastic.envvars import LOG_LEVEL_ENV
from slurm_elastic.errors import ConfigError, SlurmElasticError

__all__ = ["build_parser", "configure_logging", "main"]

log = logging.getLogger("slurm_elastic.cli")


def configure_logging(verbosity: int) -> None:
    """Configure the root logger for a slurm_elastic program (CLI, local node process).

    ``SLURM_ELASTIC_LOG_LEVEL`` wins over ``verbosity`` (-1 quiet, 0 info, 2 debug).
    """
    level = os.environ.get(LOG_LEVEL_ENV) or (
        "DEBUG" if verbosity > 1 else "INFO" if verbosity >= 0 else "WARNING"
    )
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {host} %(process)d %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that resolves an ElasticConfig.

    One flag per config field that declares one in its metadata
    (:func:`slurm_elastic.config.cli_flags`), plus ``--config`` and torchrun's ``--nnodes``.
    """
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--nnodes", help="N or MIN:MAX nodes (torchrun's form)")
    for name, flag in cli_flags().items():
        kind = field_type(name)
        extra: dict[str, Any] = {} if kind is str else {"type": kind}
        p.add_argument(*flag.names, dest=name, help=flag.help, choices=flag.choices, **extra)


def _read_job_file(path: str) -> dict[str, object]:
    """The flat mapping of a YAML job/config file; ConfigError naming the file and the fix."""
    from slurm_elastic.yamlfile import load_mapping

    return load_mapping(path)


def _job_file_config(path: str | None) -> dict[str, object] | None:
    """For a job file (one with template keys: ``mode``, ``entrypoint``, ...): the config
    keys its job script exports; ``None`` for a plain config file (or no file).

    One YAML file serves every verb: ``render`` and ``submit`` export the job file's config
    keys into the job, where they win over ``SLURM_ELASTIC_*`` variables inherited from the
    shell; ``config`` and ``agent`` given the same file apply that same precedence.
    """
    if path is None:
        return None
    from slurm_elastic.submit import render

    values = _read_job_file(path)
    if not any(str(k).replace("-", "_") in render.TEMPLATE_KEYS for k in values):
        return None
    return render.job_config(values, source=f"job file {path!r}")


def _load(ns: argparse.Namespace) -> ElasticConfig:
    overrides = {
        k: getattr(ns, k) for k in ("nnodes", *cli_flags()) if getattr(ns, k, None) is not None
    }
    job = _job_file_config(ns.config)
    if job is not None:
        return load_config(None, overrides={**job, **overrides})
    return load_config(ns.config, overrides=overrides)


def _parse_kv(items: Sequence[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key:
                raise SlurmElasticError(f"{flag} {part!r}: expected KEY=VALUE")
            out[key.strip()] = value.strip()
    return out


_STD = re.compile(r"^(?:[0-3]|\d+:[0-3](?:,\d+:[0-3])*)$")


def _check_std(flag: str, value: str) -> str:
    """torchrun's ``--redirects``/``--tee``: 0-3, or per local rank ``RANK:N,...``."""
    if not _STD.match(value.strip()):
        raise ConfigError(
            f"{flag} {value!r}: expected 0, 1, 2 or 3 (none, stdout, stderr, both), or per "
            "local rank LOCAL_RANK:N[,LOCAL_RANK:N...], e.g. 0:3,1:0"
        )
    return value.strip()


def _cmd_agent(ns: argparse.Namespace) -> int:
    # Before torch is imported (seconds): a notice meanwhile is held, not fatal.
    from slurm_elastic import _startup_seam
    from slurm_elastic.signals import hold_early_notices

    _startup_seam.pause("agent_start")  # tests only: a notice before any handler exists
    hold_early_notices()
    config = _load(ns)
    # The workers' interpreters import torch while this one does and joins the rendezvous.
    from slurm_elastic.agent import warm_workers

    warm = warm_workers.start(config, os.environ, ns.entrypoint, ns.args, ns.module)
    try:
        from slurm_elastic.agent import rendezvous_parameters, run_agent

        redirects = _check_std("--redirects", ns.redirects)
        tee = _check_std("--tee", ns.tee)
        rdzv_conf = _parse_kv(ns.rdzv_conf, "--rdzv-conf")
        rendezvous_parameters(config, rdzv_conf)  # usage errors now, as one line, exit 2
        return int(
            run_agent(
                config,
                ns.entrypoint,
                ns.args,
                module=ns.module,
                redirects=redirects,
                tee=tee,
                rdzv_conf=rdzv_conf,
                warm=warm,
            )
        )
    finally:
        if warm is not None:
            warm.close()


def _cmd_config(ns: argparse.Namespace) -> int:
    print(json.dumps(_load(ns).as_dict(), indent=2, sort_keys=True))
    return 0


def _cmd_render(ns: argparse.Namespace) -> int:
    from slurm_elastic.submit import render
    from slurm_elastic.submit.directories import ensure_job_directories

    if ns.list:
        print("\n".join(render.list_templates()))
        return 0
    values: dict[str, object] = _read_job_file(ns.config) if ns.config else {}
    values.update(_parse_kv(ns.set, "--set"))
    template = ns.template or values.get("mode")
    if not template:
        raise SlurmElasticError(
            "render: name a template (slurm-elastic render --list) or set 'mode' in the job file"
        )
    source = f"job file {ns.config!r}" if ns.config else "--set"
    if ns.config and ns.set:
        source += " or --set"
    text = render.render_template(str(template), values, source=source)
    # Slurm opens the log and working directories before the script runs: create them
    # now (relative to here, where sbatch is expected to run), whether the script goes to
    # a file or to stdout.
    for line in ensure_job_directories(values):
        print(f"slurm-elastic: {line}", file=sys.stderr)
    if ns.output:
        try:
            with open(ns.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            parent = os.path.dirname(ns.output) or "."
            raise ConfigError(
                f"-o {ns.output!r}: cannot write it ({exc.strerror}); create its directory "
                f"first (mkdir -p {parent}) or choose another path"
            ) from None
    else:
        sys.stdout.write(text)
    return 0


def _cmd_submit(ns: argparse.Namespace) -> int:
    from slurm_elastic.cli.status import WaitProgress
    from slurm_elastic.submit import submit_from_config

    progress = WaitProgress() if ns.wait and not ns.dry_run else None
    return int(
        submit_from_config(
            ns.config_file, cluster=ns.cluster, dry_run=ns.dry_run, wait=ns.wait, progress=progress
        )
    )


def _add_ops_commands(sub: Any) -> None:
    """``status``, ``logs`` and ``timeline`` (slurm_elastic.cli.status/logs/timeline)."""
    job_help = "Slurm job id, array job id, run id, or the run's state directory"

    def status(ns: argparse.Namespace) -> int:
        from slurm_elastic.cli.status import list_status, run_status

        if ns.job is None:
            if ns.watch or ns.goodput:
                raise SlurmElasticError(
                    f"status {'--watch' if ns.watch else '--goodput'} needs a run: "
                    "slurm-elastic status RUN (slurm-elastic status lists them)"
                )
            return list_status(last=ns.last, as_json=ns.json)
        return run_status(
            ns.job, as_json=ns.json, watch=ns.watch, interval_s=ns.interval, goodput=ns.goodput
        )

    def logs(ns: argparse.Namespace) -> int:
        from slurm_elastic.cli.logs import run_logs

        return run_logs(ns.job, node=ns.node, rank=ns.rank, follow=ns.follow)

    def timeline(ns: argparse.Namespace) -> int:
        from slurm_elastic.cli.timeline import run_timeline

        return run_timeline(ns.job, ns.output)

    p = sub.add_parser("status", help="where a run stands: nodes, world, checkpoint, speed")
    p.add_argument(
        "job", nargs="?", default=None, help=f"{job_help}; without it: your runs, newest first"
    )
    p.add_argument("--last", type=int, default=10, help="without JOB: list this many runs")
    p.add_argument("--json", action="store_true", help="one JSON document (docs/operability.md)")
    p.add_argument("--watch", action="store_true", help="refresh until the run ends")
    p.add_argument("--interval", type=float, default=2.0, help="--watch refresh seconds")
    p.add_argument(
        "--goodput",
        action="store_true",
        help="where the run's time went (queue wait, start-up, re-formation, restarts, "
        "redone steps, checkpoint stalls), from the event log",
    )
    p.set_defaults(func=status)

    p = sub.add_parser("logs", help="per-rank worker logs, across restarts and requeues")
    p.add_argument("job", help=job_help)
    p.add_argument("--node", help="node (array task index, host or NODE of status)")
    p.add_argument("--rank", type=int, help="global rank")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.set_defaults(func=logs)

    p = sub.add_parser("timeline", help="draw the run's timeline (PNG)")
    p.add_argument("job", help=job_help)
    p.add_argument("-o", "--output", default="timeline.png", help="image file (.png/.svg/.pdf)")
    p.set_defaults(func=timeline)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where to look, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = _Parser(
        prog="slurm-elastic",
        description="Elastic, preemption-tolerant PyTorch training on Slurm.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("-q", "--quiet", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "agent",
        help="run this node's agent (one per node)",
        description="Run this node's elastic agent; torchrun's flag names.",
    )
    _add_config_flags(p)
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        action="append",
        default=[],
        help="extra rendezvous settings K=V[,K=V]",
    )
    p.add_argument("--redirects", "-r", default="0", help="0 none, 1 out, 2 err, 3 both")
    p.add_argument("--tee", "-t", default="0", help="0 none, 1 out, 2 err, 3 both")
    p.add_argument("-m", "--module", action="store_true", help="entrypoint is a module")
    p.add_argument("entrypoint", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the training script")
    p.set_defaults(func=_cmd_agent)

    p = sub.add_parser("config", help="print the resolved configuration")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("render", help="print an sbatch template filled from a config")
    p.add_argument(
        "template",
        nargs="?",
        help="fault_tolerant, elastic or elastic_array (default: the job file's mode)",
    )
    p.add_argument("--config", help="YAML file with template values and config keys")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE (repeatable)")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.add_argument("--list", action="store_true", help="list the templates")
    p.set_defaults(func=_cmd_render)

    p = sub.add_parser("submit", help="submit a job described by a YAML config")
    p.add_argument("config_file")
    p.add_argument(
        "--cluster",
        choices=("local", "slurm"),
        default=None,
        help="default: slurm when a controller is reachable, else local",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be submitted")
    p.add_argument("--wait", action="store_true", help="wait for the job to finish")
    p.set_defaults(func=_cmd_submit)
    _add_ops_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``slurm-elastic``; returns the process exit status."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    configure_logging(-1 if ns.quiet else ns.verbose)
    try:
        return int(ns.func(ns))
    except SlurmElasticError as exc:
        print(f"slurm-elastic: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `slurm-elastic config | head`: the reader is gone, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second failure when Python flushes stdout
        return 141
    except OSError as exc:  # a file or directory the user named, or the environment
        where = f" {exc.filename!r}" if exc.filename else ""
        print(
            f"slurm-elastic: error:{where} {exc.strerror or exc}; check the path and its "
            "permissions",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("slurm-elastic: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line; the traceback with -vv
        log.debug("unexpected error", exc_info=True)
        print(
            f"slurm-elastic: internal error: {type(exc).__name__}: {_one_line(exc)} "
            "(rerun with -vv for the traceback and report it)",
            file=sys.stderr,
        )
        return 1


def _one_line(exc: BaseException) -> str:
    """The message on one line, control characters escaped (it may quote a file's text)."""
    return printable(" ".join(str(exc).split()))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
