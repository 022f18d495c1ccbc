"""Start-up hook for test/test_own_warnings.py: logs each deprecation warning raised while the plugin's code runs.

Put this folder first on PYTHONPATH (Python's ``site`` imports ``sitecustomize`` at every interpreter start, in
spawned ranks too) with ``TORCH_FSDP_EXT_WARNINGS_LOG=FILE`` and ``PYTHONWARNINGS=always``.

Note: torch reports a deprecated collective at its own ``c10d_logger.py`` line, not at the caller's, so where a
warning is reported says nothing about who caused it: the hook walks the Python stack at the moment the warning is
shown, and logs the warning when a frame of the ``torch_fsdp_ext`` package is on it.
"""

import os
import sys
import warnings

_LOG = os.environ.get("TORCH_FSDP_EXT_WARNINGS_LOG")
_show = warnings.showwarning


def _plugin_frame():
    package = sys.modules.get("torch_fsdp_ext")
    if package is None or not getattr(package, "__file__", None):
        return None
    package_dir = os.path.dirname(os.path.abspath(package.__file__)) + os.sep
    frame = sys._getframe(2)
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(package_dir):
            return frame
        frame = frame.f_back
    return None


def _showwarning(message, category, filename, lineno, file=None, line=None):
    if issubclass(category, (DeprecationWarning, FutureWarning)):
        frame = _plugin_frame()
        if frame is not None:
            with open(_LOG, "a") as log:
                log.write(
                    f"{category.__name__}: {str(message).splitlines()[0]} (reported at {filename}:{lineno}; "
                    f"plugin frame {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name})\n"
                )
    _show(message, category, filename, lineno, file, line)


if _LOG:
    warnings.showwarning = _showwarning
