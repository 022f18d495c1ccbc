"""install / uninstall / status: idempotence, identity, import order, unsupported torch."""

from __future__ import annotations

import contextlib
import io
import os
import textwrap
import types
import warnings

import torch
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext import _compat
from torch_fsdp_ext._patching import PatchSet

from torch_fsdp_ext import __main__ as cli, run as launcher

from common import (
    HAS_DTYPE_BUG,
    HAS_GRAD_DTYPES_BUG,
    HAS_RECOMPUTE_CAST_BUG,
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    fully_shard,
    run_python,
)


def patched_attributes() -> dict[tuple[str, str], object]:
    """Every attribute the fixes may touch, as found in each owner's own ``__dict__``."""
    internals = _compat.load_internals()
    out = {}
    for owner, name in _compat.WRAPPED_METHODS:
        cls = internals.symbols[owner]
        out[(owner, name)] = cls.__dict__.get(name, "<inherited>")
        cell = _compat.decorated_method_cell(out[(owner, name)]) if owner == "FSDPState" else None
        if cell is not None:  # what torch's dynamo decorator calls (switched during checkpoint regions)
            out[(owner, f"{name} (decorated method)")] = cell.cell_contents
    # The reduce fix's property for unused parameters' zeros (where the release has it).
    fsdp_param_cls = internals.symbols["FSDPParam"]
    if "unsharded_zero_grad_data" in fsdp_param_cls.__dict__:
        out[("FSDPParam", "unsharded_zero_grad_data")] = fsdp_param_cls.__dict__["unsharded_zero_grad_data"]
    # What the dtype fix wraps outside FSDP2: where optimizers and torch.distributed.checkpoint.state_dict
    # reach a model (Note [Optimizers see the upcast]).
    out[("Optimizer", "add_param_group")] = torch.optim.Optimizer.__dict__["add_param_group"]
    for module, name in _compat.state_dict_entry_points():
        out[(module.__name__, name)] = module.__dict__[name]
    return out


class TestInstallUninstall(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.was_active = [n for n, f in torch_fsdp_ext.status().fixes.items() if f.active]

    def tearDown(self) -> None:
        torch_fsdp_ext.uninstall()
        torch_fsdp_ext.install(self.was_active)
        super().tearDown()

    def test_import_installed_what_this_torch_needs(self):
        report = torch_fsdp_ext.status()
        self.assertTrue(report.supported)
        self.assertEqual(report.fixes["dtype"].active, HAS_DTYPE_BUG)
        self.assertTrue(report.fixes["recompute"].active)  # root device move: no release replays it yet
        expected_input_cast = "torch_fsdp_ext" if HAS_RECOMPUTE_CAST_BUG else "upstream"
        self.assertEqual(report.fixes["recompute"].details["replays"]["input cast"], expected_input_cast)
        self.assertIn("FSDPState._pre_forward", " ".join(report.fixes["recompute"].wraps))

    def test_install_is_idempotent(self):
        torch_fsdp_ext.install()
        once = patched_attributes()
        torch_fsdp_ext.install()
        self.assertEqual({k: id(v) for k, v in patched_attributes().items()}, {k: id(v) for k, v in once.items()})

    def test_uninstall_restores_every_original_by_identity_after_1000_cycles(self):
        torch_fsdp_ext.uninstall()
        pristine = patched_attributes()
        torch_fsdp_ext.install()
        patched = patched_attributes()
        changed = [key for key in pristine if patched[key] is not pristine[key]]
        # Every wrapped method but the reduce path of mixed groups (wrapped while such a group
        # lives, test_lifecycle), post_backward (wrapped while a frozen parameter is watched,
        # test_orders), the param group's lazy_init and FSDPParam.__init__ (the reduce fix's alone)
        # and, where torch's decorator calls them through a cell, FSDP's pre/post-forward (switched
        # only while a checkpoint region runs); the recompute fix alone wraps 8. The dtype fix also
        # wraps Optimizer.add_param_group and three state-dict entry points. The reduce fix wraps the
        # param group's lazy_init, FSDPParam.__init__ and, where the release reduces unused
        # parameters, FSDPParam.unsharded_zero_grad_data, where this torch needs it. What lies outside
        # FSDP2 (those four, the six checkpoint hooks) is armed until an FSDP2 state exists (this
        # process may hold one from another test), and the recompute fix wraps FSDPState.init for it.
        switched = 2 if torch_fsdp_ext._install._active["recompute"][0].switches_hooks else 0
        outside = 1 + len(_compat.state_dict_entry_points())
        self.assertEqual(outside, 4)
        report = torch_fsdp_ext.status().fixes
        reduce_wraps = len(report["reduce"].wraps)
        self.assertIn(reduce_wraps, (2, 3) if "reduce" in torch_fsdp_ext._install._active else (0,))
        armed = sum(len(fix.armed) for fix in report.values())
        self.assertEqual(armed, 0 if _compat.fsdp_states() else 6 + (outside if HAS_DTYPE_BUG else 0))
        first_state = 0 if HAS_DTYPE_BUG else 1  # FSDPState.init: the dtype fix wraps it anyway
        expected = (len(_compat.WRAPPED_METHODS) - 5 + outside if HAS_DTYPE_BUG else 8) + first_state - switched
        expected += reduce_wraps - armed
        self.assertEqual(len(changed), expected)
        for _ in range(1000):
            torch_fsdp_ext.install()
            torch_fsdp_ext.uninstall()
        after = patched_attributes()
        for key, original in pristine.items():
            self.assertIs(after[key], original, key)
        self.assertEqual([n for n, f in torch_fsdp_ext.status().fixes.items() if f.active], [])

    def test_context_manager_removes_only_what_it_installed(self):
        torch_fsdp_ext.uninstall()
        torch_fsdp_ext.install(["recompute"])
        with torch_fsdp_ext.installed() as active:
            self.assertIn("recompute", active)
            self.assertEqual("dtype" in active, HAS_DTYPE_BUG)
        self.assertEqual([n for n, f in torch_fsdp_ext.status().fixes.items() if f.active], ["recompute"])

    def test_unknown_fix_and_strategy_are_rejected(self):
        with self.assertRaisesRegex(ValueError, "unknown fix"):
            torch_fsdp_ext.install(["dtypes"])
        with self.assertRaisesRegex(ValueError, "dtype_strategy must be one of"):
            torch_fsdp_ext.install(dtype_strategy="downcast")

    def test_status_reports_probed_needs(self):
        report = torch_fsdp_ext.status().fixes
        self.assertEqual(report["dtype"].needed, HAS_DTYPE_BUG)
        self.assertEqual(report["recompute"].needed, True)


class TestReadableState(TestCase):
    def test_status_is_a_short_table(self):
        report = torch_fsdp_ext.status()
        lines = str(report).splitlines()
        self.assertEqual(lines[0], f"torch_fsdp_ext on torch {torch.__version__}")
        self.assertEqual(lines[1], "fix        needed  active  strategy  wrapped torch methods")
        dtype, recompute = report.fixes["dtype"], report.fixes["recompute"]
        needed = "yes" if HAS_DTYPE_BUG else "no"
        active = "yes" if dtype.active else "no"
        self.assertRegex(lines[2], rf"^dtype +{needed} +{active} +{dtype.details['strategy']} +{len(dtype.wraps)}$")
        recompute_needed = "yes" if HAS_RECOMPUTE_CAST_BUG else "partly"  # torch >= 2.13 replays the input cast
        self.assertRegex(lines[3], rf"^recompute +{recompute_needed} +yes +- +{len(recompute.wraps)}$")
        why = f"needed, because {dtype.reason}." if dtype.needed else f"not needed: {dtype.reason}."
        self.assertIn(f"dtype: {why}", lines)
        self.assertLess(len(str(report)), 1100)  # a screen: the table, a sentence or two per fix

    def test_command_line_help_status_and_launcher_usage(self):
        help_text = io.StringIO()
        with contextlib.redirect_stdout(help_text), self.assertRaises(SystemExit):
            cli.main(["--help"])
        for command in ("doctor ", "status ", "-m torch_fsdp_ext.run train.py"):
            self.assertIn(command, help_text.getvalue())
        self.assertNotIn("``", help_text.getvalue())
        usage = io.StringIO()
        with contextlib.redirect_stderr(usage), self.assertRaises(SystemExit) as exited:
            launcher.main([])
        self.assertEqual(exited.exception.code, 2)
        self.assertExpectedInline(
            usage.getvalue(),
            """\
usage: python -m torch_fsdp_ext.run [--fixes FIXES] [--dtype-strategy STRATEGY] [--compute-in-loaded-dtype MODULES] [--reduce-dtype float32] (SCRIPT | -m MODULE) [ARGS ...]
python -m torch_fsdp_ext.run: error: no script to run: give a script path, or -m and a module name
""",
        )
        # The installed entry point prints what status() says in a fresh interpreter.
        result = run_python("import sys; from torch_fsdp_ext.__main__ import main; sys.exit(main(['status']))")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.splitlines()[1:4], str(torch_fsdp_ext.status()).splitlines()[1:4])


class TestPatchSet(TestCase):
    def test_rollback_after_a_failed_wrap_restores_what_was_applied_by_identity(self):
        """torch 2.6: a wrapper factory raised midway through install(), and the rollback then
        tried to delete an inherited attribute it had never set."""

        class Base:
            def inherited(self):
                return "base"

        class Owner(Base):
            def own(self):
                return "own"

        own = Owner.__dict__["own"]
        patches = PatchSet()
        patches.wrap(Owner, "own", lambda original: lambda self: "wrapped")

        def failing_factory(original):
            raise RuntimeError("probe failed")

        with self.assertRaisesRegex(RuntimeError, "probe failed"):
            patches.wrap(Owner, "inherited", failing_factory)
        self.assertEqual(Owner().own(), "wrapped")
        patches.restore()
        self.assertIs(Owner.__dict__["own"], own)
        self.assertNotIn("inherited", Owner.__dict__)
        self.assertEqual(Owner().inherited(), "base")

    def test_restore_leaves_a_patch_put_over_ours_and_says_so(self):
        """A library that patched the attribute after us (NeMo Automodel's foreach_reduce, say) keeps its patch:
        putting torch's original back would drop it without a word."""
        owner = types.ModuleType("fsdp_module_stand_in")

        def original():
            return "torch"

        owner.reduce = original
        patches = PatchSet()
        patches.wrap(owner, "reduce", lambda current: lambda: "plugin")

        def foreign_reduce():
            return "library"

        owner.reduce = foreign_reduce
        with self.assertWarnsRegex(RuntimeWarning, r"left fsdp_module_stand_in\.reduce as it is \(.*foreign_reduce\)"):
            patches.restore()
        self.assertIs(owner.reduce, foreign_reduce)
        # Ours, still in place, is restored as before, without a warning.
        patches.wrap(owner, "reduce", lambda current: lambda: "plugin")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            patches.restore()
        self.assertIs(owner.reduce, foreign_reduce)


class TestFreshInterpreter(TestCase):
    """Import order and environment: each case in a new Python process."""

    SEEDS = textwrap.dedent(
        """
        import os, torch, torch.nn as nn, torch.distributed as dist
        from torch.utils.checkpoint import checkpoint
        dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=0, world_size=1)

        def mixed_dtypes(fully_shard, MixedPrecisionPolicy):
            m = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.LayerNorm(8))
            fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            return m

        def run_mixed(m):
            m(torch.randn(2, 8)).float().sum().backward()

        def checkpointed(fully_shard, MixedPrecisionPolicy):
            m = nn.Sequential(nn.GELU(), nn.Linear(8, 8))
            fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            return m

        def run_checkpointed(m):
            x = torch.randn(2, 8, requires_grad=True)
            checkpoint(m, x, use_reentrant=False).float().sum().backward()

        def outcome(fn, *args):
            try:
                fn(*args)
                return "ok"
            except Exception as e:
                return type(e).__name__
        """
    )

    def run_case(self, body: str, env: dict | None = None) -> str:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            env = {"INIT_FILE": f"{tmp}/init", **(env or {})}
            code = self.SEEDS + textwrap.dedent(body).replace("FSDP2_API", _compat.fsdp2_api().__name__)
            result = run_python(code, env=env)
        self.assertEqual(result.returncode, 0, result.stderr)
        # Some releases' gloo prints "[Gloo] Rank 0 is connected to ..." first.
        return "\n".join(line for line in result.stdout.strip().splitlines() if not line.startswith("[Gloo]"))

    def test_nothing_outside_fsdp2_is_wrapped_until_fully_shard(self):
        # Note [Armed] in _install: optimizers, checkpoint hooks and DCP run torch's own functions until the
        # first fully_shard; from then on the plugin's, until uninstall() puts torch's back by identity.
        out = self.run_case(
            """
            import torch.distributed.checkpoint.state_dict as dcp_state_dict
            import torch.utils.checkpoint as ckpt
            def outside():
                return [torch.optim.Optimizer.__dict__["add_param_group"],
                        *(vars(ckpt._checkpoint_hook).get(n) for n in ("__init__", "__enter__", "__exit__")),
                        *(vars(ckpt._recomputation_hook).get(n) for n in ("__init__", "__enter__", "__exit__")),
                        *(vars(dcp_state_dict)[n] for n in ("_load_model_state_dict", "_get_optim_state_dict",
                                                            "_load_optim_state_dict"))]
            torch_own = outside()
            import torch_fsdp_ext
            from FSDP2_API import fully_shard, MixedPrecisionPolicy
            def report():
                fixes = torch_fsdp_ext.status().fixes.values()
                wrapped = sorted({w for f in fixes for w in f.wraps})
                return [sum(a is b for a, b in zip(outside(), torch_own)),
                        any(w.startswith(("torch.optim", "torch.utils", "torch.distributed.checkpoint"))
                            for w in wrapped),
                        sorted(w.split(".")[-2] for f in fixes for w in f.armed)]
            print(report())
            torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # no FSDP2 use: nothing is installed
            checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True), use_reentrant=False).sum().backward()
            print(report())
            m = mixed_dtypes(fully_shard, MixedPrecisionPolicy)
            print(report())
            torch.optim.SGD(m.parameters(), lr=0.1)  # an optimizer before the first forward upcasts the model
            print(sorted({str(p.dtype) for p in m.parameters()}))
            torch_fsdp_ext.uninstall()
            print(report())
            torch_fsdp_ext.install()  # a model is sharded: installed at once
            print(report()[:2])
            """
        )
        dtype_outside = ["Optimizer", "state_dict", "state_dict", "state_dict"] if HAS_DTYPE_BUG else []
        hooks = ["_checkpoint_hook"] * 3 + ["_recomputation_hook"] * 3
        upcast = "['torch.float32']" if HAS_DTYPE_BUG else "['torch.bfloat16', 'torch.float32']"
        self.assertEqual(out.splitlines(), [
            f"[10, False, {sorted(dtype_outside + hooks)}]",
            f"[10, False, {sorted(dtype_outside + hooks)}]",
            f"[{4 - len(dtype_outside)}, True, []]",
            upcast,
            "[10, False, []]",
            f"[{4 - len(dtype_outside)}, True]",
        ])

    def test_fixes_env_var_and_launcher_option_install_only_those(self):
        # TORCH_FSDP_EXT_FIXES and the launcher's --fixes: only the fixes named (where this torch needs them); an
        # unknown name stops the import, or the launcher, with a SettingError that lists the names.
        needs_reduce = HAS_GRAD_DTYPES_BUG
        show = "print([n for n, f in torch_fsdp_ext.status().fixes.items() if f.active])"
        out = self.run_case(f"import torch_fsdp_ext\n{show}", env={"TORCH_FSDP_EXT_FIXES": " Reduce "})
        self.assertEqual(out, str(["reduce"] if needs_reduce else []))
        out = self.run_case(f"import torch_fsdp_ext\n{show}", env={"TORCH_FSDP_EXT_FIXES": "recompute,reduce"})
        self.assertEqual(out, str(["recompute", "reduce"] if needs_reduce else ["recompute"]))
        failed = run_python("import torch_fsdp_ext", env={"TORCH_FSDP_EXT_FIXES": "reduce,dtypes"})
        self.assertNotEqual(failed.returncode, 0)
        self.assertIn("SettingError: torch_fsdp_ext: TORCH_FSDP_EXT_FIXES must name some of dtype, recompute, reduce",
                      failed.stderr)
        self.assertIn("'dtypes'", failed.stderr)
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "train.py")
            with open(script, "w", encoding="utf-8") as f:
                f.write(f"import os, torch_fsdp_ext\n{show}\nprint(os.environ['TORCH_FSDP_EXT_FIXES'])\n")
            launched = run_python(f"from torch_fsdp_ext import run; run.main(['--fixes', 'reduce', {script!r}])")
            self.assertEqual(launched.returncode, 0, launched.stderr)
            # The script's interpreters started by it get the same fixes (TORCH_FSDP_EXT_FIXES).
            self.assertEqual(launched.stdout.split(), [str(["reduce"] if needs_reduce else []).replace(" ", ""),
                                                       "reduce"])
            refused = run_python(f"from torch_fsdp_ext import run; run.main(['--fixes', 'reduce,dtypes', {script!r}])")
            self.assertEqual(refused.returncode, 2)  # argparse's usage error
            self.assertIn("--fixes must name some of dtype, recompute, reduce", refused.stderr)

    def test_reduce_dtype_env_var_and_launcher_option(self):
        # TORCH_FSDP_EXT_REDUCE_DTYPE=float32 and the launcher's --reduce-dtype: the reduce fix is installed with the
        # fp32 reduction setting on every release (2.15 needs nothing else of it); --fixes still limits the fixes.
        import tempfile

        show = ("s = torch_fsdp_ext.status().fixes; "
                "print([n for n, f in s.items() if f.active], s['reduce'].details['reduce_dtype'])")
        out = self.run_case(f"import torch_fsdp_ext\n{show}", env={"TORCH_FSDP_EXT_REDUCE_DTYPE": " Float32 "})
        self.assertTrue(out.endswith("'reduce'] float32"), out)
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "train.py")
            with open(script, "w", encoding="utf-8") as f:
                f.write(f"import os, torch_fsdp_ext\n{show}\nprint(os.environ['TORCH_FSDP_EXT_REDUCE_DTYPE'])\n")
            launched = run_python(
                f"from torch_fsdp_ext import run; run.main(['--fixes', 'reduce', '--reduce-dtype', 'float32', {script!r}])"
            )
            self.assertEqual(launched.returncode, 0, launched.stderr)
            self.assertEqual(launched.stdout.split(), ["['reduce']", "float32", "float32"])
        failed = run_python("import torch_fsdp_ext", env={"TORCH_FSDP_EXT_REDUCE_DTYPE": "bf16"})
        self.assertIn("TORCH_FSDP_EXT_REDUCE_DTYPE must be one of float32, none", failed.stderr)

    def test_fully_shard_imported_before_the_plugin(self):
        out = self.run_case(
            """
            from FSDP2_API import fully_shard, MixedPrecisionPolicy
            import torch_fsdp_ext
            print(outcome(run_mixed, mixed_dtypes(fully_shard, MixedPrecisionPolicy)),
                  outcome(run_checkpointed, checkpointed(fully_shard, MixedPrecisionPolicy)))
            """
        )
        self.assertEqual(out, "ok ok")

    def test_fully_shard_called_before_install(self):
        out = self.run_case(
            """
            from FSDP2_API import fully_shard, MixedPrecisionPolicy
            import torch_fsdp_ext
            mixed, ckpt = mixed_dtypes(fully_shard, MixedPrecisionPolicy), checkpointed(fully_shard, MixedPrecisionPolicy)
            torch_fsdp_ext.install()
            rebound = torch_fsdp_ext.status().fixes["recompute"].details["rebound_hooks"]
            switched = torch_fsdp_ext._install._active["recompute"][0].switches_hooks
            print(outcome(run_mixed, mixed), outcome(run_checkpointed, ckpt), "switched" if switched else rebound)
            """,
            env={"TORCH_FSDP_EXT_DISABLE": "1"},
        )
        # Where torch's decorated hooks are switched, nothing is re-bound; else the pre and
        # post hook of the two modules sharded earlier.
        self.assertIn(out, ("ok ok switched", "ok ok 4"))

    def test_disable_env_var_imports_without_patching(self):
        out = self.run_case(
            """
            import torch_fsdp_ext
            from FSDP2_API import fully_shard, MixedPrecisionPolicy
            print([n for n, f in torch_fsdp_ext.status().fixes.items() if f.active],
                  outcome(run_mixed, mixed_dtypes(fully_shard, MixedPrecisionPolicy)))
            """,
            env={"TORCH_FSDP_EXT_DISABLE": "1"},
        )
        self.assertEqual(out, "[] AssertionError" if HAS_DTYPE_BUG else "[] ok")

    def test_unsupported_torch_warns_once_and_changes_nothing(self):
        out = self.run_case(
            """
            import warnings
            import torch_fsdp_ext
            from torch_fsdp_ext import _compat
            _compat.FSDP2_PACKAGES = ("torch.distributed.no_such_fsdp",)  # internals that moved
            _compat.load_internals.cache_clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first, second = torch_fsdp_ext.install(), torch_fsdp_ext.install()
            from FSDP2_API import fully_shard, MixedPrecisionPolicy
            print(first, second, len(caught), torch_fsdp_ext.status().supported,
                  outcome(run_mixed, mixed_dtypes(fully_shard, MixedPrecisionPolicy)))
            print(caught[0].message)
            """,
            env={"TORCH_FSDP_EXT_DISABLE": "1"},
        )
        first_line, warning = out.splitlines()
        self.assertEqual(first_line, "[] [] 1 False " + ("AssertionError" if HAS_DTYPE_BUG else "ok"))
        self.assertIn("torch.distributed.no_such_fsdp", warning)
        self.assertIn("nothing is patched", warning)

    def test_release_that_fixed_a_bug_gets_no_patch(self):
        out = self.run_case(
            """
            import torch_fsdp_ext
            from torch_fsdp_ext._compat import _dtype as _compat_dtype, _recompute as _compat_recompute
            from torch_fsdp_ext._compat import _reduce as _compat_reduce
            _compat_dtype.probe_rejects_mixed_trainable_dtypes = lambda: False  # as if upstream fixed it
            _compat_recompute.probe_recompute_casts_inputs = lambda: True
            _compat_recompute.probe_recompute_moves_inputs = lambda: True
            _compat_reduce.probe_unsharded_grad_dtype = lambda: (torch.float32, "")  # pytorch#197203
            _compat_reduce.probe_no_sync_reads_missing_unsharded_param = lambda: False
            from torch_fsdp_ext._report import plugin_does
            dtype = torch_fsdp_ext.status().fixes["dtype"]
            print(torch_fsdp_ext.install(), dtype.reason)
            print(plugin_does(dtype))  # the doctor's "plugin does" column: what torch does itself
            """,
            env={"TORCH_FSDP_EXT_DISABLE": "1"},
        )
        self.assertEqual(out, "[] this torch accepts mixed trainable dtypes in one group\n"
                              "this torch accepts mixed trainable dtypes in one group")


class TestAlreadyShardedModules(FSDPExtTestCase):
    WORLD_SIZE = 1

    def test_hooks_of_earlier_modules_are_covered_and_restored_by_identity(self):
        torch_fsdp_ext.uninstall()
        model = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(8, 8))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        hooks = dict(model._forward_pre_hooks), dict(model._forward_hooks)
        torch_fsdp_ext.install()
        fix = torch_fsdp_ext._install._active["recompute"][0]
        rebound = torch_fsdp_ext.status().fixes["recompute"].details["rebound_hooks"]
        if fix.switches_hooks:
            # The hooks torch registered stay; what they call is switched during checkpoint regions.
            self.assertEqual(rebound, 0)
            for before, now in zip(hooks, (model._forward_pre_hooks, model._forward_hooks)):
                self.assertEqual(before.keys(), now.keys())
                for key, hook in before.items():
                    self.assertIs(now[key].__func__ if isinstance(hook, types.MethodType) else now[key],
                                  hook.__func__ if isinstance(hook, types.MethodType) else hook)
        else:
            state_cls = _compat.load_internals().FSDPState
            for hooks_now, method in ((model._forward_pre_hooks, "_pre_forward"),
                                      (model._forward_hooks, "_post_forward")):
                fsdp_hooks = [h for h in hooks_now.values() if isinstance(h, types.MethodType)]
                self.assertEqual([h.__func__ for h in fsdp_hooks], [state_cls.__dict__[method]])
            self.assertEqual(rebound, 2)
        x = torch.randn(2, 8, requires_grad=True)
        checkpoint(model, x, use_reentrant=False).float().sum().backward()  # raises on 2.12 if not covered
        torch_fsdp_ext.uninstall()
        for before, now in zip(hooks, (model._forward_pre_hooks, model._forward_hooks)):
            for key, hook in before.items():
                self.assertIs(now[key], hook)
        torch_fsdp_ext.install()

    def test_grouped_modules_sharded_before_install(self):
        torch_fsdp_ext.uninstall()
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
            try:
                fully_shard([model[0], model[1]], mp_policy=policy)
            except TypeError:
                self.skipTest("this torch has no grouped fully_shard")
            fully_shard(model, mp_policy=policy)
            torch_fsdp_ext.install()
            not_covered = torch_fsdp_ext.status().fixes["recompute"].details["not_covered"]
            if not torch_fsdp_ext._install._active["recompute"][0].switches_hooks:
                self.assertEqual(not_covered, ["grouped fully_shard([FSDPLinear, FSDPLinear]) sharded before install()"])
                return
            # Covered: the grouped closures call torch's decorated hooks, switched during the region.
            self.assertEqual(not_covered, [])
            x = torch.randn(2, 4, requires_grad=True)
            expected = model(x).float().sum()
            expected.backward()
            grads = [p.grad.full_tensor().clone() for p in model.parameters()]
            model.zero_grad()
            loss = checkpoint(model, x, use_reentrant=False).float().sum()
            loss.backward()  # raises on 2.12 if not covered
            torch.testing.assert_close(loss, expected, rtol=0, atol=0)
            for p, grad in zip(model.parameters(), grads):
                torch.testing.assert_close(p.grad.full_tensor(), grad, rtol=0, atol=0)
        finally:
            torch_fsdp_ext.install()

    def test_modules_sharded_while_installed_pass_through_after_uninstall(self):
        torch_fsdp_ext.install()
        model = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(8, 8))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        torch_fsdp_ext.uninstall()
        try:
            # The hook still points at our wrapper, which must now behave like torch.
            x = torch.randn(2, 8, requires_grad=True)
            out = checkpoint(model, x, use_reentrant=False).float().sum()
            if HAS_RECOMPUTE_CAST_BUG:
                with self.assertRaises(torch.utils.checkpoint.CheckpointError):
                    out.backward()
            else:
                out.backward()
        finally:
            torch_fsdp_ext.install()


if __name__ == "__main__":
    run_tests()
