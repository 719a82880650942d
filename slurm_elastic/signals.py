"""Signal names: the one parser of the preemption notice signal; early notices.

``"USR2"``, ``"SIGUSR2"``, ``"usr2"``, ``12`` and ``signal.SIGUSR2`` all name the same
signal.

A notice may come before the agent can act on it (Slurm may send ``--signal`` within
seconds of the start, while Python imports torch): :func:`hold_early_notices`, called
first thing by ``slurm-elastic agent``, remembers USR1/USR2 instead of dying of them,
and :func:`take_early_notices` hands them to the agent once its own handlers exist. Torch-free (the lowest layer): the config, the notice helpers of the workers and
the submission side use it without importing torch.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Collection
from types import FrameType

from slurm_elastic.errors import ConfigError

__all__ = [
    "DEFAULT_PREEMPT_SIGNAL",
    "EARLY_NOTICE_SIGNALS",
    "UNCATCHABLE",
    "hold_early_notices",
    "parse_signal",
    "preempt_signal_name",
    "take_early_notices",
]

#: USR2 because NCCL may swallow USR1.
DEFAULT_PREEMPT_SIGNAL = "USR2"
#: Signals no handler can catch: never a notice signal.
UNCATCHABLE = frozenset({"KILL", "STOP"})
#: The usual notice signals, whose default action ends the process: held early.
EARLY_NOTICE_SIGNALS: tuple[_signal.Signals, ...] = (_signal.SIGUSR1, _signal.SIGUSR2)

_early: list[_signal.Signals] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _early.append(_signal.Signals(signum))


def hold_early_notices() -> None:
    """Remember USR1/USR2 from now on, until :func:`take_early_notices`.

    Call it first thing in a process that becomes the agent, before slow imports
    (torch): a notice that arrives meanwhile is neither fatal (the default action) nor
    lost. It also unblocks them: the job script starts the agent with the notice blocked
    (``env --block-signal``) so that one sent during interpreter start-up stays pending;
    it is delivered here. Main thread only.
    """
    for sig in EARLY_NOTICE_SIGNALS:
        _signal.signal(sig, _remember)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, EARLY_NOTICE_SIGNALS)


def take_early_notices(handled: Collection[_signal.Signals]) -> list[_signal.Signals]:
    """The signals :func:`hold_early_notices` remembered, oldest first (then forgotten).

    Call it after installing the agent's own handlers for ``handled``: an early-held
    signal the agent does not handle gets its default action back.
    """
    for sig in EARLY_NOTICE_SIGNALS:
        if sig not in handled and _signal.getsignal(sig) is _remember:
            _signal.signal(sig, _signal.SIG_DFL)
    taken = list(_early)
    _early.clear()
    return taken


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
