"""``python -m torch_fsdp_ext.run``: the plugin on for a script that never imports it, under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest

from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_DTYPE_BUG, ROOT, plugin_specific

SCRIPT_DIR = os.path.join(ROOT, "test", "scripts")
SCRIPT = os.path.join(SCRIPT_DIR, "train_seed000.py")  # the seed-000 model; no import of torch_fsdp_ext


def torchrun(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 ARGV`` with this checkout importable, from a neutral cwd."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, SCRIPT_DIR, os.environ.get("PYTHONPATH", "")]))
    full_env.pop("TORCH_FSDP_EXT_DISABLE", None)
    full_env.update(env or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=300, cwd=SCRIPT_DIR)


def report(result: subprocess.CompletedProcess) -> dict:
    """The JSON line rank 0 of the script printed."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    # Every rank ends cleanly: exit status 0 and no abort at exit (docs/reliability.md).
    assert result.returncode == 0 and len(lines) == 1, result.stdout + result.stderr
    assert "terminate called" not in result.stderr, result.stderr
    return json.loads(lines[0])


@plugin_specific
@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed dtypes in one FSDP group: nothing to fix")
class RunTest(TestCase):
    def test_launcher_fixes_a_script_that_never_imports_the_plugin(self) -> None:
        with open(SCRIPT, encoding="utf-8") as f:
            self.assertNotIn("import torch_fsdp_ext", f.read())
        # Without the launcher: the seed's assertion. The launcher has no effect unless used.
        plain = torchrun(SCRIPT, "--steps", "2")
        self.assertNotEqual(plain.returncode, 0)
        self.assertIn("FSDP expects uniform original parameter dtype", plain.stderr)

        launched = report(torchrun("-m", "torch_fsdp_ext.run", SCRIPT, "--steps", "2"))
        self.assertTrue(launched["plugin_imported"])
        self.assertEqual(launched["argv"], ["--steps", "2"])  # the script's own arguments, untouched
        self.assertEqual(launched["dtypes"], ["torch.float32"])  # fp32 master weights
        # The result is the manual workaround's (model.float()), bit for bit.
        workaround = report(torchrun(SCRIPT, "--steps", "2", "--workaround"))
        self.assertFalse(workaround["plugin_imported"])
        self.assertEqual(launched["losses"], workaround["losses"])

    def test_strategy_selected_on_the_command_line_module_form(self) -> None:
        result = torchrun("-m", "torch_fsdp_ext.run", "--dtype-strategy", "error", "-m", "train_seed000")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("MixedParamDtypeError", result.stderr)
        self.assertNotIn("FSDP expects uniform original parameter dtype", result.stderr)


if __name__ == "__main__":
    run_tests()
