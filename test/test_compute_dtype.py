"""Per-parameter compute dtype (``torch_fsdp_ext.MixedPrecisionPolicy(param_dtype_override_fn=...)``).

The reference is what users write today: each norm its own ``fully_shard`` unit with an
fp32 policy and ``output_dtype=bf16``. One group per layer with the override must train
bit for bit like it, with the collectives of a plain bf16 group.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_distributed import skip_if_lt_x_gpu  # noqa: F401 - harness import
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from common import (
    FSDPExtTestCase,
    Fp32RMSNorm,
    HAS_DTYPE_BUG,
    MixedPrecisionPolicy as TorchMixedPrecisionPolicy,
    RMSNorm,
    batch,
    dcp_round_trip,
    full_params,
    fully_shard,
    lm_loss,
    plugin,
    plugin_specific,
    TinyLlama,
)
from torch_fsdp_ext import _compute_dtype

BF16, FP32 = torch.bfloat16, torch.float32
COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "all_reduce")


def checkpoint_layers(model: nn.Module) -> nn.Module:
    """Run each layer of a TinyLlama-like ``model`` under non-reentrant activation checkpointing."""

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        h = model.embed(tokens)
        for layer in model.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return model.head(model.norm(h))

    model.forward = forward
    return model


def fp32_norm_model(seed: int = 0) -> nn.Module:
    """A bf16 checkpoint whose RMSNorm weights are kept in fp32 (``_keep_in_fp32_modules``)."""
    torch.manual_seed(seed)
    model = TinyLlama().to(BF16)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.float()
    return model


def reference_model(strategy: str) -> nn.Module:
    """What the plugin's strategy stores, built without it: fp32 masters (upcast) or the loaded dtypes."""
    model = fp32_norm_model()
    return model.float() if strategy == "upcast" else model


@contextlib.contextmanager
def count_collectives():
    """Counts FSDP's collectives (they are looked up on torch.distributed at each call)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@contextlib.contextmanager
def record_compute_dtypes(model: nn.Module):
    """(phase, parameter FQN) -> dtypes the module saw its parameter in; phase: forward / recompute."""
    seen: dict[tuple[str, str], set] = {}

    def hook(module, args):
        phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
        for name, param in module.named_parameters(recurse=False):
            seen.setdefault((phase, f"{module._fqn}.{name}"), set()).add(param.dtype)

    handles = []
    for fqn, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module._fqn = fqn
            handles.append(module.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def shard(model: nn.Module, layout: str, reduce_dtype, norms: tuple[type, ...], **kwargs) -> None:
    """layout: "override" (one group per layer, norms in fp32 by override), "units" (the workaround),
    "bf16" (one group per layer, everything in bf16), "fn" (a hand-written 2.15-style override)."""
    base = dict(param_dtype=BF16, reduce_dtype=reduce_dtype)
    if layout == "override":
        policy = torch_fsdp_ext.MixedPrecisionPolicy(
            **base, param_dtype_override_fn=torch_fsdp_ext.compute_in_loaded_dtype(model, norms)
        )
    elif layout == "fn":
        fp32_norms = {id(p) for m in model.modules() if isinstance(m, norms) for p in m.parameters()}
        policy = torch_fsdp_ext.MixedPrecisionPolicy(
            **base, param_dtype_override_fn=lambda p: p.dtype if id(p) in fp32_norms else None
        )
    else:
        policy = TorchMixedPrecisionPolicy(**base)
    if layout == "units":
        unit_policy = TorchMixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=reduce_dtype, output_dtype=BF16)
        for module in model.modules():
            if isinstance(module, norms):
                fully_shard(module, mp_policy=unit_policy, **kwargs)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy, **kwargs)
    fully_shard(model, mp_policy=policy, **kwargs)


def train(model: nn.Module, rank: int, steps: int = 3, checkpointed: bool = True):
    runner = checkpoint_layers(model) if checkpointed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = batch(rank, step)
        loss = lm_loss(runner(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


@plugin_specific
class TestComputeDtype(FSDPExtTestCase):
    def _train_layout(self, strategy: str, reduce_dtype, layout: str, **kwargs):
        """Our layouts with the plugin on the loaded model; the workaround and the bf16 layout in plain torch."""
        with plugin(layout in ("override", "fn"), dtype_strategy=strategy):
            model = fp32_norm_model() if layout in ("override", "fn") else reference_model(strategy)
            if layout == "bf16" and strategy == "preserve":
                model.to(BF16)
            shard(model, layout, reduce_dtype, (RMSNorm,), **kwargs)
            with count_collectives() as counts, record_compute_dtypes(model) as seen:
                losses = train(model, self.rank)
            return losses, full_params(model), counts, seen

    def _assert_same_training(self, ours, reference, what: str) -> None:
        self.assertEqual(len(ours[0]), 3)
        for step, (a, b) in enumerate(zip(ours[0], reference[0])):
            self.assertTrue(torch.equal(a, b), f"{what}: step {step} loss {a.item()!r} != {b.item()!r}")
        self.assertEqual(ours[1].keys(), reference[1].keys())
        for name, value in ours[1].items():
            self.assertTrue(torch.equal(value, reference[1][name]), f"{what}: {name} differs after 3 steps")

    def test_override_equals_norm_units(self):
        """Losses and parameters bit for bit, dtypes in forward and recompute, collectives counted."""
        for strategy in ("upcast", "preserve"):
            for reduce_dtype in (FP32, None):
                what = f"{strategy}, reduce_dtype={reduce_dtype}"
                ours = self._train_layout(strategy, reduce_dtype, "override")
                units = self._train_layout(strategy, reduce_dtype, "units")
                self._assert_same_training(ours, units, what)
                for (phase, name), dtypes in ours[3].items():
                    expected = FP32 if "norm" in name else BF16
                    self.assertEqual(dtypes, {expected}, f"{what}: {name} during {phase}")
                self.assertEqual({phase for phase, _ in ours[3]}, {"forward", "recompute"})
                if reduce_dtype is FP32:
                    plain = self._train_layout(strategy, reduce_dtype, "bf16")
                    self.assertEqual(ours[2], plain[2], what)
                    self.assertLess(sum(ours[2].values()), sum(units[2].values()), what)


if __name__ == "__main__":
    run_tests()
