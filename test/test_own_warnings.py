"""No FutureWarning or DeprecationWarning is caused by the plugin's code: ``state_dict_as_loaded`` and ``doctor``
(here) and the demo (test/test_demo.py) run with ``PYTHONWARNINGS=always`` and
test/scripts/warning_origin/sitecustomize.py, which logs every such warning raised while a ``torch_fsdp_ext`` frame
is on the stack (torch reports a deprecated collective at its own ``c10d_logger.py`` line, so the line a warning
names cannot tell)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from torch.testing._internal.common_utils import TestCase, run_tests

from common import ROOT

HOOK_DIR = os.path.join(ROOT, "test", "scripts", "warning_origin")
SAVE_AS_LOADED = os.path.join(ROOT, "test", "scripts", "save_as_loaded.py")


def run_logged(command: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    """``command`` with every warning shown; what the hook logged (deprecations caused by the plugin)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "warnings.log")
        path = [HOOK_DIR, ROOT, os.environ.get("PYTHONPATH")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), PYTHONWARNINGS="always",
                   TORCH_FSDP_EXT_WARNINGS_LOG=log)
        env.pop("TORCH_FSDP_EXT_DISABLE", None)
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
        logged = open(log).read() if os.path.exists(log) else ""
    return result, logged


class TestOwnWarnings(TestCase):
    def test_the_check_sees_a_deprecation_raised_under_a_plugin_frame(self):
        code = (
            "import os, warnings, torch_fsdp_ext\n"
            "warnings.warn('outside the plugin', DeprecationWarning)\n"
            "inside = os.path.join(os.path.dirname(torch_fsdp_ext.__file__), 'stand_in.py')\n"
            "exec(compile(\"import warnings; warnings.warn('inside the plugin', DeprecationWarning)\", inside, 'exec'))\n"
        )
        result, logged = run_logged([sys.executable, "-c", code])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(logged.count("\n"), 1, logged)
        self.assertIn("DeprecationWarning: inside the plugin", logged)
        self.assertIn("stand_in.py", logged)

    def test_the_check_sees_the_former_all_gather_into_tensor_call(self):
        # Before the fix, state_dict_as_loaded gathered through torch.distributed.all_gather_into_tensor.
        result, logged = run_logged([sys.executable, SAVE_AS_LOADED, "--deprecated-gather"])
        self.assertEqual(result.returncode, 0, result.stderr)
        if "`torch.distributed.all_gather_into_tensor` is deprecated" not in result.stderr:
            self.skipTest("this torch does not deprecate all_gather_into_tensor (2.13 and 2.14 do)")
        self.assertIn("FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated", logged)
        self.assertIn("_loaded_dtypes.py", logged)

    def test_state_dict_as_loaded(self):
        result, logged = run_logged([sys.executable, SAVE_AS_LOADED])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("['torch.bfloat16', 'torch.float32']", result.stdout)
        self.assertEqual(logged, "")

    def test_doctor(self):
        result, logged = run_logged([sys.executable, "-m", "torch_fsdp_ext", "doctor"])
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertEqual(logged, "")


if __name__ == "__main__":
    run_tests()
