"""The directories Slurm needs before a job script runs, and creating them.

sbatch starts a job in its working directory (``--chdir``, else where sbatch runs) and
opens its ``--output``/``--error`` files *before* the script runs; when one of their
directories is missing, the job fails at launch (``FAILED``, ``JobLaunchFailure``, exit
``0:53``) and writes no log at all, so the script cannot create them itself.
``slurm-elastic render`` therefore creates them (:func:`ensure_job_directories`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_elastic.privatefs import ensure_private_dir
from slurm_elastic.submit.render import split_values
from slurm_elastic.submit.value_checks import shell_words

__all__ = ["ensure_job_directories", "job_directories"]

_PATH_OPTIONS = {
    "--chdir": "dir",
    "-D": "dir",
    "--output": "file",
    "-o": "file",
    "--error": "file",
    "-e": "file",
}


def _option_paths(args: Sequence[str]) -> list[tuple[str, str]]:
    """(kind, path) of the --chdir/--output/--error options among ``sbatch_args``."""
    found: list[tuple[str, str]] = []
    for arg in args:
        text = str(arg).strip()
        for option, kind in _PATH_OPTIONS.items():
            if text.startswith(option + "=") or text.startswith(option + " "):
                found.append((kind, text[len(option) + 1 :].strip()))
            elif len(option) == 2 and text.startswith(option) and len(text) > 2 and text[2] != "-":
                found.append((kind, text[2:].strip()))
    return found


def job_directories(
    values: Mapping[str, object], cwd: str | os.PathLike[str] | None = None
) -> list[Path]:
    """The directories Slurm needs before the job script runs, resolved from ``cwd``.

    sbatch starts a job in its working directory (``--chdir``, else the directory sbatch
    runs in) and opens the ``--output``/``--error`` files there *before* the script runs;
    when one of these directories is missing, the job fails at launch (``FAILED``,
    ``JobLaunchFailure``, exit ``0:53``) and writes no log at all. Paths whose directory
    part holds a Slurm ``%`` pattern are left out (only Slurm can expand them).

    Args:
        values: the flat job values (``output_dir``, ``sbatch_args``; other keys ignored).
        cwd: where sbatch will run (default: the current directory).

    Raises:
        ConfigError: an unknown key (see :func:`split_values`).
    """
    _, template = split_values(values)
    base = Path(cwd) if cwd is not None else Path.cwd()
    extra = _option_paths(shell_words("sbatch_args", template.get("sbatch_args") or ()))
    workdir = base
    for kind, option_path in extra:
        if kind == "dir":
            workdir = base / os.path.expanduser(option_path)
    wanted = [workdir]
    if template.get("output_dir"):
        wanted.append(workdir / os.path.expanduser(str(template["output_dir"])))
    wanted += [(workdir / os.path.expanduser(p)).parent for kind, p in extra if kind == "file"]
    out: list[Path] = []
    for wanted_dir in wanted:
        if "%" not in str(wanted_dir) and wanted_dir not in out:
            out.append(wanted_dir)
    return out


def ensure_job_directories(
    values: Mapping[str, object], cwd: str | os.PathLike[str] | None = None
) -> list[str]:
    """Create the missing :func:`job_directories`; return one line per action for the user.

    A directory that cannot be created (e.g. a cluster path rendered on a laptop) gives a
    warning line, not an error: it may exist where the job is submitted.
    """
    lines: list[str] = []
    for path in job_directories(values, cwd):
        if path.is_dir():
            continue
        try:
            ensure_private_dir(path)  # 0700, like every directory we create
        except OSError as exc:
            lines.append(
                f"warning: cannot create {path} ({exc.strerror or exc}): create it before sbatch, or "
                "Slurm fails the job at launch (JobLaunchFailure) without writing a log"
            )
        else:
            lines.append(
                f"created {path}/ (Slurm opens the job's working and log directories before "
                "the script runs, and fails the job without a log when they are missing)"
            )
    return lines
