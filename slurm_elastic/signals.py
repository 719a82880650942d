"""Signal names: the one parser of the preemption notice signal.

``"USR2"``, ``"SIGUSR2"``, ``"usr2"``, ``12`` and ``signal.SIGUSR2`` all name the same
signal. Torch-free (the lowest layer): the config, the notice helpers of the workers and
the submission side use it without importing torch.
"""

from __future__ import annotations

import signal as _signal

from slurm_elastic.errors import ConfigError

__all__ = ["DEFAULT_PREEMPT_SIGNAL", "UNCATCHABLE", "parse_signal", "preempt_signal_name"]

#: USR2 because NCCL may swallow USR1.
DEFAULT_PREEMPT_SIGNAL = "USR2"
#: Signals no handler can catch: never a notice signal.
UNCATCHABLE = frozenset({"KILL", "STOP"})


def parse_signal(sig: str | int | _signal.Signals) -> _signal.Signals:
    """Turn ``"USR2"``, ``"SIGUSR2"``, ``12`` or ``signal.SIGUSR2`` into a signal.

    Raises:
        ConfigError: the name or number is not a signal of this platform.
    """
    if isinstance(sig, _signal.Signals):
        return sig
    if isinstance(sig, int):
        try:
            return _signal.Signals(sig)
        except ValueError as exc:
            raise ConfigError(
                f"preempt signal {sig!r} is not a signal number on this platform; "
                "use a name such as 'USR2'"
            ) from exc
    name = str(sig).strip().upper()
    if name.isdigit():
        return parse_signal(int(name))
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return _signal.Signals[name]
    except KeyError as exc:
        raise ConfigError(
            f"preempt signal {sig!r} is not a known signal; use a name such as 'USR2' or 'USR1'"
        ) from exc


def preempt_signal_name(value: object) -> str:
    """The config's form of a notice signal: ``"SIGUSR2"``/``"usr2"``/``"12"`` -> ``"USR2"``.

    Raises:
        ConfigError: not a signal, or one that cannot be caught (KILL, STOP); the message
            names the config key ``preempt_signal``.
    """
    raw = str(value).strip().upper()
    if raw.isdigit():
        try:
            return _signal.Signals(int(raw)).name.removeprefix("SIG")
        except ValueError:
            pass
    name = raw.removeprefix("SIG")
    if f"SIG{name}" in _signal.Signals.__members__ and name not in UNCATCHABLE:
        return name
    raise ConfigError(
        f"config key 'preempt_signal' = {value!r}: must be a catchable signal name "
        "such as USR2, USR1, TERM or HUP"
    )
