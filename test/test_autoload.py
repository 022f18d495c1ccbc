"""The start-up hook (``TORCH_FSDP_EXT_AUTOLOAD=1``) never installs inside another module's import.

Launchers that re-execute ranks (Lightning's ``ModelParallelStrategy`` runs rank 1 as
``python script.py``) import FSDP from inside ``import torch._dynamo``; every rank must
still end up with the same fixes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest

from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_DTYPE_BUG, ROOT, plugin_specific

SCRIPT_DIR = os.path.join(ROOT, "test", "scripts")


def python(*argv: str, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, SCRIPT_DIR, os.environ.get("PYTHONPATH", "")]))
    full_env.pop("TORCH_FSDP_EXT_DISABLE", None)
    full_env.update(env)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=full_env, timeout=300,
                          cwd=SCRIPT_DIR)


@plugin_specific
class AutoloadTest(TestCase):
    def test_fsdp_imported_inside_dynamo_gets_every_fix(self) -> None:
        code = (
            "import json, torch._dynamo, sys; waited = 'torch_fsdp_ext' not in sys.modules; import torch_fsdp_ext; "
            "print(json.dumps([waited, {n: [f.needed, f.active] for n, f in torch_fsdp_ext.status().fixes.items()}]))"
        )
        plain = python("-c", code)  # the fixes this torch needs, imported with torch fully loaded
        autoload = python("-c", code, TORCH_FSDP_EXT_AUTOLOAD="1")
        self.assertEqual(autoload.returncode, 0, autoload.stderr)
        self.assertNotIn("not installed", autoload.stderr)
        waited, fixes = json.loads(autoload.stdout)
        self.assertTrue(waited)  # the hook did not import the plugin inside torch._dynamo's import
        self.assertEqual(fixes, json.loads(plain.stdout)[1])
        self.assertTrue(fixes["recompute"][0] is not None)  # the recompute fix's probes ran on a loaded torch

    def test_status_never_says_the_plugin_does_what_it_stands_aside_from(self) -> None:
        code = (
            "import torch_fsdp_ext; from torch_fsdp_ext._compat import _recompute as _compat_recompute; "
            "_compat_recompute.probe_checkpoint_frames.cache_clear(); "
            "_compat_recompute.probe_checkpoint_frames = lambda: 'a stand-in difference'; "
            "print(torch_fsdp_ext.status())"
        )
        text = python("-c", code).stdout
        self.assertIn(
            "recompute: not installed: torch's internals changed (a stand-in difference); the recompute fix stands aside.",
            text,
        )
        self.assertNotIn("the plugin torch's", text)

    @unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed dtypes in one FSDP group: nothing to fix")
    def test_a_rank_the_launcher_re_executes_installs_the_same_fixes(self) -> None:
        result = python("-m", "torch_fsdp_ext.run", "reexecuted_rank.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertNotIn("not installed", result.stderr)
        ranks = {r["rank"]: r for r in map(json.loads, (l for l in result.stdout.splitlines() if l.startswith("{")))}
        self.assertEqual(sorted(ranks), [0, 1])
        self.assertEqual(ranks[0]["fixes"], ranks[1]["fixes"])
        self.assertIn("dtype", ranks[1]["fixes"])
        self.assertTrue(all(len(r["losses"]) == 2 for r in ranks.values()))


if __name__ == "__main__":
    run_tests()
