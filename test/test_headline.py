"""The README's headline case: HF Trainer / accelerate, FSDP2, ``mixed_precision: "no"``, a bf16 checkpoint of
a model whose MoE router transformers keeps in fp32; fixed by ``import torch_fsdp_ext`` alone.

DeepSeek-V2/V3 and GLM-4.5 (``Glm4Moe``) declare ``_keep_in_fp32_modules_strict = [..., "gate.weight"]``:
``from_pretrained(dtype=torch.bfloat16)`` keeps every router weight fp32 next to bf16 experts and attention
in the same decoder layer, which accelerate's FSDP2 path (the Trainer's with ``fsdp_version: 2``) shards as
one group. With ``mixed_precision: "no"`` accelerate does not upcast, and FSDP2 asserts. The router casts
its inputs to fp32 itself, so the model trains on one process as loaded.

Note: accelerate turns FSDP on only on an accelerator; as its GPU branch does, the test sets the
state's distributed type and plugin by hand on CPU ranks (as test_upcast_contract does).
"""

from __future__ import annotations

import importlib.util
import os
import re
import unittest

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests

from common import HAS_DTYPE_BUG, FSDPExtTestCase, plugin, shared_temp_dir

VOCAB, STEPS, LR = 64, 3, 0.5
needs_libraries = unittest.skipUnless(
    all(importlib.util.find_spec(name) for name in ("transformers", "accelerate")),
    "transformers and accelerate are test extras (pip install '.[test]')",
)


def tiny_moe_checkpoint(path: str) -> str:
    """A 2-layer DeepSeek-V3 (one dense, one MoE layer) saved from a config: no download."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    if torch.distributed.get_rank() == 0:
        DeepseekV3ForCausalLM(config).save_pretrained(path)
    torch.distributed.barrier()
    return path


def load_bf16(path: str) -> nn.Module:
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def trainer_prepare(model: nn.Module, rank: int, world_size: int):
    """What Trainer does under ``fsdp_version: 2`` and ``mixed_precision: "no"``: ``accelerator.prepare``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    AcceleratorState._reset_state(True)
    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True, mixed_precision="no", fsdp_plugin=fsdp_plugin)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = fsdp_plugin
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    return accelerator.prepare(model, optimizer)


def train(model: nn.Module, optimizer, batches) -> list[float]:
    losses = []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class CastParametrization(nn.Module):
    def forward(self, master: torch.Tensor) -> torch.Tensor:
        return master.to(torch.bfloat16)


def one_process_fp32_masters(path: str, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one process, each bf16 parameter an fp32 master computing in bf16, both ranks' batches."""
    from torch.nn.utils import parametrize

    model = load_bf16(path)
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad and param.dtype == torch.bfloat16:
                param.data = param.data.float()
                parametrize.register_parametrization(module, name, CastParametrization(), unsafe=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        # Each rank's batch on its own, as the ranks compute it; their gradients averaged (the halving is exact).
        step_losses = [model(input_ids=batch(rank, step), labels=batch(rank, step)).loss for rank in range(world_size)]
        for loss in step_losses:
            (loss / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(loss.item() for loss in step_losses) / world_size)
    masters = {
        re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", name): p.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return losses, masters


@needs_libraries
class TestHeadlineCase(FSDPExtTestCase):
    def test_moe_with_fp32_router_under_trainer_fsdp2(self):
        with shared_temp_dir("torch_fsdp_ext_moe_") as path:
            self.check_moe(tiny_moe_checkpoint(path))

    def check_moe(self, path: str) -> None:
        loaded = load_bf16(path)
        self.assertEqual(  # what transformers kept in fp32
            {n for n, p in loaded.named_parameters() if p.dtype == torch.float32}, {"model.layers.1.mlp.gate.weight"}
        )
        batches = [batch(self.rank, step) for step in range(STEPS)]
        if HAS_DTYPE_BUG:
            with plugin(False):
                prepared, optimizer = trainer_prepare(load_bf16(path), self.rank, self.world_size)
                with self.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
                    train(prepared, optimizer, batches)
        with plugin(True):  # what `import torch_fsdp_ext` installs
            prepared, optimizer = trainer_prepare(loaded, self.rank, self.world_size)
            local = train(prepared, optimizer, batches)
        # The mean of the ranks' losses.
        losses = torch.tensor(local)
        torch.distributed.all_reduce(losses)
        losses /= self.world_size
        reference_losses, reference_masters = one_process_fp32_masters(path, self.world_size)
        self.assertTrue(torch.isfinite(losses).all(), losses)
        torch.testing.assert_close(losses, torch.tensor(reference_losses), rtol=1e-5, atol=0)
        masters = {n: p.full_tensor() for n, p in prepared.named_parameters() if p.requires_grad}
        self.assertEqual(masters.keys(), reference_masters.keys())
        self.assertEqual({p.dtype for p in masters.values()}, {torch.float32})  # fp32 master weights
        initial = dict(load_bf16(path).named_parameters())
        for name, master in masters.items():
            # SGD: an update follows its gradient (Adam's first steps are sign-like).
            moved = (reference_masters[name] - initial[name].float()).norm()
            self.assertGreater(moved.item(), 0, name)
            # Measured: at most 0.83% of the distance moved (gradients reach the masters through bf16 compute
            # and FSDP's reduce); bf16 master weights (a bf16 SGD step) end ~10% away.
            self.assertLess((master - reference_masters[name]).norm().item(), 0.02 * moved.item(), name)

if __name__ == "__main__":
    run_tests()
