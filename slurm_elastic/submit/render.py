"""Render the sbatch templates of ``sbatch_templates/`` into job scripts.

Rendering is a pure function of a template name and a flat mapping of values, so every
"submit" is "render, then send" and a dry run prints exactly what would be sent. It lives
in :mod:`slurm_elastic.submit` because rendering a job script is part of submitting it.

Templates (one per TorchElastic mode, see :data:`TEMPLATES`):

* ``fault_tolerant``: a fixed number of nodes in one allocation, restarts on failure;
* ``elastic``: ``--nodes=MIN-MAX`` in one allocation;
* ``elastic_array``: ``--array=0-(MAX-1)``, one node per array task, requeue per task.

Template syntax: ``${name}`` with a lowercase name is a placeholder; everything else,
including bash's own ``$VAR``/``${VAR}`` (uppercase by convention in the templates), is
left alone; ``$${name}`` renders a literal ``${name}``. A line holding only a placeholder
that renders empty is dropped.

Values (a flat mapping, e.g. a YAML file plus ``--set k=v``) are of two kinds:

* **config keys** (:class:`~slurm_elastic.config.ElasticConfig` fields, or ``nnodes``):
  validated by the config class and exported as ``SLURM_ELASTIC_<KEY>`` in the script,
  so the agent on each node resolves the same config (env beats YAML in the precedence)
  and the rendered script is a complete record of the run;
* **template keys** (:data:`TEMPLATE_KEYS`): the Slurm request and the command line.

Unknown keys and missing required values raise :class:`~slurm_elastic.errors.ConfigError`
naming the key and the fix.

One template key depends on the Slurm in use: ``expedited_requeue: true`` renders
``--requeue=expedite`` instead of ``--requeue``, which only Slurm >= 25.11 accepts. Only
then is the installed version asked for (``sbatch --version``, through the ``slurm_version``
probe every rendering function takes; tests inject one); an older or unreachable Slurm is
refused with a message naming the version found and the fix. Every other rendering is a
pure function of the values.

The canonical templates live in the top-level ``sbatch_templates/`` directory;
``slurm_elastic/templates`` is a symlink to it, so the same files ship as package data
(setuptools copies the files through the link into wheels).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources

from slurm_elastic.config import ENV_PREFIX, ElasticConfig, load_config, parse_nnodes
from slurm_elastic.envvars import SIGNAL_LEAD_ENV
from slurm_elastic.errors import ConfigError
from slurm_elastic.slurm.env import SlurmEnv
from slurm_elastic.submit.requeue_option import (
    VersionProbe,
    installed_slurm_version,
    requeue_option,
)
from slurm_elastic.submit.sbatch_options import SBATCH_OPTIONS, SbatchOption
from slurm_elastic.submit.value_checks import (
    boolean_value,
    int_value,
    line_value,
    shell_words,
    slurm_time_minutes,
)

__all__ = [
    "CONFIG_KEYS",
    "SBATCH_OPTIONS",
    "TEMPLATES",
    "TEMPLATE_KEYS",
    "SbatchOption",
    "TemplateSpec",
    "VersionProbe",
    "boolean_value",
    "installed_slurm_version",
    "job_config",
    "list_templates",
    "render_template",
    "requeue_option",
    "slurm_time_minutes",
    "split_values",
    "template_text",
    "template_values",
]


@dataclass(frozen=True)
class TemplateSpec:
    """What a template needs besides its text.

    Attributes:
        name: the template's name (file ``<name>.sbatch``).
        summary: one line for ``slurm-elastic render --list``.
        defaults: values used when the caller gives none (template or config keys).
        fixed_nodes: True when the mode runs exactly ``nodes`` nodes (no MIN-MAX range).
    """

    name: str
    summary: str
    defaults: Mapping[str, object] = field(default_factory=dict)
    fixed_nodes: bool = False


TEMPLATES: dict[str, TemplateSpec] = {
    spec.name: spec
    for spec in (
        TemplateSpec(
            "fault_tolerant",
            "fixed N nodes x nproc_per_node trainers in one allocation; restarts on failure",
            {"nodes": 4, "nproc_per_node": 8, "max_restarts": 3},
            fixed_nodes=True,
        ),
        TemplateSpec(
            "elastic",
            "one allocation of --nodes=MIN-MAX; whatever Slurm grants in the range trains",
            {"min_nodes": 1, "max_nodes": 4},
        ),
        TemplateSpec(
            "elastic_array",
            "job array, one node per task; starts with the first task, requeues per task",
            {"min_nodes": 1, "max_nodes": 4},
        ),
    )
}

#: Template keys with their defaults (``None``: optional, left out when not given).
TEMPLATE_KEYS: dict[str, object] = {
    "mode": None,  # the template's name; `slurm-elastic submit` picks the shape with it
    "entrypoint": None,  # required: the training script (or module) the agents run
    "args": (),  # its arguments: a list, or one string of shell words
    "module": False,  # the entrypoint is a module: the agents run `python -m entrypoint`
    "job_name": "slurm-elastic",
    "nodes": None,  # fault_tolerant only
    "signal_lead_s": 120,  # --signal=B:<preempt_signal>@<lead>: notice this early
    "output_dir": None,  # sbatch --output directory; None: the submit directory (always exists)
    "setup": "",  # shell lines run before the agent (module load, venv activate)
    "launcher": "slurm-elastic",  # the command that provides `agent`
    "partition": None,
    "account": None,
    "qos": None,
    "time": None,  # sbatch --time, e.g. "04:00:00"
    "constraint": None,
    "mem": None,
    "gpus_per_node": None,
    "cpus_per_task": None,
    "exclusive": False,
    "expedited_requeue": False,  # --requeue=expedite (Slurm >= 25.11) instead of --requeue
    "sbatch_args": (),  # extra sbatch options, e.g. ["--mail-type=END"]
    "srun_args": (),  # extra srun options (allocation templates)
    "env": {},  # extra environment variables to export
}

#: Config keys accepted in the values (exported as SLURM_ELASTIC_<KEY>).
CONFIG_KEYS: tuple[str, ...] = (
    "nnodes",
    *(f.name for f in dataclasses.fields(ElasticConfig)),
)


#: The template ``slurm-elastic submit`` and :func:`job_config` use without a ``mode``.
DEFAULT_MODE = "elastic_array"
#: How error messages name the values when the caller does not say where they came from.
VALUES_SOURCE = "the job values"

_PLACEHOLDER = re.compile(r"\$(\$)?\{([a-z][a-z0-9_]*)\}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def list_templates() -> list[str]:
    """Return the names of the shipped templates, sorted."""
    return sorted(TEMPLATES)


def _spec(name: str) -> TemplateSpec:
    try:
        return TEMPLATES[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), TEMPLATES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown sbatch template {name!r}{hint} (choose one of: {', '.join(list_templates())})"
        ) from None


def template_text(name: str) -> str:
    """Return the unrendered text of template ``name``.

    Raises:
        ConfigError: no such template.
    """
    _spec(name)
    ref = resources.files("slurm_elastic") / "templates" / f"{name}.sbatch"
    try:
        return ref.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(
            f"sbatch template {name!r} is not installed at {ref}; reinstall slurm-elastic "
            "(the templates ship as package data)"
        ) from exc


def split_values(values: Mapping[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """Split a flat mapping into (config keys, template keys); ``-`` in keys becomes ``_``.

    Raises:
        ConfigError: a key is neither (the message suggests the closest known key).
    """
    config: dict[str, object] = {}
    template: dict[str, object] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key in TEMPLATE_KEYS:
            template[key] = value
        elif key in CONFIG_KEYS:
            config[key] = value
        else:
            known = [*TEMPLATE_KEYS, *CONFIG_KEYS]
            close = difflib.get_close_matches(key, known, n=2)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(
                f"unknown value {raw_key!r} for an sbatch template{hint} "
                f"(template keys: {', '.join(TEMPLATE_KEYS)}; config keys: {', '.join(CONFIG_KEYS)})"
            )
    return config, template


def _nodes(spec: TemplateSpec, config: dict[str, object], template: dict[str, object]) -> None:
    """Make the node counts consistent with the template's mode (in place)."""
    if "nnodes" in config:
        config["min_nodes"], config["max_nodes"] = parse_nnodes(config.pop("nnodes"))
    if spec.fixed_nodes:
        explicit = {k: config[k] for k in ("min_nodes", "max_nodes") if k in config}
        given = template.get("nodes")
        if (
            given is None
            and len(explicit) == 2
            and len({int_value(k, v, 1) for k, v in explicit.items()}) == 1
        ):
            given = explicit["min_nodes"]  # nnodes: N (or min_nodes = max_nodes) names the count
        nodes = int_value("nodes", given if given is not None else spec.defaults.get("nodes"), 1)
        if any(int_value(k, v, 1) != nodes for k, v in explicit.items()):
            raise ConfigError(
                f"template {spec.name!r} runs a fixed number of nodes (nodes={nodes}) but "
                f"{explicit} was given; set 'nodes' only, or use the 'elastic' template"
            )
        template["nodes"] = nodes
        config["min_nodes"] = config["max_nodes"] = nodes
    else:
        if template.get("nodes") is not None:
            raise ConfigError(
                f"template {spec.name!r} takes a node range: set min_nodes/max_nodes "
                f"(or nnodes: 'MIN:MAX') instead of nodes={template['nodes']!r}"
            )
        config.setdefault("min_nodes", spec.defaults["min_nodes"])
        if "max_nodes" not in config:
            default_max = int_value("max_nodes", spec.defaults["max_nodes"], 1)
            config["max_nodes"] = max(default_max, int_value("min_nodes", config["min_nodes"], 1))


def _resolve(
    name: str, values: Mapping[str, object], source: str = VALUES_SOURCE
) -> tuple[TemplateSpec, dict[str, object], dict[str, object], ElasticConfig]:
    """(spec, config keys to export, template keys with defaults, validated config)."""
    spec = _spec(name)
    config, template = split_values(values)
    if template.get("mode") not in (None, name):
        raise ConfigError(
            f"the values say mode {template['mode']!r} but template {name!r} is being "
            f"rendered; render {template['mode']!r} or drop 'mode'"
        )
    defaults_config, defaults_template = split_values(
        {k: v for k, v in spec.defaults.items() if k not in ("min_nodes", "max_nodes", "nodes")}
    )
    config = {**defaults_config, **config}
    template = {
        **{k: v for k, v in TEMPLATE_KEYS.items() if v is not None},
        **defaults_template,
        **{k: v for k, v in template.items() if v is not None},
    }
    _nodes(spec, config, template)

    # Validate and normalise the config keys with the config class itself, without
    # anything derived from this machine's environment.
    resolved = load_config(
        None,
        environ={},
        overrides=config,
        slurm=SlurmEnv.from_environ({}),
        overrides_source=source,
    )
    return spec, config, template, resolved


def job_config(
    values: Mapping[str, object], mode: str | None = None, *, source: str = VALUES_SOURCE
) -> dict[str, object]:
    """The config keys a job's script exports (``SLURM_ELASTIC_<KEY>``), validated.

    The same resolution as :func:`render_template` (and ``slurm-elastic submit``): the
    template's node logic and defaults for ``mode`` (default: the values' ``mode``, else
    ``elastic_array``). Inside the job these values win over ``SLURM_ELASTIC_*`` variables
    inherited from the submitting shell.

    ``source`` names where ``values`` came from in error messages (``"job file 'x.yaml'"``).

    Raises:
        ConfigError: as :func:`template_values` (``entrypoint`` is not required here).
    """
    name = str(mode or values.get("mode") or DEFAULT_MODE)
    _, config, _, resolved = _resolve(name, values, source)
    return {key: getattr(resolved, key) for key in sorted(config)}


def template_values(
    name: str,
    values: Mapping[str, object],
    *,
    source: str = VALUES_SOURCE,
    slurm_version: VersionProbe | None = None,
) -> dict[str, str]:
    """Resolve ``values`` into the text of every placeholder of template ``name``.

    Args:
        name: a template name (:func:`list_templates`).
        values: config keys and template keys (see the module docstring).
        source: where ``values`` came from, as error messages name it.
        slurm_version: see :func:`requeue_option` (asked only for ``expedited_requeue``).

    Returns:
        placeholder name -> rendered text.

    Raises:
        ConfigError: unknown template or key, a missing required value, or a bad value.
    """
    spec, config, template, resolved = _resolve(name, values, source)
    exported = {key: getattr(resolved, key) for key in sorted(config)}
    out = _command_values(name, spec, template, resolved, slurm_version)
    out["sbatch_options"] = _sbatch_options(template)
    out["srun_options"] = _srun_options(template)
    out["env_exports"] = _env_exports(exported, template, out["signal_lead_s"])
    return out


def _command_values(
    name: str,
    spec: TemplateSpec,
    template: Mapping[str, object],
    resolved: ElasticConfig,
    slurm_version: VersionProbe | None,
) -> dict[str, str]:
    """The job's name, output, nodes, and the command each task runs (launcher,
    entrypoint, args, setup)."""
    entrypoint = template.get("entrypoint")
    if not entrypoint:
        raise ConfigError(
            f"template {name!r} needs a value for 'entrypoint' (the training script the "
            "agents run, e.g. train.py): set 'entrypoint: train.py' in the YAML or pass "
            "--set entrypoint=train.py"
        )

    output_dir = template.get("output_dir")
    launcher = shell_words("launcher", template["launcher"])
    if not launcher:
        raise ConfigError(
            "template value 'launcher' is empty: set it to a command that provides `agent`, e.g. slurm-elastic"
        )
    out: dict[str, str] = {
        "job_name": line_value("job_name", template["job_name"]),
        "output_prefix": f"{line_value('output_dir', output_dir).rstrip('/')}/"
        if output_dir
        else "",
        "launcher": " ".join(shlex.quote(w) for w in launcher),
        "launcher_command": shlex.quote(launcher[0]),
        "entrypoint": ("-m " if boolean_value("module", template["module"]) else "")
        + shlex.quote(line_value("entrypoint", entrypoint)),
        "signal_lead_s": str(int_value("signal_lead_s", template["signal_lead_s"], 0)),
        "preempt_signal": resolved.preempt_signal,
        "min_nodes": str(resolved.min_nodes),
        "max_nodes": str(resolved.max_nodes),
        "array_last": str(resolved.max_nodes - 1),
        "nproc_per_node": str(resolved.nproc_per_node or "auto"),
        "requeue_option": requeue_option(
            boolean_value("expedited_requeue", template["expedited_requeue"]), slurm_version
        ),
    }
    if spec.fixed_nodes:
        out["nodes"] = str(template["nodes"])
    args = shell_words("args", template["args"])
    out["args"] = (" " + shlex.join(args)) if args else ""

    setup = template["setup"]
    setup_text = setup if isinstance(setup, str) else "\n".join(shell_words("setup", setup))
    out["setup"] = setup_text.strip("\n")
    return out


def _sbatch_options(template: Mapping[str, object]) -> str:
    """The ``#SBATCH`` lines: one per Slurm option set (:data:`SBATCH_OPTIONS`), then
    ``sbatch_args``."""
    sbatch = []
    for opt in SBATCH_OPTIONS:
        value = template.get(opt.key)
        if value is None:
            continue
        if opt.boolean:
            if boolean_value(opt.key, value):
                sbatch.append(f"#SBATCH {opt.flag}")
        else:
            if opt.check is not None:
                opt.check(value)
            sbatch.append(f"#SBATCH {opt.flag}={line_value(opt.key, value)}")
    sbatch += [f"#SBATCH {arg}" for arg in shell_words("sbatch_args", template["sbatch_args"])]
    return "\n".join(sbatch)


def _srun_options(template: Mapping[str, object]) -> str:
    """The options of the ``srun`` that starts one agent per node."""
    # Since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch.
    srun = []
    if template.get("cpus_per_task") is not None:
        srun.append(f"--cpus-per-task={int_value('cpus_per_task', template['cpus_per_task'], 1)}")
    srun += shell_words("srun_args", template["srun_args"])
    return "".join(" " + shlex.quote(a) for a in srun)


def _env_exports(
    exported: Mapping[str, object], template: Mapping[str, object], signal_lead_s: str
) -> str:
    """The script's ``export`` lines: the config keys, the notice lead, the user's ``env``."""
    exports = [
        f"export {ENV_PREFIX}{key.upper()}={shlex.quote(str(value))}"
        for key, value in exported.items()
        if value is not None
    ]
    # the agent judges whether a checkpoint save fits the notice (slurm_elastic.slurm.window)
    exports.append(f"export {SIGNAL_LEAD_ENV}={signal_lead_s}")
    env = template["env"]
    if not isinstance(env, Mapping):
        raise ConfigError(f"template value 'env' = {env!r}: expected a mapping NAME: value")
    for env_name, env_value in sorted(env.items()):
        if not _ENV_NAME.match(str(env_name)):
            raise ConfigError(
                f"template value 'env' has the invalid variable name {env_name!r}; "
                "use letters, digits and '_'"
            )
        exports.append(f"export {env_name}={shlex.quote(line_value(f'env.{env_name}', env_value))}")
    return "\n".join(exports)


def render_template(
    name: str,
    values: Mapping[str, object] | None = None,
    *,
    source: str = VALUES_SOURCE,
    slurm_version: VersionProbe | None = None,
) -> str:
    """Render template ``name`` with ``values``: a dry run by construction.

    Args:
        name: a template name (:func:`list_templates`).
        values: config keys and template keys (see the module docstring); ``entrypoint``
            is required.
        source: where ``values`` came from, as error messages name it.
        slurm_version: see :func:`requeue_option` (asked only for ``expedited_requeue``).

    Returns:
        The complete sbatch script.

    Raises:
        ConfigError: unknown template or key, missing ``entrypoint``, or a bad value;
            the message names the key and the fix.
    """
    text = template_text(name)
    resolved = template_values(name, values or {}, source=source, slurm_version=slurm_version)
    missing: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        escaped, key = match.group(1), match.group(2)
        if escaped:
            return "${" + key + "}"
        if key not in resolved:
            missing.append(key)
            return match.group(0)
        return resolved[key]

    lines: list[str] = []
    for line in text.splitlines():
        only = _PLACEHOLDER.fullmatch(line.strip())
        rendered = _PLACEHOLDER.sub(substitute, line)
        if only and not only.group(1) and rendered.strip() == "":
            continue
        lines.append(rendered)
    if missing:
        raise ConfigError(
            f"template {name!r} uses placeholders without a value: {', '.join(sorted(set(missing)))}; "
            "set them in the YAML or with --set KEY=VALUE"
        )
    return "\n".join(lines) + "\n"
