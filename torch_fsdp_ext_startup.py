"""Start-up hook: the plugin in every Python process started with ``TORCH_FSDP_EXT_AUTOLOAD=1``.

Reaches the processes a training script starts itself (``torch.multiprocessing.spawn``,
``subprocess``), which neither ``import torch_fsdp_ext`` in the parent nor the
launcher's own import can reach. The package installs ``torch_fsdp_ext.pth`` at the
top of site-packages; Python's ``site`` runs its one line at every interpreter start,
and that line imports this module only when the variable is set (as coverage.py's
``COVERAGE_PROCESS_START``). ``python -m torch_fsdp_ext.run`` sets it.

Note: the plugin is imported right after torch, not at start-up: torch may live in a
site directory that ``site`` has not added yet (a venv with ``--system-site-packages``
processes its own ``.pth`` files first), and a process that never imports torch pays
nothing. This module itself imports nothing but the standard library.
"""

from __future__ import annotations

import os
import sys
import warnings

VARIABLE = "TORCH_FSDP_EXT_AUTOLOAD"
_ON = frozenset({"1", "true", "yes", "on"})  # as torch_fsdp_ext._env.switch reads a switch


class _ImportPluginAfterTorch:
    """A meta path finder that lets the other finders find torch, then imports the plugin once torch ran."""

    def find_spec(self, name: str, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_torch = spec.loader, spec.loader.exec_module

        def exec_module(module) -> None:
            del loader.exec_module  # back to the loader's own method
            exec_torch(module)
            try:
                import torch_fsdp_ext  # noqa: F401 - installs the fixes (TORCH_FSDP_EXT_DISABLE still applies)
            except Exception as e:  # noqa: BLE001 - never break the process that imports torch
                warnings.warn(f"torch_fsdp_ext: {VARIABLE} is set but the plugin failed to import: {e!r}",
                              RuntimeWarning, stacklevel=2)

        loader.exec_module = exec_module
        return spec


def activate() -> None:
    """Called from ``torch_fsdp_ext.pth`` when the variable is set."""
    if os.environ.get(VARIABLE, "").strip().lower() not in _ON:
        return
    if "torch" in sys.modules:
        import torch_fsdp_ext  # noqa: F401
    elif not any(isinstance(finder, _ImportPluginAfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportPluginAfterTorch())
