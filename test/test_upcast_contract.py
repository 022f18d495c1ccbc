"""The upcast contract, proven on the loaders users run after ``fully_shard``.

Every trainable floating parameter narrower than the widest in what one root's
tree shards together becomes an fp32 master weight, at one moment every loader
sees alike on every rank (Note [Upcast moment] in ``_dtype/_fix.py``); each module
computes in the dtype it computed in before. Each loader's result is compared bit
for bit with its no-plugin reference.
"""

from __future__ import annotations

import importlib.util
import os
import types
import unittest

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from torch_fsdp_ext import MixedParamDtypeError, MixedPrecisionPolicy
from torch_fsdp_ext._dtype import _compute_dtype

from common import (
    HAS_DTYPE_BUG,
    FSDPExtTestCase,
    batch,
    full_grads,
    full_params,
    lm_loss,
    mixed_llama,
    plugin,
    plugin_specific,
    pretrained_llama,
    seed_000_model,
    shared_temp_dir,
    train_lm,
)

try:
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
except ImportError:  # a test extra
    fsdp2_load_full_state_dict = None
try:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
except ImportError:  # a test extra
    convert_to_float8_training = None

needs_dtype_bug = unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: nothing to fix")
needs_accelerate = unittest.skipIf(fsdp2_load_full_state_dict is None, "accelerate is not installed")
BF16_MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
NO_MP = MixedPrecisionPolicy()  # accelerate's mixed_precision: "no"
STEPS = 3


def shard_with_embedding_unit(model: nn.Module, mp_policy) -> nn.Module:
    """torchtitan's and accelerate's layout: the embedding (all bf16) is an FSDP unit of its own."""
    fully_shard(model.embed, mp_policy=mp_policy)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def train(model: nn.Module, rank: int, steps: int = STEPS) -> list[torch.Tensor]:
    return train_lm(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, steps)


def upcast_trainable(model: nn.Module) -> nn.Module:
    """accelerate's own upcast (``mixed_precision != "no"``), before it captures the state dict."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return model


def accelerate_efficient_load(model: nn.Module, rank: int, mp_policy) -> nn.Module:
    """``fsdp_cpu_ram_efficient_loading: true``: capture, meta, fully_shard, rank-0 broadcast (accelerate's own loader)."""
    full_sd = model.state_dict() if rank == 0 else {}
    model = model.to(torch.device("meta"))
    shard_with_embedding_unit(model, mp_policy)
    # Note: the two attributes accelerate's loader reads off its Accelerator, set here for CPU ranks.
    accelerator = types.SimpleNamespace(is_main_process=rank == 0, device=torch.device("cpu"))
    return fsdp2_load_full_state_dict(accelerator, model, full_sd)


def perturbed_fp32_masters(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 values no bf16 can hold, for every (trainable) parameter: a checkpoint of fp32 master weights."""
    generator = torch.Generator().manual_seed(7)
    return {
        name: param.detach().float() + 1e-3 * torch.randn(param.shape, generator=generator)
        for name, param in model.named_parameters()
    }


class TestAccelerateLoading(FSDPExtTestCase):
    """accelerate's ``fsdp2_prepare_model`` with ``cpu_ram_efficient_loading`` (its default)."""

    @needs_accelerate
    @needs_dtype_bug
    def test_without_plugin_the_first_forward_asserts(self):
        with plugin(False):
            model = accelerate_efficient_load(seed_000_model(), self.rank, BF16_MP)
            with self.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
                model(batch(self.rank))

    @needs_accelerate
    @plugin_specific
    def test_bf16_policy_equals_accelerates_own_upcast(self):
        """mixed_precision: bf16 — the plugin (no upcast by accelerate) equals accelerate's upcast, bit for bit."""
        with plugin(False):
            reference = accelerate_efficient_load(upcast_trainable(seed_000_model()), self.rank, BF16_MP)
            reference_losses = train(reference, self.rank)
            reference_params = full_params(reference)
        with plugin(True):
            model = accelerate_efficient_load(seed_000_model(), self.rank, BF16_MP)
            losses = train(model, self.rank)
        self.assertEqual(losses, reference_losses, atol=0, rtol=0)
        self.assertEqual(full_params(model), reference_params, atol=0, rtol=0)

    @needs_accelerate
    @plugin_specific
    def test_no_mixed_precision_trains_as_without_the_efficient_loading(self):
        """mixed_precision: "no" — meta + rank-0 broadcast gives what a model loaded on every rank gives.

        Before the upcast moved to the first forward, the broadcast paired rank 0's bf16
        elements with fp32 buffers on rank 1: NaN losses, no error.
        """
        with plugin(True):
            loaded = shard_with_embedding_unit(mixed_llama(), NO_MP)
            reference_losses = train(loaded, self.rank)
            reference_params = full_params(loaded)
            model = accelerate_efficient_load(mixed_llama(), self.rank, NO_MP)
            losses = train(model, self.rank)
        self.assertTrue(all(torch.isfinite(loss) for loss in losses), losses)
        self.assertEqual(losses, reference_losses, atol=0, rtol=0)
        self.assertEqual(full_params(model), reference_params, atol=0, rtol=0)
        self.assertEqual({p.dtype for p in model.parameters()}, {torch.float32})


def accelerate_prepare(rank: int, world_size: int, cpu_ram_efficient_loading: bool) -> nn.Module:
    """accelerate itself: ``Accelerator(mixed_precision="no")`` with an FSDP2 plugin, then ``prepare(model)``.

    Note: accelerate turns FSDP on only on an accelerator; as its GPU branch does, this sets the
    state's distributed type and plugin by hand, here, for CPU ranks (``cpu=True``: accelerate's
    multi-CPU state, so that only rank 0 is its main process).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    # What a launcher sets; accelerate reuses the process group already initialized here.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    AcceleratorState._reset_state(True)
    fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=cpu_ram_efficient_loading,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["MixedBlock"],
    )
    accelerator = Accelerator(cpu=True, mixed_precision="no", fsdp_plugin=fsdp_plugin)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = fsdp_plugin
    return accelerator.prepare(mixed_llama())


class TestAccelerateEndToEnd(FSDPExtTestCase):
    @needs_accelerate
    @plugin_specific
    def test_default_efficient_loading_trains_as_loading_on_every_rank(self):
        """accelerate 1.15, mixed_precision "no", fsdp_cpu_ram_efficient_loading true (its default) vs false."""
        if HAS_DTYPE_BUG:
            with plugin(False):
                model = accelerate_prepare(self.rank, self.world_size, cpu_ram_efficient_loading=True)
                with self.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
                    model(batch(self.rank))
        with plugin(True):
            reference = accelerate_prepare(self.rank, self.world_size, cpu_ram_efficient_loading=False)
            reference_losses = train(reference, self.rank)
            model = accelerate_prepare(self.rank, self.world_size, cpu_ram_efficient_loading=True)
            losses = train(model, self.rank)
        self.assertEqual(type(model).__name__, "FSDPMixedLlama")
        self.assertTrue(all(torch.isfinite(loss) for loss in losses), losses)
        self.assertEqual(losses, reference_losses, atol=0, rtol=0)
        self.assertEqual(full_params(model), full_params(reference), atol=0, rtol=0)


class TestTorchLoaders(FSDPExtTestCase):
    @plugin_specific
    def test_set_model_state_dict_broadcast_from_rank0_keeps_fp32_masters(self):
        """A checkpoint of fp32 masters loads into a bf16-loaded model unrounded, materialized or on meta."""
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        masters = perturbed_fp32_masters(seed_000_model())
        for on_meta in (False, True):
            with self.subTest(on_meta=on_meta), plugin(True):
                model = seed_000_model()
                if on_meta:
                    model = model.to(torch.device("meta"))
                shard_with_embedding_unit(model, BF16_MP)
                if on_meta:
                    model.to_empty(device="cpu")
                # Note: a copy, since rank 0's dict is replaced in place by its shards.
                set_model_state_dict(model, dict(masters) if self.rank == 0 else {}, options=options)
                model(batch(self.rank))
                model.reshard()  # the root keeps its parameters unsharded after forward
                self.assertEqual(full_params(model), masters, atol=0, rtol=0)

    @plugin_specific
    def test_torchtitan_order_meta_init_to_empty_init_weights_dcp_load(self):
        """meta init → fully_shard → to_empty → init weights → dcp.load of an upcast checkpoint: exact masters."""
        with plugin(True):
            trained = shard_with_embedding_unit(seed_000_model(), BF16_MP)
            train(trained, self.rank, steps=1)  # fp32 masters no bf16 can hold
            expected = full_params(trained)
            with shared_temp_dir("upcast_contract_dcp") as path:
                dcp.save(trained.state_dict(), checkpoint_id=path)
                with torch.device("meta"):
                    model = seed_000_model()
                shard_with_embedding_unit(model, BF16_MP)
                model.to_empty(device="cpu")
                with torch.no_grad():
                    for param in model.parameters():
                        param.normal_()  # torchtitan's init_weights, overwritten by the load
                state = model.state_dict()
                dcp.load(state, checkpoint_id=path)
                model.load_state_dict(state)
                model(batch(self.rank))
                model.reshard()
        loaded = full_params(model)
        self.assertEqual({n: t.dtype for n, t in loaded.items()}, {n: t.dtype for n, t in expected.items()})
        self.assertEqual(loaded, expected, atol=0, rtol=0)


class TestWholeModel(FSDPExtTestCase):
    @plugin_specific
    def test_uniform_bf16_embedding_unit_is_upcast_like_model_float(self):
        """The all-bf16 embedding unit gets fp32 masters too: bit for bit the model.float() workaround."""
        with plugin(False):
            reference = shard_with_embedding_unit(seed_000_model().float(), BF16_MP)
            reference_losses = train(reference, self.rank)
            reference_params = full_params(reference)
        with plugin(True):
            model = shard_with_embedding_unit(seed_000_model(), BF16_MP)
            losses = train(model, self.rank)
        self.assertEqual(model.embed.weight.dtype, torch.float32)
        self.assertEqual(losses, reference_losses, atol=0, rtol=0)
        self.assertEqual(full_params(model), reference_params, atol=0, rtol=0)


class TestTransformers(FSDPExtTestCase):
    @unittest.skipIf(importlib.util.find_spec("transformers") is None, "transformers is not installed")
    @plugin_specific
    def test_from_pretrained_bf16_with_keep_in_fp32_modules_equals_model_float(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        with shared_temp_dir("upcast_contract_llama") as path:
            if self.rank == 0:
                config = LlamaConfig(
                    vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=32,
                )
                torch.manual_seed(0)
                LlamaForCausalLM(config).save_pretrained(path)
            dist.barrier()
            loaded, for_reference = pretrained_llama(path), pretrained_llama(path)

        def shard_and_train(model: nn.Module) -> tuple[list[torch.Tensor], dict]:
            model.config._attn_implementation = "eager"
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=BF16_MP)
            fully_shard(model, mp_policy=BF16_MP)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(STEPS):
                tokens = batch(self.rank, step)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
            return losses, full_params(model)

        self.assertEqual(loaded.model.norm.weight.dtype, torch.float32)
        self.assertEqual(loaded.model.layers[0].mlp.up_proj.weight.dtype, torch.bfloat16)
        with plugin(False):
            reference = shard_and_train(for_reference.float())
        with plugin(True):
            result = shard_and_train(loaded)
        self.assertEqual(result[0], reference[0], atol=0, rtol=0)
        self.assertEqual(result[1], reference[1], atol=0, rtol=0)


class HFRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: computes in fp32, returns ``weight * x`` in the input's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x32.to(input_dtype)


class LoRABlock(nn.Module):
    """TRL's LoRA shape: frozen bf16 base, fp32 adapters, a trainable bf16 norm (modules_to_save)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = HFRMSNorm(dim)
        self.base = nn.Linear(dim, dim, bias=False)
        self.lora_a = nn.Linear(dim, 4, bias=False)
        self.lora_b = nn.Linear(4, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.base(h) + self.lora_b(self.lora_a(h.to(self.lora_a.weight.dtype))).to(h.dtype)


class LoRAModel(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LoRABlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def lora_model() -> LoRAModel:
    torch.manual_seed(0)
    model = LoRAModel().to(torch.bfloat16)
    model.requires_grad_(False)
    for layer in model.layers:
        layer.norm.weight.requires_grad_(True)
        for adapter in (layer.lora_a, layer.lora_b):
            adapter.float().requires_grad_(True)
    return model


class TestComputeUnchanged(FSDPExtTestCase):
    @plugin_specific
    def test_lora_shape_without_param_dtype_computes_as_in_one_process(self):
        """No param_dtype: the upcast bf16 norm still computes (and returns) bf16 into the frozen bf16 base.

        Before: ``RuntimeError: mat1 and mat2 must have the same dtype`` at the first forward.
        """
        tokens = batch(self.rank)
        with torch.no_grad():
            one_process_loss = lm_loss(lora_model()(tokens), tokens)
        with plugin(True):
            model = lora_model()
            for layer in model.layers:
                fully_shard(layer, mp_policy=NO_MP)
            fully_shard(model, mp_policy=NO_MP)
            losses = train(model, self.rank)
        self.assertEqual(losses[0], one_process_loss, atol=0, rtol=0)
        self.assertTrue(all(torch.isfinite(loss) for loss in losses), losses)
        self.assertEqual(model.layers[0].norm.weight.dtype, torch.float32)  # the master
        self.assertEqual(model.layers[0].base.weight.dtype, torch.bfloat16)  # frozen: never cast


class TestNeverCast(FSDPExtTestCase):
    @unittest.skipIf(convert_to_float8_training is None, "torchao is not installed")
    @plugin_specific
    def test_torchao_float8_training_weights_are_left_alone(self):
        """torchao's float8 all-gather weights keep their dtype; a group that that leaves mixed is an error."""

        def float8_model(weight_dtype: torch.dtype) -> nn.Module:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.LayerNorm(32)).to(weight_dtype)
            model[1].float()
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
            return convert_to_float8_training(model, config=config)

        for strategy in torch_fsdp_ext.STRATEGIES:
            with self.subTest(strategy=strategy), plugin(True, dtype_strategy=strategy):
                model = fully_shard(float8_model(torch.bfloat16), mp_policy=BF16_MP)
                with self.assertRaises(MixedParamDtypeError) as caught:
                    model(torch.randn(4, 32))
                self.assertRegex(str(caught.exception), r"\n  0\.weight: bfloat16 \([^)]*: tensor subclass with fsdp_pre_all_gather\)")
                self.assertEqual(model[0].weight.dtype, torch.bfloat16)
        with plugin(True):
            # The usual setup, fp32 weights inside the float8 subclass: nothing to cast, FSDP takes it as it is.
            model = fully_shard(float8_model(torch.float32), mp_policy=BF16_MP)
            model(torch.randn(4, 32)).sum().backward()
            self.assertEqual(type(model[0].weight.to_local()).__name__, "WeightWithDynamicFloat8CastTensor")


@unittest.skipIf(_compute_dtype.TORCH_HAS_OVERRIDE, "this torch has param_dtype_override_fn natively")
class TestPolicyNeverSilentlyOff(FSDPExtTestCase):
    WORLD_SIZE = 1

    @plugin_specific
    def test_override_policy_without_the_dtype_fix_is_an_error(self):
        override = _compute_dtype.LoadedDtypeModules({})
        with plugin(False):
            with self.assertRaisesRegex(ValueError, "needs the plugin's dtype fix"):
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=override)

    @plugin_specific
    def test_override_outlives_uninstall(self):
        """A group built with an override while installed computes the same after uninstall()."""

        def norm_output_dtype(uninstall_first: bool) -> torch.dtype:
            with plugin(True):
                model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
                policy = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16,
                    param_dtype_override_fn=torch_fsdp_ext.compute_in_loaded_dtype(model, [nn.LayerNorm]),
                )
                fully_shard(model, mp_policy=policy)
                seen = []
                model[1].register_forward_hook(lambda module, args, output: seen.append(args[0].dtype))
                if uninstall_first:
                    torch_fsdp_ext.uninstall()
                model(torch.randn(2, 8))
                return seen[0]

        self.assertEqual(norm_output_dtype(uninstall_first=False), torch.float32)
        self.assertEqual(norm_output_dtype(uninstall_first=True), torch.float32)


@unittest.skipUnless(_compute_dtype.TORCH_HAS_OVERRIDE, "this torch has no native param_dtype_override_fn")
class TestNativePolicy(FSDPExtTestCase):
    @plugin_specific
    def test_native_override_policy_computes_the_same_with_and_without_the_plugin(self):
        """compute_in_loaded_dtype carries its own boundary casts: the plugin adds nothing to torch's policy."""

        def loss_and_grads(enabled: bool) -> tuple[torch.Tensor, dict, torch.dtype]:
            with plugin(enabled):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
                policy = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16,
                    reduce_dtype=torch.float32,
                    param_dtype_override_fn=torch_fsdp_ext.compute_in_loaded_dtype(model, [nn.LayerNorm]),
                )
                fully_shard(model, mp_policy=policy)
                seen = []
                model[1].register_forward_hook(lambda module, args, output: seen.append(args[0].dtype))
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(self.rank))
                loss = model(x).float().pow(2).mean()
                loss.backward()
                return loss.detach(), full_grads(model), seen[0]

        without, with_plugin = loss_and_grads(False), loss_and_grads(True)
        self.assertEqual(without[2], torch.float32)  # the norm computes in its loaded dtype without the plugin too
        self.assertEqual(with_plugin[0], without[0], atol=0, rtol=0)
        self.assertEqual(with_plugin[1], without[1], atol=0, rtol=0)


if __name__ == "__main__":
    run_tests()
