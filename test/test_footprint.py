"""Note [Armed] in ``_install``: in a process that imported the plugin and sharded nothing, optimizers and
checkpointed regions run torch's own code; from the first ``fully_shard`` on, the plugin's wrappers there pass
through with a check that finds nothing (tools/benchmarks/footprint_instructions.py)."""

from __future__ import annotations

import re
import subprocess
import sys

from torch.testing._internal.common_utils import TestCase, run_tests

from torch_fsdp_ext import _compat
from torch_fsdp_ext._recompute import RecomputeReplay

from common import HAS_DTYPE_BUG, ROOT


class TestFootprint(TestCase):
    def test_plugin_calls_per_optimizer_and_checkpoint_region(self):
        # Seconds, no valgrind: the plugin's own Python functions that one operation calls. The identity of the
        # torch functions is tested in test_api (TestFreshInterpreter); this is what runs.
        result = subprocess.run([sys.executable, "tools/benchmarks/footprint_instructions.py", "--calls"],
                                capture_output=True, text=True, cwd=ROOT, timeout=300)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        calls = {(moment, op): (int(n), listed) for moment, op, n, listed in re.findall(
            r"^(no FSDP2|FSDP2 used)\s+(\w+)\s+plugin calls: (\d+) \((.*)\)$", result.stdout, re.M)}
        self.assertEqual(calls[("no FSDP2", "optimizer")], (0, "none"), result.stdout)
        self.assertEqual(calls[("no FSDP2", "checkpoint")], (0, "none"), result.stdout)
        # After fully_shard: the dtype fix's add_param_group wrapper and its check, which finds no undecided model.
        self.assertEqual(calls[("FSDP2 used", "optimizer")],
                         (2, "_fix.py:upcast_models_holding 1, _optimizer_state.py:add_param_group 1")
                         if HAS_DTYPE_BUG else (0, "none"), result.stdout)
        # The six checkpoint-hook wrappers, once each per region (attach_records and find_records are both
        # __init__ in _records.py); where regions keep records, the recompute fix also records a plain forward.
        n, listed = calls[("FSDP2 used", "checkpoint")]
        called = dict(re.findall(r"(\S+) (\d+)", listed))
        hooks = {"_records.py:__enter__": "1", "_records.py:__exit__": "1", "_records.py:__init__": "2",
                 "_replay.py:__enter__": "1", "_replay.py:__exit__": "1"}
        self.assertEqual({name: called.get(name) for name in hooks}, hooks, result.stdout)
        if not RecomputeReplay(_compat.load_internals()).records_regions:
            self.assertEqual(n, 6, result.stdout)


if __name__ == "__main__":
    run_tests()
