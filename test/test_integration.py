"""The libraries users train with: transformers (tiny Llama), peft (LoRA), tensor parallel + FSDP (2-D).

Each case runs once per dtype strategy that keeps training going (``upcast``; ``preserve``,
skipped with a reason where this version of the plugin lacks it) and compares with the
manual workaround.
"""

from __future__ import annotations

import importlib.util
import unittest

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext

from common import HAS_DTYPE_BUG, FSDPExtTestCase, MixedPrecisionPolicy, fully_shard, plugin

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STEPS = 3
VOCAB = 64

has_transformers = importlib.util.find_spec("transformers") is not None
has_peft = importlib.util.find_spec("peft") is not None
needs_transformers = unittest.skipUnless(has_transformers, "transformers is not installed (pip install '.[test]')")
needs_peft = unittest.skipUnless(has_peft, "peft is not installed (pip install '.[test]')")
NORMS = ["input_layernorm", "post_attention_layernorm"]  # trainable bf16 copies next to fp32 adapters


def needs_strategy(strategy: str):
    """Skip in the parent process (before ranks spawn), with the reason, where the plugin lacks ``strategy``."""
    return unittest.skipUnless(
        strategy in torch_fsdp_ext.STRATEGIES, f"dtype strategy {strategy!r} is not in this version of the plugin"
    )


needs_dtype_bug = unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed dtypes in one FSDP group")


def tiny_llama(fp32_norms: bool = True, seed: int = 0) -> nn.Module:
    """A 2-layer LlamaForCausalLM from a config (no download) in bf16; RMSNorm weights in fp32 if asked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for module in model.modules():
        if fp32_norms and type(module).__name__ == "LlamaRMSNorm":
            module.float()
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a (possibly peft-wrapped) LlamaForCausalLM."""
    return model.get_decoder().layers if hasattr(model, "get_decoder") else model.base_model.model.model.layers


def shard_llama(model: nn.Module) -> nn.Module:
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=BF16)
    fully_shard(model, mp_policy=BF16)
    return model


def train_llama(model: nn.Module, rank: int) -> list[float]:
    """STEPS AdamW steps of causal-LM loss on per-rank token batches."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def cast_trainable(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The manual workaround for a frozen base: cast only the trainable parameters."""
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(dtype)
    return model


class StrategyCases:
    """Each case is a ``check_*(strategy)`` method, run by one test per training strategy."""

    def assert_matches_workaround(self, strategy: str, losses: list[float], workaround: list[float]) -> None:
        if strategy == "upcast":
            self.assertEqual(losses, workaround)  # fp32 masters, like the workaround: bit for bit
        else:
            # preserve computes the first step from the same bf16 values as the workaround's bf16 casts of
            # its fp32 masters: bit for bit. Later steps apply the updates to bf16 storage instead of fp32
            # masters, so they differ by bf16 rounding of the updates (test_preserve compares those exactly
            # with a reference that keeps each dtype).
            self.assertEqual(losses[0], workaround[0])
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(workaround), rtol=2e-2, atol=0)

    def assert_dtypes_kept(self, strategy: str, model: nn.Module, loaded: dict[str, torch.dtype]) -> None:
        if strategy == "preserve":
            self.assertEqual({n: p.dtype for n, p in model.named_parameters()}, loaded)


@needs_transformers
class LlamaTest(StrategyCases, FSDPExtTestCase):
    @needs_dtype_bug
    def test_without_plugin_seed_assertion(self) -> None:
        with plugin(False):
            model = shard_llama(tiny_llama())
            with self.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
                train_llama(model, self.rank)

    def check_gradient_checkpointing(self, strategy: str) -> None:
        with plugin(False):
            model = tiny_llama().float()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            workaround = train_llama(shard_llama(model), self.rank)
        with plugin(True, dtype_strategy=strategy):
            model = tiny_llama()
            loaded = {n: p.dtype for n, p in model.named_parameters()}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.assertTrue(model.is_gradient_checkpointing)
            losses = train_llama(shard_llama(model), self.rank)
        self.assert_matches_workaround(strategy, losses, workaround)
        self.assert_dtypes_kept(strategy, model, loaded)

    def test_gradient_checkpointing_upcast(self) -> None:
        self.check_gradient_checkpointing("upcast")

    @needs_strategy("preserve")
    def test_gradient_checkpointing_preserve(self) -> None:
        self.check_gradient_checkpointing("preserve")


@needs_transformers
@needs_peft
class LoraTest(StrategyCases, FSDPExtTestCase):
    def lora_model(self, modules_to_save: list[str] | None) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save)
        model = get_peft_model(tiny_llama(fp32_norms=False), config)  # adapters in fp32 on an all-bf16 base
        adapters = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
        self.assertEqual(adapters, {torch.float32})
        return model

    def frozen_dtypes(self, model: nn.Module) -> set[torch.dtype]:
        return {p.dtype for p in model.parameters() if not p.requires_grad}

    def check_lora(self, strategy: str, modules_to_save: list[str] | None) -> None:
        with plugin(False):
            reference = shard_llama(cast_trainable(self.lora_model(modules_to_save), torch.float32))
            workaround = train_llama(reference, self.rank)
        with plugin(True, dtype_strategy=strategy):
            model = self.lora_model(modules_to_save)
            loaded = {n: p.dtype for n, p in model.named_parameters()}
            losses = train_llama(shard_llama(model), self.rank)
        self.assert_dtypes_kept(strategy, model, loaded)
        self.assertEqual(self.frozen_dtypes(model), {torch.bfloat16})  # the frozen base stays bf16
        self.assert_matches_workaround(strategy, losses, workaround)

    def test_lora_fp32_adapters_unchanged_by_plugin(self) -> None:
        # Trainable params are all fp32 adapters: FSDP accepts it alone; the plugin must not change the result.
        with plugin(False):
            unpatched = train_llama(shard_llama(self.lora_model(None)), self.rank)
        with plugin(True):
            model = shard_llama(self.lora_model(None))
            self.assertEqual(train_llama(model, self.rank), unpatched)
        self.assertEqual(self.frozen_dtypes(model), {torch.bfloat16})

    @needs_dtype_bug
    def test_lora_modules_to_save_norms_without_plugin(self) -> None:
        with plugin(False):
            model = shard_llama(self.lora_model(NORMS))
            with self.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
                train_llama(model, self.rank)

    def test_lora_modules_to_save_norms_upcast(self) -> None:
        self.check_lora("upcast", NORMS)

    @needs_strategy("preserve")
    def test_lora_modules_to_save_norms_preserve(self) -> None:
        self.check_lora("preserve", NORMS)


class TPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


class TPModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TPBlock(dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class TensorParallelTest(StrategyCases, FSDPExtTestCase):
    """2-D: dp=2 x tp=2 on 4 gloo ranks; parallelize_module, then fully_shard over the dp mesh."""

    WORLD_SIZE = 4

    def train_2d(self, workaround: bool) -> list[float]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = TPModel().to(torch.bfloat16)
        for block in model.blocks:
            block.norm.float()
        if workaround:
            model.float()
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"], mp_policy=BF16)
        fully_shard(model, mesh=mesh["dp"], mp_policy=BF16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        dp_rank = mesh["dp"].get_local_rank()
        for step in range(STEPS):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + dp_rank))
            loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    @needs_dtype_bug
    def test_tp_fsdp_2d_without_plugin(self) -> None:
        with plugin(False), self.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
            self.train_2d(workaround=False)

    def check_2d(self, strategy: str) -> None:
        with plugin(False):
            workaround = self.train_2d(workaround=True)
        with plugin(True, dtype_strategy=strategy):
            losses = self.train_2d(workaround=False)
        self.assert_matches_workaround(strategy, losses, workaround)

    def test_tp_fsdp_2d_upcast(self) -> None:
        self.check_2d("upcast")

    @needs_strategy("preserve")
    def test_tp_fsdp_2d_preserve(self) -> None:
        self.check_2d("preserve")


if __name__ == "__main__":
    run_tests()
