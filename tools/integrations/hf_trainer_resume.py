"""HF Trainer ``resume_from_checkpoint`` under accelerate's FSDP2 path, bit for bit, with the plugin.

    PYTHONPATH=. python tools/integrations/hf_trainer_resume.py

Model: peft LoRA (r=4 on ``q_proj``/``v_proj``, fp32 adapters) on an all-bf16 2-layer ``LlamaForCausalLM`` from a
``LlamaConfig`` (no download), its RMSNorms trained as bf16 copies (``modules_to_save``): fp32 and bf16 trainable
parameters in one FSDP group. ``transformers.Trainer`` trains it with ``fsdp="full_shard"``,
``fsdp_config={"fsdp_version": 2, ...}`` and no mixed precision (accelerate's case that meets FSDP's uniform-dtype
assertion), AdamW with a linear schedule, on 2 gloo ranks, 4 optimizer steps over a fixed token dataset.

Two jobs with the plugin (``import torch_fsdp_ext`` on every rank): an uninterrupted 4-step run (``save_steps=2``,
``SHARDED_STATE_DICT``: accelerate's DCP checkpoints of model and optimizer) and a second run that resumes with
``trainer.train(resume_from_checkpoint=".../checkpoint-2")`` and trains steps 3-4. The table compares both ranks'
losses of steps 3-4 (as ``compute_loss`` returned them, unrounded) and every full parameter after step 4; the exit
status is 1 unless they are equal bit for bit and every trainable parameter is fp32 after the resume.

There is no hand-workaround run: without mixed precision, the workaround (trainable parameters cast to fp32) feeds
the fp32 norms' fp32 output into the bf16 base's ``q_proj`` and stops at the first forward (``expected m1 and m2 to
have the same dtype``), while the plugin keeps each module's compute dtype as loaded.

accelerate turns FSDP on only on an accelerator (on CPU it falls back to DDP without a word); as its GPU branch does,
the Accelerator the Trainer creates gets ``distributed_type = FSDP`` and the Trainer's FSDP plugin set by hand
(``integrations/_accelerate.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from _accelerate import accelerate_fsdp_on_cpu  # this script's folder
from _resume_table import HEADER, compare

STEPS = 4
RESUME_STEP = 2
VOCAB, SEQ_LEN, BATCH = 64, 16, 2
NORMS = ["input_layernorm", "post_attention_layernorm"]


def mixed_lora_llama():
    """peft LoRA (fp32 adapters) on an all-bf16 2-layer Llama, the RMSNorms trainable bf16 copies (modules_to_save)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=NORMS)
    return get_peft_model(base, lora)


def token_dataset():
    """Fixed sequences, enough for STEPS steps of BATCH per rank on 2 ranks in one epoch."""
    import torch

    tokens = torch.randint(0, VOCAB, (STEPS * BATCH * 2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in tokens]


def rank_job(phase: str, output_dir: str, result_path: str) -> None:
    import torch_fsdp_ext  # noqa: F401
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import Trainer, TrainingArguments

    accelerate_fsdp_on_cpu()
    losses = []

    class LossRecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(loss.detach().clone())
            return loss

    arguments = TrainingArguments(
        output_dir=output_dir, use_cpu=True, max_steps=STEPS, save_steps=RESUME_STEP, save_strategy="steps",
        per_device_train_batch_size=BATCH, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=0,
        optim="adamw_torch", logging_steps=1, report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
        fsdp="full_shard", fsdp_config={
            "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT",
        },
        disable_tqdm=True,
    )
    trainer = LossRecordingTrainer(model=mixed_lora_llama(), args=arguments, train_dataset=token_dataset())
    resume = os.path.join(output_dir, f"checkpoint-{RESUME_STEP}") if phase == "resumed" else None
    trainer.train(resume_from_checkpoint=resume)

    params = {}
    for name, param in trainer.model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        params[name] = full.detach().clone()
    first_step = RESUME_STEP + 1 if phase == "resumed" else 1
    rank_losses = torch.stack(losses)
    gathered = [torch.empty_like(rank_losses) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rank_losses)
    if dist.get_rank() == 0:
        per_step = {first_step + i: torch.stack([g[i] for g in gathered]) for i in range(len(losses))}
        trainable = {n: params[n] for n, p in trainer.model.named_parameters() if p.requires_grad}
        torch.save(
            {"losses": per_step, "params": params, "trainable": trainable, "fsdp": type(trainer.model).__name__},
            result_path,
        )


def launch(phase: str, output_dir: str, result_path: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        os.path.abspath(__file__), "--rank-job", phase, output_dir, result_path,
    ]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        sys.stderr.write(completed.stdout[-4000:] + completed.stderr[-8000:])
        raise SystemExit(f"{phase} job failed (exit status {completed.returncode})")


def main() -> int:
    from importlib.metadata import version

    import torch

    with tempfile.TemporaryDirectory() as root:
        results = {}
        for phase in ("uninterrupted", "resumed"):
            path = os.path.join(root, f"{phase}.pt")
            launch(phase, os.path.join(root, "output"), path)
            results[phase] = torch.load(path)

    row, exact = compare("plugin: resumed vs uninterrupted", results["resumed"], results["uninterrupted"],
                         range(RESUME_STEP + 1, STEPS + 1))
    not_fp32 = [n for n, p in results["resumed"]["trainable"].items() if p.dtype != torch.float32]
    print(f"torch {torch.__version__}, transformers {version('transformers')}, accelerate {version('accelerate')}, "
          f"peft {version('peft')}, 2 gloo ranks, model {results['resumed']['fsdp']}, {STEPS} steps, "
          f"resume from step {RESUME_STEP}")
    print(HEADER)
    print(row)
    print(f"trainable parameters not fp32 after the resume: {', '.join(not_fp32) or 'none'}")
    return 0 if exact and not not_fp32 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-job", nargs=3, metavar=("PHASE", "OUTPUT_DIR", "RESULT"))
    arguments = parser.parse_args()
    if arguments.rank_job:
        rank_job(*arguments.rank_job)
        from torch_fsdp_ext._rank_end import end_rank  # the rank job imported the plugin already

        end_rank()
    sys.exit(main())
