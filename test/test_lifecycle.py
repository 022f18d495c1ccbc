"""Lifecycle and state: what outlives the moment it was made.

A group's dtype decision, optimizer state made before an upcast, the reduce dtype
the user asked for, accumulation across micro-batches, uninstall() with live
preserve groups, and ranks that a training script spawns itself. Each result is
compared with the manual workaround (``model.float()`` before ``fully_shard``) or
with plain torch.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import site
import subprocess
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
from torch_fsdp_ext import MixedParamDtypeError, _compat
from torch_fsdp_ext._compat import _dtype as _compat_dtype

from common import (
    HAS_DTYPE_BUG,
    ROOT,
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    batch,
    fsdp2_gradient_scale,
    full_grads,
    full_params,
    lm_loss,
    mixed_llama,
    plugin,
    plugin_specific,
    seed_000_model,
    shard_model,
)

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
PRESERVE = {"dtype_strategy": "preserve"}
needs_dtype_bug = unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: nothing to fix")


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        tokens = batch(rank, step)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def assert_same_params(test: TestCase, mine: dict, theirs: dict) -> None:
    test.assertEqual(mine.keys(), theirs.keys())
    for name, value in mine.items():
        test.assertEqual(value.dtype, theirs[name].dtype, name)
        test.assertTrue(torch.equal(value, theirs[name]), name)


@plugin_specific
@needs_dtype_bug
class TestLifecycle(FSDPExtTestCase):
    # -- 1: upcasts never meet stale optimizer state -------------------------------

    def test_groups_built_before_install_are_upcast_at_install_and_resume_bitwise(self):
        # The manual workaround trains one step and checkpoints (fp32 masters, AdamW state) ...
        with plugin(False):
            workaround = shard_model(seed_000_model().float(), mp_policy=MP)
            optimizer = torch.optim.AdamW(workaround.parameters(), lr=1e-2)
            train_steps(workaround, optimizer, self.rank, range(1))
            checkpoint = copy.deepcopy(get_state_dict(workaround, optimizer))
            expected_losses = train_steps(workaround, optimizer, self.rank, range(1, 3))
        # ... and a model sharded before install() resumes from it: upcast at install(), before the
        # optimizer exists and before the load, so nothing is rounded to bf16 and AdamW steps.
        with plugin(False):
            model = shard_model(seed_000_model(), mp_policy=MP)
            self.assertIn(torch.bfloat16, {p.dtype for p in model.parameters()})
        with plugin(True):
            self.assertIn(torch.bfloat16, {p.dtype for p in model.parameters()})  # install() casts nothing
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            # A step-0 save: the model's state_dict() upcasts it, before the optimizer state is created.
            get_state_dict(model, optimizer)
            self.assertEqual({p.dtype for p in model.parameters()}, {torch.float32})
            set_state_dict(model, optimizer, model_state_dict=checkpoint[0], optim_state_dict=checkpoint[1])
            losses = train_steps(model, optimizer, self.rank, range(1, 3))
        self.assertEqual(losses, expected_losses, atol=0, rtol=0)
        assert_same_params(self, full_params(model), full_params(workaround))

    def test_optimizer_state_older_than_an_upcast_is_named_before_the_step(self):
        with plugin(True):
            # A group sharded before install() whose optimizer already holds bf16 state ...
            torch_fsdp_ext.uninstall()
            early = shard_model(seed_000_model(), mp_policy=MP)
            early_optimizer = torch.optim.AdamW(early.parameters(), lr=1e-2)
            get_state_dict(early, early_optimizer)
            torch_fsdp_ext.install()
            with self.assertRaises(MixedParamDtypeError) as caught:
                train_steps(early, early_optimizer, self.rank, range(1))
            self.assertIn("layers.0.wq.weight: bfloat16 -> float32, state exp_avg, exp_avg_sq still bfloat16",
                          str(caught.exception))
            # ... while an optimizer built on an installed plugin's model upcasts it first: its own step-0
            # state dict makes fp32 state, and it trains as the workaround (test_orders.py has every order).
            model = shard_model(seed_000_model(1), mp_policy=MP)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            self.assertEqual({p.dtype for p in model.parameters() if p.requires_grad}, {torch.float32})
            get_optimizer_state_dict(model, optimizer)
            self.assertEqual({v.dtype for state in optimizer.state.values() for v in state.values() if v.dim()},
                             {torch.float32})
        lines = str(caught.exception).splitlines()
        self.assertExpectedInline(
            "\n".join([lines[0], *[line for line in lines if "layers.1.w" in line], lines[-1]]),
            """\
torch_fsdp_ext was installed after this model was sharded (fully_shard ran before `import torch_fsdp_ext`), and this optimizer made or loaded its state before the plugin upcast these parameters to fp32 master weights: that state is in their old dtype (loaded state, and weights loaded into the model then, were rounded to it):
  layers.1.wq.weight: bfloat16 -> float32, state exp_avg, exp_avg_sq still bfloat16
  layers.1.wo.weight: bfloat16 -> float32, state exp_avg, exp_avg_sq still bfloat16
  layers.1.w1.weight: bfloat16 -> float32, state exp_avg, exp_avg_sq still bfloat16
  layers.1.w2.weight: bfloat16 -> float32, state exp_avg, exp_avg_sq still bfloat16
Fix: move `import torch_fsdp_ext` before fully_shard and before loading the model's weights and the optimizer's state (or launch with TORCH_FSDP_EXT_AUTOLOAD=1), then resume again. The hand workaround, model.float() before fully_shard, needs no plugin.""",
        )
        # Without the check, the step fails inside AdamW on the stale state.
        from torch_fsdp_ext._dtype import _optimizer_state

        _optimizer_state._upcast.clear()
        with self.assertRaisesRegex(RuntimeError, "dtype"):
            early_optimizer.step()

    def test_strategy_of_a_group_is_kept_whatever_is_installed_later(self):
        def preserve_run(change_strategy: bool) -> dict:
            with plugin(True, **PRESERVE):
                model = shard_model(mixed_llama(), mp_policy=MP)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
                train_steps(model, optimizer, self.rank, range(1))
                if change_strategy:
                    for strategy in ("upcast", "error"):
                        torch_fsdp_ext.install(dtype_strategy=strategy)
                        model.layers[0].unshard()  # FSDP re-runs _init_mp_dtypes here
                        model.layers[0].reshard()
                train_steps(model, optimizer, self.rank, range(1, 2))
            return full_params(model)

        changed, unchanged = preserve_run(True), preserve_run(False)
        self.assertEqual({p.dtype for p in changed.values()}, {torch.bfloat16, torch.float32})
        assert_same_params(self, changed, unchanged)
        # A real dtype change is still handled, with the group's own strategy (upcast here).
        with plugin(True, dtype_strategy="upcast"):
            model = shard_model(seed_000_model(), mp_policy=MP)
            tokens = batch(self.rank)
            lm_loss(model(tokens), tokens).backward()
            torch_fsdp_ext.install(dtype_strategy="preserve")
            state = model.state_dict()
            state["layers.0.wq.weight"] = state["layers.0.wq.weight"].to(torch.bfloat16)
            model.load_state_dict(state, assign=True)
            self.assertEqual(model.layers[0].wq.weight.dtype, torch.bfloat16)
            model.layers[0].unshard()
            model.layers[0].reshard()
            self.assertEqual(model.layers[0].wq.weight.dtype, torch.float32)

    # -- 3 and 4: preserve's reduce dtype and accumulation (what 2.15 does natively) ----

    def test_preserve_reduces_in_the_reduce_dtype_asked_for(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        reduced_dtypes = set()
        # FSDP2 reduce-scatters through dist.reduce_scatter_single on recent releases, reduce_scatter_tensor before.
        names = [name for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)]
        originals = {name: getattr(dist, name) for name in names}

        def recording(name):
            def reduce_scatter(*args, **kwargs):
                reduced_dtypes.update(t.dtype for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
                return originals[name](*args, **kwargs)

            return reduce_scatter

        grads = {}
        for strategy, model in (("workaround", mixed_llama().float()), ("preserve", mixed_llama())):
            with plugin(strategy == "preserve", **PRESERVE):
                model = shard_model(model, mp_policy=policy)
                tokens = batch(self.rank)
                for name in names:
                    setattr(dist, name, recording(name))
                try:
                    lm_loss(model(tokens), tokens).backward()
                finally:
                    for name in names:
                        setattr(dist, name, originals[name])
                grads[strategy] = full_grads(model)
        self.assertEqual(reduced_dtypes, {torch.bfloat16})
        for name, grad in grads["preserve"].items():
            self.assertTrue(torch.equal(grad, grads["workaround"][name].to(grad.dtype)), name)

    def test_preserve_accumulates_each_parameter_in_its_own_dtype(self):
        """16 micro-batches without sync, param_dtype=bf16 and no reduce_dtype, against an fp64 accumulation."""
        micro_batches = 16
        scale = fsdp2_gradient_scale(self.world_size, self.rank)
        exact: dict[str, torch.Tensor] = {}
        for rank in range(self.world_size):
            compute = mixed_llama().to(torch.bfloat16)  # what param_dtype=bf16 computes with
            for step in range(micro_batches):
                tokens = batch(rank, step)
                lm_loss(compute(tokens), tokens).backward()
                for name, param in compute.named_parameters():
                    exact[name] = exact.get(name, 0) + param.grad.double()
                    param.grad = None
        with plugin(True, **PRESERVE):
            model = shard_model(mixed_llama(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            for step in range(micro_batches):
                model.set_requires_gradient_sync(step == micro_batches - 1)
                tokens = batch(self.rank, step)
                lm_loss(model(tokens), tokens).backward()
        grads = full_grads(model)
        for name, param in model.named_parameters():
            reference = exact[name] / self.world_size * scale
            error = ((grads[name].double() - reference).norm() / reference.norm()).item()
            self.assertEqual(grads[name].dtype, param.dtype, name)
            # fp32 parameters accumulate in fp32 (bf16 accumulation: 3e-3); bf16 ones in bf16.
            self.assertLess(error, 1e-5 if param.dtype == torch.float32 else 2e-2, name)

    def test_what_was_fine_stays_fine_under_preserve(self):
        """An exception in a forward, clip_grad_norm_ over mixed-dtype DTensor gradients, zero_grad(set_to_none=False)."""
        runs = {}
        for set_to_none in (True, False):
            with plugin(True, **PRESERVE):
                model = shard_model(mixed_llama(), mp_policy=MP)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
                if not set_to_none:
                    with self.assertRaises(IndexError):
                        model(torch.full((2, 8), 99))  # token ids past the embedding
                for step in range(2):
                    tokens = batch(self.rank, step)
                    lm_loss(model(tokens), tokens).backward()
                    grads = full_grads(model)
                    # As clip_grad_norm_ computes it: each gradient's norm in its own dtype, then their norm.
                    expected = torch.stack([g.norm().double() for g in grads.values()]).norm()
                    total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
                    total = total.full_tensor() if hasattr(total, "full_tensor") else total
                    torch.testing.assert_close(total.double(), expected, rtol=1e-2, atol=0)  # bf16 norms, per shard
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=set_to_none)
                runs[set_to_none] = full_params(model)
        assert_same_params(self, runs[False], runs[True])

    # -- 5: uninstall() with live preserve groups -------------------------------------

    def test_uninstall_keeps_live_preserve_groups_working_then_restores_originals(self):
        group_cls = _compat.load_internals().FSDPParamGroup
        reduce_module = _compat.load_internals().fsdp_param_group_module
        wraps_reduce = not _compat_dtype.probe_reduce_casts_grads_per_param()  # releases up to 2.14
        original_foreach_reduce = _compat.torch_own(reduce_module.foreach_reduce, "foreach_reduce")
        with plugin(True, **PRESERVE):
            original_init_mp_dtypes = group_cls._init_mp_dtypes.__wrapped__
            # The reduce fix wraps no foreach_reduce; the dtype fix wraps it once a group stays mixed.
            installed_foreach_reduce = reduce_module.foreach_reduce
            self.assertIs(installed_foreach_reduce, original_foreach_reduce)
            reference = shard_model(mixed_llama(), mp_policy=MP)
            reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
            expected = train_steps(reference, reference_optimizer, self.rank, range(3))
            del reference, reference_optimizer

            model = shard_model(mixed_llama(), mp_policy=MP)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = train_steps(model, optimizer, self.rank, range(1))
            self.assertEqual(reduce_module.foreach_reduce is not installed_foreach_reduce, wraps_reduce)
            torch_fsdp_ext.uninstall()
            self.assertFalse(torch_fsdp_ext.status().fixes["dtype"].active)
            model.layers[1].unshard()
            model.layers[1].reshard()
            losses += train_steps(model, optimizer, self.rank, range(1, 3))
            self.assertEqual(losses, expected, atol=0, rtol=0)
            # A group built after uninstall() gets torch's own behaviour.
            with self.assertRaisesRegex(AssertionError, "FSDP expects uniform original parameter dtype"):
                shard_model(mixed_llama(), mp_policy=MP)(batch(self.rank))
            self.assertIsNot(group_cls._init_mp_dtypes, original_init_mp_dtypes)  # kept for `model`
            del model, optimizer
            gc.collect()
            self.assertIs(group_cls._init_mp_dtypes, original_init_mp_dtypes)
            self.assertIs(reduce_module.foreach_reduce, original_foreach_reduce)


# -- 6: ranks the script spawns itself ------------------------------------------------

SCRIPT_DIR = os.path.join(ROOT, "test", "scripts")


@plugin_specific
@needs_dtype_bug
class CountingList(list):
    """A param group's ``params`` that counts how often something walks it."""

    walks = 0

    def __iter__(self):
        CountingList.walks += 1
        return super().__iter__()


class StandInFSDPParam:
    """What the optimizer pre-hook keeps of an FSDPParam: its sharded parameter."""

    def __init__(self) -> None:
        self.sharded_param = nn.Parameter(torch.zeros(2))


class TestOptimizerPreHookCost(TestCase):
    """The pre-hook that looks for optimizer state older than an upcast (``_optimizer_state``)."""

    def setUp(self) -> None:
        from torch_fsdp_ext._dtype import _optimizer_state

        self.state = _optimizer_state
        self.addCleanup(self.reset)

    def reset(self) -> None:
        self.state._upcast.clear()
        self.state._check_pending(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))  # empties: hook off
        self.state.release()

    def optimizer(self, count: int, counting: bool = True) -> torch.optim.Optimizer:
        params = [nn.Parameter(torch.zeros(2)) for _ in range(count)]
        for p in params:
            p.grad = torch.ones(2)
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if counting:
            optimizer.param_groups[0]["params"] = CountingList(optimizer.param_groups[0]["params"])
        return optimizer

    def test_steps_walk_the_optimizer_once_not_per_step(self):
        optimizer = self.optimizer(100)
        self.state.remember_upcast(StandInFSDPParam(), torch.bfloat16)  # pending for good: no optimizer holds it
        CountingList.walks = 0
        hook = self.state._check_before_step
        for _ in range(5):
            hook(optimizer, (), {})
        self.assertEqual(CountingList.walks, 1)  # the ids are collected once, not at every step
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
        hook(optimizer, (), {})
        self.assertEqual(CountingList.walks, 2)  # ... and again when the groups change

    def test_nothing_pending_after_the_holding_optimizer_stepped(self):
        held = StandInFSDPParam()
        held.sharded_param.grad = torch.ones(2)
        optimizer = torch.optim.SGD([held.sharded_param], lr=0.1, momentum=0.9)
        self.state.remember_upcast(held, torch.bfloat16)
        self.assertTrue(self.state._awaiting_check)
        optimizer.step()  # its state is made in the new dtype: nothing older to find
        self.assertFalse(self.state._awaiting_check)
        self.assertEqual(len(self.state._held), 0)

    def test_no_graph_break_in_a_compiled_step_once_nothing_is_pending(self):
        from torch._dynamo.utils import counters

        def breaks_of_compiled_steps(with_hook: bool) -> list[str]:
            torch._dynamo.reset()
            counters.clear()
            optimizer = self.optimizer(4, counting=False)  # dynamo before 2.13 cannot trace a list subclass
            if with_hook:
                held = StandInFSDPParam()
                held.sharded_param.grad = torch.ones(2)
                optimizer.add_param_group({"params": [held.sharded_param]})
                self.state.remember_upcast(held, torch.bfloat16)
                optimizer.step()  # the first step clears what was pending
                self.assertIsNotNone(self.state._hook_handle)
            step = torch.compile(optimizer.step, backend="eager")
            for _ in range(2):
                step()
            return sorted(counters["graph_break"])

        self.assertEqual(breaks_of_compiled_steps(True), breaks_of_compiled_steps(False))


class TestSpawnedRanks(TestCase):
    """``train_seed000.py --spawn 2`` starts its ranks with torch.multiprocessing.spawn and never imports
    the plugin; the package is installed (editable, as CI does) into a throwaway venv that reuses this torch."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.tmp = tempfile.TemporaryDirectory()
        venv = os.path.join(cls.tmp.name, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True)
        cls.python = os.path.join(venv, "bin", "python")
        venv_site = subprocess.run(
            [cls.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
        with open(os.path.join(venv_site, "parent_env.pth"), "w") as f:  # this interpreter's torch, pip, setuptools
            f.write("\n".join(site.getsitepackages()) + "\n")
        subprocess.run(
            [cls.python, "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT],  # as .ci/run installs it
            check=True, capture_output=True, env=cls.env(),
        )

    @classmethod
    def tearDownClass(cls) -> None:
        cls.tmp.cleanup()
        super().tearDownClass()

    @staticmethod
    def env(**extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FSDP_EXT_") and k != "PYTHONPATH"}
        return dict(env, **extra)

    def run_script(self, *argv: str, **env: str) -> subprocess.CompletedProcess:
        command = [self.python, *argv, "--spawn", "2", "--steps", "2"]
        return subprocess.run(command, capture_output=True, text=True, env=self.env(**env), timeout=300, cwd=SCRIPT_DIR)

    def report(self, result: subprocess.CompletedProcess) -> dict:
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        # Every rank ends cleanly: exit status 0 and no abort at exit (docs/reliability.md).
        self.assertTrue(result.returncode == 0 and len(lines) == 1, result.stdout + result.stderr)
        self.assertNotIn("terminate called", result.stderr)
        return json.loads(lines[0])

    def test_launcher_and_variable_reach_spawned_ranks(self):
        # Installed but not asked for: the spawned ranks run plain torch.
        plain = self.run_script("train_seed000.py")
        self.assertNotEqual(plain.returncode, 0)
        self.assertIn("FSDP expects uniform original parameter dtype", plain.stderr)
        workaround = self.report(self.run_script("train_seed000.py", "--workaround"))
        self.assertFalse(workaround["plugin_imported"])

        launched = self.report(self.run_script("-m", "torch_fsdp_ext.run", "train_seed000.py"))
        self.assertTrue(launched["plugin_imported"])  # in rank 0, a spawned interpreter
        self.assertEqual(launched["dtypes"], ["torch.float32"])
        self.assertEqual(launched["losses"], workaround["losses"])

        # The variable alone, in any interpreter that imports FSDP, with the strategy it is given.
        probe = (
            "import sys, torch.distributed.fsdp; plugin = sys.modules.get('torch_fsdp_ext'); "
            "print(plugin and plugin.status().fixes['dtype'].details['strategy'])"
        )
        variable = self.python_c(probe, TORCH_FSDP_EXT_AUTOLOAD="1", TORCH_FSDP_EXT_DTYPE_STRATEGY="preserve")
        self.assertEqual(variable.stdout.strip(), "preserve", variable.stderr)

    def python_c(self, code: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.python, "-c", code], capture_output=True, text=True, cwd=SCRIPT_DIR,
                              env=self.env(**env), timeout=300)

    def test_autoload_waits_for_fsdp_and_a_bad_setting_stops_only_that_process(self):
        imported = "import sys; print(sorted(m for m in ('torch_fsdp_ext', 'torch._dynamo') if m in sys.modules))"
        # A process that imports torch and never FSDP gets nothing of the plugin.
        torch_only = self.python_c("import torch; " + imported, TORCH_FSDP_EXT_AUTOLOAD="1")
        self.assertEqual((torch_only.returncode, torch_only.stdout.strip()), (0, "[]"), torch_only.stderr)
        with_fsdp = self.python_c("import torch.distributed.fsdp; " + imported, TORCH_FSDP_EXT_AUTOLOAD="1")
        self.assertIn("'torch_fsdp_ext'", with_fsdp.stdout, with_fsdp.stderr)

        bad_settings = {
            "TORCH_FSDP_EXT_DTYPE_STRATEGY": ("preserv", "TORCH_FSDP_EXT_DTYPE_STRATEGY must be one of upcast"),
            "TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE": (",,,", "TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=',,,' names no"),
        }
        for variable, (value, error) in bad_settings.items():
            with self.subTest(variable=variable):
                settings = {"TORCH_FSDP_EXT_AUTOLOAD": "1", variable: value}
                unrelated = self.python_c("import torch; print(torch.ones(1).item())", **settings)
                self.assertEqual((unrelated.returncode, unrelated.stdout.strip()), (0, "1.0"), unrelated.stderr)
                self.assertNotIn("torch_fsdp_ext", unrelated.stderr)
                training = self.python_c("from torch.distributed.fsdp import fully_shard", **settings)
                self.assertNotEqual(training.returncode, 0)
                self.assertIn(error, training.stderr)
                self.assertIn("SettingError", training.stderr)


if __name__ == "__main__":
    run_tests()
