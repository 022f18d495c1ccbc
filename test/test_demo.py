"""``python -m torch_fsdp_ext demo``, run as README.md prints it: the failure without the plugin, the losses with
it, the release checkpoint in BF16 with the router in F32, and no deprecation warning caused by the plugin's code
(test/test_own_warnings.py's check)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import unittest

from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_DTYPE_BUG, ROOT
from test_own_warnings import run_logged

DEMO_EXTRAS = all(importlib.util.find_spec(name) for name in ("accelerate", "transformers"))

# Installed as sitecustomize.py, it hides accelerate from the command and its ranks, as a venv without the extra.
HIDE_ACCELERATE = """
import sys
from importlib.machinery import PathFinder


class HideAccelerate(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] == "accelerate" else PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [HideAccelerate if finder is PathFinder else finder for finder in sys.meta_path]
"""


def readme_line(pattern: str) -> str:
    """The README's command line (an indented line) that matches ``pattern``."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [line.strip() for line in f if line.startswith("    ") and re.search(pattern, line)]
    assert len(lines) == 1, f"README.md has {len(lines)} command lines matching {pattern!r}"
    return lines[0]


def demo_command() -> list[str]:
    command = shlex.split(readme_line(r"-m torch_fsdp_ext demo"))
    assert command[0] == "python", command
    return [sys.executable, *command[1:]]


def run_demo(extra_path: str) -> subprocess.CompletedProcess:
    """The demo with ``extra_path`` (a folder holding a sitecustomize.py) first on the import path."""
    path = [extra_path, ROOT, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    env.pop("TORCH_FSDP_EXT_DISABLE", None)
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(demo_command(), capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


class TestDemo(TestCase):
    @unittest.skipUnless(DEMO_EXTRAS, "the demo needs accelerate and transformers (pip install -e '.[demo]')")
    def test_readme_demo_command(self):
        result, deprecations = run_logged(demo_command())
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr[-4000:])
        self.assertEqual(deprecations, "")
        lines = result.stdout.splitlines()
        without = next(line for line in lines if line.startswith("without the plugin: "))
        if HAS_DTYPE_BUG:
            # torch prints the set of dtypes in either order
            self.assertRegex(
                without,
                r"^without the plugin: AssertionError: FSDP expects uniform original parameter dtype but got "
                r"(\{torch\.bfloat16, torch\.float32\}|\{torch\.float32, torch\.bfloat16\})$",
            )
        else:
            self.assertTrue(without.startswith("without the plugin: trains"), without)
        trains = next(line for line in lines if line.startswith("with the plugin: "))
        losses = [float(loss) for loss in re.fullmatch(r"with the plugin: trains; losses of steps 1-4: (.*)",
                                                       trains).group(1).split(", ")]
        self.assertEqual(len(losses), 4)
        self.assertTrue(all(math.isfinite(loss) for loss in losses), losses)
        self.assertEqual(losses, sorted(losses, reverse=True))  # one batch, lr 1e-2: every step lowers the loss
        self.assertLess(losses[-1], losses[0] - 0.5)
        saved = next(line for line in lines if line.startswith("saved with state_dict_as_loaded"))
        self.assertIn("dtypes ['BF16', 'F32']", saved)
        self.assertRegex(saved, r"F32: [^;]*\bmodel\.layers\.1\.mlp\.gate\.weight\b")

    def test_without_the_extra_it_says_what_to_install(self):
        with tempfile.TemporaryDirectory() as hook_dir:
            with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
                f.write(HIDE_ACCELERATE)
            result = run_demo(hook_dir)
        self.assertEqual(result.returncode, 1)
        self.assertEqual(
            result.stdout,
            "torch_fsdp_ext demo: the demo needs accelerate and transformers: pip install -e '.[demo]'\n",
        )

    def test_the_readme_install_line_names_the_demo_extra(self):
        install = shlex.split(readme_line(r"pip install -e"))
        self.assertEqual(install, ["pip", "install", "-e", ".[demo]"])
        with open(os.path.join(ROOT, "setup.py")) as f:
            extra = re.search(r'"demo": \[([^]]*)\]', f.read())
        self.assertIsNotNone(extra, "setup.py has no 'demo' extra")
        self.assertEqual(sorted(re.findall(r'"(\w+)', extra.group(1))), ["accelerate", "transformers"])


if __name__ == "__main__":
    run_tests()
