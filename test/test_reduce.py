"""The reduce fix: FSDP2's gradient reduction with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

Three cases of an ordinary fp32 model in one ``fully_shard`` group, each failing on the releases that have it:

- accumulation without sync where a parameter's gradient first appears on the synchronizing micro-batch
  (pytorch#196996, #160279): ``AssertionError: FSDP reduce-scatter expects uniform gradient dtype``;
- ``set_reduce_scatter_unused_params(True)`` with accumulation (pytorch#196996): the same assertion;
- the first forward with every parameter frozen, then unfrozen and trained (pytorch#186998): ``RuntimeError:
  attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'``.

The reference for each: every rank's gradients computed in bf16 by a plain copy of the model, cast to fp32,
accumulated over the micro-batches and averaged over the ranks, then one SGD step; torch 2.15 computes exactly
that (the same tests run there, where the plugin installs nothing for this fix).
"""

from __future__ import annotations

import copy
import gc
import importlib
import unittest
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
from common import (
    HAS_FROZEN_BUG, HAS_GRAD_DTYPES_BUG, FSDPExtTestCase, MixedPrecisionPolicy, batch, full_params, fully_shard,
    needs_dtype_fix, plugin, plugin_specific, seed_000_model, shard_model,
)
from torch_fsdp_ext import _compat

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LR = 0.1

HAS_UNUSED_API = hasattr(_compat.fsdp2_api().FSDPModule, "set_reduce_scatter_unused_params")
needs_unused_api = unittest.skipUnless(HAS_UNUSED_API, "this torch has no set_reduce_scatter_unused_params")


class Branches(nn.Module):
    """``a`` runs on every micro-batch; ``b`` only where the micro-batch asks for it (an MoE expert, a branch)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return h + self.b(x) if use_b else h


def micro_batch(rank: int, index: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * index + rank))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


# (uses b on each micro-batch; the last one synchronizes), per case
CASES = {
    "fresh_on_sync": (False, True),
    "unused": (False, False),
    "frozen_first_forward": (True,),
}


def reference(model: nn.Module, uses_b: tuple[bool, ...], rank: int, world_size: int):
    """Gradients (fp32, averaged over the ranks) and SGD-updated parameters, by hand."""
    compute = copy.deepcopy(model).to(torch.bfloat16)
    accumulated: dict[str, torch.Tensor] = {}
    for index, use_b in enumerate(uses_b):
        compute.zero_grad(set_to_none=True)
        loss_of(compute(micro_batch(rank, index).to(torch.bfloat16), use_b)).backward()
        for name, param in compute.named_parameters():
            if param.grad is not None:
                grad = param.grad.to(torch.float32)
                accumulated[name] = grad if name not in accumulated else accumulated[name] + grad
    updated = copy.deepcopy(model)
    grads = {}
    for name, param in updated.named_parameters():
        local = accumulated.get(name, torch.zeros_like(param))
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        grads[name] = param.grad = torch.stack(gathered).sum(0) / world_size
    torch.optim.SGD(updated.parameters(), lr=LR).step()
    return grads, full_params(updated)


class TestReduceCases(FSDPExtTestCase):
    def _train(self, case: str, model: nn.Module):
        """Shard ``model`` and run ``case``; the gradients after the synchronizing micro-batch and the updated
        parameters."""
        uses_b = CASES[case]
        fully_shard(model, mp_policy=MP)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        if case == "unused":
            model.set_reduce_scatter_unused_params(True)
        if case == "frozen_first_forward":
            model.requires_grad_(False)
            with torch.no_grad():
                model(micro_batch(self.rank, 99), True)  # a rollout or evaluation before training
            model.requires_grad_(True)
        for index, use_b in enumerate(uses_b):
            model.set_requires_gradient_sync(index == len(uses_b) - 1)
            loss_of(model(micro_batch(self.rank, index), use_b)).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        optimizer.step()
        return grads, full_params(model)

    def _check_case(self, case: str) -> None:
        torch.manual_seed(0)
        model = Branches()
        expected_grads, expected_params = reference(model, CASES[case], self.rank, self.world_size)
        with plugin(True):
            grads, params = self._train(case, model)
        for name in expected_grads:
            self.assertEqual(grads[name].dtype, torch.float32)
            self.assertTrue(torch.equal(grads[name], expected_grads[name]), f"{case}: gradient of {name} differs")
            self.assertTrue(torch.equal(params[name], expected_params[name]), f"{case}: {name} differs")

    def _check_fails_without_plugin(self, case: str, error: type, message: str) -> None:
        torch.manual_seed(0)
        with plugin(False), self.assertRaisesRegex(error, message):
            self._train(case, Branches())

    def test_fresh_gradient_on_the_sync_micro_batch_equals_reference(self):
        self._check_case("fresh_on_sync")

    @needs_unused_api
    def test_unused_parameters_with_accumulation_equal_reference(self):
        self._check_case("unused")

    def test_frozen_first_forward_then_trained_equals_reference(self):
        self._check_case("frozen_first_forward")

    @unittest.skipUnless(HAS_GRAD_DTYPES_BUG, "this torch reduces gradients of two dtypes itself")
    @plugin_specific
    def test_fresh_gradient_on_the_sync_micro_batch_fails_without_plugin(self):
        self._check_fails_without_plugin("fresh_on_sync", AssertionError, "expects uniform gradient dtype")

    @unittest.skipUnless(HAS_GRAD_DTYPES_BUG, "this torch reduces gradients of two dtypes itself")
    @needs_unused_api
    @plugin_specific
    def test_unused_parameters_with_accumulation_fail_without_plugin(self):
        self._check_fails_without_plugin("unused", AssertionError, "expects uniform gradient dtype")

    @unittest.skipUnless(HAS_FROZEN_BUG, "this torch resolves a frozen group's reduce dtype itself (pytorch#187376)")
    @plugin_specific
    def test_frozen_first_forward_fails_without_plugin(self):
        self._check_fails_without_plugin("frozen_first_forward", RuntimeError, "grad_dtype")


def reduce_modules():
    internals = _compat.load_internals()
    collectives = importlib.import_module(internals.fsdp_package + "._fsdp_collectives")
    return collectives, internals.fsdp_param_group_module


def nemo_patch():
    """NeMo Automodel's own ``patch_fsdp_uniform_reduce_dtype`` (process-global, no undo), or None."""
    try:
        from nemo_automodel.components.distributed.fsdp_patches import patch_fsdp_uniform_reduce_dtype
    except Exception:  # noqa: BLE001 - not installed, or it does not import with this torch
        return None
    return patch_fsdp_uniform_reduce_dtype


class MixedChild(nn.Module):
    """A bf16 linear and an fp32 norm: a group that ``preserve`` keeps mixed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class BranchesAfterMixed(Branches):
    def __init__(self) -> None:
        super().__init__()
        self.child = MixedChild()

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return super().forward(self.child(x), use_b)


@plugin_specific
class TestReduceComposition(FSDPExtTestCase):
    def _fresh_on_sync(self, model: nn.Module):
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for index, use_b in enumerate(CASES["fresh_on_sync"]):
            model.set_requires_gradient_sync(index == 1)
            loss_of(model(micro_batch(self.rank, index), use_b)).backward()
        optimizer.step()
        return full_params(model)

    def _with_nemo(self, when: str):
        """The fresh-on-sync case with NeMo's wrapper applied ``when``: never, before or after the plugin's install."""
        collectives, param_group_module = reduce_modules()
        previous = collectives.foreach_reduce, param_group_module.foreach_reduce
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # uninstall() names NeMo's wrapper put over the plugin's
                if when == "before":
                    nemo_patch()()
                with plugin(True):
                    if when == "after":
                        nemo_patch()()
                    torch.manual_seed(0)
                    model = Branches()
                    expected = reference(model, CASES["fresh_on_sync"], self.rank, self.world_size)[1]
                    fully_shard(model, mp_policy=MP)
                    return self._fresh_on_sync(model), expected
        finally:
            collectives.foreach_reduce, param_group_module.foreach_reduce = previous

    @unittest.skipIf(nemo_patch() is None, "nemo_automodel does not import here")
    def test_nemo_wrapper_either_order_is_bit_for_bit_with_the_plugin_alone(self):
        alone, expected = self._with_nemo("never")
        for when in ("before", "after"):
            with self.subTest(when=when):
                params, _ = self._with_nemo(when)
                for name, value in params.items():
                    self.assertTrue(torch.equal(value, alone[name]), f"NeMo {when}: {name} differs")
                    self.assertTrue(torch.equal(value, expected[name]), f"NeMo {when}: {name} differs from reference")

    def _preserve_run(self, order: tuple[str, ...]):
        torch_fsdp_ext.uninstall()
        for name in order:
            torch_fsdp_ext.install([name], dtype_strategy="preserve")
        try:
            torch.manual_seed(0)
            model = BranchesAfterMixed()
            fully_shard(model.child, mp_policy=MP)
            fully_shard(model, mp_policy=MP)
            params = self._fresh_on_sync(model)
            return params
        finally:
            model = None
            gc.collect()
            torch_fsdp_ext.uninstall()
            torch_fsdp_ext.install(dtype_strategy="upcast")

    def test_with_preserve_in_either_install_order(self):
        first = self._preserve_run(("dtype", "reduce"))
        self.assertEqual({first[n].dtype for n in ("child.linear.weight", "child.norm.weight")},
                         {torch.bfloat16, torch.float32})  # the child group stayed mixed
        second = self._preserve_run(("reduce", "dtype"))
        for name, value in first.items():
            self.assertTrue(torch.equal(value, second[name]), f"{name} differs between install orders")

    def test_reduce_uninstalled_while_a_mixed_group_lives_restores_torch(self):
        """The dtype fix wraps foreach_reduce while a preserve group lives; uninstalling the reduce fix then gives
        back torch's own gradient dtypes (its assertion for the plain group), and torch's function comes back when
        the mixed group goes."""
        param_group_module = reduce_modules()[1]
        torch_fsdp_ext.uninstall()
        original = param_group_module.foreach_reduce
        torch_fsdp_ext.install(dtype_strategy="preserve")
        try:
            torch.manual_seed(0)
            model = BranchesAfterMixed()
            fully_shard(model.child, mp_policy=MP)
            fully_shard(model, mp_policy=MP)
            self._fresh_on_sync(model)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "left ... as it is": the wrapper above is the plugin's own
                torch_fsdp_ext.uninstall(["reduce"])
            if HAS_GRAD_DTYPES_BUG:
                with self.assertRaisesRegex(AssertionError, "expects uniform gradient dtype"):
                    self._fresh_on_sync(model)  # torch's own assertion again
            model = None
            gc.collect()
            torch_fsdp_ext.uninstall()
            self.assertIs(param_group_module.foreach_reduce, original)
        finally:
            torch_fsdp_ext.uninstall()
            torch_fsdp_ext.install(dtype_strategy="upcast")


@needs_dtype_fix
@plugin_specific
class TestReduceFixOnEveryRank(FSDPExtTestCase):
    def test_a_rank_without_the_reduce_fix_fails_on_every_rank_naming_it(self):
        """The ranks compare the fixes they installed (three names now) at the first forward."""
        with plugin(True):
            if not torch_fsdp_ext.status().fixes["reduce"].active:
                self.skipTest("this torch needs no reduce fix: nothing can differ")
            if self.rank == 1:
                torch_fsdp_ext.uninstall(["reduce"])
            model = shard_model(seed_000_model(), mp_policy=MP)
            with self.assertRaises(torch_fsdp_ext.MixedParamDtypeError) as caught:
                model(batch(self.rank, 0))
        self.assertTrue(str(caught.exception).startswith(
            "torch_fsdp_ext: fix 'reduce' is installed on rank(s) 0 and not on rank(s) 1; every rank must install "
            "the same fixes"
        ), str(caught.exception))


    def test_a_rank_without_the_fp32_reduction_setting_fails_on_every_rank_naming_it(self):
        with plugin(True):
            if self.rank == 0:
                torch_fsdp_ext.install(reduce_dtype="float32")
            try:
                model = shard_model(seed_000_model(), mp_policy=MP)
                with self.assertRaises(torch_fsdp_ext.MixedParamDtypeError) as caught:
                    model(batch(self.rank, 0))
            finally:
                torch_fsdp_ext.install(reduce_dtype=None)
        # Where torch needs nothing else of the reduce fix (2.15), the setting alone installs it on rank 0.
        self.assertRegex(str(caught.exception), r"^torch_fsdp_ext: fix 'reduce(_dtype=float32)?' is installed on "
                                                r"rank\(s\) 0 and not on rank\(s\) 1")


@plugin_specific
class TestReduceFixInstall(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.before = [name for name, fix in torch_fsdp_ext.status().fixes.items() if fix.active]
        torch_fsdp_ext.uninstall()

    def tearDown(self) -> None:
        torch_fsdp_ext.uninstall()
        torch_fsdp_ext.install(self.before)
        super().tearDown()

    def test_installed_where_a_part_is_needed_and_restored_by_uninstall(self):
        internals = _compat.load_internals()
        owners = [(internals.FSDPParamGroup, "lazy_init"), (internals.FSDPParam, "__init__"),
                  (internals.FSDPParam, "unsharded_zero_grad_data")]
        before = [owner.__dict__.get(name) for owner, name in owners]
        foreach_reduce = internals.fsdp_param_group_module.foreach_reduce
        active = torch_fsdp_ext.install(["reduce"])
        fix = torch_fsdp_ext.status().fixes["reduce"]
        parts = fix.details["parts"]
        self.assertEqual(parts["gradients in reduce_dtype"], "torch_fsdp_ext" if HAS_GRAD_DTYPES_BUG else "upstream")
        self.assertEqual(parts["units that never ran"], "torch_fsdp_ext" if HAS_GRAD_DTYPES_BUG else "upstream")
        self.assertEqual(parts["fp32 reduction"], "off")
        # Note [Gradients born in the reduce dtype]: nothing wraps the reduce itself.
        self.assertIs(internals.fsdp_param_group_module.foreach_reduce, foreach_reduce)
        if HAS_GRAD_DTYPES_BUG:
            self.assertEqual(active, ["reduce"])
            self.assertTrue(fix.active)
            # unsharded_zero_grad_data: where the release has unused-parameter reduction (2.13, 2.14).
            wrapped = [name in {w.rsplit(".", 1)[1] for w in fix.wraps} for _, name in owners]
            self.assertEqual(wrapped[:2], [True, True], fix.wraps)
            self.assertEqual(wrapped[2], HAS_UNUSED_API, fix.wraps)
            during = [owner.__dict__.get(name) for owner, name in owners]
            self.assertEqual([d is not b for d, b in zip(during, before)], wrapped)
        else:  # 2.15: nothing installed, nothing patched
            self.assertEqual(active, [])
            self.assertFalse(fix.active)
            self.assertFalse(fix.needed)
            self.assertEqual(fix.wraps, [])
        self.assertEqual(torch_fsdp_ext.install(["reduce"]), active)  # idempotent
        torch_fsdp_ext.uninstall(["reduce"])
        self.assertEqual([owner.__dict__.get(name) for owner, name in owners], before)
        self.assertFalse(torch_fsdp_ext.status().fixes["reduce"].active)

    def test_fp32_reduction_setting_installs_the_fix_on_every_release(self):
        internals = _compat.load_internals()
        lazy_init = internals.FSDPParamGroup.__dict__["lazy_init"]
        with torch_fsdp_ext.installed(["reduce"], reduce_dtype="float32"):
            fix = torch_fsdp_ext.status().fixes["reduce"]
            self.assertTrue(fix.active)
            self.assertEqual(fix.details["parts"]["fp32 reduction"], "torch_fsdp_ext")
            self.assertEqual(fix.details["reduce_dtype"], "float32")
            self.assertIsNot(internals.FSDPParamGroup.__dict__["lazy_init"], lazy_init)
        self.assertIs(internals.FSDPParamGroup.__dict__["lazy_init"], lazy_init)
        self.assertEqual(torch_fsdp_ext.status().fixes["reduce"].details["reduce_dtype"], "each policy's own")
        with self.assertRaisesRegex(ValueError, "reduce_dtype must be one of float32, none"):
            torch_fsdp_ext.install(reduce_dtype="bfloat16")

    def test_status_names_each_part(self):
        torch_fsdp_ext.install()
        text = str(torch_fsdp_ext.status())
        row = next(line for line in text.splitlines() if line.startswith("reduce "))
        if HAS_GRAD_DTYPES_BUG:
            self.assertRegex(row, r"^reduce\s+yes\s+yes")
            self.assertIn("reduce: the plugin fixes the gradients in reduce_dtype, the units that never ran and the "
                          "grad_dtype before fully_shard.", text)
        else:
            self.assertRegex(row, r"^reduce\s+no\s+no")


if __name__ == "__main__":
    run_tests()
