"""torch_fsdp_ext repairs three FSDP2 (fully_shard) mixed-precision failures: mixed parameter dtypes in one group;
activation-checkpoint recompute; gradient reduction in reduce_dtype.

``import torch_fsdp_ext`` installs every fix this torch release needs: it wraps FSDP2's own
functions then, and what optimizers, activation checkpointing and DCP run (for any model)
only from the first ``fully_shard`` on (``status()`` lists both). Set
``TORCH_FSDP_EXT_FIXES=reduce`` (comma-separated names of ``FIX_NAMES``) to install only
those, ``TORCH_FSDP_EXT_DISABLE=1`` to import without installing, and
``TORCH_FSDP_EXT_DTYPE_STRATEGY`` to choose the dtype strategy (an unknown fix or strategy
stops the import with a ``SettingError``, a ``ValueError``), and
``TORCH_FSDP_EXT_REDUCE_DTYPE=float32`` to accumulate and reduce gradients in fp32 where a
``fully_shard`` policy asks for 16 bits or nothing. See README.md.
"""

import sys as _sys
import warnings as _warnings

# Note: torch warns "Failed to initialize NumPy" when it is imported without numpy, an optional
# package of its own that the plugin never uses; importing torch here keeps that out of status and doctor.
with _warnings.catch_warnings():
    _warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch as _torch  # noqa: F401

from . import _env, _install
from ._dtype import _compute_dtype
from ._dtype._compute_dtype import LoadedDtypeModules, MixedPrecisionPolicy, compute_in_loaded_dtype
from ._dtype._loaded_dtypes import iter_state_dict_as_loaded, loaded_dtypes, save_loaded_dtypes, state_dict_as_loaded
from ._dtype._plan import MixedParamDtypeError
from ._dtype._strategies import STRATEGIES
from ._env import SettingError
from ._install import FIX_NAMES, FixStatus, Status, install, installed, status, uninstall, upcast_now
from ._rank_consistency import RankCheckTimeoutError

__all__ = [
    "FIX_NAMES",
    "STRATEGIES",
    "FixStatus",
    "LoadedDtypeModules",
    "MixedPrecisionPolicy",
    "MixedParamDtypeError",
    "RankCheckTimeoutError",
    "SettingError",
    "Status",
    "compute_in_loaded_dtype",
    "install",
    "installed",
    "iter_state_dict_as_loaded",
    "loaded_dtypes",
    "save_loaded_dtypes",
    "state_dict_as_loaded",
    "status",
    "uninstall",
    "upcast_now",
]
__version__ = "0.1.0"

_compute_dtype.set_default_selectors(_compute_dtype.selectors_from_env())
# Note: raises on a strategy it cannot honour; training with the default instead would
# silently double the training state a user chose "preserve" to avoid.
_install.set_default_dtype_strategy(_env.choice("TORCH_FSDP_EXT_DTYPE_STRATEGY", STRATEGIES))
_install.set_default_reduce_dtype(_env.choice("TORCH_FSDP_EXT_REDUCE_DTYPE", _install.REDUCE_DTYPES))
# Note: read before anything is installed, and raised as the strategy is: a fix left out is never a typo's effect.
_fixes = _env.names("TORCH_FSDP_EXT_FIXES", FIX_NAMES)
# Note: the start-up hook may be waiting to import the plugin at the first FSDP group
# (torch_fsdp_ext_startup); this import ends that wait.
if "torch_fsdp_ext_startup" in _sys.modules:
    _sys.modules["torch_fsdp_ext_startup"].end_wait()
if not _env.switch("TORCH_FSDP_EXT_DISABLE"):
    try:
        install(_fixes)
    except Exception as _e:  # noqa: BLE001 - importing must never break a training script
        _warnings.warn(f"torch_fsdp_ext: not installed at import: {_e!r}", RuntimeWarning, stacklevel=2)
