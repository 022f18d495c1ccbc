"""``python -m torch_fsdp_ext doctor``: its table and its exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_DTYPE_BUG, HAS_GRAD_DTYPES_BUG, HAS_RECOMPUTE_CAST_BUG, ROOT


# Installed as sitecustomize.py, it hides numpy from every interpreter the command starts (its ranks too), as
# an environment without numpy would: torch's own probe (importlib.util.find_spec) then finds nothing.
HIDE_NUMPY = """
import sys
from importlib.machinery import PathFinder


class HideNumpy:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.partition(".")[0] == "numpy" else PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()

    # importlib.metadata asks the finders for installed distributions (entry points)
    find_distributions = PathFinder.find_distributions


sys.meta_path[:] = [HideNumpy if finder is PathFinder else finder for finder in sys.meta_path]
"""


def run_doctor(extra_path: str | None = None, command: str = "doctor", **extra_env: str) -> subprocess.CompletedProcess:
    path = [p for p in (extra_path, ROOT, os.environ.get("PYTHONPATH")) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra_env)
    env.pop("TORCH_FSDP_EXT_DISABLE", None)
    return subprocess.run(
        [sys.executable, "-m", "torch_fsdp_ext", command], capture_output=True, text=True, env=env, timeout=180,
        cwd=ROOT,
    )


def table(stdout: str) -> str:
    """The fix table, without the legend that follows it."""
    lines = stdout.splitlines()
    start = lines.index(next(l for l in lines if l.startswith("fix ")))
    end = lines.index(next(l for l in lines if l.startswith("needed: ")))
    return "\n".join(lines[start:end])


# The reduce fix's row, by whether this torch makes unsharded gradients in the compute dtype (up to 2.14).
REDUCE_ROWS = {
    True: "reduce     yes     yes     AssertionError → fixed                "
          "fixes gradients in reduce_dtype, units that never ran, grad_dtype before fully_shard",  # 2.12 - 2.14
    False: "reduce     no      no      no failure → runs                     "
           "this torch makes, accumulates and reduces gradients in reduce_dtype itself",  # 2.15
}


class TestDoctor(TestCase):
    def test_table_and_exit_status(self):
        result = run_doctor()
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertTrue(result.stdout.startswith("torch_fsdp_ext doctor\ntorch "))
        self.assertIn("self-test: 2 rank(s), gloo on cpu", result.stdout)
        self.assertEqual([l for l in result.stdout.splitlines() if len(l) > 160], [], "lines a terminal wraps")
        rows = table(result.stdout).splitlines()
        reduce_row = next(row for row in rows if row.startswith("reduce "))
        self.assertEqual(reduce_row, REDUCE_ROWS[HAS_GRAD_DTYPES_BUG])
        others = "\n".join(row for row in rows if row is not reduce_row)
        if HAS_DTYPE_BUG and HAS_RECOMPUTE_CAST_BUG:  # e.g. torch 2.12
            self.assertExpectedInline(
                others,
                """\
fix        needed  active  seed scenario: without → with plugin  plugin does
dtype      yes     yes     AssertionError → fixed                strategy upcast
recompute  yes     yes     CheckpointError → fixed               replays input cast, output cast, root input move, autocast state""",
            )
        elif HAS_DTYPE_BUG:  # e.g. torch 2.13: upstream replays the input cast, so recompute is needed in part
            self.assertExpectedInline(
                others,
                """\
fix        needed  active  seed scenario: without → with plugin  plugin does
dtype      yes     yes     AssertionError → fixed                strategy upcast
recompute  partly  yes     no failure → runs                     replays root input move, autocast state (torch: input cast, output cast)""",
            )
            self.assertIn("partly = torch repairs part, the plugin the rest", result.stdout)
            # README.md shows this release's table: it must be what doctor prints.
            with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
                readme = f.read()
            for line in others.splitlines():
                self.assertIn(f"    {line}\n", readme)
            if HAS_GRAD_DTYPES_BUG:  # the same row on 2.12 - 2.14; README shows 2.13's table
                self.assertIn(f"    {reduce_row}\n", readme)
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
            dtype_row, """dtype      yes     yes     AssertionError → fixed                strategy preserve"""
        )

    def test_status_is_sentences(self):
        result = run_doctor(command="status")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        prose = [line for line in result.stdout.splitlines() if line.startswith(("dtype: ", "recompute: "))]
        self.assertGreaterEqual(len(prose), 2)
        for line in prose:  # "fix: sentence." with words, not a fragment glued to a reason
            self.assertTrue(line.endswith("."), line)
            self.assertNotIn("the plugin torch", line)
        if HAS_DTYPE_BUG and not HAS_RECOMPUTE_CAST_BUG:  # e.g. torch 2.13
            self.assertIn(
                "recompute: needed in part: during recompute this torch replays the input cast and the output cast "
                "itself.\nrecompute: the plugin replays the root input move and the autocast state.\n",
                result.stdout,
            )

    def test_no_word_from_torch_about_a_missing_numpy(self):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
                f.write(HIDE_NUMPY)
            probe = subprocess.run(
                [sys.executable, "-c", "import importlib.util, torch; print(importlib.util.find_spec('numpy'))"],
                capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=tmp), timeout=120,
            )
            self.assertEqual(probe.stdout.strip(), "None", probe.stderr)  # numpy is hidden ...
            self.assertIn("Failed to initialize NumPy", probe.stderr)  # ... and plain torch says so
            for command in ("status", "doctor"):
                result = run_doctor(extra_path=tmp, command=command)
                self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
                self.assertNotIn("numpy", (result.stdout + result.stderr).lower(), command)

    def test_a_broken_fix_makes_doctor_fail(self):
        if not HAS_DTYPE_BUG:
            self.skipTest("this torch has no dtype bug to break the fix of")
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
                f.write(
                    textwrap.dedent(
                        """
                        # Sabotage the dtype fix in every process the doctor starts.
                        from torch_fsdp_ext._dtype import _fix as d
                        d.DtypeFix.upcast_root = lambda self, root, names=None: []
                        d._prepare = lambda group, strategy: False
                        """
                    )
                )
            result = run_doctor(extra_path=tmp)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("dtype      yes     yes     AssertionError → still fails: AssertionError", result.stdout)


if __name__ == "__main__":
    run_tests()
