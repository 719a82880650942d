"""A validated submission request, built from the same flat values as the sbatch templates.

One vocabulary for ``slurm-elastic render`` and ``slurm-elastic submit``: config keys
(:class:`~slurm_elastic.config.ElasticConfig` fields, ``nnodes``) and template keys
(:data:`~slurm_elastic.submit.render.TEMPLATE_KEYS`), with ``mode`` naming the shape
(``fault_tolerant``, ``elastic``, ``elastic_array``). Validation is the renderer's, so a
config that renders also submits.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_elastic.errors import ConfigError
from slurm_elastic.submit import render

__all__ = ["DEFAULT_MODE", "JobRequest", "build_request"]

DEFAULT_MODE = "elastic_array"


@dataclass(frozen=True)
class JobRequest:
    """Everything needed to submit one run (to Slurm or locally).

    Attributes:
        mode: ``fault_tolerant``, ``elastic`` or ``elastic_array``.
        entrypoint: the training script (or module with ``module``).
        args: its arguments.
        module: run ``python -m entrypoint``.
        overrides: config keys the user set (node counts included); resolved on each node.
        min_nodes: the run starts with this many nodes.
        max_nodes: nodes requested (array size, or the allocation's upper bound).
        preempt_signal: the notice signal name (``USR2``).
        signal_lead_s: how long before the end Slurm sends it.
        job_name: Slurm job name.
        output_dir: where local jobs' logs go by default (``logs``); a Slurm job writes
            its log where the template's ``output_dir`` says.
        template: the remaining template keys (partition, time, ...).
        requeue_option: ``--requeue``, or ``--requeue=expedite`` (``expedited_requeue``,
            checked against the Slurm version when the request was built).
        values: the flat values it was built from (``mode`` aside): a Slurm submission
            renders its template from them, as ``slurm-elastic render`` does.
    """

    mode: str
    entrypoint: str
    args: tuple[str, ...]
    module: bool
    overrides: Mapping[str, Any]
    min_nodes: int
    max_nodes: int
    preempt_signal: str
    signal_lead_s: int
    job_name: str
    output_dir: str
    template: Mapping[str, Any] = field(default_factory=dict)
    requeue_option: str = "--requeue"
    values: Mapping[str, Any] = field(default_factory=dict)

    @property
    def setup_lines(self) -> list[str]:
        """Shell lines to run before the agent."""
        setup = self.template.get("setup") or ""
        return setup.splitlines() if isinstance(setup, str) else [str(s) for s in setup]

    @property
    def env(self) -> dict[str, str]:
        """Extra environment variables for the job."""
        return {str(k): str(v) for k, v in dict(self.template.get("env") or {}).items()}

    @property
    def sbatch_args(self) -> list[str]:
        """Extra sbatch options."""
        return _words(self.template.get("sbatch_args") or ())

    @property
    def srun_args(self) -> list[str]:
        """Extra srun options."""
        return _words(self.template.get("srun_args") or ())


def _words(value: object) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]  # type: ignore[attr-defined]


def _jsonable(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def build_request(
    values: Mapping[str, object],
    *,
    entrypoint: str | None = None,
    args: object = None,
    mode: str | None = None,
    module: bool = False,
    slurm_version: render.VersionProbe | None = None,
) -> JobRequest:
    """Validate ``values`` (config + template keys) into a :class:`JobRequest`.

    ``entrypoint``/``args``/``mode`` given here win over the same keys in ``values``.
    ``slurm_version``: the Slurm the job goes to, asked only for ``expedited_requeue``
    (see :func:`~slurm_elastic.submit.render.requeue_option`).

    Raises:
        ConfigError: unknown mode or key, missing entrypoint, or a bad value (the
            renderer's checks: the message names the key and the fix).
    """
    merged: dict[str, object] = {str(k).replace("-", "_"): v for k, v in values.items()}
    if entrypoint is not None:
        merged["entrypoint"] = entrypoint
    if args is not None:
        merged["args"] = args
    if module:
        merged["module"] = True
    chosen = str(mode or merged.pop("mode", None) or DEFAULT_MODE)
    merged.pop("mode", None)
    if chosen not in render.TEMPLATES:
        raise ConfigError(
            f"unknown mode {chosen!r}: choose one of {', '.join(render.list_templates())}"
        )
    resolved = render.template_values(chosen, merged, slurm_version=slurm_version)  # validates all
    config, template = render.split_values(merged)
    spec = render.TEMPLATES[chosen]
    min_nodes, max_nodes = int(resolved["min_nodes"]), int(resolved["max_nodes"])
    overrides = {k: _jsonable(v) for k, v in config.items() if k != "nnodes"}
    overrides.update(min_nodes=min_nodes, max_nodes=max_nodes)
    for key, default in spec.defaults.items():
        if key in render.CONFIG_KEYS and key not in ("min_nodes", "max_nodes"):
            overrides.setdefault(key, default)
    raw_args = template.get("args") or ()
    try:
        arg_list = shlex.split(raw_args) if isinstance(raw_args, str) else list(raw_args)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"args {raw_args!r}: expected a list or shell words") from exc
    return JobRequest(
        mode=chosen,
        entrypoint=str(template["entrypoint"]),
        args=tuple(str(a) for a in arg_list),
        module=render.boolean_value("module", template.get("module", False)),
        overrides=overrides,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        preempt_signal=resolved["preempt_signal"],
        signal_lead_s=int(resolved["signal_lead_s"]),
        job_name=resolved["job_name"],
        output_dir=str(template.get("output_dir") or "logs"),
        template={k: v for k, v in template.items() if k not in ("entrypoint", "args")},
        requeue_option=resolved["requeue_option"],
        values=dict(merged),
    )
