"""TRL's ``SFTTrainer`` on accelerate's FSDP2 path, a bf16 Llama with fp32 RMSNorm weights, with the plugin.

    PYTHONPATH=. python tools/integrations/trl_sft.py

The model is loaded as a user loads a checkpoint that keeps its norms in fp32: ``from_pretrained(path,
dtype=torch.bfloat16)`` of a ``LlamaForCausalLM`` subclass whose ``_keep_in_fp32_modules_strict`` names the
RMSNorms (a tiny 2-layer Llama from a ``LlamaConfig``, saved by this tool, no download): linears and embedding
bf16, the 5 norm weights fp32. ``SFTTrainer`` (TRL's defaults: gradient checkpointing on, AdamW) trains it on a
fixed text dataset (``datasets.Dataset.from_list``, a word-level tokenizer made here) with ``fsdp=True``,
``fsdp_config={"fsdp_version": 2, ...}``, 3 steps, batch 2 per rank. Each job is launched as users launch one,
``torchrun --nproc-per-node 2 train.py`` (gloo); the plugin's jobs through the launcher, ``torchrun
--nproc-per-node 2 -m torch_fsdp_ext.run train.py``. accelerate takes its FSDP path only on an accelerator: on these
CPU ranks it is switched on by hand, as its GPU branch does (``_accelerate.py``).

With ``bf16=True`` (``SFTConfig``'s default) accelerate upcasts every trainable parameter to fp32 itself before
``fully_shard`` and computes in bf16 through a ``MixedPrecisionPolicy``:

- ``mp-plain``: no plugin; trains (there is no mixed dtype left for FSDP to see);
- ``mp-plugin``: the plugin; nothing left to do, bit for bit with ``mp-plain``;
- ``mp-float``: ``model.float()`` before the trainer (the hand workaround); bit for bit with both.

With ``bf16=False`` (accelerate's ``mixed_precision: "no"``) nothing casts:

- ``nomp-plain``: no plugin; FSDP2's uniform-dtype assertion is expected;
- ``nomp-plugin``: the plugin (fp32 masters, each parameter all-gathered in its loaded dtype); an fp32 norm returns
  fp32 into the bf16 ``q_proj``, and the first forward fails (``expected m1 and m2 to have the same dtype``), as it
  does for this model without FSDP;
- ``nomp-auto``: the plugin with ``TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=auto`` (the launcher's
  ``--compute-in-loaded-dtype auto``): the norms the model's ``_keep_in_fp32_modules_strict`` names compute in fp32
  with casts at their boundaries, the linears in bf16; it trains;
- ``nomp-float``: ``model.float()`` before the trainer: everything computes in fp32, so its losses and parameters
  differ from ``nomp-auto``'s by design (the figures are printed, not required equal);
- ``nomp-stock``: the stock ``LlamaForCausalLM`` (it lists no fp32 modules, so ``auto`` selects nothing): loaded
  with ``dtype=torch.bfloat16`` it casts the checkpoint's fp32 norms to bf16 (counted); the norms are then made fp32
  by hand and the plugin runs with the norm class named, ``TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=LlamaRMSNorm``.

Exit status 1 unless: every ``mp-*`` job trains and they are equal bit for bit (both ranks' losses at every step and
every full parameter), ``nomp-plain`` fails with the assertion, ``nomp-plugin`` with the dtype error, ``nomp-auto``
trains with every parameter fp32 after its steps, and its step-1 loss on each rank equals ``mp-plain``'s bit for bit
(the norm weights start at 1, so an fp32 norm cast back to bf16 computes what the bf16 policy's norm computes; later
steps differ: ``mp-plain`` reduces gradients in bf16 and computes the norms with bf16 copies of their weights), the
stock class loads no fp32 parameter, and ``nomp-stock`` equals ``nomp-auto`` bit for bit.
"""

from __future__ import annotations

import os
import tempfile

import torch

from _accelerate import accelerate_fsdp_on_cpu  # this script's folder
from _jobs import ASSERTION, launch_job, run_tool
from _model import compare

STEPS, BATCH, WORDS = 3, 2, 12
VOCAB = 32
NORMS = ["input_layernorm", "post_attention_layernorm", "norm"]
DTYPE_ERROR = "expected m1 and m2 to have the same dtype"
LABEL = "trl-sft"


def mixed_llama_class():
    """``LlamaForCausalLM`` with its RMSNorms in ``_keep_in_fp32_modules_strict``: a bf16 load keeps them fp32."""
    from transformers import LlamaForCausalLM

    return type("MixedLlamaForCausalLM", (LlamaForCausalLM,), {"_keep_in_fp32_modules_strict": NORMS})


def save_checkpoint(path: str) -> None:
    """A tiny Llama checkpoint (bf16, fp32 norm weights) and a word-level tokenizer for it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2 * WORDS, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in NORMS:
            module.float()
    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)


def text_dataset():
    """Fixed texts: STEPS steps of BATCH rows on each of 2 ranks, one epoch."""
    from datasets import Dataset

    words = torch.randint(2, VOCAB, (STEPS * BATCH * 2, WORDS), generator=torch.Generator().manual_seed(0))
    return Dataset.from_list([{"text": " ".join(f"w{i}" for i in row.tolist())} for row in words])


def job(variant: str, root: str, result_path: str) -> None:
    """One rank of a torchrun job; the plugin comes from the launcher where the variant has it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    accelerate_fsdp_on_cpu()
    checkpoint = os.path.join(root, "checkpoint")
    stock = variant == "nomp-stock"
    model = (LlamaForCausalLM if stock else mixed_llama_class()).from_pretrained(checkpoint, dtype=torch.bfloat16)
    loaded = {name: param.dtype for name, param in model.named_parameters()}
    if stock:
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.float()
    if variant.endswith("float"):
        model.float()
    losses = []

    class LossRecordingSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(loss.detach().clone())
            return loss

    arguments = SFTConfig(
        output_dir=os.path.join(root, variant), use_cpu=True, bf16=variant.startswith("mp-"), max_steps=STEPS,
        per_device_train_batch_size=BATCH, learning_rate=1e-2, optim="adamw_torch", seed=0, data_seed=0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    trainer = LossRecordingSFTTrainer(model=model, args=arguments, train_dataset=text_dataset(),
                                      processing_class=AutoTokenizer.from_pretrained(checkpoint))
    trainer.train()

    params = {}
    for name, param in trainer.model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        params[name] = full.detach().clone()
    rank_losses = torch.stack(losses)
    gathered = [torch.empty_like(rank_losses) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rank_losses)
    if dist.get_rank() == 0:
        torch.save({"losses": torch.stack(gathered, dim=1), "params": params, "loaded": loaded,
                    "fsdp": type(trainer.model).__name__}, result_path)


def main() -> int:
    from importlib.metadata import version

    variants = ("mp-plain", "mp-plugin", "mp-float", "nomp-plain", "nomp-plugin", "nomp-auto", "nomp-float",
                "nomp-stock")
    selected = {"nomp-auto": "auto", "nomp-stock": "LlamaRMSNorm"}  # TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE
    results, processes = {}, {}
    with tempfile.TemporaryDirectory() as root:
        save_checkpoint(os.path.join(root, "checkpoint"))
        for variant in variants:
            plugin = variant.endswith("plugin") or variant in selected
            settings = {"TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE": selected[variant]} if variant in selected else None
            processes[variant], results[variant] = launch_job(__file__, variant, root, through_launcher=plugin,
                                                              torchrun=True, settings=settings)
    print(f"torch {torch.__version__}, trl {version('trl')}, transformers {version('transformers')}, "
          f"accelerate {version('accelerate')}, 2 gloo ranks, {STEPS} steps")
    ok = True
    for variant in ("mp-plain", "mp-plugin", "mp-float", "nomp-auto", "nomp-float", "nomp-stock"):
        if results[variant] is None:
            print(processes[variant].stdout[-4000:] + processes[variant].stderr[-8000:])
            print(f"{LABEL}: the {variant} job failed (exit {processes[variant].returncode})")
            ok = False
    if not ok:
        return 1

    loaded = results["mp-plain"]["loaded"]
    fp32 = [name for name, dtype in loaded.items() if dtype == torch.float32]
    print(f"{LABEL}: loaded: {len(fp32)} fp32 norm weights, {len(loaded) - len(fp32)} bf16 parameters; "
          f"the trainer's model {results['mp-plain']['fsdp']}")
    ok = len(fp32) == 5 and all("norm" in name for name in fp32)

    print(f"{LABEL}: bf16=True, without plugin: trains")
    plugin_lines, exact_plugin = compare(f"{LABEL}: bf16=True", results["mp-plugin"], results["mp-plain"],
                                         "without plugin")
    float_lines, exact_float = compare(f"{LABEL}: bf16=True", results["mp-float"], results["mp-plain"],
                                       "without plugin", result_name="model.float()")
    print("\n".join(plugin_lines + float_lines))

    def failed_with(variant: str, text: str) -> bool:
        process = processes[variant]
        return process.returncode != 0 and text in process.stdout + process.stderr

    asserted = failed_with("nomp-plain", ASSERTION)
    print(f"{LABEL}: bf16=False, without plugin: {'AssertionError: ' + ASSERTION if asserted else 'NO ASSERTION'}")
    mismatched = failed_with("nomp-plugin", DTYPE_ERROR)
    print(f"{LABEL}: bf16=False, plugin: {'RuntimeError: ' + DTYPE_ERROR if mismatched else 'NO ERROR'}")
    auto = results["nomp-auto"]
    not_fp32 = [name for name, param in auto["params"].items() if param.dtype != torch.float32]
    print(f"{LABEL}: bf16=False, plugin with TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=auto: trains, "
          f"parameters not fp32: {', '.join(not_fp32) or 'none'}")
    # Note: at step 1 the norm weights are the checkpoint's ones, so an fp32 norm whose output is cast to bf16 gives
    # what the bf16 policy's norm gives: the forward is bf16=True's, bit for bit, the rank's batch being the same.
    first_exact = torch.equal(auto["losses"][0], results["mp-plain"]["losses"][0])
    print(f"{LABEL}: bf16=False, plugin with auto vs bf16=True, step 1 loss on both ranks: "
          f"{'bit for bit' if first_exact else 'differs'}")
    lines, _ = compare(f"{LABEL}: bf16=False", auto, results["nomp-float"], "model.float() (all fp32 compute)",
                       result_name="plugin with auto")
    print("\n".join(lines))

    stock_loaded = results["nomp-stock"]["loaded"]
    stock_fp32 = sum(dtype == torch.float32 for dtype in stock_loaded.values())
    print(f"{LABEL}: bf16=False, stock LlamaForCausalLM: loaded with dtype=torch.bfloat16: {stock_fp32} fp32 "
          f"parameters (the checkpoint's {len(fp32)} fp32 norm weights arrive bf16)")
    lines, exact_stock = compare(f"{LABEL}: bf16=False, stock LlamaForCausalLM, norms made fp32 by hand",
                                 results["nomp-stock"], auto, "plugin with auto",
                                 result_name="plugin with LlamaRMSNorm named")
    print("\n".join(lines))
    ok &= exact_plugin and exact_float and asserted and mismatched and not not_fp32 and first_exact
    return 0 if ok and stock_fp32 == 0 and exact_stock else 1


if __name__ == "__main__":
    run_tool(__doc__, job, main)
