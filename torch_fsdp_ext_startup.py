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

Note: never inside someone else's import. FSDP's package is often imported by another
module's import (``import lightning`` -> ``import torch._dynamo`` -> FSDP), while that
module is half executed; the plugin's probes then meet it half loaded (``partially
initialized module 'torch._dynamo' has no attribute 'disable'``) and a fix stands aside
on this rank only. So when any other module is still executing, the import waits until
the first ``FSDPParamGroup`` is built (the first ``fully_shard`` of a module with
parameters; the plugin's fixes act from there on): a one-time stand-in for its
``__init__`` puts torch's back, imports the plugin, and builds the group through it.
Every rank then installs with torch fully imported, whatever its launcher imports first.
A library that wraps the stand-in while it waits (its own import imported FSDP) is
composed with: the stand-in builds that first group through the plugin's hook with
torch's constructor, and the plugin's wrapper goes in front of the library's for the
groups after it (the library's wrapper runs once per group either way).
"""

from __future__ import annotations

import functools
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


def _importing_besides(package: str) -> bool:
    """Is a module other than ``package`` (which has just run) still executing its import?"""
    return any(
        getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
        if name != package
    )


# While the import waits: (FSDPParamGroup, torch's __init__, the one-time stand-in in its place).
_waiting: list[tuple[type, object, object]] = []


def _param_group_class(package: str) -> type | None:
    module = sys.modules.get(package + ("._fully_shard" if package == FSDP_PACKAGES[0] else "") + "._fsdp_param_group")
    cls = getattr(module, "FSDPParamGroup", None)
    return cls if isinstance(cls, type) and "__init__" in cls.__dict__ else None


def _import_at_first_group(cls: type) -> None:
    torch_init = cls.__dict__["__init__"]

    @functools.wraps(torch_init)
    def __init__(group, *args, **kwargs) -> None:
        # Note: ranks as threads of one process build their first groups at once. The stand-in
        # stays in place until the plugin's import has installed its fixes, and each thread that
        # met it waits in that import (Python's lock on a module being imported), then builds
        # through the plugin's wrapper: no rank builds a group with torch's own __init__ meanwhile.
        met_directly = cls.__dict__.get("__init__") is __init__
        _import_plugin()  # its import ends the wait (end_wait), then installs
        end_wait()  # the import failed before ending it
        if met_directly:
            cls.__init__(group, *args, **kwargs)  # through the plugin's wrapper
        else:  # another library wrapped this stand-in (its wrapper runs once, around this call)
            _build_through_plugin(torch_init, group, args, kwargs)

    _waiting.append((cls, torch_init, __init__))
    cls.__init__ = __init__


def _build_through_plugin(torch_init, group, args: tuple, kwargs: dict) -> None:
    """Torch's constructor through the plugin's hook, which the wrapper over this stand-in never reaches."""
    install = sys.modules.get("torch_fsdp_ext._install")
    if install is None:  # the plugin failed to import (warned): torch as without it
        torch_init(group, *args, **kwargs)
    else:
        install.build_param_group(torch_init, group, *args, **kwargs)


def end_wait() -> None:
    """Put torch's ``FSDPParamGroup.__init__`` back where the stand-in still holds it; the plugin's import calls this."""
    while _waiting:
        cls, torch_init, stand_in = _waiting.pop()
        if cls.__dict__.get("__init__") is stand_in:
            cls.__init__ = torch_init


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
            cls = _param_group_class(name) if _importing_besides(name) else None
            if cls is not None:
                _import_at_first_group(cls)
            else:
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
