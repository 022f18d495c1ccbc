"""Another library's wrapper of ``FSDPParamGroup.__init__`` (a library that observes or extends FSDP2).

With or without ``functools.wraps``, applied before or after the plugin's import, with or
without the autoload start-up hook (where the library's own import of FSDP makes it wrap the
hook's one-time stand-in): the seed-000 layout with fp32 weights loaded into a block before the
optimizer trains bit for bit as the hand workaround (``model.float()`` before ``fully_shard``, no
plugin), with the library's wrapper run once per group. A wrapper that calls torch's constructor
directly from behind the plugin's is refused once by name where the model's dtypes would need the
plugin, and taken in where they do not; one the plugin cannot see through is named, never torch.
Each case runs in a fresh process (``test/scripts/foreign_group_init.py``), on one gloo rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_DTYPE_BUG, ROOT, plugin_specific

SCRIPT_DIR = os.path.join(ROOT, "test", "scripts")
OBSERVER = "fsdp_group_observer.install.<locals>.__init__"


def run(order: str, wrap: str = "wraps", autoload: bool = False, **env: str) -> tuple[dict | None, str]:
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, SCRIPT_DIR, os.environ.get("PYTHONPATH", "")]))
    for name in ("TORCH_FSDP_EXT_DISABLE", "TORCH_FSDP_EXT_AUTOLOAD", "TORCH_FSDP_EXT_DTYPE_STRATEGY"):
        full_env.pop(name, None)
    full_env.update(FOREIGN_ORDER=order, FSDP_OBSERVER_WRAP=wrap, **env,
                    FSDP_OBSERVER_AT="later" if order == "bypass" else "import",
                    **({"TORCH_FSDP_EXT_AUTOLOAD": "1"} if autoload else {}))
    result = subprocess.run([sys.executable, "foreign_group_init.py"], capture_output=True, text=True, env=full_env,
                            timeout=300, cwd=SCRIPT_DIR)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), result.stderr


CASES = [(autoload, wrap, order) for autoload in (False, True) for wrap in ("wraps", "plain")
         for order in ("before", "after", "bypass")]


@plugin_specific
@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed dtypes in one FSDP group: nothing to fix")
class TestForeignGroupConstructorWrapper(TestCase):
    def test_each_composition_trains_as_the_workaround_or_is_refused_by_name(self):
        with ThreadPoolExecutor(2) as pool:
            reference = pool.submit(run, "none", WORKAROUND="1", TORCH_FSDP_EXT_DISABLE="1")
            outcomes = [pool.submit(run, order, wrap, autoload) for autoload, wrap, order in CASES]
            uniform = pool.submit(run, "bypass", "plain", WORKAROUND="1")
        reference, _ = reference.result()
        self.assertIsNone(reference["error"])
        self.assertEqual(len(reference["losses"]), 3)
        for (autoload, wrap, order), outcome in zip(CASES, outcomes):
            with self.subTest(autoload=autoload, wrap=wrap, order=order):
                result, stderr = outcome.result()
                self.assertIsNotNone(result, stderr)
                self.assertNotIn("not installed", stderr)
                self.assertIn("dtype", result["fixes"])
                # The library's wrapper runs once per group: two blocks, then the fp32 source block.
                self.assertEqual(result["calls"], 3)
                if order == "bypass" and not autoload:
                    # It captured torch's constructor before the plugin, and replaced the plugin's after.
                    self.assertIn("MixedParamDtypeError", result["error"])
                    self.assertIn("group(s) '0', '1' of Sequential were built by fully_shard without the plugin's",
                                  result["error"])
                    self.assertIn(f"FSDPParamGroup.__init__ is now {OBSERVER}", result["error"])
                    self.assertEqual(result["losses"], [])
                    continue
                self.assertIsNone(result["error"])
                self.assertEqual(result["losses"], reference["losses"])
                self.assertEqual(result["params"], reference["params"])
        # A model the plugin would not change is taken in past the wrapper: it trains as torch.
        result, stderr = uniform.result()
        self.assertIsNone(result["error"], stderr)
        self.assertEqual((result["losses"], result["params"]), (reference["losses"], reference["params"]))

    def test_a_wrapper_that_hides_torchs_constructor_is_named_not_torch(self):
        result, stderr = run("before", "hidden")
        stood_aside = [line for line in stderr.splitlines() if "fix 'dtype' not installed" in line]
        self.assertEqual(len(stood_aside), 1, stderr)
        self.assertIn(f"FSDPParamGroup.__init__ is {OBSERVER}, another library's wrapper", stood_aside[0])
        self.assertNotIn(f"torch {torch.__version__}", stood_aside[0])
        self.assertNotIn("lacks", stood_aside[0])
        self.assertNotIn("dtype", result["fixes"])


if __name__ == "__main__":
    run_tests()
