"""Simulated future torch releases: torch's checkpoint or FSDP2 internals change meaning before
the plugin is imported (test/scripts/simulated_release.py), or FSDP2 is missing altogether.

Expected per change: the fix works bit for bit, or it stands aside with one warning naming it
and training, with checkpoint, with and without FSDP, equals plain torch's bit for bit.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "test", "scripts", "simulated_release.py")

# Changes under which the recompute fix must stand aside, and what its warning names.
STANDS_ASIDE = {
    "recompute_fn_renamed": "recompute_fn",
    "recomputation_hook_takes_frame": "weak reference",
    "iter_forward_root_renamed": "iter_forward_root",
}
WORKS = ("no_decorator_cell",)  # the fix is installed and replays as on torch unchanged


def simulate(case: str, *flags: str, env: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    env.pop("TORCH_FSDP_EXT_DISABLE", None)
    result = subprocess.run(
        [sys.executable, SCRIPT, case, *flags], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    if result.returncode != 0:
        raise AssertionError(f"{case} {flags}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def reduce_active() -> bool:
    """Whether the reduce fix installs on this torch unchanged (none of these changes touches what it wraps)."""
    return simulate("none", "--plugin")["active"]["reduce"]


def sets_sorted(message: str | None) -> str | None:
    """``message`` with each printed set's items in sorted order (set order differs between processes)."""
    if message is None:
        return None
    return re.sub(r"\{([^{}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", message)


class TestSimulatedReleases(unittest.TestCase):
    def test_stands_aside_alone_and_trains_as_plain_torch(self) -> None:
        for case, named in STANDS_ASIDE.items():
            with self.subTest(case=case):
                plain, fixed = simulate(case), simulate(case, "--plugin")
                self.assertNotIn("error", plain)  # the simulated torch trains by itself
                self.assertNotIn("error", fixed)
                self.assertEqual(len(fixed["warnings"]), 1, fixed["warnings"])
                self.assertIn("'recompute'", fixed["warnings"][0])
                self.assertIn(named, fixed["warnings"][0])
                # the dtype fix still works
                self.assertEqual(fixed["active"], {"dtype": True, "recompute": False, "reduce": reduce_active()})
                self.assertIsNone(fixed["recompute_needed"])
                self.assertEqual(fixed["plain"], plain["plain"])  # bit for bit, checkpoint without FSDP
                self.assertEqual(fixed["fsdp"], plain["fsdp"])  # and under fully_shard

    def test_fix_works_bit_for_bit(self) -> None:
        reference = simulate("none", "--plugin", "--bf16")
        self.assertNotIn("error", reference)
        for case in WORKS:
            with self.subTest(case=case):
                fixed = simulate(case, "--plugin", "--bf16")
                self.assertEqual(fixed["warnings"], [])
                self.assertEqual(fixed["active"], {"dtype": True, "recompute": True, "reduce": reduce_active()})
                self.assertEqual(fixed["plain"], reference["plain"])
                self.assertEqual(fixed["fsdp"], reference["fsdp"])



    def test_a_symbol_only_one_fix_needs_sets_aside_that_fix_alone(self) -> None:
        # simulated change -> (the fix that stands aside, what its warning names, the fix that stays active)
        cases = {
            "init_mp_dtypes_renamed": ("dtype", "FSDPParamGroup._init_mp_dtypes", "recompute"),
            "recomputation_hook_renamed": ("recompute", "_recomputation_hook", "dtype"),
        }
        for case, (aside, named, works) in cases.items():
            with self.subTest(case=case):
                plain, fixed = simulate(case, "--bf16"), simulate(case, "--plugin", "--bf16")
                self.assertNotIn("error", plain)
                self.assertNotIn("error", fixed)
                self.assertEqual(len(fixed["warnings"]), 1, fixed["warnings"])
                self.assertIn(f"fix '{aside}' not installed", fixed["warnings"][0])
                self.assertIn(named, fixed["warnings"][0])
                self.assertEqual(fixed["active"], {aside: False, works: True, "reduce": reduce_active()})
                self.assertEqual(fixed["plain"], plain["plain"])  # checkpoint without FSDP: plain torch's

    def test_uniform_check_moved_into_the_group_lazy_init(self) -> None:
        # _init_mp_dtypes accepts the mixed model, FSDPParamGroup.lazy_init asserts: torch still rejects it.
        case = "uniform_check_in_lazy_init"
        plain = simulate(case, "--mixed")
        self.assertIn("uniform original parameter dtype", plain["error"])  # the simulated torch rejects it
        reference, fixed = simulate("none", "--plugin", "--mixed"), simulate(case, "--plugin", "--mixed")
        self.assertNotIn("error", fixed)
        self.assertEqual(fixed["warnings"], [])
        self.assertEqual(fixed["active"], {"dtype": True, "recompute": True, "reduce": reduce_active()})
        self.assertIn("FSDPParamGroup.lazy_init asserts one dtype", fixed["dtype_reason"])  # not "fixed upstream"
        self.assertEqual(fixed["fsdp"], reference["fsdp"])  # upcast: bit for bit as on torch unchanged
        preserved = simulate(case, "--plugin", "--mixed", env={"TORCH_FSDP_EXT_DTYPE_STRATEGY": "preserve"})
        self.assertIn("MixedParamDtypeError", preserved["error"])  # refused by the plugin, not torch's assertion
        self.assertIn("FSDPParamGroup.lazy_init", preserved["error"])
        self.assertIn("'blocks.0'", preserved["error"])
        self.assertIn("blocks.0.lin2.weight: bfloat16", preserved["error"])


    def test_an_upstream_fix_is_left_to_torch(self) -> None:
        # _init_mp_dtypes without its assertion (rewritten from torch's own source): the plugin upcasts
        # nothing and trains exactly as torch does (2.15: natively mixed; before: torch's own reduce error).
        case = "uniform_check_removed"
        plain, fixed = simulate(case, "--mixed"), simulate(case, "--plugin", "--mixed")
        self.assertEqual(fixed["warnings"], [])
        self.assertEqual(fixed["active"], {"dtype": False, "recompute": True, "reduce": reduce_active()})
        self.assertEqual(fixed["dtype_reason"], "this torch accepts mixed trainable dtypes in one group")
        self.assertEqual(fixed.get("fsdp"), plain.get("fsdp"))
        self.assertEqual(sets_sorted(fixed.get("error")), sets_sorted(plain.get("error")))
        self.assertNotIn("uniform original parameter dtype", plain.get("error", ""))

    def test_group_init_without_argument_names(self) -> None:
        # FSDPParamGroup.__init__(self, *args, **kwargs): the dtype fix cannot find the parameters it plans.
        case = "group_init_args_hidden"
        plain, fixed = simulate(case, "--mixed"), simulate(case, "--plugin", "--mixed")
        self.assertEqual(len(fixed["warnings"]), 1, fixed["warnings"])
        self.assertIn("fix 'dtype' not installed", fixed["warnings"][0])
        self.assertIn("FSDPParamGroup.__init__ argument 'params'", fixed["warnings"][0])
        self.assertEqual(fixed["active"], {"dtype": False, "recompute": True, "reduce": reduce_active()})
        for outcome in (plain, fixed):  # torch's own assertion, as without the plugin
            self.assertRegex(outcome["error"], r"^AssertionError: FSDP expects uniform original parameter dtype")


# FSDP2 cannot be imported (a build or release without it), or its package has no fully_shard.
NO_FSDP2 = {
    "not importable": "sys.modules['torch.distributed.fsdp'] = None",
    "no fully_shard": "import torch.distributed.fsdp as public, torch.distributed._composable.fsdp as old\n"
    "public.__dict__.pop('fully_shard'); old.__dict__.pop('fully_shard', None)",
}
NO_FSDP2_PROBE = """
import json, sys, warnings
import torch
from torch.utils.checkpoint import checkpoint
{simulation}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_fsdp_ext
try:
    torch_fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    policy_error = None
except ImportError as e:
    policy_error = str(e)
torch.manual_seed(0)
lin = torch.nn.Linear(4, 4)
x = torch.randn(2, 4)
checkpoint(lambda t: lin(t).relu(), x, use_reentrant=False).sum().backward()
checkpointed = lin.weight.grad.clone()
lin.weight.grad = None
lin(x).relu().sum().backward()
print(json.dumps({
    "warnings": [str(w.message) for w in caught if "torch_fsdp_ext" in str(w.message)],
    "active": [name for name, fix in torch_fsdp_ext.status().fixes.items() if fix.active],
    "policy_error": policy_error,
    "checkpoint_exact": bool(torch.equal(checkpointed, lin.weight.grad)),
}))
"""


class TestWithoutFSDP2(unittest.TestCase):
    def test_import_succeeds_warns_once_and_checkpoint_works(self) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TORCH_FSDP_EXT_DISABLE", None)
        for case, simulation in NO_FSDP2.items():
            with self.subTest(case=case):
                result = subprocess.run([sys.executable, "-c", NO_FSDP2_PROBE.replace("{simulation}", simulation)],
                                        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
                self.assertEqual(result.returncode, 0, result.stderr[-3000:])
                outcome = json.loads(result.stdout.strip().splitlines()[-1])
                self.assertIn("FSDP2", outcome["policy_error"])
                self.assertTrue(outcome["checkpoint_exact"])
                if case == "not importable":
                    self.assertEqual(outcome["active"], [])
                    self.assertEqual(len(outcome["warnings"]), 1, outcome["warnings"])
                    self.assertIn("nothing is patched", outcome["warnings"][0])
                else:  # the internals the fixes patch are still there: they install, with no warning
                    self.assertEqual(outcome["warnings"], [])


UNDECIDABLE_DTYPE_CHECK = """
import json, warnings
import torch_fsdp_ext
from torch_fsdp_ext._compat import _dtype as _compat_dtype
_compat_dtype.probe_rejects_mixed_trainable_dtypes = lambda: None  # _init_mp_dtypes ran but told nothing
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch_fsdp_ext.install()
    torch_fsdp_ext.install()
dtype = torch_fsdp_ext.status().fixes["dtype"]
print(json.dumps({
    "warnings": [str(w.message) for w in caught if "torch_fsdp_ext" in str(w.message)],
    "needed": dtype.needed, "active": dtype.active, "reason": dtype.reason,
}))
"""


class TestUndecidableDtypeCheck(unittest.TestCase):
    def test_the_dtype_fix_stands_aside_instead_of_upcasting_on_a_guess(self) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TORCH_FSDP_EXT_DISABLE="1")
        result = subprocess.run([sys.executable, "-c", UNDECIDABLE_DTYPE_CHECK], capture_output=True, text=True,
                                env=env, timeout=120, cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        outcome = json.loads(result.stdout.strip().splitlines()[-1])
        self.assertEqual((outcome["needed"], outcome["active"]), (None, False))
        self.assertIn("nothing is upcast", outcome["reason"])
        self.assertEqual(len(outcome["warnings"]), 1, outcome["warnings"])
        self.assertIn("fix 'dtype' not installed", outcome["warnings"][0])

    def test_the_probe_runs_the_real_group_lazy_init(self) -> None:
        # What lets the probe see a check moved into lazy_init: on this release the real
        # FSDPParamGroup.lazy_init runs to its end on the probe's group, and fails only on mixed dtypes.
        import torch
        from common import plugin

        from torch_fsdp_ext import _compat
        from torch_fsdp_ext._compat import _dtype as _compat_dtype

        internals = _compat.load_internals()

        def lazy_init_rejects(*dtypes: torch.dtype) -> bool | None:
            group = _compat_dtype._lazy_init_probe_group(internals, [_compat_dtype._ProbeParam(d, True) for d in dtypes])
            return _compat_dtype._rejects(lambda: internals.FSDPParamGroup.lazy_init(group))

        with plugin(False):  # torch's own lazy init, as the probe sees it before installing
            self.assertIs(lazy_init_rejects(torch.float32, torch.float32), False)
            self.assertIs(lazy_init_rejects(torch.bfloat16, torch.float32), True)  # inside its _init_mp_dtypes here
        self.assertEqual(_compat_dtype.probe_uniform_dtype_check(), "_init_mp_dtypes")

if __name__ == "__main__":
    unittest.main()
