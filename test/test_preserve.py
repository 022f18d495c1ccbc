"""dtype_strategy="preserve": a mixed-dtype group trains every parameter in its own dtype.

The reference is the same model without FSDP in which each parameter keeps its
dtype: per rank a compute copy in ``param_dtype`` (or in the parameters' own
dtypes without it), the rank gradients averaged in the reduce dtype and cast to
each parameter's dtype, then the same optimizer.
"""

from __future__ import annotations

import copy
import functools
import unittest

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests

from torch_fsdp_ext import MixedParamDtypeError

from common import (
    HAS_DTYPE_BUG,
    CPUOffloadPolicy,
    FSDPExtTestCase,
    Fp32RMSNorm,
    InputCastingLinear,
    MixedPrecisionPolicy,
    batch,
    dcp_round_trip,
    error_text,
    fsdp2_gradient_scale,
    full_grads,
    full_params,
    fully_shard,
    lm_loss,
    mixed_llama,
    plugin,
    plugin_specific,
    shard_model,
)

PRESERVE = {"dtype_strategy": "preserve"}

BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# (param_dtype, reduce_dtype) pairs: classic mixed precision, bf16 reduction, no mixed precision.
POLICIES = ((torch.bfloat16, torch.float32), (torch.bfloat16, None), (None, None))


def loaded_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {name: param.dtype for name, param in model.named_parameters()}


class Reference:
    """The model without FSDP, each parameter in its own dtype, data parallel done by hand."""

    def __init__(self, world_size: int, param_dtype, reduce_dtype, grad_scale: float) -> None:
        self.model = mixed_llama()
        self.world_size, self.param_dtype, self.reduce_dtype, self.grad_scale = (
            world_size, param_dtype, reduce_dtype, grad_scale,
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def backward(self, steps: list[int]) -> list[torch.Tensor]:
        """Set ``.grad`` on every parameter (accumulating) and return the per-rank losses of the last step.

        Several ``steps`` are micro-batches accumulated without sync, as FSDP does: in the
        reduce dtype when one is set, else by autograd in the compute dtype.
        """
        per_rank_grads, losses = [], []
        for rank in range(self.world_size):
            compute = copy.deepcopy(self.model)
            for param in compute.parameters():
                param.grad = None
            if self.param_dtype is not None:
                compute.to(self.param_dtype)
            accumulated: dict[str, torch.Tensor] = {}
            for step in steps:
                tokens = batch(rank, step)
                loss = lm_loss(compute(tokens), tokens)
                loss.backward()
                if self.reduce_dtype is not None:
                    for name, param in compute.named_parameters():
                        grad = param.grad.to(self.reduce_dtype)
                        accumulated[name] = accumulated[name] + grad if name in accumulated else grad
                        param.grad = None
            losses.append(loss.detach())
            per_rank_grads.append(accumulated or {n: p.grad for n, p in compute.named_parameters()})
        # Every FSDP group of this model mixes dtypes, so without reduce_dtype it reduces in
        # the promoted dtype of its parameters (each gradient follows its parameter's dtype).
        reduce_dtype = self.reduce_dtype or functools.reduce(
            torch.promote_types, {p.dtype for p in self.model.parameters()}
        )
        for name, param in self.model.named_parameters():
            total = per_rank_grads[0][name].to(reduce_dtype)
            for grads in per_rank_grads[1:]:
                total = total + grads[name].to(reduce_dtype)
            reduced = (total / self.world_size * self.grad_scale).to(reduce_dtype)
            if param.grad is None:
                param.grad = reduced.to(param.dtype)
            else:
                param.grad += reduced  # as FSDP accumulates into an existing sharded grad
        return losses

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()


class TestPreserve(FSDPExtTestCase):
    def train_and_compare(self, param_dtype, reduce_dtype, steps: int = 3, **fully_shard_kwargs) -> nn.Module:
        """Losses and step-1 gradients bitwise, parameters after ``steps`` AdamW steps close."""
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        scale = fsdp2_gradient_scale(self.world_size, self.rank, **fully_shard_kwargs)
        reference = Reference(self.world_size, param_dtype, reduce_dtype, scale)
        label = f"param_dtype={param_dtype}, reduce_dtype={reduce_dtype}, {fully_shard_kwargs}"
        with plugin(True, **PRESERVE):
            model = shard_model(mixed_llama(), mp_policy=policy, **fully_shard_kwargs)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(steps):
                tokens = batch(self.rank, step)
                loss = lm_loss(model(tokens), tokens)
                loss.backward()
                ref_losses = reference.backward([step])
                self.assertTrue(torch.equal(loss.detach(), ref_losses[self.rank]), f"{label}: loss at step {step}")
                if step == 0:
                    grads = full_grads(model)
                    for name, param in reference.model.named_parameters():
                        self.assertEqual(grads[name].dtype, param.dtype, f"{label}: {name}")
                        self.assertTrue(torch.equal(grads[name], param.grad), f"{label}: grad of {name}")
                optimizer.step()
                optimizer.zero_grad()
                reference.step()
        # Note: AdamW's update divides by sqrt(exp_avg_sq); sharded and unsharded foreach
        # kernels may round the last bit differently, which bf16 parameters can show as one ulp.
        updated = full_params(model)
        for name, param in reference.model.named_parameters():
            self.assertEqual(updated[name].dtype, param.dtype)
            torch.testing.assert_close(updated[name], param, msg=f"{label}: {name}")
        return model

    @unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes")
    def test_assertion_without_plugin_then_preserve_keeps_loaded_dtypes(self):
        with plugin(False):
            model = shard_model(mixed_llama(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            with self.assertRaises(AssertionError) as caught:
                model(batch(self.rank))
        self.assertExpectedInline(
            error_text(caught.exception),
            """FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}""",
        )

    def test_matches_reference_for_each_policy(self):
        for param_dtype, reduce_dtype in POLICIES:
            self.train_and_compare(param_dtype, reduce_dtype)

    def one_adamw_step(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        with plugin(True, **PRESERVE):
            model = shard_model(mixed_llama(), mp_policy=BF16_FP32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            tokens = batch(self.rank)
            lm_loss(model(tokens), tokens).backward()
            optimizer.step()
        return model, optimizer

    def test_dtypes_of_params_grads_optimizer_state_and_shard_bytes(self):
        loaded = loaded_dtypes(mixed_llama())
        self.assertEqual(set(loaded.values()), {torch.bfloat16, torch.float32})
        model, optimizer = self.one_adamw_step()
        expected_bytes = 0
        for name, param in model.named_parameters():
            self.assertEqual(param.dtype, loaded[name], name)
            self.assertEqual(param.grad.dtype, loaded[name], name)
            state = optimizer.state[param]
            self.assertEqual(state["exp_avg"].dtype, loaded[name], name)
            self.assertEqual(state["exp_avg_sq"].dtype, loaded[name], name)
            local = param.to_local()
            self.assertEqual(local.dtype, loaded[name])
            rows = -(-param.shape[0] // self.world_size)  # dim-0 shard, padded to equal chunks
            expected_rows = max(0, min(rows, param.shape[0] - self.rank * rows))
            expected_bytes += expected_rows * param[0].numel() * loaded[name].itemsize
        actual_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
        self.assertEqual(actual_bytes, expected_bytes)

    def test_dcp_checkpoint_keeps_dtypes_and_values(self):
        model, _ = self.one_adamw_step()
        with plugin(True, **PRESERVE):
            restored = dcp_round_trip(model, shard_model(mixed_llama(seed=1), mp_policy=BF16_FP32), self.file_name)
        mine, theirs = full_params(model), full_params(restored)
        for name, value in mine.items():
            self.assertEqual(theirs[name].dtype, value.dtype, name)
            self.assertTrue(torch.equal(theirs[name], value), name)
        self.assertEqual(set(v.dtype for v in theirs.values()), {torch.bfloat16, torch.float32})

    def test_gradient_accumulation_without_sync(self):
        """Two micro-batches, the first without gradient sync: the gradients the reference accumulates."""
        for param_dtype, reduce_dtype in ((torch.bfloat16, torch.float32), (None, None)):
            label = f"param_dtype={param_dtype}, reduce_dtype={reduce_dtype}"
            policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            scale = fsdp2_gradient_scale(self.world_size, self.rank)
            reference = Reference(self.world_size, param_dtype, reduce_dtype, scale)
            reference.backward([0, 1])
            with plugin(True, **PRESERVE):
                model = shard_model(mixed_llama(), mp_policy=policy)
                for step, sync in ((0, False), (1, True)):
                    model.set_requires_gradient_sync(sync)
                    tokens = batch(self.rank, step)
                    lm_loss(model(tokens), tokens).backward()
            grads = full_grads(model)
            for name, param in reference.model.named_parameters():
                self.assertEqual(grads[name].dtype, param.dtype, f"{label}: {name}")
                self.assertTrue(torch.equal(grads[name], param.grad), f"{label}: grad of {name}")

    def test_composition_matches_reference(self):
        """Reshard variants, CPU offload and meta-device init give the reference's results."""
        self.train_and_compare(torch.bfloat16, torch.float32, steps=2, reshard_after_forward=False)
        if self.world_size > 1:
            self.train_and_compare(torch.bfloat16, torch.float32, steps=2, reshard_after_forward=1)
        model = self.train_and_compare(
            torch.bfloat16, torch.float32, steps=2, offload_policy=CPUOffloadPolicy(pin_memory=False)
        )
        self.assertEqual(model.layers[0].w1.weight.to_local().device.type, "cpu")

    def test_meta_device_init_then_to_empty(self):
        policy = BF16_FP32
        loaded = loaded_dtypes(mixed_llama())
        with plugin(True, **PRESERVE):
            with torch.device("meta"):
                model = mixed_llama()
            shard_model(model, mp_policy=policy)
            model.to_empty(device=self.device)
            source = full_params(shard_model(mixed_llama(), mp_policy=policy))
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(torch.distributed.tensor.distribute_tensor(
                        source[name], param.device_mesh, param.placements
                    ))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            tokens = batch(self.rank)
            lm_loss(model(tokens), tokens).backward()
            optimizer.step()
        self.assertEqual(loaded_dtypes(model), loaded)

    @plugin_specific
    def test_float8_in_a_mixed_group_is_named(self):
        if not hasattr(torch, "float8_e4m3fn"):
            self.skipTest("no float8 dtypes")
        with plugin(True, **PRESERVE):
            model = nn.Sequential(nn.Linear(16, 16).to(torch.bfloat16), nn.LayerNorm(16))
            model[1].register_parameter("scale8", nn.Parameter(torch.zeros(16, dtype=torch.float8_e4m3fn)))
            fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            with self.assertRaises(MixedParamDtypeError) as caught:
                model(torch.randn(4, 16))
        self.assertExpectedInline(
            str(caught.exception),
            """\
torch_fsdp_ext: FSDP2 param group '<root>' needs one dtype for its trainable parameters but has bfloat16, float32, float8_e4m3fn:
  1.scale8: float8_e4m3fn (cannot be reduced with other dtypes: float8)
  0.weight: bfloat16
  0.bias: bfloat16
  1.weight: float32
  1.bias: float32
Fix: parameters that must not be cast need one dtype per group: freeze them (requires_grad_(False)), give them their own fully_shard group, or pass them in ignored_params.""",
        )

    def test_frozen_base_and_mixed_trainable_params(self):
        """LoRA-style: frozen bf16 base, fp32 adapter, a trainable bf16 norm: nothing changes dtype."""

        class AdaptedLinear(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.base = nn.Linear(16, 16, bias=False).to(torch.bfloat16).requires_grad_(False)
                self.adapter = InputCastingLinear(16, 16, bias=False)
                self.norm = Fp32RMSNorm(16).to(torch.bfloat16)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.norm(self.base(x) + self.adapter(x))

        with plugin(True, **PRESERVE):
            torch.manual_seed(0)
            model = AdaptedLinear()
            fully_shard(model)
            model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
        self.assertEqual(model.base.weight.dtype, torch.bfloat16)
        self.assertIsNone(model.base.weight.grad)
        self.assertEqual(model.adapter.weight.grad.dtype, torch.float32)
        self.assertEqual(model.norm.weight.grad.dtype, torch.bfloat16)


class TestPreserveHSDP(FSDPExtTestCase):
    WORLD_SIZE = 4

    def test_hsdp_2x2_matches_reference(self):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
        try:
            fsdp2_gradient_scale(self.world_size, self.rank, mesh=mesh)
        except RuntimeError as e:  # torch 2.7 reduces HSDP replicas with ReduceOp.AVG, which gloo lacks
            if "Gloo" not in str(e):
                raise
            self.skipTest(f"this torch's FSDP2 cannot run HSDP on gloo at all: {e}")
        TestPreserve.train_and_compare(self, torch.bfloat16, torch.float32, steps=2, mesh=mesh)


if __name__ == "__main__":
    run_tests()
