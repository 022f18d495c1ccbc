"""Per-parameter compute dtype (``torch_fsdp_ext.MixedPrecisionPolicy(param_dtype_override_fn=...)``).

The reference is what users write today: each norm its own ``fully_shard`` unit with an
fp32 policy and ``output_dtype=bf16``. One group per layer with the override must train
bit for bit like it, with the collectives of a plain bf16 group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import tempfile
import types
import unittest
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from common import (
    CPUOffloadPolicy,
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
from test_integration import decoder_layers, has_transformers, tiny_llama, train_llama
from torch_fsdp_ext import _compute_dtype, run
from torch_fsdp_ext._dtype._strategies import UPCAST_COST

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


def fp32_norm_model(seed: int = 0, norm: type = RMSNorm) -> nn.Module:
    """A bf16 checkpoint whose RMSNorm weights are kept in fp32 (``_keep_in_fp32_modules``).

    ``norm=Fp32RMSNorm``: the same weights, with a forward that computes in fp32 and returns
    its input's dtype, which a hand-written 2.15-style override needs (it adds no casts).
    """
    torch.manual_seed(seed)
    model = TinyLlama().to(BF16)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.float()
            module.__class__ = norm
    return model


def reference_model(strategy: str, norm: type = RMSNorm) -> nn.Module:
    """What the plugin's strategy stores, built without it: fp32 masters (upcast) or the loaded dtypes."""
    model = fp32_norm_model(norm=norm)
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


def train(model: nn.Module, rank: int, steps: int = 3, checkpointed: bool = True, accumulate: bool = False):
    """AdamW steps; ``accumulate``: two micro-batches per step, the first without gradient sync."""
    runner = checkpoint_layers(model) if checkpointed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        if accumulate:
            model.set_requires_gradient_sync(False)
            tokens = batch(rank, 100 + step)
            lm_loss(runner(tokens), tokens).backward()
            model.set_requires_gradient_sync(True)
        tokens = batch(rank, step)
        loss = lm_loss(runner(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


@plugin_specific
class TestComputeDtype(FSDPExtTestCase):
    def _train_layout(
        self, strategy: str, reduce_dtype, layout: str, accumulate: bool = False, norm: type = RMSNorm, **kwargs
    ):
        """Our layouts with the plugin on the loaded model; the workaround and the bf16 layout in plain torch."""
        with plugin(layout in ("override", "fn"), dtype_strategy=strategy):
            model = fp32_norm_model(norm=norm) if layout in ("override", "fn") else reference_model(strategy, norm)
            if layout == "bf16" and strategy == "preserve":
                model.to(BF16)
            shard(model, layout, reduce_dtype, (norm,), **kwargs)
            with count_collectives() as counts, record_compute_dtypes(model) as seen:
                losses = train(model, self.rank, accumulate=accumulate)
            return losses, full_params(model), counts, seen, model

    def _assert_same_training(self, ours, reference, what: str) -> None:
        self.assertEqual(len(ours[0]), 3)
        for step, (a, b) in enumerate(zip(ours[0], reference[0])):
            self.assertTrue(torch.equal(a, b), f"{what}: step {step} loss {a.item()!r} != {b.item()!r}")
        self.assertEqual(ours[1].keys(), reference[1].keys())
        for name, value in ours[1].items():
            self.assertTrue(torch.equal(value, reference[1][name]), f"{what}: {name} differs after 3 steps")

    def test_override_equals_norm_units(self):
        """Losses and parameters bit for bit, dtypes in forward and recompute, collectives counted.

        Under upcast through ``compute_in_loaded_dtype``; under preserve through a hand-written
        2.15-style function (``param_dtype_override_fn=lambda p: ...``), unchanged on every release.
        """
        for strategy, layout, norm in (("upcast", "override", RMSNorm), ("preserve", "fn", Fp32RMSNorm)):
            for reduce_dtype in (FP32, None):
                what = f"{strategy}, {layout}, reduce_dtype={reduce_dtype}"
                ours = self._train_layout(strategy, reduce_dtype, layout, norm=norm)
                # The plugin's fp32 masters reduce in fp32 where the policy sets no reduce dtype, as 2.15 does
                # (Note in _compute_dtype._masters_reduce_in_their_dtype); the workaround's hand-made ones do
                # so before 2.15 when asked.
                units_reduce_dtype = FP32 if strategy == "upcast" else reduce_dtype
                units = self._train_layout(strategy, units_reduce_dtype, "units", norm=norm)
                self._assert_same_training(ours, units, what)
                for (phase, name), dtypes in ours[3].items():
                    expected = FP32 if "norm" in name else BF16
                    self.assertEqual(dtypes, {expected}, f"{what}: {name} during {phase}")
                self.assertEqual({phase for phase, _ in ours[3]}, {"forward", "recompute"})
                if reduce_dtype is FP32 and strategy == "upcast":
                    plain = self._train_layout(strategy, reduce_dtype, "bf16")
                    self.assertEqual(ours[2], plain[2], what)
                    self.assertLess(sum(ours[2].values()), sum(units[2].values()), what)

    def test_composes_with_hsdp_offload_accumulation_dcp(self):
        """HSDP (replicas all-reduce), CPU offload, no reshard after forward, gradient accumulation, with
        reduce_dtype=None; then a DCP round trip of the trained model, which trains on equally."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        kwargs = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False), reshard_after_forward=False, accumulate=True)
        try:
            units = self._train_layout("preserve", None, "units", **kwargs)
        except RuntimeError as e:  # torch 2.7 reduces HSDP replicas with ReduceOp.AVG, which gloo lacks
            self.skipTest(f"this torch's FSDP2 cannot run HSDP on gloo: {e}")
        ours = self._train_layout("preserve", None, "override", **kwargs)
        self._assert_same_training(ours, units, "HSDP + offload + accumulation")
        self.assertGreater(ours[2]["all_reduce"], 0)  # the replicas did reduce
        with plugin(True, dtype_strategy="preserve"):
            fresh = fp32_norm_model(seed=1)
            shard(fresh, "override", None, (RMSNorm,), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            loaded = dcp_round_trip(ours[4], fresh, self.file_name)
            for name, value in full_params(loaded).items():
                self.assertTrue(torch.equal(value, ours[1][name]), f"DCP: {name}")
            self.assertEqual({p.dtype for p in loaded.norm.parameters()}, {FP32})
            losses_after = train(loaded, self.rank, steps=1)
        self.assertTrue(torch.isfinite(losses_after[0]))

    def test_torch_compile_adds_no_graph_break(self):
        """Compiled whole model: the override layout has the graph breaks of a plain bf16 group."""
        from torch._dynamo.utils import counters

        seen = {}
        for layout in ("override", "bf16"):
            torch._dynamo.reset()
            counters.clear()
            with plugin(layout == "override", dtype_strategy="upcast"):
                model = fp32_norm_model() if layout == "override" else fp32_norm_model().float()
                shard(model, layout, FP32, (RMSNorm,))
                compiled = torch.compile(model, backend="aot_eager")
                for step in range(2):
                    tokens = batch(self.rank, step)
                    lm_loss(compiled(tokens), tokens).backward()
            seen[layout] = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
        self.assertEqual(seen["override"][0], seen["bf16"][0])  # graph breaks
        # Layers: one graph each, the casts inlined. The root-level norm runs outside any compiled frame
        # (FSDP's root hooks are not traced), so dynamo compiles its two cast hooks as frames of their own.
        self.assertEqual(seen["override"][1], seen["bf16"][1] + 2)
        self.assertGreater(seen["bf16"][1], 0)

    @unittest.skipUnless(has_transformers, "transformers is not installed (pip install '.[test]')")
    def test_transformers_llama_through_the_switch(self):
        """fp32 LlamaRMSNorm computing in fp32 through the default selectors (what the environment variable
        and the launcher set), equal to the per-norm-unit workaround; DCP round trip of the mixed group."""
        results = {}
        for layout in ("switch", "units"):
            with plugin(layout == "switch", dtype_strategy="preserve"):
                model = tiny_llama()
                policy = TorchMixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
                if layout == "units":
                    unit = TorchMixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=FP32, output_dtype=BF16)
                    for module in model.modules():
                        if type(module).__name__ == "LlamaRMSNorm":
                            fully_shard(module, mp_policy=unit)
                _compute_dtype.set_default_selectors("LlamaRMSNorm" if layout == "switch" else None)
                try:
                    for layer in decoder_layers(model):
                        fully_shard(layer, mp_policy=policy)
                    fully_shard(model, mp_policy=policy)
                    with record_compute_dtypes(model) as seen:
                        losses = train_llama(model, self.rank)
                finally:
                    _compute_dtype.set_default_selectors(None)
                results[layout] = (losses, full_params(model), seen)
        self.assertEqual(results["switch"][0], results["units"][0])
        for name, value in results["switch"][1].items():
            self.assertTrue(torch.equal(value, results["units"][1][name]), name)
        for (_, name), dtypes in results["switch"][2].items():
            self.assertEqual(dtypes, {FP32 if "norm" in name else BF16}, name)

    @unittest.skipUnless(has_transformers, "transformers is not installed (pip install '.[test]')")
    def test_transformers_keep_in_fp32_lists_through_auto(self):
        """A stock bf16 LlamaForCausalLM whose keep-in-fp32 list keeps the RMSNorms in fp32, no mixed precision
        (accelerate's ``mixed_precision: "no"``): an fp32 norm hands fp32 to the bf16 q_proj and it fails, with or
        without the plugin. ``--compute-in-loaded-dtype auto`` reads the model's list and trains bit for bit like
        each norm in an fp32 unit of its own, output cast back to bf16 (the workaround), under preserve."""
        no_mp = TorchMixedPrecisionPolicy()

        def model_keeping_norms_in_fp32():
            model = tiny_llama()  # bf16, LlamaRMSNorm weights fp32
            # What transformers sets from a model class's _keep_in_fp32_modules_strict.
            model._keep_in_fp32_modules_strict = {"input_layernorm", "post_attention_layernorm", "norm"}
            return model

        def shard(model):
            for layer in decoder_layers(model):
                fully_shard(layer, mp_policy=no_mp)
            fully_shard(model, mp_policy=no_mp)
            return model

        with plugin(True), unittest.mock.patch.object(UPCAST_COST, "_warned", False):
            model = shard(model_keeping_norms_in_fp32())
            warning = self.assertLogs("torch_fsdp_ext", logging.WARNING) if self.rank == 0 else contextlib.nullcontext()
            with warning as logs, self.assertRaisesRegex(RuntimeError, "expected m1 and m2 to have the same dtype"):
                train_llama(model, self.rank)
        if self.rank == 0:  # the upcast warning, logged right before the failure, names the fix
            self.assertIn(
                "\n  These modules compute in float32 and hand float32 to the next layer:\n    model.norm\n"
                "    model.layers.0.input_layernorm\n    model.layers.0.post_attention_layernorm\n    ...\n"
                "  If that fails ('expected m1 and m2 to have the same dtype'), cast at their boundaries:\n"
                "  launch with --compute-in-loaded-dtype CLASS",
                logs.output[0],
            )
            self.assertLessEqual(max(map(len, logs.output[0].splitlines())), 120)
        results = {}
        for layout in ("auto", "units"):
            with plugin(layout == "auto", dtype_strategy="preserve"):
                model = model_keeping_norms_in_fp32()
                if layout == "units":
                    unit = TorchMixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=FP32, output_dtype=BF16)
                    for module in model.modules():
                        if type(module).__name__ == "LlamaRMSNorm":
                            fully_shard(module, mp_policy=unit)
                _compute_dtype.set_default_selectors("auto" if layout == "auto" else None)
                try:
                    shard(model)
                    with record_compute_dtypes(model) as seen:
                        losses = train_llama(model, self.rank)
                finally:
                    _compute_dtype.set_default_selectors(None)
                results[layout] = (losses, full_params(model), seen)
        self.assertTrue(all(torch.isfinite(torch.tensor(results["auto"][0]))))
        self.assertEqual(results["auto"][0], results["units"][0])
        for name, value in results["auto"][1].items():
            self.assertTrue(torch.equal(value, results["units"][1][name]), name)
        for (_, name), dtypes in results["auto"][2].items():
            self.assertEqual(dtypes, {FP32 if "norm" in name else BF16}, name)


@plugin_specific
class TestComputeDtypeErrors(TestCase):
    """Bad input is named: the parameter, its dtype, what is allowed."""

    def setUp(self):
        super().setUp()
        self.model = fp32_norm_model()
        self.params = list(self.model.layers[0].parameters())

    def _resolve(self, fn, param_dtype=BF16) -> str:
        policy = torch_fsdp_ext.MixedPrecisionPolicy(param_dtype=param_dtype, param_dtype_override_fn=fn)
        with self.assertRaises(ValueError) as raised:
            _compute_dtype.resolve_before_sharding(self.params, (self.model.layers[0],), policy)
        return str(raised.exception)

    def test_override_returns_another_dtype(self):
        self.assertExpectedInline(
            self._resolve(lambda p: torch.float16),
            """torch_fsdp_ext: param_dtype_override_fn must return None, param_dtype (torch.bfloat16), or the \
parameter's original dtype (torch.float32) but got torch.float16 for Block:attn_norm.weight (float32)""",
        )

    def test_override_returns_a_non_dtype(self):
        self.assertExpectedInline(
            self._resolve(lambda p: "float32"),
            """torch_fsdp_ext: param_dtype_override_fn must return a torch.dtype or None but got str ('float32') \
for Block:attn_norm.weight (float32)""",
        )

    def test_policy_class_keeps_torch_semantics(self):
        policy = torch_fsdp_ext.MixedPrecisionPolicy(param_dtype=BF16, param_dtype_override_fn=lambda p: p.dtype)
        self.assertIsInstance(policy, TorchMixedPrecisionPolicy)
        self.assertEqual(policy._resolve_for_param(self.model.norm.weight).param_dtype, FP32)
        self.assertIsNone(policy._resolve_for_param(self.model.norm.weight).param_dtype_override_fn)
        with self.assertRaises(dataclasses.FrozenInstanceError):
            policy.param_dtype = FP32
        with self.assertRaisesRegex(ValueError, "must return None, param_dtype.* but got torch.float16 for a param"):
            dataclasses.replace(policy, param_dtype_override_fn=lambda p: torch.float16)._resolve_for_param(
                self.model.norm.weight
            )

    def test_selector_that_matches_nothing(self):
        with self.assertRaises(ValueError) as raised:
            torch_fsdp_ext.compute_in_loaded_dtype(self.model, [RMSNorm, "LayerNorm", "layers.*.mlp_norm"])
        self.assertExpectedInline(
            str(raised.exception),
            """torch_fsdp_ext: compute_in_loaded_dtype: 'LayerNorm' matched no module. Module classes in the model: \
Block, Dropout, Embedding, Linear, ModuleList, RMSNorm, TinyLlama. Selectors are nn.Module classes, class names, FQN \
globs or FQN components.""",
        )
        with self.assertRaisesRegex(TypeError, "takes nn.Module classes, class names or module FQN patterns, got 3"):
            torch_fsdp_ext.compute_in_loaded_dtype(self.model, [3])

    def test_environment_selector_that_matches_nothing(self):
        _compute_dtype.set_default_selectors(" RMSNorm, NoSuchNorm ")
        try:
            self.assertEqual(_compute_dtype.default_selectors(), ("RMSNorm", "NoSuchNorm"))
            _compute_dtype.resolve_before_sharding(
                self.params, (self.model.layers[0],), TorchMixedPrecisionPolicy(param_dtype=BF16)
            )
            with self.assertRaises(ValueError) as raised:
                _compute_dtype.check_defaults_matched()
        finally:
            _compute_dtype.set_default_selectors(None)
        self.assertExpectedInline(
            str(raised.exception),
            """torch_fsdp_ext: TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE: 'NoSuchNorm' matched no module. Selectors are \
nn.Module classes, class names, FQN globs or FQN components. No FSDP2 group built so far holds such a module.""",
        )

    def test_environment_and_launcher_set_the_selectors(self):
        # What ``import torch_fsdp_ext`` does with the variable.
        with unittest.mock.patch.dict(os.environ, {_compute_dtype.ENV_VAR: " LlamaRMSNorm, layers.*.norm "}):
            _compute_dtype.set_default_selectors(_compute_dtype.selectors_from_env())
        self.assertEqual(_compute_dtype.default_selectors(), ("LlamaRMSNorm", "layers.*.norm"))
        with tempfile.TemporaryDirectory() as tmp:
            script, seen = os.path.join(tmp, "train.py"), os.path.join(tmp, "seen.txt")
            with open(script, "w") as f:
                f.write(
                    "import torch_fsdp_ext\n"
                    f"open({seen!r}, 'w').write(repr(torch_fsdp_ext._dtype._compute_dtype.default_selectors()))\n"
                )
            argv, path = sys.argv[:], sys.path[:]
            try:
                # The launcher sets variables for the interpreters the script starts: keep them in this test.
                with unittest.mock.patch.dict(os.environ):
                    run.main(["--compute-in-loaded-dtype", "RMSNorm,norm", script])
            finally:
                sys.argv[:], sys.path[:] = argv, path
                _compute_dtype.set_default_selectors(None)
            with open(seen) as f:
                self.assertEqual(f.read(), "('RMSNorm', 'norm')")

    def test_two_cast_dtypes_in_one_group(self):
        """Under upcast, keeping a loaded bf16 next to param_dtype=fp16 would need two casts in one all-gather."""
        params = [
            types.SimpleNamespace(_param_fqn=name, orig_dtype=FP32, param_dtype=dtype)
            for name, dtype in (("layers.0.wq.weight", torch.float16), ("layers.0.lora_a.weight", BF16))
        ]
        group = types.SimpleNamespace(fsdp_params=params, _module_fqn="layers.0")
        with self.assertRaises(ValueError) as raised:
            _compute_dtype._check_one_cast_dtype(group)
        self.assertExpectedInline(
            str(raised.exception),
            """torch_fsdp_ext: FSDP2 group 'layers.0' would cast parameters to several compute dtypes: \
layers.0.wq.weight (float32 -> float16), layers.0.lora_a.weight (float32 -> bfloat16). A loaded dtype other than \
param_dtype can only be kept where the parameter is stored in it. Fix: install(dtype_strategy='preserve'), or make \
param_dtype that dtype.""",
        )

    def test_selectors_pick_modules(self):
        fn = torch_fsdp_ext.compute_in_loaded_dtype(self.model, ["layers.1.attn_norm", "norm"])
        chosen = {name for name, p in self.model.named_parameters() if fn(p) is not None}
        self.assertEqual(chosen, {"layers.1.attn_norm.weight", "norm.weight"})
        self.assertEqual(fn(self.model.norm.weight), FP32)


    def test_auto_selects_the_keep_in_fp32_modules_loaded_in_fp32(self):
        model = TinyLlama().to(BF16)
        model.layers[0].attn_norm.float()
        model.layers[1].mlp_norm.float()
        model.norm.float()
        # Entries as transformers writes them: a module name, a parameter name, a glob; mlp_norm of
        # layer 0 is listed but was loaded in bf16, so it is not selected.
        model._keep_in_fp32_modules = ["attn_norm"]
        model._keep_in_fp32_modules_strict = {"layers.*.mlp_norm.weight", "norm"}
        fn = torch_fsdp_ext.compute_in_loaded_dtype(model, "auto")
        chosen = {name for name, p in model.named_parameters() if fn(p) is not None}
        self.assertEqual(chosen, {"layers.0.attn_norm.weight", "layers.1.mlp_norm.weight", "norm.weight"})

    def test_auto_on_a_model_without_lists(self):
        with self.assertRaisesRegex(ValueError, "'auto': TinyLlama declares no _keep_in_fp32_modules"):
            torch_fsdp_ext.compute_in_loaded_dtype(TinyLlama(), ["auto"])

if __name__ == "__main__":
    run_tests()
