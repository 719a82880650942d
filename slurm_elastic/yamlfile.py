"""Reading the YAML job and config files: one loader for every verb.

:func:`load_mapping` reads a flat mapping with a safe loader that differs from PyYAML's
``SafeLoader`` in one way: YAML 1.1's base-60 ("sexagesimal") numbers are not numbers.
YAML 1.1 reads an unquoted ``nnodes: 1:4`` as the integer 64 and ``time: 4:00:00`` as
14400; here both stay the strings ``"1:4"`` and ``"4:00:00"``, which is what anyone
writing them means (YAML 1.2 dropped the form too). Every other scalar resolves as in
``yaml.safe_load``.

Every failure is a :class:`~slurm_elastic.errors.ConfigError` naming the file and the
fix: missing, unreadable, binary, not valid YAML, or not a mapping.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from slurm_elastic.errors import ConfigError

__all__ = ["Loader", "load_mapping"]

_INT = re.compile(
    r"""^(?:[-+]?0b[0-1_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""",
    re.X,
)
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without YAML 1.1's sexagesimal ints and floats."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load_mapping(path: str | os.PathLike[str], what: str = "config file") -> dict[str, Any]:
    """Read ``path`` as a YAML mapping (empty file: ``{}``); keys become strings.

    Raises:
        ConfigError: the file is missing, unreadable, binary, not valid YAML or not a
            mapping; the message names the file and the fix.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=Loader)  # a SafeLoader: no arbitrary objects
    except FileNotFoundError:
        raise ConfigError(f"{what} {name!r} does not exist; check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {name!r} is a directory; name a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"{what} {name!r} is not text (not UTF-8); name the YAML file, not a binary"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{what} {name!r} cannot be read ({exc.strerror}); fix its permissions"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(
            f"{what} {name!r} is not valid YAML{where} ({problem}); fix the file "
            "(a flat mapping of key: value lines)"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what} {name!r} must hold a mapping of key: value lines, not a {type(data).__name__}"
        )
    return {str(k): v for k, v in data.items()}
