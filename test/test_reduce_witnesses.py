"""The reduce fix's rows beyond the reduce itself, each by a mantissa witness or an in-release reference.

The witness: a weight's gradient gets 1.0 on the first micro-batch and 2**-10 on the second (no sync
between them). Accumulated in fp32 that is 1.0009765625; in bf16 (8 mantissa bits) it stays 1.0. torch
2.15 gives 1.0009765625 in every row below but the explicit bf16 policy; each row fails or gives 1.0 on
releases before it without the plugin.

- the plugin's own ``upcast`` masters under no policy (accelerate's ``mixed_precision: "no"``);
- a ``grad_dtype`` set on a bf16 parameter before ``fully_shard`` (pytorch#170648);
- ``install(reduce_dtype=torch.float32)`` with accelerate's ``(bf16, bf16)`` policy and a ``param_dtype``-only one;
- a ``fully_shard`` unit that never ran forward, in accumulation without sync (pytorch#194058): trains, with
  the weights of the same run where the unit runs and its output is scaled by 0.0; NeMo Automodel's own guard
  on top, in either order, changes nothing.
"""

from __future__ import annotations

import unittest

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from common import FSDPExtTestCase, MixedPrecisionPolicy, fully_shard, needs_dtype_fix, plugin, plugin_specific
from torch_fsdp_ext import _compat
from torch_fsdp_ext._compat import _reduce as _compat_reduce

CONTRIBUTIONS = (1.0, 2.0**-10)
SUM_FP32 = (torch.tensor(CONTRIBUTIONS[0]) + torch.tensor(CONTRIBUTIONS[1])).item()  # 1.0009765625
SUM_BF16 = torch.tensor(CONTRIBUTIONS, dtype=torch.bfloat16).sum().item()  # 1.0
BF16 = torch.bfloat16
# 2.15 makes a gradient in the parameter's own dtype where the policy sets no reduce dtype (pytorch#197203).
TORCH_MAKES_GRADS_IN_REDUCE_DTYPE = _compat_reduce.probe_unsharded_grad_dtype()[0] == torch.float32
TORCH_FAILS_UNIT_THAT_NEVER_RAN = bool(_compat_reduce.probe_no_sync_reads_missing_unsharded_param())


class Scale(nn.Module):
    """``x * weight``: the weight's gradient is the input, summed over nothing (one element each)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.weight.dtype) * self.weight


class ScaleWithRouter(nn.Module):
    """A bf16 weight beside an fp32 router in one group: ``upcast`` makes the weight an fp32 master."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale(BF16)
        self.router = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x).float() + 0.0 * self.router(x.float())


def witness(model: nn.Module, param: nn.Parameter) -> torch.Tensor:
    """``param``'s gradient after the two micro-batches (the last one synchronizes), every element equal."""
    for index, contribution in enumerate(CONTRIBUTIONS):
        model.set_requires_gradient_sync(index == len(CONTRIBUTIONS) - 1)
        model(torch.full((4,), contribution)).float().sum().backward()
    grad = param.grad.full_tensor()
    return grad


class TestReduceWitnesses(FSDPExtTestCase):
    def check(self, grad: torch.Tensor, expected: float, dtype: torch.dtype = torch.float32) -> None:
        self.assertEqual(grad.dtype, dtype)
        self.assertEqual(grad.tolist(), [expected] * 4)

    @needs_dtype_fix
    def test_upcast_master_under_no_policy_accumulates_in_its_dtype(self):
        with plugin(True):
            model = ScaleWithRouter()
            fully_shard(model)  # accelerate's mixed_precision: "no"
            torch_fsdp_ext.upcast_now(model)
            self.assertEqual(model.scale.weight.dtype, torch.float32)
            self.check(witness(model, model.scale.weight), SUM_FP32)

    @plugin_specific
    def test_grad_dtype_set_before_fully_shard_is_kept(self):
        with plugin(True):
            model = Scale(BF16)
            model.weight.grad_dtype = torch.float32
            fully_shard(model)
            self.check(witness(model, model.weight), SUM_FP32)

    @unittest.skipIf(TORCH_MAKES_GRADS_IN_REDUCE_DTYPE, "this torch keeps grad_dtype through fully_shard")
    def test_grad_dtype_set_before_fully_shard_is_dropped_without_plugin(self):
        with plugin(False):
            model = Scale(BF16)
            model.weight.grad_dtype = torch.float32
            fully_shard(model)
            self.check(witness(model, model.weight), SUM_BF16, BF16)

    def test_fp32_reduction_setting_with_a_bf16_policy(self):
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)  # accelerate's mixed_precision: bf16
        with plugin(False):
            model = Scale()
            fully_shard(model, mp_policy=policy)
            self.check(witness(model, model.weight), SUM_BF16)  # every release, 2.15 included
        with plugin(True), torch_fsdp_ext.installed(reduce_dtype=torch.float32):
            model = Scale()
            fully_shard(model, mp_policy=policy)
            self.check(witness(model, model.weight), SUM_FP32)
            self.assertEqual(model.weight.grad.dtype, torch.float32)

    def test_fp32_reduction_setting_with_a_param_dtype_only_policy(self):
        policy = MixedPrecisionPolicy(param_dtype=BF16)
        with plugin(True):  # the setting off: this release's rule (2.15: fp32, before: bf16)
            model = Scale()
            fully_shard(model, mp_policy=policy)
            self.check(witness(model, model.weight), SUM_FP32 if TORCH_MAKES_GRADS_IN_REDUCE_DTYPE else SUM_BF16)
        with plugin(True), torch_fsdp_ext.installed(reduce_dtype=torch.float32):
            model = Scale()
            fully_shard(model, mp_policy=policy)
            self.check(witness(model, model.weight), SUM_FP32)
        self.assertEqual(torch_fsdp_ext.status().fixes["reduce"].details.get("reduce_dtype"), "each policy's own")


def nemo_guard():
    """NeMo Automodel's ``patch_fsdp_accumulated_grad_guard``, or None."""
    try:
        from nemo_automodel.components.distributed.fsdp_patches import patch_fsdp_accumulated_grad_guard
    except Exception:  # noqa: BLE001 - not installed, or it does not import with this torch
        return None
    return patch_fsdp_accumulated_grad_guard


class Tower(nn.Module):
    """A text path ``a`` and a vision tower ``tower`` (a ``fully_shard`` unit of its own)."""

    def __init__(self, tower: nn.Module | None = None) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.tower = tower if tower is not None else nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, tower_scale: float | None) -> torch.Tensor:
        out = self.a(x)
        return out if tower_scale is None else out + tower_scale * self.tower(x).to(out.dtype)


class MixedTower(nn.Module):
    """A bf16 linear and an fp32 norm: a group that ``preserve`` keeps mixed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16).to(BF16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x.to(BF16)))


class TestUnitThatNeverRan(FSDPExtTestCase):
    """Text-only batches through a model whose vision tower is a unit of its own (pytorch#194058)."""

    def train(self, tower_scale: float | None, policy, make_tower=None, frozen: bool = False):
        torch.manual_seed(0)
        model = Tower(make_tower() if make_tower else None)
        for param in model.parameters():
            torch.distributed.broadcast(param.data, 0)
        if frozen:
            model.tower.requires_grad_(False)
        fully_shard(model.tower, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for step in range(2):
            for index in range(2):
                model.set_requires_gradient_sync(index == 1)
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + index + self.rank))
                model(x, tower_scale).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return {name: p.full_tensor() for name, p in model.named_parameters()}

    def check_trains_as_scaled_by_zero(self, policy, make_tower=None, frozen: bool = False, **install) -> None:
        with plugin(True, **install):
            never = self.train(None, policy, make_tower, frozen)
            scaled = self.train(0.0, policy, make_tower, frozen)
        self.assertEqual(never.keys(), scaled.keys())
        for name in never:
            self.assertTrue(torch.equal(never[name], scaled[name]), name)

    def test_fp32_reduction_policy(self):
        self.check_trains_as_scaled_by_zero(MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))

    def test_frozen_unit(self):
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        self.check_trains_as_scaled_by_zero(policy, frozen=True)

    @needs_dtype_fix
    def test_preserve_group_without_a_reduce_dtype(self):
        self.check_trains_as_scaled_by_zero(MixedPrecisionPolicy(param_dtype=BF16), MixedTower,
                                            dtype_strategy="preserve")

    @unittest.skipIf(nemo_guard() is None, "nemo_automodel does not import here")
    @unittest.skipUnless(TORCH_FAILS_UNIT_THAT_NEVER_RAN, "no to_accumulated_grad_if_needed for NeMo to guard")
    @plugin_specific
    def test_nemo_guard_in_either_order_is_bit_for_bit_with_the_plugin_alone(self):
        """NeMo Automodel's ``patch_fsdp_accumulated_grad_guard`` (its fix of the same failure, process-global,
        no undo) applied before or after the plugin's install."""
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        fsdp_param_cls = _compat.load_internals().FSDPParam
        torch_method = fsdp_param_cls.__dict__.get("to_accumulated_grad_if_needed")
        with plugin(True):
            alone = self.train(None, policy)
        for when in ("before", "after"):
            try:
                with plugin(False):
                    if when == "before":
                        nemo_guard()()
                    with plugin(True):
                        if when == "after":
                            nemo_guard()()
                        params = self.train(None, policy)
            finally:
                setattr(fsdp_param_cls, "to_accumulated_grad_if_needed", torch_method)
            for name, value in params.items():
                self.assertTrue(torch.equal(value, alone[name]), f"NeMo's guard {when}: {name} differs")

    @unittest.skipUnless(TORCH_FAILS_UNIT_THAT_NEVER_RAN, "this torch skips a unit that never ran")
    @plugin_specific
    def test_fails_without_plugin(self):
        with plugin(False), self.assertRaisesRegex(AttributeError, "_unsharded_param"):
            self.train(None, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32))


if __name__ == "__main__":
    run_tests()
