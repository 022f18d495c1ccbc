"""Every fenced code block of README.md and docs/*.md runs as printed.

What a block is, by its fence and first line:

- a ``python`` block runs in a fresh interpreter, in a new empty directory;
- a ``python`` block whose first line is ``# torchrun --nproc-per-node 2 NAME.py`` is a whole script: it is
  written to NAME.py and launched that way (2 CPU ranks, gloo), and must exit 0 on both;
- a ``print(...)  # [...]`` line of a block must print what its comment shows;
- a ``yaml`` block is an accelerate config: it must load as accelerate's ``ClusterConfig`` and name its
  processes and wrap policy;
- a block whose first line is ``# not run: REASON`` is not run (an excerpt, a shape to copy); one whose reason is
  ``a fragment of PATH`` must name a file of this checkout that its page links. Every other block must be one of
  the above. Indented blocks are command lines and output, not snippets.

docs/checkpoints.md's table of key layouts (``export`` vs ``save_pretrained``) is checked against what its
``train_and_save.py`` script and ``python -m torch_fsdp_ext export`` write.

Each block runs in its own process with this checkout first on the import path, so a name a block does not
define or import fails it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"^# not run: \S")
FRAGMENT = re.compile(r"^# not run: a fragment of (\S+)")
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

    def test_fragments_name_a_file_their_page_links(self):
        fragments = 0
        for path, line, _, code in snippets():
            fragment = FRAGMENT.match(code)
            if not fragment:
                continue
            fragments += 1
            target = fragment.group(1)
            self.assertTrue(os.path.isfile(os.path.join(ROOT, target)), f"{path}:{line}: no file {target}")
            with open(os.path.join(ROOT, path)) as f:
                page = f.read()
            link = os.path.relpath(os.path.join(ROOT, target), os.path.dirname(os.path.join(ROOT, path)))
            self.assertIn(f"]({link})", page, f"{path}:{line}: the page does not link {target}")
        self.assertGreater(fragments, 0)

    def test_export_and_save_pretrained_key_layouts(self):
        """Both files of docs/checkpoints.md's key-layout table hold the tensors it counts and load into
        transformers with equal values."""
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        (code,) = [code for path, _, _, code in snippets() if TORCHRUN.match(code)
                   and TORCHRUN.match(code).group(1) == "train_and_save.py"]
        with open(os.path.join(ROOT, "docs", "checkpoints.md")) as f:
            page = f.read()
        counts = {
            "export": int(re.search(r"^\| `python -m torch_fsdp_ext export` \| (\d+) \|", page, re.M).group(1)),
            "save_pretrained": int(re.search(r"^\| `save_pretrained\(.*?\)` \| (\d+) \|", page, re.M).group(1)),
        }
        with tempfile.TemporaryDirectory() as cwd:
            with open(os.path.join(cwd, "train_and_save.py"), "w") as f:
                f.write(code)
            for command in (
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "train_and_save.py"],
                [sys.executable, "-m", "torch_fsdp_ext", "export", "ckpt", "exported"],
            ):
                result = run(command, cwd)
                self.assertEqual(result.returncode, 0, result.stdout[-3000:] + result.stderr[-6000:])
            shutil.copy(os.path.join(cwd, "release", "config.json"), os.path.join(cwd, "exported"))
            states = {}
            for name, folder in (("save_pretrained", "release"), ("export", "exported")):
                with safe_open(os.path.join(cwd, folder, "model.safetensors"), "pt") as f:
                    self.assertEqual(len(list(f.keys())), counts[name], name)
                states[name] = AutoModelForCausalLM.from_pretrained(os.path.join(cwd, folder)).state_dict()
        self.assertEqual(states["export"].keys(), states["save_pretrained"].keys())
        for fqn, tensor in states["save_pretrained"].items():
            self.assertTrue(torch.equal(tensor, states["export"][fqn]), fqn)

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
