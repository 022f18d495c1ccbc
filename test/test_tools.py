"""The scripts in tools/ run end to end on CPU (their GPU runs need a machine this suite never has)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import unittest

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

from torch_fsdp_ext import _compat
from torch_fsdp_ext._recompute import RecomputeReplay

from common import HAS_DTYPE_BUG, HAS_RECOMPUTE_CAST_BUG, ROOT


def run_tool(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


class TestTools(TestCase):
    def test_recompute_cases_on_cpu(self):
        result = run_tool("tools/reproductions/recompute_cases.py")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = {line[:32].strip(): line for line in result.stdout.splitlines()}
        self.assertIn("all cases ok with the plugin", result.stdout)
        fsdp2_seed = lines["seed script, FSDP2"].split()
        self.assertEqual(fsdp2_seed[-2:], ["CheckpointError", "ok"] if HAS_RECOMPUTE_CAST_BUG else ["ok", "ok"])
        self.assertIn("n/a on CPU", lines["seed script, FSDP1"])  # FSDP1 needs an accelerator
        self.assertIn("n/a on CPU", lines["2 root, CPU inputs"])

    def test_gpu_bench_tiny(self):
        result = run_tool("tools/benchmarks/gpu_bench.py", "--tiny")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        setups = ("(a) workarounds, no plugin", "(b) plugin, no workaround", "(c) needs nothing, no plugin",
                  "(c) needs nothing, plugin")
        rows = {line[:30].strip(): line.split() for line in result.stdout.splitlines() if line[:30].strip() in setups}
        self.assertEqual(len(rows), 4, result.stdout)
        # (a) and (b) both train fp32 master weights with bf16 compute from the same init: same loss.
        self.assertEqual(rows["(a) workarounds, no plugin"][-1], rows["(b) plugin, no workaround"][-1])

    def test_cpu_benchmarks_quick(self):
        result = run_tool("tools/benchmarks/bench_cpu.py", "all", "--quick")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        for strategy in ("upcast", "preserve"):
            self.assertIn(
                f"{strategy}: same decisions at every world size: True; "
                "the same plugin calls per step at every world size: True",
                result.stdout,
            )
        # fp32 norms in one bf16 group: the collectives of a bf16 group, the training of per-norm fp32 units.
        self.assertRegex(result.stdout, r"\(a\) collectives == \(c\): True; \(a\) < \(b\): True")
        self.assertRegex(result.stdout, r"\(a\) losses == \(b\) losses bit for bit over \d+ steps: True")
        if HAS_DTYPE_BUG:
            self.assertRegex(result.stdout, r"bytes added (\d+) = expected \1 ")

    def test_export_bench_quick(self):
        result = run_tool("tools/benchmarks/bench_export.py", "--quick")
        # Exit 0 also means every method's result equaled get_model_state_dict + a cast by hand bit for bit.
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        methods = [line.split()[0] for line in result.stdout.splitlines()
                   if line.startswith(("by hand", "state_dict_as_loaded", "streamed"))]
        self.assertEqual(methods, ["by", "state_dict_as_loaded", "streamed"], result.stdout)
        self.assertRegex(result.stdout, r"streamed extra peak <= 1.1 x largest tensor on every rank: \d")

    def test_live_models_cost(self):
        result = run_tool("tools/benchmarks/live_models_cost.py", "--live", "1", "4")
        # Exit 0 also means the plugin's side upcast each timed model at its first AdamW.
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        rows = [line for line in result.stdout.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
        self.assertEqual(len(rows), 2, result.stdout)
        self.assertIn("plugin's first AdamW with 4 live models / with 1:", result.stdout)

    def test_startup_cost_one_round(self):
        result = run_tool("tools/benchmarks/startup_cost.py", "--rounds", "1")
        # Exit 0: under TORCH_FSDP_EXT_AUTOLOAD=1, a process that imports torch and never FSDP loads no plugin module.
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        rows = {tuple(line.split()[:2]): line.split() for line in result.stdout.splitlines()}
        self.assertEqual(rows[("torch.distributed.fsdp", "set")][-2], "True", result.stdout)  # there it is imported

    def test_plugin_bytecodes_per_step_direct_layout(self):
        # Seconds, no valgrind: the plugin's Python bytecodes in one step of the direct layout (8 blocks, each its
        # own root, each checkpointed). Without checkpointing no plugin code runs. Where a region cannot need a
        # replay (RecomputeReplay.records_regions), only the six checkpoint-hook wrappers run per region and pass
        # through: FSDP's forward hooks stay torch's own.
        result = run_tool("tools/benchmarks/bench_instructions.py", "--bytecodes", "--layout", "direct")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        without, with_checkpoint = result.stdout.split("\nper-block checkpoint\n")
        # No plugin code runs without checkpointing, the reduce fix included: it acts once per parameter, at the
        # first all-gather (Note [Until the first all-gather]), before the measured step.
        self.assertRegex(without, r"\n\s*total\s+0\s+0\n")
        rows = {line.split()[0]: line.split()[1:] for line in with_checkpoint.splitlines()[1:] if line.strip()}
        if RecomputeReplay(_compat.load_internals()).records_regions:
            self.assertIn("_replay.py:_pre_forward", rows, result.stdout)  # regions keep records
            return
        hook_wrappers = {"_records.py:__init__", "_records.py:__enter__", "_records.py:__exit__",
                         "_replay.py:__enter__", "_replay.py:__exit__"}
        self.assertEqual(set(rows) - {"total"}, hook_wrappers, result.stdout)
        # __init__, __enter__, __exit__ of 2 hooks per region
        self.assertEqual(int(rows["total"][1]), 6 * 8, result.stdout)

    @unittest.skipIf(
        shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
        "valgrind (callgrind) is not installed: tools/benchmarks/bench_instructions.py counts with it",
    )
    @unittest.skipIf(
        torch.version.cuda is not None,
        "counted on CPU builds of torch only: a CUDA build loads its CUDA libraries under valgrind, minutes more per run",
    )
    def test_instruction_counts_quick(self):
        # Six callgrind processes (each re-imports torch under valgrind: most of this test's time), 2 steps of
        # unpatched and of patched, each at 3 address shifts, no checkpointing. The tool exits 1 when the plugin
        # adds more than the bound per FSDP forward beyond the spread over the shifts (where things lie in memory
        # moves a count by tens of thousands of instructions per step).
        result = run_tool("tools/benchmarks/bench_instructions.py", "--quick", timeout=1200)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        row = next(line for line in result.stdout.splitlines() if line.strip().startswith("no checkpoint"))
        cells = re.split(r"\s{2,}", row.strip())
        unpatched = float(cells[1].replace(",", ""))
        self.assertGreater(unpatched, 1e6)  # callgrind counted the steps (about 18 M each)
        per_forward = float(cells[3].split()[0].replace(",", ""))
        spread_per_forward = float(cells[4].replace(",", "")) / 8  # 8 FSDP forwards per step
        self.assertLessEqual(per_forward - spread_per_forward, 3_500)


if __name__ == "__main__":
    run_tests()
