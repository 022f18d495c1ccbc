"""Environment variables read at import. Case and surrounding whitespace never matter.

- ``TORCH_FSDP_EXT_DISABLE``: import without installing anything (an unknown value warns
  and counts as unset: the fixes stay on);
- ``TORCH_FSDP_EXT_FIXES``: the fixes the import installs, comma-separated (unset: all this
  torch needs). An unknown name raises, listing the names;
- ``TORCH_FSDP_EXT_DTYPE_STRATEGY``: the dtype strategy used when ``install()`` names none.
  An unknown value raises: a strategy the user asked for is never silently replaced by
  the default;
- ``TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE`` (read by ``_compute_dtype``): a value that
  names no module raises for the same reason.
"""

from __future__ import annotations

import os
import warnings
from typing import Iterable

class SettingError(ValueError):
    """A setting the plugin cannot honour (environment or API); raised, never replaced by a default."""


SettingError.__module__ = "torch_fsdp_ext"  # where users import it from; tracebacks name it so


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def switch(name: str) -> bool:
    """An on/off variable: case and surrounding whitespace do not matter; unset is off.

    An unknown value warns and counts as unset.
    """
    raw = os.environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        warnings.warn(
            f"torch_fsdp_ext: ignoring {name}={raw!r}: expected 1/true/yes/on or 0/false/no/off",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


def parse_choice(value: object, allowed: Iterable[str], what: str) -> str:
    """``value`` as one of ``allowed``: case and surrounding whitespace do not matter.

    Anything else raises ``ValueError`` naming ``what`` and the allowed values. The
    environment and the Python API parse their settings with this one function.
    """
    allowed = tuple(allowed)
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in allowed:
        raise SettingError(
            f"torch_fsdp_ext: {what} must be one of {', '.join(allowed)} (any case), got {value!r}"
        )
    return name


def choice(name: str, allowed: Iterable[str]) -> str | None:
    """The variable as one of ``allowed`` (see ``parse_choice``), or None when unset or empty.

    An unknown value raises ``ValueError`` naming the variable and the allowed values.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return parse_choice(raw, allowed, name)


def parse_names(value: str, allowed: Iterable[str], what: str) -> tuple[str, ...]:
    """Comma-separated names, each one of ``allowed`` (case and whitespace do not matter), in the order
    of ``allowed``. None of them, or one that is not allowed, raises ``SettingError`` listing ``allowed``."""
    allowed = tuple(allowed)
    names = {name.strip().lower() for name in value.split(",") if name.strip()}
    unknown = sorted(names.difference(allowed))
    if unknown or not names:
        named = f"unknown name(s) {', '.join(map(repr, unknown))}" if unknown else "no name"
        raise SettingError(
            f"torch_fsdp_ext: {what} must name some of {', '.join(allowed)} (comma-separated, any case), "
            f"got {named} in {value!r}"
        )
    return tuple(name for name in allowed if name in names)


def names(name: str, allowed: Iterable[str]) -> tuple[str, ...] | None:
    """The variable as comma-separated names of ``allowed`` (see ``parse_names``), or None when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return parse_names(raw, allowed, name)
