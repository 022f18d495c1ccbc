"""The framework tools in tools/integrations/ run end to end on 2 CPU ranks and print what docs/integrations.md
states (each tool exits 1 when its result is not that)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import unittest

from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_DTYPE_BUG, ROOT

HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None


def torchtune_missing() -> str | None:
    """Why the torchtune tool cannot run here, or None. Note: torchtune 0.6.1 fails to import with the torchao
    release the test extras install (0.18); it imports with torchao 0.14.1, in an environment of its own."""
    if importlib.util.find_spec("torchtune") is None:
        return "torchtune is not installed (pip install torchtune==0.6.1 torchao==0.14.1, in its own environment)"
    try:
        import torchtune.training  # noqa: F401
    except Exception as error:  # its import fails on an incompatible torchao with various errors
        return f"torchtune does not import here: {type(error).__name__}: {error}"
    return None


def run_tool(path: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def result_lines(stdout: str, label: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(f"{label}: ")]


@unittest.skipUnless(HAS_LIGHTNING, "lightning is not installed (pip install -e '.[test]' installs it)")
@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestLightningTools(TestCase):
    def check(self, tool: str, label: str, resume: str) -> list[str]:
        result = run_tool(tool)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result_lines(result.stdout, label)
        self.assertEqual(lines[0], f"{label}: without plugin: AssertionError: FSDP expects uniform original parameter dtype")
        self.assertRegex(lines[1], rf"^{label}: plugin vs model\.float\(\): bit for bit \(losses [0-9., ]+; 15/15 params\)$")
        self.assertRegex(lines[2], rf"^{label}: {resume}: plugin vs uninterrupted: bit for bit \(losses [0-9., ]+; 15/15 params\)$")
        # The resumed run's losses are the uninterrupted run's steps 3-4.
        self.assertTrue(lines[1].split("losses ")[1].split(";")[0].endswith(lines[2].split("losses ")[1].split(";")[0]))
        return lines

    def test_trainer(self):
        lines = self.check("tools/integrations/lightning_trainer.py", "lightning-trainer",
                           r"save_checkpoint -> fit\(ckpt_path\) at step 2")
        self.assertRegex(lines[3], r"precision='bf16-true' after model\.float\(\): 5/5 fp32 RMSNorm weights are bf16")

    def test_fabric(self):
        self.check("tools/integrations/lightning_fabric.py", "lightning-fabric",
                   r"fabric\.save -> fabric\.load at step 2 \(one file\)")


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestTorchtuneTool(TestCase):
    def test_shard_model(self):
        reason = torchtune_missing()
        if reason:
            self.skipTest(reason)
        result = run_tool("tools/integrations/torchtune_shard.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result_lines(result.stdout, "torchtune")
        self.assertEqual(lines[0], "torchtune: without plugin: AssertionError: FSDP expects uniform original parameter dtype")
        self.assertTrue(lines[1].endswith("step 1 loss on every rank: bit for bit"), lines[1])
        self.assertEqual(lines[3], "torchtune: parameters not fp32 after the plugin's steps: none")
        lora = "torchtune: fp32 LoRA on a frozen bf16 base"
        self.assertEqual(lines[4], f"{lora}, without plugin: RuntimeError: expected m1 and m2 to have the same dtype")
        self.assertEqual(lines[5], f"{lora}, plugin: RuntimeError: expected m1 and m2 to have the same dtype")
        self.assertRegex(lines[6], rf"^{lora}, plugin with TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=lora_a,lora_b: trains, "
                                   r"step 1 loss on every rank bit for bit with the bf16 base unsharded")


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
@unittest.skipUnless(importlib.util.find_spec("axolotl") is not None,
                     "axolotl is not installed (echo torch==2.13.0 > constraints.txt; pip install axolotl==0.19.0 -c "
                     "constraints.txt, in an environment of its own: it pins its own transformers, accelerate, peft)")
class TestAxolotlTool(TestCase):
    def test_train(self):
        result = run_tool("tools/integrations/axolotl_train.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result_lines(result.stdout, "axolotl")
        self.assertRegex(lines[0], r"^axolotl: without plugin: trains \(rank 0/1 losses [0-9./, ]+\); fp32 parameters it "
                                   r"shards: 0 \(of the checkpoint's 5 fp32 RMSNorm weights, 5 load as bf16\)$")
        self.assertEqual(lines[1], "axolotl: plugin vs without plugin: bit for bit (losses of both ranks; 21/21 params); "
                                   "dtype fix active: yes, parameters it upcast: 0")
        self.assertEqual(lines[2], "axolotl: fp32_norms: true, without plugin: trains; 5/5 RMSNorm weights fp32, every "
                                   "other parameter bf16: yes")


if __name__ == "__main__":
    run_tests()
