"""Simulated future torch releases for the recompute fix: torch's checkpoint or FSDP2 internals
change meaning before the plugin is imported (test/scripts/simulated_release.py).

Expected per change: the fix works bit for bit, or it stands aside with one warning naming it
and training, with checkpoint, with and without FSDP, equals plain torch's bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "test", "scripts", "simulated_release.py")

# Changes under which the recompute fix must stand aside, and what its warning names.
STANDS_ASIDE = {
    "recompute_fn_renamed": "recompute_fn",
    "recomputation_hook_takes_frame": "weak reference",
    "iter_forward_root_renamed": "iter_forward_root",
}
WORKS = ("no_decorator_cell",)  # the fix is installed and replays as on torch unchanged


def simulate(case: str, *flags: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TORCH_FSDP_EXT_DISABLE", None)
    result = subprocess.run(
        [sys.executable, SCRIPT, case, *flags], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    if result.returncode != 0:
        raise AssertionError(f"{case} {flags}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


class TestSimulatedReleases(unittest.TestCase):
    def test_stands_aside_alone_and_trains_as_plain_torch(self) -> None:
        for case, named in STANDS_ASIDE.items():
            with self.subTest(case=case):
                plain, fixed = simulate(case), simulate(case, "--plugin")
                self.assertNotIn("error", plain)  # the simulated torch trains by itself
                self.assertNotIn("error", fixed)
                self.assertEqual(len(fixed["warnings"]), 1, fixed["warnings"])
                self.assertIn("'recompute'", fixed["warnings"][0])
                self.assertIn(named, fixed["warnings"][0])
                self.assertEqual(fixed["active"], {"dtype": True, "recompute": False})  # the dtype fix still works
                self.assertIsNone(fixed["recompute_needed"])
                self.assertEqual(fixed["plain"], plain["plain"])  # bit for bit, checkpoint without FSDP
                self.assertEqual(fixed["fsdp"], plain["fsdp"])  # and under fully_shard

    def test_fix_works_bit_for_bit(self) -> None:
        reference = simulate("none", "--plugin", "--bf16")
        self.assertNotIn("error", reference)
        for case in WORKS:
            with self.subTest(case=case):
                fixed = simulate(case, "--plugin", "--bf16")
                self.assertEqual(fixed["warnings"], [])
                self.assertEqual(fixed["active"], {"dtype": True, "recompute": True})
                self.assertEqual(fixed["plain"], reference["plain"])
                self.assertEqual(fixed["fsdp"], reference["fsdp"])


if __name__ == "__main__":
    unittest.main()
