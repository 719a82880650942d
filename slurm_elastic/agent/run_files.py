"""The run's files on shared storage, as the agent sets them up: private directories,
the run key, and the workers' log layout.

Every directory of the run (state, rendezvous root, checkpoints, events, logs) is
``0700`` and checked before use; the run key seals each round's store
(:mod:`slurm_elastic.live.auth`); the workers' output goes to per-rank files kept
across restarts and requeues (``slurm-elastic logs`` reads them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from slurm_elastic.config import ElasticConfig
from slurm_elastic.live import auth
from slurm_elastic.privatefs import ensure_private_dir, private_tree

__all__ = ["RoundLogsSpecs", "private_directories", "run_key", "worker_logs"]


class RoundLogsSpecs(DefaultLogsSpecs):
    """torch's log layout, one ``attempt_<n>`` directory per round, none overwritten.

    torch names a round's directory after ``TORCHELASTIC_RESTART_COUNT`` and deletes it
    first; a restart not charged to ``max_restarts`` (a membership change) reuses the
    count and would wipe the previous round's logs. Here ``n`` counts rounds instead (the
    workers' environment is unchanged).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rounds = 0
        self._root = kwargs.get("log_dir")

    def reify(self, envs: dict[int, dict[str, str]]) -> Any:
        numbered = {
            r: {**e, "TORCHELASTIC_RESTART_COUNT": str(self._rounds)} for r, e in envs.items()
        }
        self._rounds += 1
        dest = super().reify(numbered)
        if self._root:  # torch makes attempt_<n>/<rank> with the umask: 0700 like ours
            private_tree(Path(self._root))
        return dest


def worker_logs(config: ElasticConfig, redirects: str, tee: str) -> tuple[Path, str, str]:
    """Where the workers' output goes: per-rank files kept across restarts and requeues.

    With no ``log_dir`` configured, the files go under ``state_dir/logs/<run_id>`` (``run``
    without a run id) and are also copied to the agent's output (``tee``), each line
    prefixed ``[rank<R>]:``, unless the user chose ``redirects``/``tee`` explicitly or the
    run has no id (``slurm-elastic logs`` reads them). Never torch's default, a new
    ``torchelastic_*`` directory in the system's temporary directory per agent start that
    nothing removes.
    """
    if config.log_dir is not None:
        return config.log_dir, redirects, tee
    log_dir = config.state_dir / "logs" / (config.run_id or "run")
    if config.run_id is None or (redirects, tee) != ("0", "0"):
        return log_dir, redirects, tee
    return log_dir, "0", "3"


def private_directories(config: ElasticConfig, log_dir: Path | None) -> None:
    """Create the run's directories ``0700`` (whatever the umask or a setgid parent) and
    check the existing ones: the state directory and, wherever they are, the rendezvous
    root, checkpoints, events and logs. Below the state directory every component must be
    private; a directory configured elsewhere is checked from itself down.

    Raises:
        UnsafeDirectoryError: a component is a link, not ours, or writable by others.
        OSError: one cannot be created.
    """
    state = Path(os.path.abspath(config.state_dir))
    wanted: list[Path | None] = [state, config.events_dir, config.checkpoint_dir, log_dir]
    if config.rdzv_backend == "slurm":
        wanted.append(config.rdzv_dir)
    for directory in wanted:
        if directory is None:
            continue
        path = Path(os.path.abspath(directory))
        inside = path == state or state in path.parents
        ensure_private_dir(path, root=state if inside else path)


def run_key(config: ElasticConfig) -> Path:
    """The run key's file (created by the first agent), in the run's private directory
    that every node shares: the rendezvous root for the ``slurm`` backend, else the state
    directory. Its workers seal the round's store with it (:mod:`slurm_elastic.live.auth`).
    """
    base = Path(
        os.path.abspath(config.rdzv_dir if config.rdzv_backend == "slurm" else config.state_dir)
    )
    keys = ensure_private_dir(base / ".keys", root=base)
    return auth.load_or_create_key(keys, f"{config.run_id or 'run'}.key")
