"""How a template value is read: an integer, a boolean, one line of text, shell words,
a Slurm time.

Template values come from a YAML job file or ``--set k=v``: text or YAML scalars and
lists. Each reader takes the key (for the message) and the value, and raises
:class:`~slurm_elastic.errors.ConfigError` naming both and what was expected; a value
that would end up in a ``#SBATCH`` line or a command must be a single line.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from slurm_elastic.errors import ConfigError

__all__ = ["boolean_value", "int_value", "line_value", "shell_words", "slurm_time_minutes"]


def int_value(key: str, value: object, minimum: int) -> int:
    """The value as an integer of at least ``minimum`` (no bool, no fraction)."""
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        number = int(str(value).strip()) if isinstance(value, str) else int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"template value {key!r} = {value!r}: expected an integer") from exc
    if number < minimum:
        raise ConfigError(f"template value {key!r} = {value!r}: must be >= {minimum}")
    return number


def boolean_value(key: str, value: object) -> bool:
    """A template flag's value as a bool (``true``/``yes``/``1``...).

    Raises:
        ConfigError: not a boolean.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"template value {key!r} = {value!r}: expected true or false")


def line_value(key: str, value: object) -> str:
    """The value as one line of text (a string or a number, no newline)."""
    if not isinstance(value, str | int | float):  # a mapping or list is a mistake
        raise ConfigError(
            f"template value {key!r} = {value!r}: expected a string, not a {type(value).__name__}"
        )
    text = str(value)
    if "\n" in text or "\r" in text:
        raise ConfigError(
            f"template value {key!r} = {value!r}: must be a single line "
            "(a newline would end the #SBATCH directive or the command)"
        )
    return text


def shell_words(key: str, value: object) -> list[str]:
    """The value as a list of words: one string of shell words, or a list of lines."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ConfigError(
                f"template value {key!r} = {value!r}: not valid shell words ({exc})"
            ) from exc
    if isinstance(value, Sequence):
        return [line_value(key, v) for v in value]
    raise ConfigError(
        f"template value {key!r} = {value!r}: expected a list of strings or one string"
    )


def slurm_time_minutes(value: object) -> int:
    """Minutes of a Slurm ``--time`` (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``).

    Seconds round up to the next minute (the template checks a time with it).

    Raises:
        ConfigError: not a Slurm time.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    try:
        days = 0
        if "-" in text:
            d, text = text.split("-", 1)
            days = int(d)
            parts = [int(p) for p in text.split(":")] + [0, 0]
            hours, minutes, seconds = parts[0], parts[1], parts[2]
        else:
            parts = [int(p) for p in text.split(":")]
            if len(parts) == 1:
                hours, minutes, seconds = 0, parts[0], 0
            elif len(parts) == 2:
                hours, minutes, seconds = 0, parts[0], parts[1]
            elif len(parts) == 3:
                hours, minutes, seconds = parts
            else:
                raise ValueError(text)
    except ValueError as exc:
        raise ConfigError(
            f"time {value!r}: expected minutes or a Slurm time such as '04:00:00' or '1-12:00'"
        ) from exc
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)
