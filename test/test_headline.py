"""The README's headline case: HF Trainer / accelerate, FSDP2, a LoRA classifier (peft puts the head in
``modules_to_save``), ``mixed_precision: "no"``, fixed by ``import torch_fsdp_ext`` alone.

peft's LoRA adapters are fp32 on a bf16 base; for ``task_type=SEQ_CLS`` peft adds the classification
head (``score``) to ``modules_to_save``: a trainable bf16 copy. Trainer replaces accelerate's wrap
policy with peft's (``transformers.distributed.fsdp.update_fsdp_plugin_peft``), which accelerate's FSDP2
path does not translate: the whole model is one ``fully_shard`` group with fp32 and bf16 trainable
parameters, and FSDP2 asserts. The same model trains on one process.

Note: accelerate turns FSDP on only on an accelerator; as its GPU branch does, the test sets the
state's distributed type and plugin by hand on CPU ranks (as test_upcast_contract does).
"""

from __future__ import annotations

import importlib.util
import os
import unittest

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests

from common import HAS_DTYPE_BUG, FSDPExtTestCase, plugin

VOCAB, STEPS, LR = 64, 3, 1e-3
needs_libraries = unittest.skipUnless(
    all(importlib.util.find_spec(name) for name in ("transformers", "peft", "accelerate")),
    "transformers, peft and accelerate are test extras (pip install '.[test]')",
)


def lora_classifier() -> nn.Module:
    """A 2-layer bf16 LlamaForSequenceClassification from a config, LoRA on q_proj/v_proj (peft's defaults)."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, num_labels=2,
    )
    torch.manual_seed(0)
    base = LlamaForSequenceClassification(config).to(torch.bfloat16)
    return get_peft_model(base, LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["q_proj", "v_proj"]))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(1, VOCAB, (2, 16), generator=generator), torch.randint(0, 2, (2,), generator=generator)


def trainer_prepare(model: nn.Module, rank: int, world_size: int):
    """What Trainer does with a peft model under ``fsdp_version: 2`` and ``mixed_precision: "no"``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers.distributed.fsdp import update_fsdp_plugin_peft

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    AcceleratorState._reset_state(True)
    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True, mixed_precision="no", fsdp_plugin=fsdp_plugin)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = fsdp_plugin
    update_fsdp_plugin_peft(model, accelerator)  # Trainer, for every peft model under FSDP
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    return accelerator.prepare(model, optimizer)


def train(model: nn.Module, optimizer, batches) -> list[float]:
    losses = []
    for tokens, labels in batches:
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class CastParametrization(nn.Module):
    def forward(self, master: torch.Tensor) -> torch.Tensor:
        return master.to(torch.bfloat16)


def one_process_fp32_masters(world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one process, the global batch, the bf16 head copy as an fp32 master computing in bf16."""
    from torch.nn.utils import parametrize

    model = lora_classifier()
    for module in model.modules():
        if "weight" in module._parameters and module.weight.requires_grad and module.weight.dtype == torch.bfloat16:
            module.weight.data = module.weight.data.float()
            parametrize.register_parametrization(module, "weight", CastParametrization(), unsafe=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    global_batches = []
    for step in range(STEPS):
        parts = [batch(rank, step) for rank in range(world_size)]
        global_batches.append((torch.cat([t for t, _ in parts]), torch.cat([l for _, l in parts])))
    losses = train(model, optimizer, global_batches)
    masters = {
        name.replace(".parametrizations.weight.original", ".weight"): p.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return losses, masters


@needs_libraries
class TestHeadlineCase(FSDPExtTestCase):
    def test_lora_classifier_under_trainer_fsdp2(self):
        model = lora_classifier()
        trainable = {p.dtype for p in model.parameters() if p.requires_grad}
        self.assertEqual(trainable, {torch.float32, torch.bfloat16})  # fp32 adapters, the bf16 head copy
        batches = [batch(self.rank, step) for step in range(STEPS)]
        if HAS_DTYPE_BUG:
            with plugin(False):
                prepared, optimizer = trainer_prepare(lora_classifier(), self.rank, self.world_size)
                with self.assertRaisesRegex(AssertionError, "uniform original parameter dtype"):
                    train(prepared, optimizer, batches)
        with plugin(True):  # what `import torch_fsdp_ext` installs
            prepared, optimizer = trainer_prepare(model, self.rank, self.world_size)
            local = train(prepared, optimizer, batches)
        # The loss of the global batch: the mean of the ranks' losses (equal batch sizes).
        losses = torch.tensor(local)
        torch.distributed.all_reduce(losses)
        losses /= self.world_size
        reference_losses, reference_masters = one_process_fp32_masters(self.world_size)
        reference = torch.tensor(reference_losses)
        self.assertTrue(torch.isfinite(losses).all(), losses)
        self.assertNotEqual(losses[0].item(), losses[-1].item())  # it trains
        # bf16 compute: per-rank batches and the one-process batch round differently.
        torch.testing.assert_close(losses, reference, rtol=1e-2, atol=1e-2)
        masters = {n: p.full_tensor() for n, p in prepared.named_parameters() if p.requires_grad}
        self.assertEqual(masters.keys(), reference_masters.keys())
        self.assertEqual({p.dtype for p in masters.values()}, {torch.float32})  # the head copy: an fp32 master
        initial = {n: p for n, p in lora_classifier().named_parameters() if n in masters}
        for name, master in masters.items():
            moved = (reference_masters[name] - initial[name].float()).abs().max().item()
            self.assertGreater(moved, 1e-3, name)  # AdamW moved it (lr 1e-3, 3 steps)
            torch.testing.assert_close(master, reference_masters[name], rtol=0, atol=moved / 10, msg=name)
        self.assertEqual({p.dtype for p in prepared.parameters() if not p.requires_grad}, {torch.bfloat16})


if __name__ == "__main__":
    run_tests()
