"""FSDP2 + tensor parallel: a TP-replicated parameter's gradient is all-reduced over the TP mesh in ``reduce_dtype``.

2 gloo ranks, a (dp=1, tp=2) mesh: ``parallelize_module`` (``SequenceParallel`` on an RMSNorm and a router,
``ColwiseParallel``/``RowwiseParallel`` on an MLP), then ``fully_shard`` over the dp mesh with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (pytorch#190626). Up to 2.14 torch all-reduces
the norm's and the router's ``Partial`` gradients in bf16; 2.15 does it in fp32.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import unittest

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
from torch_fsdp_ext import _compat
from torch_fsdp_ext._compat import _reduce as _compat_reduce
from torch_fsdp_ext._patching import PatchSet
from torch_fsdp_ext._reduce._grad_dtype import GradDtypeAtBirth

from common import ROOT, FSDPExtTestCase, MixedPrecisionPolicy, RMSNorm, fully_shard, plugin

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
DIM = 8
STEPS = 3
# The witness: rank 0 contributes 1.0 to each norm-weight gradient element, rank 1 2**-10. Summed in fp32:
# 1.0009765625; in bf16 (8 mantissa bits) the sum rounds back to 1.0.
CONTRIBUTIONS = (1.0, 2.0**-10)
SUM_FP32 = (torch.tensor(CONTRIBUTIONS[0]) + torch.tensor(CONTRIBUTIONS[1])).item()
SUM_BF16 = torch.tensor(CONTRIBUTIONS, dtype=torch.bfloat16).sum().item()

TORCH_REDUCES_TP_IN_BF16 = _compat_reduce.probe_tp_grad_reduce_dtype()[0] == torch.bfloat16
needs_tp_bug = unittest.skipUnless(TORCH_REDUCES_TP_IN_BF16, "this torch all-reduces TP gradients in reduce_dtype")
needs_spmd_mesh = unittest.skipUnless(
    hasattr(_compat.fsdp2_api(), "DataParallelMeshDims"), "this torch's fully_shard takes no dp_mesh_dims"
)
needs_unused_params_api = unittest.skipUnless(
    hasattr(_compat.fsdp2_api().FSDPModule, "set_reduce_scatter_unused_params"),
    "this torch has no FSDPModule.set_reduce_scatter_unused_params",
)


def tp_reduce_fix() -> contextlib.AbstractContextManager:
    """The plugin, whose ``reduce`` fix holds the TP all-reduce part."""
    return plugin(True)


class TPBlock(nn.Module):
    """Sequence-parallel norm and router (TP-replicated parameters) around a tensor-parallel MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)
        self.router = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(nn.functional.silu(self.up(self.norm(x))))
        return self.router(x)


class TPExperts(nn.Module):
    """A used and an unused TP-sharded expert, a used and an unused TP-replicated (sequence-parallel) layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.used = nn.Linear(DIM, 2 * DIM, bias=False)
        self.unused = nn.Linear(DIM, 8 * DIM, bias=False)
        self.unused_router = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(self.norm(x))


def tp_mesh_and_model() -> tuple[object, TPBlock]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TPBlock()
    parallelize_module(model, mesh["tp"], {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "router": SequenceParallel(),
    })
    fully_shard(model, mesh=mesh["dp"], mp_policy=BF16)
    return mesh, model


def local_batch(tp_rank: int, step: int) -> torch.Tensor:
    """This rank's half of the sequence (SequenceParallel takes a plain input as the local shard)."""
    full = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(step))
    return full.chunk(2, dim=1)[tp_rank]


def local_loss(model: TPBlock, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.to_local().float().pow(2).mean()


class TPReduceTest(FSDPExtTestCase):
    WORLD_SIZE = 2

    def witness_norm(self, spmd_mesh: bool = False) -> tuple[nn.Module, torch.Tensor]:
        """A TP-replicated norm under ``fully_shard`` and its input, for ``witness_backward``.

        ``spmd_mesh``: the weight is a DTensor on the whole (dp, tp) mesh and ``fully_shard`` is
        told its dp dim (``DataParallelMeshDims``) instead of getting the dp sub-mesh.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        norm = RMSNorm(DIM)
        # A constant token normalizes to 1.0 in bf16; the output's gradient is this rank's contribution.
        x = torch.full((1, 1, DIM), 3.0)
        if spmd_mesh:
            norm.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, (Replicate(), Replicate())))
            x = DTensor.from_local(x, mesh, (Replicate(), Shard(1)))
            dp_dims = _compat.fsdp2_api().DataParallelMeshDims(shard="dp")
            fully_shard(norm, mesh=mesh, mp_policy=BF16, dp_mesh_dims=dp_dims)
        else:
            parallelize_module(norm, mesh["tp"], SequenceParallel())
            fully_shard(norm, mesh=mesh["dp"], mp_policy=BF16)
        return norm, x

    def witness_backward(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The norm-weight gradient after one backward whose TP contributions are ``CONTRIBUTIONS``."""
        norm.weight.grad = None
        out = norm(x).to_local()
        (out.float() * CONTRIBUTIONS[self.rank]).sum().backward()
        grad = norm.weight.grad
        self.assertEqual(grad.dtype, torch.float32)
        return grad.full_tensor()

    def witness_grad(self, spmd_mesh: bool = False) -> torch.Tensor:
        return self.witness_backward(*self.witness_norm(spmd_mesh))

    def train(self, steps: int, reference: bool) -> tuple[list[float], list[torch.Tensor]]:
        """AdamW steps; the local losses and the updated parameters.

        ``reference``: each step's backward runs without gradient sync and a second, zero-loss
        backward syncs. FSDP then holds the gradient in ``reduce_dtype`` (an upcast copy) before
        the TP all-reduce on every release: 2.15's order of operations, reached without the plugin.
        """
        mesh, model = tp_mesh_and_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tp_rank = mesh["tp"].get_local_rank()
        losses = []
        for step in range(steps):
            x = local_batch(tp_rank, step)
            if reference:
                model.set_requires_gradient_sync(False)
            loss = local_loss(model, x)
            loss.backward()
            if reference:
                model.set_requires_gradient_sync(True)
                (local_loss(model, x) * 0.0).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, [p.full_tensor() for p in model.parameters()]

    # -- the mantissa witness --------------------------------------------------

    def test_witness_with_fix(self) -> None:
        with tp_reduce_fix():
            grad = self.witness_grad()
        self.assertEqual(grad, torch.full((DIM,), SUM_FP32), atol=0, rtol=0)

    @needs_spmd_mesh
    def test_witness_spmd_mesh_with_fix(self) -> None:
        with tp_reduce_fix():
            grad = self.witness_grad(spmd_mesh=True)
        self.assertEqual(grad, torch.full((DIM,), SUM_FP32), atol=0, rtol=0)

    @needs_spmd_mesh
    def test_witness_spmd_mesh_without_fix(self) -> None:
        with plugin(False):
            grad = self.witness_grad(spmd_mesh=True)
        expected = SUM_BF16 if TORCH_REDUCES_TP_IN_BF16 else SUM_FP32
        self.assertEqual(grad, torch.full((DIM,), expected), atol=0, rtol=0)

    def test_witness_without_fix(self) -> None:
        with plugin(False):
            grad = self.witness_grad()
        expected = SUM_BF16 if TORCH_REDUCES_TP_IN_BF16 else SUM_FP32
        self.assertEqual(grad, torch.full((DIM,), expected), atol=0, rtol=0)

    @needs_tp_bug
    def test_witness_installed_after_first_backward(self) -> None:
        """A model whose groups ran their lazy init before the plugin was installed gets the cast at install."""
        with plugin(False):
            norm, x = self.witness_norm()
            self.assertEqual(self.witness_backward(norm, x), torch.full((DIM,), SUM_BF16), atol=0, rtol=0)
            with tp_reduce_fix():
                self.assertEqual(self.witness_backward(norm, x), torch.full((DIM,), SUM_FP32), atol=0, rtol=0)
            # uninstall() takes the cast away again: torch's own reduce, in bf16
            self.assertEqual(self.witness_backward(norm, x), torch.full((DIM,), SUM_BF16), atol=0, rtol=0)

    # -- unused parameters -----------------------------------------------------

    def unused_placeholders(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What FSDP hands its reduce-scatter per parameter (shape, dtype) with unused parameters reduced."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))
        model = TPExperts()
        parallelize_module(model, mesh["ep"], {
            "norm": SequenceParallel(), "used": ColwiseParallel(input_layouts=Shard(1)),
            "unused": ColwiseParallel(), "unused_router": SequenceParallel(),
        })
        fully_shard(model, mesh=mesh["dp"], mp_policy=BF16)
        model.set_reduce_scatter_unused_params(True)
        seen: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

        def spy(original):
            def foreach_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
                for param, grad in zip(fsdp_params, unsharded_grads):
                    seen[_compat.fsdp_param_fqn(param)] = (tuple(grad.shape), grad.dtype)
                return original(fsdp_params, unsharded_grads, *args, **kwargs)

            return foreach_reduce

        patches = PatchSet()
        patches.wrap(_compat.load_internals().fsdp_param_group_module, "foreach_reduce", spy)
        try:
            model(torch.randn(1, 4, DIM)).float().sum().backward()
        finally:
            patches.restore()
        return seen

    @needs_unused_params_api
    def test_unused_sharded_placeholder_has_local_shape(self) -> None:
        """NeMo Automodel #3540 saw an unused expert's zero placeholder built with the global DTensor shape (36 GiB)
        on a 2.13 pre-release. The placeholder FSDP reduces has the TP-local shape, as a used expert's gradient."""
        local = {"norm.weight": (DIM,), "used.weight": (DIM, DIM), "unused.weight": (4 * DIM, DIM),
                 "unused_router.weight": (2, DIM), "unused_router.bias": (2,)}
        with plugin(False):
            seen = self.unused_placeholders()
        self.assertEqual({fqn: shape for fqn, (shape, _) in seen.items()}, local)
        with tp_reduce_fix():
            seen = self.unused_placeholders()
        self.assertEqual({fqn: shape for fqn, (shape, _) in seen.items()}, local)
        if TORCH_REDUCES_TP_IN_BF16:
            # Made in reduce_dtype, the unused parameters' zeros included (2.15 upcasts its fresh ones in the copy-in).
            self.assertEqual({fqn: dtype for fqn, (_, dtype) in seen.items()}, dict.fromkeys(local, torch.float32))

    # -- training --------------------------------------------------------------

    def test_training_matches_fp32_reduction(self) -> None:
        with plugin(False):
            ref_losses, ref_params = self.train(STEPS, reference=True)
        with tp_reduce_fix():
            losses, params = self.train(STEPS, reference=False)
        self.assertEqual(losses, ref_losses, atol=0, rtol=0)
        for param, ref in zip(params, ref_params):
            self.assertEqual(param, ref, atol=0, rtol=0)

    def test_training_without_fix(self) -> None:
        """The failure reproduces where torch has it (the parameters drift from the reference), not on 2.15."""
        with plugin(False):
            ref_losses, ref_params = self.train(STEPS, reference=True)
            losses, params = self.train(STEPS, reference=False)
        same = all(torch.equal(p, r) for p, r in zip(params, ref_params))
        self.assertEqual(same, not TORCH_REDUCES_TP_IN_BF16)

    def test_accumulation_with_fix(self) -> None:
        """With the fix installed, torch's accumulation path (already in reduce_dtype) is unchanged."""
        with plugin(False):
            expected = self.train(STEPS, reference=True)
        with tp_reduce_fix():
            actual = self.train(STEPS, reference=True)
        self.assertEqual(actual, expected, atol=0, rtol=0)


class TPReduceProbeTest(TestCase):
    """The probe of the dtype in which this torch all-reduces a TP-replicated gradient, in one process."""

    def test_fix_needed_where_torch_reduces_in_bf16(self) -> None:
        """The gradient-dtype part is what makes the TP all-reduce run in reduce_dtype (no part of its own)."""
        needed, why = GradDtypeAtBirth(_compat.load_internals()).needed()
        self.assertEqual(needed, TORCH_REDUCES_TP_IN_BF16, why)

    @needs_tp_bug
    def test_probe_sees_a_cast_before_the_redistribute(self) -> None:
        """PR #190627's change (an upcast at the top of ``_get_grad_inner_tensor``), applied as a stand-in."""
        owner, name = _compat.load_internals().FSDPParam, _compat_reduce.TP_REDUCE_METHOD[1]
        original = getattr(owner, name)

        def casting(fsdp_param, grad):
            return original(fsdp_param, grad.to(fsdp_param.reduce_dtype))

        self.assertEqual(self.probe_with(owner, name, casting), torch.float32)

    @needs_tp_bug
    def test_probe_stands_aside_where_internals_changed(self) -> None:
        owner, name = _compat.load_internals().FSDPParam, _compat_reduce.TP_REDUCE_METHOD[1]
        self.assertIsNone(self.probe_with(owner, name, lambda fsdp_param, grad: grad))

    def probe_with(self, owner: object, name: str, replacement) -> torch.dtype | None:
        patches = PatchSet()
        patches.wrap(owner, name, lambda original: replacement)
        _compat_reduce.probe_tp_grad_reduce_dtype.cache_clear()
        try:
            return _compat_reduce.probe_tp_grad_reduce_dtype()[0]
        finally:
            patches.restore()
            _compat_reduce.probe_tp_grad_reduce_dtype.cache_clear()


class TPWitnessToolTest(TestCase):
    def test_tool_prints_the_witness(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        result = subprocess.run(
            [sys.executable, "tools/reproductions/tp_witness.py"],
            capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
        )
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        without = SUM_BF16 if TORCH_REDUCES_TP_IN_BF16 else SUM_FP32
        self.assertIn(f"needed={TORCH_REDUCES_TP_IN_BF16} ", result.stdout)
        self.assertIn(f"without {without!r}, with {SUM_FP32!r}", result.stdout)


if __name__ == "__main__":
    run_tests()
