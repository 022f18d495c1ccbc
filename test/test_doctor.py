"""``python -m torch_fsdp_ext doctor``: its table and its exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_DTYPE_BUG, HAS_RECOMPUTE_CAST_BUG, ROOT


def run_doctor(extra_path: str | None = None, **extra_env: str) -> subprocess.CompletedProcess:
    path = [p for p in (extra_path, ROOT, os.environ.get("PYTHONPATH")) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra_env)
    env.pop("TORCH_FSDP_EXT_DISABLE", None)
    return subprocess.run(
        [sys.executable, "-m", "torch_fsdp_ext", "doctor"], capture_output=True, text=True, env=env, timeout=180, cwd=ROOT
    )


def table(stdout: str) -> str:
    lines = stdout.splitlines()
    return "\n".join(lines[lines.index(next(l for l in lines if l.startswith("fix "))):])


class TestDoctor(TestCase):
    def test_table_and_exit_status(self):
        result = run_doctor()
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertTrue(result.stdout.startswith("torch_fsdp_ext doctor\ntorch "))
        self.assertIn("self-test: 2 rank(s), gloo on cpu", result.stdout)
        if HAS_DTYPE_BUG and HAS_RECOMPUTE_CAST_BUG:  # e.g. torch 2.12
            self.assertExpectedInline(
                table(result.stdout),
                """\
fix        needed  active  self-test (without plugin → with plugin)
dtype      yes     yes     AssertionError reproduced → fixed; strategy upcast
recompute  yes     yes     CheckpointError reproduced → fixed; replays input cast, output cast, root input move, autocast state""",
            )
        elif HAS_DTYPE_BUG:  # e.g. torch 2.13
            self.assertExpectedInline(
                table(result.stdout),
                """\
fix        needed  active  self-test (without plugin → with plugin)
dtype      yes     yes     AssertionError reproduced → fixed; strategy upcast
recompute  yes     yes     not reproduced → ok; replays root input move, autocast state""",
            )
        else:
            self.skipTest("no expected table for a torch without the dtype bug")

    def test_self_test_follows_the_strategy_chosen_in_the_environment(self):
        if not HAS_DTYPE_BUG:
            self.skipTest("this torch has no dtype bug to self-test a strategy on")
        result = run_doctor(TORCH_FSDP_EXT_DTYPE_STRATEGY="preserve")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("dtype strategy 'preserve'", result.stdout)
        dtype_row = next(line for line in result.stdout.splitlines() if line.startswith("dtype "))
        self.assertExpectedInline(
            dtype_row, """dtype      yes     yes     AssertionError reproduced → fixed; strategy preserve"""
        )

    def test_a_broken_fix_makes_doctor_fail(self):
        if not HAS_DTYPE_BUG:
            self.skipTest("this torch has no dtype bug to break the fix of")
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
                f.write(
                    textwrap.dedent(
                        """
                        # Sabotage the dtype fix in every process the doctor starts.
                        from torch_fsdp_ext import _dtype_fix as d
                        d.DtypeFix.before_sharding = lambda self, *args: None
                        d._prepare = lambda group, strategy: False
                        """
                    )
                )
            result = run_doctor(extra_path=tmp)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("dtype      yes     yes     AssertionError reproduced → still fails: AssertionError", result.stdout)


if __name__ == "__main__":
    run_tests()
