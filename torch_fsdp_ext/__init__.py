"""torch_fsdp_ext: repairs two FSDP2 (``fully_shard``) mixed-precision failures.

``import torch_fsdp_ext`` installs every fix this torch release needs; set
``TORCH_FSDP_EXT_DISABLE=1`` to import without installing. See README.md.
"""

import os as _os
import warnings as _warnings

from ._dtype_plan import MixedParamDtypeError
from ._dtype_strategies import STRATEGIES
from ._install import FIX_NAMES, FixStatus, Status, install, installed, status, uninstall

__all__ = [
    "FIX_NAMES",
    "STRATEGIES",
    "FixStatus",
    "MixedParamDtypeError",
    "Status",
    "install",
    "installed",
    "status",
    "uninstall",
]
__version__ = "0.1.0"

if _os.environ.get("TORCH_FSDP_EXT_DISABLE", "") not in ("1", "true", "True", "yes"):
    try:
        install()
    except Exception as _e:  # noqa: BLE001 - importing must never break a training script
        _warnings.warn(f"torch_fsdp_ext: not installed at import: {_e!r}", RuntimeWarning, stacklevel=2)
