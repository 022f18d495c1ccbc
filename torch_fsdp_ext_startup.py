"""Start-up hook: the plugin in every Python process started with ``TORCH_FSDP_EXT_AUTOLOAD=1``.

Reaches the processes a training script starts itself (``torch.multiprocessing.spawn``,
``subprocess``), which neither ``import torch_fsdp_ext`` in the parent nor the
launcher's own import can reach. The package installs ``torch_fsdp_ext.pth`` at the
top of site-packages; Python's ``site`` runs its one line at every interpreter start,
and that line imports this module only when the variable is set (as coverage.py's
``COVERAGE_PROCESS_START``). ``python -m torch_fsdp_ext.run`` sets it.

Note: the plugin is imported right after FSDP's package (``torch.distributed.fsdp``;
``torch.distributed._composable.fsdp`` on 2.5), not at start-up nor with torch: a
process that never imports FSDP (pip, a plain ``python -c``, a data-loading worker)
pays nothing, and one that does gets the plugin before it can call ``fully_shard``.
A setting the plugin cannot honour (``TORCH_FSDP_EXT_DTYPE_STRATEGY=preserv``) fails
that import with the plugin's error, as ``import torch_fsdp_ext`` would; any other
failure only warns. This module itself imports nothing but the standard library.
"""

from __future__ import annotations

import os
import sys
import warnings

VARIABLE = "TORCH_FSDP_EXT_AUTOLOAD"
_ON = frozenset({"1", "true", "yes", "on"})  # as torch_fsdp_ext._env.switch reads a switch
FSDP_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _import_plugin() -> None:
    try:
        import torch_fsdp_ext  # noqa: F401 - installs the fixes (TORCH_FSDP_EXT_DISABLE still applies)
    except Exception as e:
        setting_error = getattr(sys.modules.get("torch_fsdp_ext._env"), "SettingError", None)
        if setting_error is not None and isinstance(e, setting_error):
            raise
        # never break the process that imports FSDP over anything but the user's own setting
        warnings.warn(f"torch_fsdp_ext: {VARIABLE} is set but the plugin failed to import: {e!r}",
                      RuntimeWarning, stacklevel=3)


class _ImportPluginAfterFSDP:
    """A meta path finder that lets the other finders find FSDP's package, then imports the plugin once it ran."""

    def find_spec(self, name: str, path=None, target=None):
        if name not in FSDP_PACKAGES:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_package = spec.loader, spec.loader.exec_module

        def exec_module(module) -> None:
            del loader.exec_module  # back to the loader's own method
            exec_package(module)
            _import_plugin()

        loader.exec_module = exec_module
        return spec


def activate() -> None:
    """Called from ``torch_fsdp_ext.pth`` when the variable is set."""
    if os.environ.get(VARIABLE, "").strip().lower() not in _ON:
        return
    if any(name in sys.modules for name in FSDP_PACKAGES):
        _import_plugin()
    elif not any(isinstance(finder, _ImportPluginAfterFSDP) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportPluginAfterFSDP())
