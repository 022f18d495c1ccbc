"""axolotl: FSDP2 through its own ``fsdp2_prepare_model`` (accelerate's FSDP2 path), from a mixed-dtype checkpoint.

    PYTHONPATH=. python tools/integrations/axolotl_train.py    (a python where axolotl is installed)

The checkpoint: a 2-layer ``LlamaForCausalLM`` saved with ``save_pretrained``, embedding and linears bf16, RMSNorm
weights fp32, with a word-level tokenizer and a pre-tokenized JSONL dataset (no download). Each job is one axolotl
run of a YAML config as users write one (``bf16: true``, ``fsdp_version: 2``, ``fsdp_config`` with
``TRANSFORMER_BASED_WRAP`` on ``LlamaDecoderLayer``, AdamW, 4 steps of 2 sequences per rank), started as
``torchrun --nproc-per-node 2`` starts axolotl's training module on 2 gloo ranks:

- ``plain``: no plugin;
- ``plugin``: the same run through ``python -m torch_fsdp_ext.run``;
- ``fp32-norms``: no plugin, ``fp32_norms: true`` (axolotl's own way to keep norms in fp32 under FSDP2).

axolotl is GPU-only as shipped; each rank switches on what its CPU path lacks, as on a GPU: ``ACCELERATE_USE_CPU``
(axolotl resets accelerate's state before building the Accelerator), ``TrainingArguments.use_cpu`` (axolotl has no
key for it), a CPU device mesh (axolotl builds it on "cuda"), and, as tools/integrations/hf_trainer_resume.py does, the
Accelerator's FSDP plugin, with the ``MixedPrecisionPolicy`` that ``bf16: true`` gives it, and ``distributed_type =
FSDP`` (accelerate uses FSDP only on an accelerator). axolotl's final ``save_pretrained`` is skipped: on CPU ranks it
fails in safetensors' shared-tensor check (``Attempted to access the data pointer on an invalid python storage``).

Exit status 1 unless: ``plain`` trains and the model it shards has no fp32 parameter (axolotl loads the checkpoint
in the config's dtype), ``plugin`` has the plugin's dtype fix active and equals ``plain`` bit for bit (losses of
both ranks, every full parameter), and ``fp32-norms`` trains with every RMSNorm weight fp32 and every other parameter
bf16.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from _jobs import launch_job, run_tool  # this script's folder

STEPS, BATCH, SEQ_LEN, VOCAB = 4, 2, 16, 64
VARIANTS = ("plain", "plugin", "fp32-norms")

CONFIG = """\
base_model: {root}/model
tokenizer_config: {root}/model
model_type: LlamaForCausalLM
datasets:
  - path: {root}/data.jsonl
    ds_type: json
    type: completion
dataset_prepared_path: {root}/prepared
dataset_num_proc: 1
val_set_size: 0
sequence_len: {seq_len}
sample_packing: false
micro_batch_size: {batch}
gradient_accumulation_steps: 1
max_steps: {steps}
num_epochs: 1
optimizer: adamw_torch
lr_scheduler: constant
learning_rate: 0.01
bf16: true
seed: 0
logging_steps: 1
save_strategy: "no"
output_dir: {root}/output-{variant}
fsdp_version: 2
fsdp_config:
  auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: LlamaDecoderLayer
  state_dict_type: FULL_STATE_DICT
  reshard_after_forward: true
"""


def write_inputs(root: str) -> None:
    """The checkpoint (bf16, fp32 RMSNorm weights), its tokenizer and the dataset."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"t{i}": i for i in range(4, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(os.path.join(root, "model"))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.float()
    model.save_pretrained(os.path.join(root, "model"))
    rows = torch.randint(4, VOCAB, (STEPS * BATCH * 2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with open(os.path.join(root, "data.jsonl"), "w") as data:
        for row in rows.tolist():
            data.write(json.dumps({"input_ids": row, "attention_mask": [1] * SEQ_LEN, "labels": row}) + "\n")


def fsdp_on_cpu() -> None:
    """What axolotl's GPU path gets from the machine, given to CPU ranks (see the module's docstring)."""
    os.environ["ACCELERATE_USE_CPU"] = "true"
    import transformers.trainer
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType
    from transformers import TrainingArguments

    post_init = TrainingArguments.__post_init__

    def post_init_on_cpu(self):
        self.use_cpu = True
        post_init(self)

    TrainingArguments.__post_init__ = post_init_on_cpu
    build_device_mesh = ParallelismConfig.build_device_mesh
    ParallelismConfig.build_device_mesh = lambda self, device_type: build_device_mesh(self, "cpu")

    def accelerator_with_fsdp(**kwargs):
        accelerator = Accelerator(**kwargs)
        fsdp_plugin = kwargs["fsdp_plugin"]
        if accelerator.state.mixed_precision != "no":  # as accelerate's state does for FSDP on a GPU
            fsdp_plugin.set_mixed_precision(accelerator.state.mixed_precision)
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = fsdp_plugin
        return accelerator

    transformers.trainer.Accelerator = accelerator_with_fsdp


def record(result_path: str) -> None:
    """Make axolotl's trainer save, on rank 0, both ranks' losses, the dtypes of the parameters it shards and every
    full parameter after training; skip the final save (see the module's docstring)."""
    import axolotl.train
    import torch.distributed as dist
    from axolotl.core.trainers.base import AxolotlTrainer

    from _model import full_params

    losses = []
    training_step, train = AxolotlTrainer.training_step, AxolotlTrainer.train

    def recording_training_step(self, *args, **kwargs):
        loss = training_step(self, *args, **kwargs)
        losses.append(loss.detach().clone())
        return loss

    def recording_train(self, *args, **kwargs):
        loaded = {name: param.dtype for name, param in self.model.named_parameters()}
        output = train(self, *args, **kwargs)
        rank_losses = torch.stack(losses)
        gathered = [torch.empty_like(rank_losses) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, rank_losses)
        params = full_params(self.model)
        plugin = sys.modules.get("torch_fsdp_ext")
        dtype_fix = plugin.status().fixes["dtype"] if plugin is not None else None
        if dist.get_rank() == 0:
            torch.save({"losses": gathered, "params": params, "loaded": loaded,
                        "dtype_fix": dtype_fix and (dtype_fix.active, dtype_fix.details["upcast"]["params"])},
                       result_path)
        return output

    AxolotlTrainer.training_step = recording_training_step
    AxolotlTrainer.train = recording_train
    axolotl.train.save_trained_model = lambda *args, **kwargs: None


def job(variant: str, root: str, result_path: str) -> None:
    """One rank of an axolotl run (torchrun starts both)."""
    config_path = os.path.join(root, f"{variant}.yml")
    fsdp_on_cpu()
    record(result_path)
    from axolotl.cli.train import do_cli

    sys.argv = sys.argv[:1]  # axolotl parses its own command-line arguments too
    do_cli(config_path)


def main() -> int:
    from importlib.metadata import version

    os.environ.update(AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    with tempfile.TemporaryDirectory() as root:
        write_inputs(root)
        from safetensors.torch import load_file

        checkpoint = load_file(os.path.join(root, "model", "model.safetensors"))
        checkpoint_fp32 = [name for name, tensor in checkpoint.items() if tensor.dtype == torch.float32]
        for variant in VARIANTS:
            config = CONFIG.format(root=root, variant=variant, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN)
            with open(os.path.join(root, f"{variant}.yml"), "w") as file:
                file.write(config + ("fp32_norms: true\n" if variant == "fp32-norms" else ""))
        results = {}
        for variant in VARIANTS:
            process, results[variant] = launch_job(__file__, variant, root, through_launcher=variant == "plugin",
                                                   torchrun=True)
            if process.returncode != 0 or results[variant] is None:
                print(process.stdout[-4000:] + process.stderr[-8000:])
                print(f"axolotl: the {variant} job failed (exit {process.returncode})")
                return 1

    print(f"torch {torch.__version__}, axolotl {version('axolotl')}, transformers {version('transformers')}, "
          f"accelerate {version('accelerate')}, 2 gloo ranks, {STEPS} steps")
    plain, plugin, fp32_norms = (results[variant] for variant in VARIANTS)
    plain_fp32 = [name for name, dtype in plain["loaded"].items() if dtype == torch.float32]
    as_bf16 = [name for name in checkpoint_fp32 if plain["loaded"].get(name) == torch.bfloat16]
    losses = ", ".join(f"{a.item():.6f}/{b.item():.6f}" for a, b in zip(*plain["losses"]))
    print(f"axolotl: without plugin: trains (rank 0/1 losses {losses}); fp32 parameters it shards: "
          f"{len(plain_fp32)} (of the checkpoint's {len(checkpoint_fp32)} fp32 RMSNorm weights, {len(as_bf16)} load "
          f"as bf16)")
    same_losses = all(torch.equal(a, b) for a, b in zip(plugin["losses"], plain["losses"]))
    names = plain["params"].keys()
    equal = [n for n in names if n in plugin["params"] and torch.equal(plugin["params"][n], plain["params"][n])]
    exact = same_losses and len(equal) == len(names) and plugin["params"].keys() == names
    active, upcast = plugin["dtype_fix"] or (False, None)
    print(f"axolotl: plugin vs without plugin: {'bit for bit' if exact else 'DIFFERENT'} "
          f"(losses of both ranks; {len(equal)}/{len(names)} params); dtype fix active: {'yes' if active else 'NO'}, "
          f"parameters it upcast: {upcast}")
    norms_fp32 = [n for n in checkpoint_fp32 if fp32_norms["params"][n].dtype == torch.float32]
    others_bf16 = all(p.dtype == torch.bfloat16 for n, p in fp32_norms["params"].items() if n not in checkpoint_fp32)
    print(f"axolotl: fp32_norms: true, without plugin: trains; {len(norms_fp32)}/{len(checkpoint_fp32)} RMSNorm "
          f"weights fp32, every other parameter bf16: {'yes' if others_bf16 else 'NO'}")
    loads_uniform = not plain_fp32 and len(as_bf16) == len(checkpoint_fp32)
    plugin_inert = exact and active and not (plain["dtype_fix"] or (False,))[0]
    return 0 if loads_uniform and plugin_inert and len(norms_fp32) == len(checkpoint_fp32) and others_bf16 else 1


if __name__ == "__main__":
    run_tool(__doc__, job, main)
