"""torchtitan 0.3.0: a ``CheckpointManager`` resume of a mixed-dtype Llama, bit for bit, with the plugin.

    PYTHONPATH=. python tools/integrations/torchtitan_resume.py

Model: torchtitan's ``debugmodel`` Llama 3 flavour cut to 2 layers, parameters in bf16 with the RMSNorm weights in
fp32 (a bf16 checkpoint that keeps its norms in fp32), parallelised by torchtitan's own ``parallelize_llama`` (full
activation checkpointing, FSDP2 with ``MixedPrecisionPolicy(bf16, fp32)``, ``tok_embeddings`` its own FSDP unit) on 2
gloo ranks, torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``, one fixed-seed synthetic batch
per rank and step.

Two ways to train it, each as an uninterrupted 4-step job (its ``CheckpointManager`` saves at steps 2 and 4) and as a
second job that resumes from the step-2 checkpoint and trains steps 3-4:

- ``plugin``: ``import torch_fsdp_ext`` on every rank, the mixed model as loaded;
- ``workaround``: no plugin, ``model.float()`` before ``parallelize_llama``.

The table compares losses and parameters (every full tensor after step 4) of the resumed jobs with the uninterrupted
ones, and the plugin's with the workaround's; the exit status is 1 unless all are equal bit for bit and every
parameter is fp32 after the resume.

torchtitan's trainer needs CUDA, so this builds the pieces it assembles, on CPU: the mesh's device type is "cpu",
gloo has no PREMUL_SUM (``set_force_sum_reduction_for_comms(True)``), attention is ``ScaledDotProductAttention``
(FlexAttention has no CPU backward), the ``partial_dtensor`` backend (``spmd_types`` needs torch 2.15). torchtitan's
expert-parallel dispatcher imports Triton kernels at import time; a dense Llama never calls them, so without Triton
that one module is replaced by placeholders that raise when called.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import types

from _resume_table import HEADER, compare  # this script's folder

STEPS = 4
RESUME_STEP = 2
VARIANTS = ("plugin", "workaround")
BATCH, SEQ_LEN = 2, 32


def stub_expert_parallel_kernels() -> None:
    """Note: torchtitan.models.common imports the MoE dispatcher, whose kernels module imports Triton."""
    if importlib.util.find_spec("triton") is not None:
        return
    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def needs_triton(*args, **kwargs):
        raise RuntimeError("torchtitan's expert-parallel kernels need Triton")

    for name in (
        "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
    ):
        setattr(kernels, name, needs_triton)
    sys.modules[kernels.__name__] = kernels


def llama_config():
    """torchtitan's debugmodel with 2 layers, SDPA attention and a RoPE cache of SEQ_LEN."""
    import dataclasses

    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    return config


def build(variant: str):
    """The model as loaded (bf16, fp32 norms), parallelised the way torchtitan's trainer does it."""
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common import RMSNorm
    from torchtitan.models.llama3 import parallelize_llama

    torch.manual_seed(0)
    model = llama_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            param.data = param.data.to(torch.float32 if isinstance(module, RMSNorm) else torch.bfloat16)
    if variant == "workaround":
        model.float()

    parallel_dims_module.device_type = "cpu"  # Note: torchtitan picks "cuda" when no accelerator is present
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=dist.get_world_size(), cp=1, tp=1, pp=1, ep=1,
        world_size=dist.get_world_size(), spmd_backend="partial_dtensor",
    )
    parallel_dims.build_mesh()
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="bfloat16", mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=False),
        ac_config=FullAC.Config(),
        dump_folder=tempfile.gettempdir(),
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # Note: gloo has no PREMUL_SUM
    return model


def rank_job(variant: str, phase: str, folder: str, result_path: str) -> None:
    if variant == "plugin":
        import torch_fsdp_ext  # noqa: F401
    stub_expert_parallel_kernels()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(variant)
    model.train()
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=folder, interval=RESUME_STEP, keep_latest_k=0),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={}, sd_adapter=None,
    )
    first_step = 1
    if phase == "resumed":
        assert checkpointer.load(step=RESUME_STEP), f"no checkpoint at step {RESUME_STEP} in {folder}"
        first_step = RESUME_STEP + 1

    vocab = model.config.vocab_size
    losses = {}
    for step in range(first_step, STEPS + 1):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, vocab, (BATCH, SEQ_LEN + 1), generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        losses[step] = loss.detach().clone()
        if phase == "uninterrupted":
            checkpointer.save(step)
    checkpointer.close()

    params = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        params[name] = full.detach().clone()
    if rank == 0:
        torch.save({"losses": losses, "params": params}, result_path)


def launch(variant: str, phase: str, folder: str, result_path: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        os.path.abspath(__file__), "--rank-job", variant, phase, folder, result_path,
    ]
    plugin_off = {} if variant == "plugin" else {"TORCH_FSDP_EXT_DISABLE": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **plugin_off})
    if completed.returncode != 0:
        sys.stderr.write(completed.stdout[-4000:] + completed.stderr[-8000:])
        raise SystemExit(f"{variant} {phase} job failed (exit status {completed.returncode})")


def main() -> int:
    import torch

    with tempfile.TemporaryDirectory() as root:
        results = {}
        for variant in VARIANTS:
            for phase in ("uninterrupted", "resumed"):
                path = os.path.join(root, f"{variant}-{phase}.pt")
                launch(variant, phase, os.path.join(root, f"checkpoints-{variant}"), path)
                results[variant, phase] = torch.load(path)

    resumed_steps = range(RESUME_STEP + 1, STEPS + 1)
    rows = [
        compare("plugin: resumed vs uninterrupted", results["plugin", "resumed"],
                results["plugin", "uninterrupted"], resumed_steps),
        compare("workaround: resumed vs uninterrupted", results["workaround", "resumed"],
                results["workaround", "uninterrupted"], resumed_steps),
        compare("uninterrupted: plugin vs workaround", results["plugin", "uninterrupted"],
                results["workaround", "uninterrupted"], range(1, STEPS + 1)),
        compare("resumed: plugin vs workaround", results["plugin", "resumed"],
                results["workaround", "resumed"], resumed_steps),
    ]
    not_fp32 = [n for n, p in results["plugin", "resumed"]["params"].items() if p.dtype != torch.float32]
    print(f"torch {torch.__version__}, torchtitan {version('torchtitan')}, 2 gloo ranks, "
          f"{STEPS} steps, resume from step {RESUME_STEP}")
    print(HEADER)
    for row, _ in rows:
        print(row)
    print(f"parameters not fp32 after the plugin's resume: {', '.join(not_fp32) or 'none'}")
    return 0 if all(exact for _, exact in rows) and not not_fp32 else 1


def version(package: str) -> str:
    from importlib.metadata import version as installed_version

    return installed_version(package)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-job", nargs=4, metavar=("VARIANT", "PHASE", "FOLDER", "RESULT"))
    arguments = parser.parse_args()
    if arguments.rank_job:
        rank_job(*arguments.rank_job)
        from torch_fsdp_ext._rank_end import end_rank  # installs nothing where TORCH_FSDP_EXT_DISABLE=1

        end_rank()
    sys.exit(main())
