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
from torch_fsdp_ext import _compat

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


def nemo_automodel_missing() -> str | None:
    """Why the NeMo Automodel tool cannot run here, or None. Note: NeMo Automodel's default install pulls CUDA
    packages; without its dependencies it imports on a CPU torch, and the tool needs nothing else from them."""
    if importlib.util.find_spec("nemo_automodel") is None:
        return "nemo_automodel is not installed (pip install --no-deps nemo_automodel==0.7.0)"
    try:
        import nemo_automodel.components.distributed.model_parallelizer  # noqa: F401
    except Exception as error:
        return f"nemo_automodel does not import here: {type(error).__name__}: {error}"
    if not hasattr(_compat.load_internals().FSDPParam, "to_accumulated_grad_if_needed"):
        return ("nemo_automodel 0.7.0 does not run on this torch: its dense parallelizer patches "
                "FSDPParam.to_accumulated_grad_if_needed, which this torch does not have")
    return None


def float8_training_missing() -> str | None:
    """Why torchao's float8 training cannot run on this machine's CPU, or None. Note: probed, not read from a
    version: the tool needs torchao's float8 API and a float8 ``torch._scaled_mm`` on CPU."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install -e '.[test]' installs it)"
    import torch

    if not hasattr(torch, "float8_e4m3fn"):
        return "this torch has no float8 dtypes"
    ones = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scale = torch.tensor(1.0)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    except Exception as error:  # the kernel's absence shows as various errors
        return f"this torch has no float8 torch._scaled_mm on CPU: {type(error).__name__}: {error}"
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception as error:  # an incompatible torchao fails to import with various errors
        return f"torchao.float8 does not import here: {type(error).__name__}: {error}"
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
class TestNemoAutomodelTool(TestCase):
    def test_parallelizers(self):
        reason = nemo_automodel_missing()
        if reason:
            self.skipTest(reason)
        result = run_tool("tools/integrations/nemo_automodel_parallelize.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result_lines(result.stdout, "nemo-automodel")
        self.assertEqual(len(lines), 6, result.stdout)
        self.assertEqual(lines[0],
                         "nemo-automodel: without plugin: AssertionError: FSDP expects uniform original parameter dtype")
        exact = r": bit for bit \(losses ([0-9., ]+); 21/21 params\)$"
        self.assertRegex(lines[1], rf"^nemo-automodel: plugin vs model\.float\(\){exact}")
        self.assertRegex(lines[2], r"^nemo-automodel: preserve \(5 FSDP units\): "
                                   rf"plugin vs fully_shard_by_dtype \(9 FSDP units\){exact}")
        patched = "nemo-automodel: NeMo's foreach_reduce patch before the first forward"
        self.assertRegex(lines[3], rf"^{patched}, upcast: plugin vs model\.float\(\){exact}")
        self.assertRegex(lines[4], rf"^{patched}, preserve: plugin vs fully_shard_by_dtype{exact}")
        # preserve keeps bf16 weights: its later steps differ from upcast's fp32 masters.
        self.assertNotEqual(lines[1].split("losses ")[1], lines[2].split("losses ")[1])
        late = "nemo-automodel: NeMo's foreach_reduce patch after the first step, preserve"
        self.assertTrue(lines[5].startswith(f"{late}: RuntimeError: torch_fsdp_ext: "), lines[5])
        self.assertIn(".foreach_reduce is nemo_automodel.components.distributed.fsdp_patches."
                      "patch_fsdp_uniform_reduce_dtype.<locals>.foreach_reduce_uniform_dtype, another library's patch, "
                      "put in place after the plugin's wrapper, which it dropped", lines[5])
        self.assertIn("torch_fsdp_ext refuses", lines[5])


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestTorchaoFloat8Tool(TestCase):
    def test_float8_training(self):
        reason = float8_training_missing()
        if reason:
            self.skipTest(reason)
        result = run_tool("tools/integrations/torchao_float8.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result_lines(result.stdout, "torchao-float8")
        label, subclass = "torchao-float8", "WeightWithDynamicFloat8CastTensor"
        for line, config in zip(lines[:2], ("all-gather off", "float8 all-gather")):
            self.assertEqual(line, f"{label}: {config}: without plugin: AssertionError: FSDP expects uniform original "
                                   "parameter dtype")
        self.assertRegex(lines[2], rf"^{label}: all-gather off: plugin vs model\.float\(\): bit for bit "
                                   r"\(losses [0-9., ]+; 15/15 params\)$")
        self.assertEqual(lines[3], f"{label}: float8 all-gather: model.float(): 8/8 float8 weights' local tensors "
                                   f"{subclass}, all-gathered by torchao: torch.float8_e4m3fn")
        self.assertRegex(lines[4], rf"^{label}: float8 all-gather: plugin: MixedParamDtypeError: torch_fsdp_ext: FSDP2 "
                                   r"param group 'layers\.0' of TinyLlama needs one dtype for its trainable parameters")
        self.assertEqual(lines[5], f"{label}: float8 all-gather: plugin: 8 weights named 'must not be cast: tensor "
                                   "subclass with fsdp_pre_all_gather', fix named: model.float() before "
                                   "convert_to_float8_training and fully_shard; parameters cast: none; 8/8 weights "
                                   f"still {subclass}")
        self.assertRegex(lines[6], rf"^{label}: float8 all-gather, model\.float\(\): plugin vs model\.float\(\) "
                                   r"without it: bit for bit \(losses [0-9., ]+; 15/15 params\); 8/8 float8 weights' "
                                   rf"local tensors {subclass}, all-gathered by torchao: torch\.float8_e4m3fn$")
        self.assertRegex(lines[7], rf"^{label}: all-gather off: preserve: trains with 10 bf16 masters, losses ")
        self.assertRegex(lines[8], rf"^{label}: float8 all-gather: preserve: MixedParamDtypeError: ")
        # Both runs start from the same weights: the same first loss; preserve's bf16 masters then drift.
        off = lines[2].split("losses ")[1].split(";")[0].split(", ")
        preserve, reference = (part.split(", ")
                               for part in lines[7].split("losses ")[1].rstrip(")").split(" (model.float(): "))
        self.assertEqual(reference, off)
        self.assertEqual(preserve[0], off[0])
        self.assertNotEqual(preserve, off)


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestTrlTool(TestCase):
    def test_sft_trainer(self):
        if importlib.util.find_spec("trl") is None:
            self.skipTest("trl is not installed (pip install trl==1.16.0, in its own environment: it adds datasets, "
                          "pandas and pyarrow)")
        result = run_tool("tools/integrations/trl_sft.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = result_lines(result.stdout, "trl-sft")
        self.assertEqual(lines[0], "trl-sft: loaded: 5 fp32 norm weights, 16 bf16 parameters; "
                                   "the trainer's model FSDPMixedLlamaForCausalLM")
        mixed = "trl-sft: bf16=True"
        self.assertRegex(lines[1], rf"^{mixed}, without plugin: trains \(losses [0-9.]+, [0-9.]+, [0-9.]+\)$")
        self.assertEqual(lines[2], f"{mixed}, plugin vs without: bit for bit (both ranks' losses, 21/21 params)")
        self.assertEqual(lines[3], f"{mixed}, model.float() vs without plugin: bit for bit (both ranks' losses, 21/21 params)")
        off = "trl-sft: bf16=False"
        self.assertEqual(lines[4], f"{off}, without plugin: AssertionError: FSDP expects uniform original parameter dtype")
        self.assertEqual(lines[5], f"{off}, plugin: RuntimeError: expected m1 and m2 to have the same dtype")
        auto = f"{off}, plugin with TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=auto"
        self.assertEqual(lines[6], f"{auto}: trains, parameters not fp32: none")
        self.assertEqual(lines[7], f"{off}, plugin with auto vs bf16=True, step 1 loss on both ranks: bit for bit")
        # Step 1 of the auto run is bf16=True's on rank 0 too, as printed.
        first = lines[1].split("losses ")[1].split(",")[0]
        self.assertRegex(lines[8], rf"^{off}, rank 0 losses: plugin with auto {first}, [0-9.]+, [0-9.]+; "
                                   r"model\.float\(\) [0-9.]+, [0-9.]+, [0-9.]+$")
        # All-fp32 compute differs from bf16 linears by design: no parameter is equal after the steps.
        self.assertRegex(lines[9], rf"^{off}, plugin with auto vs model\.float\(\) \(all fp32 compute\): "
                                   r"max abs diff losses [0-9.e+-]+, params [0-9.e+-]+ \(0/21 params equal\)$")


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
