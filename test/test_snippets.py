"""Every fenced code block of README.md and docs/*.md runs as printed.

What a block is, by its fence and first line:

- a ``python`` block runs in a fresh interpreter, in a new empty directory;
- a ``python`` block whose first line is ``# torchrun --nproc-per-node 2 NAME.py`` is a whole script: it is
  written to NAME.py and launched that way (2 CPU ranks, gloo), and must exit 0 on both;
- a ``print(...)  # [...]`` line of a block must print what its comment shows;
- a ``yaml`` block is an accelerate config: it must load as accelerate's ``ClusterConfig`` and name its
  processes and wrap policy;
- a block whose first line is ``# not run: REASON`` is not run (an excerpt, a shape to copy); every other
  block must be one of the above. Indented blocks are command lines and output, not snippets.

Each block runs in its own process with this checkout first on the import path, so a name a block does not
define or import fails it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import unittest

from torch.testing._internal.common_utils import TestCase, run_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"^# not run: \S")
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node 2 (\w+\.py)\b")
PRINTS = re.compile(r"^ *print\(.*\) +# (\[.*\])$", re.MULTILINE)  # a print whose comment is its output (a list)
has_extras = all(importlib.util.find_spec(name) for name in ("transformers", "accelerate", "peft", "yaml"))


def snippets() -> list[tuple[str, int, str, str]]:
    """(file, line, language, code) of every fenced block."""
    found = []
    for path in DOCS:
        with open(path) as f:
            text = f.read()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((os.path.relpath(path, ROOT), line, match.group(1), match.group(2)))
    return found


def run(command: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for name in ("TORCH_FSDP_EXT_DISABLE", "TORCH_FSDP_EXT_DTYPE_STRATEGY", "TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE"):
        env.pop(name, None)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@unittest.skipUnless(has_extras, "transformers, accelerate, peft and pyyaml are test extras (pip install '.[test]')")
class TestSnippets(TestCase):
    def test_every_block_is_run_or_marked(self):
        unmarked = [
            f"{path}:{line} ({language or 'no language'})"
            for path, line, language, code in snippets()
            if not NOT_RUN.match(code) and language not in ("python", "yaml")
        ]
        self.assertEqual(unmarked, [])
        self.assertGreater(len(snippets()), 10)

    def test_snippets_run_as_printed(self):
        ran = 0
        for path, line, language, code in snippets():
            if NOT_RUN.match(code) or language not in ("python", "yaml"):
                continue
            with self.subTest(snippet=f"{path}:{line}"), tempfile.TemporaryDirectory() as cwd:
                if language == "yaml":
                    self.check_accelerate_config(code, cwd)
                else:
                    script = TORCHRUN.match(code)
                    name = script.group(1) if script else "snippet.py"
                    with open(os.path.join(cwd, name), "w") as f:
                        f.write(code)
                    command = [sys.executable, name]
                    if script:
                        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", "2", name]
                    result = run(command, cwd)
                    self.assertEqual(result.returncode, 0, f"{path}:{line}\n{result.stdout[-3000:]}{result.stderr[-6000:]}")
                    for printed in PRINTS.findall(code):
                        self.assertIn(printed + "\n", result.stdout, f"{path}:{line}")
                ran += 1
        self.assertGreater(ran, 5)

    def check_accelerate_config(self, code: str, cwd: str) -> None:
        from accelerate.commands.config.config_args import ClusterConfig

        config_file = os.path.join(cwd, "accelerate.yaml")
        with open(config_file, "w") as f:
            f.write(code)
        config = ClusterConfig.from_yaml_file(config_file)  # unknown keys are an error
        self.assertGreater(config.num_processes, 1)
        self.assertEqual(getattr(config.distributed_type, "value", config.distributed_type), "FSDP")
        self.assertEqual(config.fsdp_config["fsdp_version"], 2)
        self.assertIn("fsdp_auto_wrap_policy", config.fsdp_config)


if __name__ == "__main__":
    run_tests()
