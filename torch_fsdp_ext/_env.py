"""Environment variables read at import: parsed leniently, and a bad value never breaks the import.

- ``TORCH_FSDP_EXT_DISABLE``: import without installing anything;
- ``TORCH_FSDP_EXT_DTYPE_STRATEGY``: the dtype strategy used when ``install()`` names none.
"""

from __future__ import annotations

import os
import warnings
from typing import Iterable

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


def choice(name: str, allowed: Iterable[str]) -> str | None:
    """One of ``allowed`` (case and whitespace do not matter), or None when unset, empty or unknown.

    An unknown value warns, naming the allowed ones, and counts as unset.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    allowed = tuple(allowed)
    value = raw.strip().lower()
    if value in allowed:
        return value
    warnings.warn(
        f"torch_fsdp_ext: ignoring {name}={raw!r}: expected one of {', '.join(allowed)}",
        RuntimeWarning,
        stacklevel=2,
    )
    return None
