"""The framework tools in tools/integrations/ run end to end on 2 CPU ranks and print what docs/integrations.md
states (each tool exits 1 when its result is not that)."""

from __future__ import annotations

import importlib.util
import os
import re
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


PAGE = os.path.join(ROOT, "docs", "integrations.md")
ASSERTED = "without plugin: AssertionError: FSDP expects uniform original parameter dtype"
FIGURE = re.compile(r"\d+\.\d+(?:e[+-]\d+)?")  # a loss or a difference as the tools print it; counts stay
SIDE = re.compile(r"(.+?) ([0-9.]+(?:, [0-9.]+)*)")  # one side of a rank line: its name, then its losses


def run_tool(path: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def result_lines(stdout: str, label: str) -> list[str]:
    """The tool's result lines, without the per-rank loss lines of its comparisons."""
    lines = stdout.splitlines()
    return [line for line in lines if line.startswith(f"{label}: ") and not line.startswith(f"{label}:   ")]


def rank_losses(stdout: str, label: str) -> list[dict[str, list[str]]]:
    """The per-rank loss lines in the order printed: for each, the losses of both sides, by side name."""
    found = []
    for line in stdout.splitlines():
        if line.startswith(f"{label}:   rank "):
            sides = line.split(" losses: ", 1)[1].split("; ")
            found.append({m.group(1): m.group(2).split(", ") for m in (SIDE.fullmatch(side) for side in sides)})
    return found


def page_table() -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the page's stack table (its first table)."""
    with open(PAGE) as f:
        table = [line for line in f.read().split("\n\n") if line.startswith("| ")][0].splitlines()
    split = lambda line: [cell.strip() for cell in line.strip().strip("|").split(" | ")]  # noqa: E731
    return split(table[0]), [split(line) for line in table[2:]]


class TestIntegrationsPage(TestCase):
    """The page's table stays one a user can act on: short cells, the line to add in every row."""

    def test_table_rows(self):
        header, rows = page_table()
        self.assertIn("your code", header)
        self.assertGreaterEqual(len(rows), 8)
        for row in rows:
            self.assertEqual(len(row), len(header), row[0])
            for cell in row:
                self.assertLessEqual(len(cell), 300, f"{row[0]}: {cell}")
            self.assertRegex(row[header.index("your code")], r"`[^`]+`", row[0])
            # A count of parameters says what it counts: "15/15 params" alone did not.
            self.assertNotRegex(" ".join(row), r"\d+/\d+ params?\b", row[0])


def check_page(test: TestCase, stdout: str, label: str) -> None:
    """Every result line the tool printed is on the page as printed, its losses and differences aside (they are the
    page's torch release's)."""
    with open(PAGE) as f:
        page = {FIGURE.sub("#", line.strip()) for line in f}
    for line in stdout.splitlines():
        if line.startswith(f"{label}: "):
            test.assertTrue(FIGURE.sub("#", line) in page, f"not on docs/integrations.md: {line}")


def check_comparison(test: TestCase, stdout: str, label: str, heading: str, exact: bool, tensors: int,
                     first: int = 0) -> list[dict[str, list[str]]]:
    """The comparison line starting with ``heading`` says ``exact`` (bit for bit), with figures that agree: 2 ranks'
    losses, ``tensors`` parameter tensors, no difference where exact; its rank lines (``first``: the index of its
    first among the tool's rank lines) hold both sides' losses, equal on every rank where exact. The rank lines."""
    line = next(line for line in result_lines(stdout, label) if line.startswith(heading))
    if exact:
        test.assertRegex(line, r": bit for bit: losses of 2 ranks x \d+ steps, max abs diff 0; "
                               rf"{tensors}/{tensors} parameter tensors equal, max abs diff 0$")
    else:
        test.assertRegex(line, r": differs: losses of 2 ranks x \d+ steps, max abs diff [0-9.e+-]+; "
                               rf"\d+/{tensors} parameter tensors equal, max abs diff [0-9.e+-]+$")
    steps = int(re.search(r"x (\d+) steps", line).group(1))
    ranks = rank_losses(stdout, label)[first:first + 2]
    test.assertEqual(len(ranks), 2)
    for sides in ranks:
        ours, theirs = sides.values()
        test.assertEqual((len(ours), len(theirs)), (steps, steps))
        if exact:
            test.assertEqual(ours, theirs)
    return ranks


@unittest.skipUnless(HAS_LIGHTNING, "lightning is not installed (pip install -e '.[test]' installs it)")
@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestLightningTools(TestCase):
    def check(self, tool: str, label: str, resume: str) -> list[str]:
        result = run_tool(tool)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        check_page(self, result.stdout, label)
        lines = result_lines(result.stdout, label)
        self.assertEqual(lines[0], f"{label}: {ASSERTED}")
        full = check_comparison(self, result.stdout, label, f"{label}: plugin vs model.float()", True, 15)
        resumed = check_comparison(self, result.stdout, label, f"{label}: {resume}: resumed vs uninterrupted", True, 15,
                                   first=2)
        # The resumed run's losses are the uninterrupted run's steps 3-4, on each rank.
        for whole, tail in zip(full, resumed):
            self.assertEqual(whole["plugin"][2:], tail["resumed"])
        return lines

    def test_trainer(self):
        lines = self.check("tools/integrations/lightning_trainer.py", "lightning-trainer",
                           "save_checkpoint -> fit(ckpt_path) at step 2")
        self.assertRegex(lines[3], r"precision='bf16-true' after model\.float\(\): 5/5 fp32 RMSNorm weights are bf16")

    def test_fabric(self):
        self.check("tools/integrations/lightning_fabric.py", "lightning-fabric",
                   "fabric.save -> fabric.load at step 2 (one file)")


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestTorchtuneTool(TestCase):
    def test_shard_model(self):
        reason = torchtune_missing()
        if reason:
            self.skipTest(reason)
        result = run_tool("tools/integrations/torchtune_shard.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        label = "torchtune"
        check_page(self, result.stdout, label)
        lines = result_lines(result.stdout, label)
        self.assertEqual(lines[0], f"{label}: {ASSERTED}")
        self.assertTrue(lines[1].endswith("step 1 loss on every rank: bit for bit"), lines[1])
        ranks = rank_losses(result.stdout, label)
        for sides in ranks[:2]:
            self.assertEqual(sides["plugin"], sides["unsharded"])
        # bf16 weights compute in bf16: model.float()'s all-fp32 run differs by design, from step 1 on.
        fp32 = check_comparison(self, result.stdout, label, f"{label}: plugin vs model.float() (all fp32 compute)",
                                False, 21, first=2)
        self.assertEqual([sides["plugin"][0] for sides in fp32], [sides["plugin"][0] for sides in ranks[:2]])
        self.assertEqual(lines[3], f"{label}: parameters not fp32 after the plugin's steps: none")
        lora = f"{label}: fp32 LoRA on a frozen bf16 base"
        self.assertEqual(lines[4], f"{lora}, without plugin: RuntimeError: expected m1 and m2 to have the same dtype")
        self.assertEqual(lines[5], f"{lora}, plugin: RuntimeError: expected m1 and m2 to have the same dtype")
        self.assertEqual(lines[6], f"{lora}, plugin with TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=lora_a,lora_b: trains, "
                                   "step 1 loss on every rank bit for bit with the bf16 base unsharded")
        for sides in ranks[4:6]:
            self.assertEqual(sides["plugin"], sides["unsharded bf16 base"])


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestNemoAutomodelTool(TestCase):
    def test_parallelizers(self):
        reason = nemo_automodel_missing()
        if reason:
            self.skipTest(reason)
        result = run_tool("tools/integrations/nemo_automodel_parallelize.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        label = "nemo-automodel"
        check_page(self, result.stdout, label)
        lines = result_lines(result.stdout, label)
        self.assertEqual(len(lines), 6, result.stdout)
        self.assertEqual(lines[0], f"{label}: {ASSERTED}")
        upcast = check_comparison(self, result.stdout, label, f"{label}: plugin vs model.float()", True, 21)
        preserve = check_comparison(self, result.stdout, label, f"{label}: preserve (5 FSDP units): plugin vs "
                                    "fully_shard_by_dtype (9 FSDP units)", True, 21, first=2)
        patched = f"{label}: NeMo's foreach_reduce patch before the first forward"
        check_comparison(self, result.stdout, label, f"{patched}, upcast: plugin vs model.float()", True, 21, first=4)
        check_comparison(self, result.stdout, label, f"{patched}, preserve: plugin vs fully_shard_by_dtype", True, 21,
                         first=6)
        # preserve keeps bf16 weights: its later steps differ from upcast's fp32 masters.
        self.assertNotEqual(upcast[0]["plugin"], preserve[0]["plugin"])
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
        label, subclass = "torchao-float8", "WeightWithDynamicFloat8CastTensor"
        check_page(self, result.stdout, label)
        lines = result_lines(result.stdout, label)
        for line, config in zip(lines[:2], ("all-gather off", "float8 all-gather")):
            self.assertEqual(line, f"{label}: {config}: {ASSERTED}")
        off = check_comparison(self, result.stdout, label, f"{label}: all-gather off: plugin vs model.float()", True,
                               15)
        self.assertEqual(lines[3], f"{label}: float8 all-gather: model.float(): 8/8 float8 weights' local tensors "
                                   f"{subclass}, all-gathered by torchao: torch.float8_e4m3fn")
        self.assertRegex(lines[4], rf"^{label}: float8 all-gather: plugin: MixedParamDtypeError: torch_fsdp_ext: FSDP2 "
                                   r"param group 'layers\.0' of TinyLlama needs one dtype for its trainable parameters")
        self.assertEqual(lines[5], f"{label}: float8 all-gather: plugin: 8 weights named 'must not be cast: tensor "
                                   "subclass with fsdp_pre_all_gather', fix named: model.float() before "
                                   "convert_to_float8_training and fully_shard; parameters cast: none; 8/8 weights "
                                   f"still {subclass}")
        check_comparison(self, result.stdout, label, f"{label}: float8 all-gather, model.float(): plugin vs "
                         "model.float() without it", True, 15, first=2)
        self.assertEqual(lines[7], f"{label}: float8 all-gather, model.float(): plugin: 8/8 float8 weights' local "
                                   f"tensors {subclass}, all-gathered by torchao: torch.float8_e4m3fn")
        self.assertEqual(lines[8], f"{label}: all-gather off: preserve: trains with 10 bf16 masters")
        preserve = check_comparison(self, result.stdout, label, f"{label}: all-gather off: preserve vs model.float()",
                                    False, 15, first=4)
        self.assertEqual(lines[10], f"{label}: all-gather off: preserve vs model.float(), step 1 loss on both ranks: "
                                    "bit for bit")
        self.assertRegex(lines[11], rf"^{label}: float8 all-gather: preserve: MixedParamDtypeError: ")
        # Both runs start from the same weights: the same first loss on each rank; preserve's bf16 masters then drift.
        for rank in range(2):
            self.assertEqual(preserve[rank]["model.float()"], off[rank]["model.float()"])
            self.assertEqual(preserve[rank]["preserve"][0], off[rank]["plugin"][0])
            self.assertNotEqual(preserve[rank]["preserve"], off[rank]["plugin"])


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
class TestTrlTool(TestCase):
    def test_sft_trainer(self):
        if importlib.util.find_spec("trl") is None:
            self.skipTest("trl is not installed (pip install trl==1.16.0, in its own environment: it adds datasets, "
                          "pandas and pyarrow)")
        result = run_tool("tools/integrations/trl_sft.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        label = "trl-sft"
        check_page(self, result.stdout, label)
        lines = result_lines(result.stdout, label)
        self.assertEqual(lines[0], f"{label}: loaded: 5 fp32 norm weights, 16 bf16 parameters; "
                                   "the trainer's model FSDPMixedLlamaForCausalLM")
        mixed = f"{label}: bf16=True"
        self.assertEqual(lines[1], f"{mixed}, without plugin: trains")
        plain = check_comparison(self, result.stdout, label, f"{mixed}: plugin vs without plugin", True, 21)
        check_comparison(self, result.stdout, label, f"{mixed}: model.float() vs without plugin", True, 21, first=2)
        off = f"{label}: bf16=False"
        self.assertEqual(lines[4], f"{off}, {ASSERTED}")
        self.assertEqual(lines[5], f"{off}, plugin: RuntimeError: expected m1 and m2 to have the same dtype")
        self.assertEqual(lines[6], f"{off}, plugin with TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=auto: trains, "
                                   "parameters not fp32: none")
        self.assertEqual(lines[7], f"{off}, plugin with auto vs bf16=True, step 1 loss on both ranks: bit for bit")
        # All-fp32 compute differs from bf16 linears by design: no parameter tensor is equal after the steps.
        auto = check_comparison(self, result.stdout, label, f"{off}: plugin with auto vs model.float() (all fp32 "
                                "compute)", False, 21, first=4)
        self.assertRegex(lines[8], r" 0/21 parameter tensors equal")
        # Step 1 of the auto run is bf16=True's on each rank, as printed.
        for rank in range(2):
            self.assertEqual(auto[rank]["plugin with auto"][0], plain[rank]["without plugin"][0])
        self.assertEqual(lines[9], f"{off}, stock LlamaForCausalLM: loaded with dtype=torch.bfloat16: 0 fp32 "
                                   "parameters (the checkpoint's 5 fp32 norm weights arrive bf16)")
        check_comparison(self, result.stdout, label, f"{off}, stock LlamaForCausalLM, norms made fp32 by hand: "
                         "plugin with LlamaRMSNorm named vs plugin with auto", True, 21, first=6)


@unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: there is nothing for the plugin to fix")
@unittest.skipUnless(importlib.util.find_spec("axolotl") is not None,
                     "axolotl is not installed (echo torch==2.13.0 > constraints.txt; pip install axolotl==0.19.0 -c "
                     "constraints.txt, in an environment of its own: it pins its own transformers, accelerate, peft)")
class TestAxolotlTool(TestCase):
    def test_train(self):
        result = run_tool("tools/integrations/axolotl_train.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        check_page(self, result.stdout, "axolotl")
        lines = result_lines(result.stdout, "axolotl")
        self.assertRegex(lines[0], r"^axolotl: without plugin: trains \(rank 0/1 losses [0-9./, ]+\); fp32 parameters it "
                                   r"shards: 0 \(of the checkpoint's 5 fp32 RMSNorm weights, 5 load as bf16\)$")
        self.assertEqual(lines[1], "axolotl: plugin vs without plugin: bit for bit (losses of both ranks; 21/21 params); "
                                   "dtype fix active: yes, parameters it upcast: 0")
        self.assertEqual(lines[2], "axolotl: fp32_norms: true, without plugin: trains; 5/5 RMSNorm weights fp32, every "
                                   "other parameter bf16: yes")


if __name__ == "__main__":
    run_tests()
