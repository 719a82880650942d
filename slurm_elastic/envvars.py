"""Our own ``SLURM_ELASTIC_*`` environment variables, as one table.

Every variable slurm_elastic (or its scripts) sets or reads is a row of :data:`VARIABLES`:
its name, what it means, who sets it and who reads it. Modules import the names from
here instead of spelling string literals, and ``tests/config/test_envvars.py`` checks that
no other module of the package spells one and that the README's reference is this table
(:func:`markdown_table`).

Two families are described by a pattern rather than one row each:

* ``SLURM_ELASTIC_<KEY>``: one variable per config key (``SLURM_ELASTIC_MAX_NODES=4``),
  read by :func:`slurm_elastic.config.load_config`. Some rows below are config keys too
  (the agent exports ``RUN_ID``, ``CHECKPOINT_DIR``, ``EVENTS_DIR`` and
  ``PREEMPT_SIGNAL`` to its workers, and the config would resolve them the same way);
* ``SLURM_ELASTIC_CLUSTER*``: the local test cluster (``scripts/slurm-cluster``).

Torch-free and import-free (besides the standard library): the lowest layer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "CLUSTER_PREFIX",
    "CONFIG_KEY_PATTERN",
    "EVENTS_DIR_ENV",
    "IN_PLACE_ENV",
    "KEY_FILE_ENV",
    "LOG_LEVEL_ENV",
    "NODE_DIR_ENV",
    "NOTICE_HELD_ENV",
    "PREEMPT_SIGNAL_ENV",
    "PREFIX",
    "REQUEUE_COUNT_ENV",
    "ROUND_ENV",
    "RUN_ID_ENV",
    "SIGNAL_LEAD_ENV",
    "SUBMISSION_ENV",
    "TEST_PAUSE_AT_ENV",
    "TEST_PAUSE_DIR_ENV",
    "TEST_PREFIX",
    "VARIABLES",
    "EnvVar",
    "config_key_variable",
    "lookup",
    "markdown_table",
]

#: The prefix of every variable of ours.
PREFIX = "SLURM_ELASTIC_"
#: The family of config-key variables (``<KEY>`` is a config key, upper case).
CONFIG_KEY_PATTERN = f"{PREFIX}<KEY>"

RUN_ID_ENV = f"{PREFIX}RUN_ID"
CHECKPOINT_DIR_ENV = f"{PREFIX}CHECKPOINT_DIR"
EVENTS_DIR_ENV = f"{PREFIX}EVENTS_DIR"
REQUEUE_COUNT_ENV = f"{PREFIX}REQUEUE_COUNT"
NODE_DIR_ENV = f"{PREFIX}NODE_DIR"
NOTICE_HELD_ENV = f"{PREFIX}NOTICE_HELD"
PREEMPT_SIGNAL_ENV = f"{PREFIX}PREEMPT_SIGNAL"
LOG_LEVEL_ENV = f"{PREFIX}LOG_LEVEL"
ROUND_ENV = f"{PREFIX}ROUND"
IN_PLACE_ENV = f"{PREFIX}IN_PLACE"
KEY_FILE_ENV = f"{PREFIX}KEY_FILE"
SIGNAL_LEAD_ENV = f"{PREFIX}SIGNAL_LEAD_S"
SUBMISSION_ENV = f"{PREFIX}SUBMISSION"
#: ``SLURM_ELASTIC_CLUSTER``, ``SLURM_ELASTIC_CLUSTER_DIR``, ``..._MODE``, ...
CLUSTER_PREFIX = f"{PREFIX}CLUSTER"
#: Reserved for test harnesses; never a config key.
TEST_PREFIX = f"{PREFIX}TEST_"
#: Test seam (``slurm_elastic._startup_seam``, the job scripts): pause start-up at this phase...
TEST_PAUSE_AT_ENV = f"{TEST_PREFIX}PAUSE_AT"
#: ... and wait there for ``<phase>.go`` in this directory.
TEST_PAUSE_DIR_ENV = f"{TEST_PREFIX}PAUSE_DIR"


@dataclass(frozen=True)
class EnvVar:
    """One of our environment variables.

    Attributes:
        name: the variable's name, or a pattern (``<KEY>``, ``*``) for a family.
        meaning: what its value means.
        set_by: who sets it.
        read_by: who reads it.
        config_key: the :class:`~slurm_elastic.config.ElasticConfig` field it also sets,
            if any (the config reads every ``SLURM_ELASTIC_<KEY>``).
    """

    name: str
    meaning: str
    set_by: str
    read_by: str
    config_key: str | None = None

    @property
    def is_family(self) -> bool:
        """Whether the row describes a family of names (a pattern) rather than one name."""
        return self.name.endswith("*") or "<" in self.name


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        CONFIG_KEY_PATTERN,
        "a config key, e.g. SLURM_ELASTIC_MAX_NODES=4 (beats the YAML file, loses to flags)",
        "you; `render` exports the job file's config keys in the sbatch script",
        "`slurm_elastic.config.load_config` (agent, `config`)",
    ),
    EnvVar(
        RUN_ID_ENV,
        "the run id (rendezvous and checkpoint namespace)",
        "the agent, for its workers",
        "workers; events (`run_id` of each record); the config (key `run_id`)",
        config_key="run_id",
    ),
    EnvVar(
        CHECKPOINT_DIR_ENV,
        "this run's checkpoint directory",
        "the agent, for its workers",
        "`CheckpointManager.from_env`; the config (key `checkpoint_dir`)",
        config_key="checkpoint_dir",
    ),
    EnvVar(
        EVENTS_DIR_ENV,
        "where events are written (JSONL, one file per live process; each agent merges "
        "those of its node's gone processes into `<host>.archive.jsonl`); unset: no events",
        "the agent, for itself and its workers",
        "`slurm_elastic.events`; the config (key `events_dir`)",
        config_key="events_dir",
    ),
    EnvVar(
        PREEMPT_SIGNAL_ENV,
        "the preemption notice signal (USR2)",
        "the agent, for its workers",
        "`notice.install_preemption_handler`; the config (key `preempt_signal`)",
        config_key="preempt_signal",
    ),
    EnvVar(
        SIGNAL_LEAD_ENV,
        "seconds between the time-limit notice and the limit (the job's --signal lead)",
        "the job script (`render`, `submit`), from the template key `signal_lead_s`",
        "the agent's preemption-window check (`slurm_elastic.slurm.window`)",
    ),
    EnvVar(
        REQUEUE_COUNT_ENV,
        "how often this node's job/task was requeued (Slurm's SLURM_RESTART_COUNT)",
        "the agent, for its workers",
        "training scripts (informational)",
    ),
    EnvVar(
        NODE_DIR_ENV,
        "the node channel: the agent's private node-local directory of the messages "
        "between it and its workers (notice, progress, registrations, assignments; "
        "`slurm_elastic.channel` lists them)",
        "the agent, for its workers",
        "`slurm_elastic.notice` and `slurm_elastic.live` in the workers; the agent",
    ),
    EnvVar(
        NOTICE_HELD_ENV,
        "the job script runs again with the notice blocked: 1 if a notice came before "
        "(raised again, pending); unset before `setup`",
        "the `elastic_array` job script, for itself",
        "the `elastic_array` job script",
    ),
    EnvVar(
        ROUND_ENV,
        "the rendezvous round the workers were started in",
        "the agent, for its workers",
        "`slurm_elastic.live` (tells a new assignment from a stale one)",
    ),
    EnvVar(
        KEY_FILE_ENV,
        "the run key (a 0600 file in the run's private directory) that seals the round's "
        "store values, so that only the run's own processes take a seat",
        "the agent, for its workers",
        "`slurm_elastic.live` in the workers",
    ),
    EnvVar(
        SUBMISSION_ENV,
        "a random id of one submission (16 hex digits): Slurm hands it to every task and "
        "keeps it across requeues; the first agent of a run records it, and an agent of "
        "another submission whose job id repeats the run's stops",
        "`slurm-elastic submit` and `submit()`, through sbatch's environment",
        "the agent (`slurm_elastic.agent.run_owner`)",
    ),
    EnvVar(
        IN_PLACE_ENV,
        "0: membership changes restart the workers instead of re-forming in place",
        "you (agent and workers)",
        "the agent; `slurm_elastic.live.ElasticLoop`",
    ),
    EnvVar(
        LOG_LEVEL_ENV,
        "log level of slurm_elastic programs (DEBUG, INFO, ...); beats -v/-q",
        "you",
        "`slurm-elastic` (the CLI's `configure_logging`) and local node processes",
    ),
    EnvVar(
        f"{CLUSTER_PREFIX}*",
        "the local test cluster: _DIR, _MODE, _NODES, _UP_TIMEOUT, _KEEP_LOGS, ...; "
        "SLURM_ELASTIC_CLUSTER=0 disables it for the tests",
        "you; `scripts/slurm-cluster` writes them into the cluster's env file",
        "`scripts/slurm-cluster`, `tests/conftest.py`, `bench/`",
    ),
    EnvVar(
        f"{TEST_PREFIX}*",
        "reserved for test harnesses",
        "tests",
        "tests",
    ),
)


def config_key_variable(key: str) -> str:
    """The variable that sets config key ``key`` (``max_nodes`` -> ``SLURM_ELASTIC_MAX_NODES``)."""
    return f"{PREFIX}{key.upper()}"


def lookup(name: str) -> EnvVar | None:
    """The row of ``name`` (an exact row first, then a ``*`` family), or ``None``.

    The ``SLURM_ELASTIC_<KEY>`` family is not matched here: which keys exist is the
    config's business (:mod:`slurm_elastic.config`).
    """
    for var in VARIABLES:
        if var.name == name:
            return var
    for var in VARIABLES:
        if var.name.endswith("*") and name.startswith(var.name[:-1]):
            return var
    return None


def markdown_table() -> str:
    """The table as Markdown (the README's environment reference is exactly this text)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| variable | meaning | set by | read by |", "|---|---|---|---|"]
    for var in VARIABLES:
        lines.append(
            f"| `{var.name}` | {cell(var.meaning)} | {cell(var.set_by)} | {cell(var.read_by)} |"
        )
    return "\n".join(lines) + "\n"
