"""NeMo Automodel 0.7.0: a mixed-dtype HF Llama sharded by NeMo's own parallelizers, with the plugin.

    PYTHONPATH=. python tools/integrations/nemo_automodel_parallelize.py

Each job runs under ``torchrun --nproc-per-node 2`` on gloo and builds, per run, the mesh NeMo builds for FSDP2
(``MeshContext.build(FSDP2Config(), ParallelismSizes(dp_size=2))``, NeMo's default policy
``MixedPrecisionPolicy(bf16, fp32)``) and a tiny ``LlamaForCausalLM`` (2 layers, vocab 32, hidden 32) in bf16 with
its RMSNorm weights in fp32, as a checkpoint of that kind loads, sharded by ``parallelize_model(model,
mesh_context)``: NeMo's dense ``ModelParallelizer``, ``fully_shard`` per decoder layer, on the untied input and
output embeddings, and at the root. AdamW, 4 steps, one fixed batch per rank and step. Runs, by job:

- ``reference`` (no plugin): ``workaround``, ``model.float()`` before ``parallelize_model``; ``by-dtype``, NeMo's own
  answer to mixed dtypes, its Qwen3.5 sidecar (``Qwen3_5ModelParallelizer``: the dense parallelizer with
  ``fully_shard_by_dtype`` per decoder layer, each layer's fp32 norms in FSDP units of their own that compute in the
  policy's bf16); ``plain``, the mixed model as loaded, which must fail with FSDP2's uniform-dtype assertion;
- ``plugin`` (``import torch_fsdp_ext``): ``upcast`` (the default strategy), then ``preserve``
  (``torch_fsdp_ext.install(dtype_strategy="preserve")``), then both again with NeMo's
  ``patch_fsdp_uniform_reduce_dtype()`` (its replacement of FSDP's ``foreach_reduce``) applied after
  ``parallelize_model`` and before the first forward, where NeMo's MoE parallelizer applies it;
- ``late`` (the plugin, ``TORCH_FSDP_EXT_DTYPE_STRATEGY=preserve``): NeMo's patch applied after the first step.

FSDP units are counted on rank 0 as the modules that are ``FSDPModule`` instances after parallelizing (one per
``fully_shard`` call).

Exit status 1 unless: plain fails with the assertion; upcast's 4 steps (both ranks' losses and every full parameter)
equal the workaround's bit for bit, with and without NeMo's patch; preserve's equal by-dtype's bit for bit, with and
without NeMo's patch; and the late patch is refused at the next backward with the plugin's error naming it.
"""

from __future__ import annotations

import gc
import tempfile

import torch

from _jobs import ASSERTION, launch_job, run_tool  # this script's folder
from _model import VOCAB, compare, full_params, gathered_losses, lm_loss, tokens

STEPS = 4
LABEL = "nemo-automodel"


def llama() -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM`` (no download) in bf16 with fp32 RMSNorm weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.float()
    return model


def run(rank: int, run_name: str, patch_after: str | None = None) -> dict:
    """One run: the model parallelized by NeMo (``model.float()`` first for ``workaround``, NeMo's Qwen3.5 sidecar
    for ``by-dtype``), NeMo's ``foreach_reduce`` patch applied after ``parallelize`` or after the ``first step`` if
    ``patch_after`` says so, 4 steps; the losses, full parameters and the number of FSDP units."""
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.fsdp_patches import patch_fsdp_uniform_reduce_dtype
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from nemo_automodel.components.models.qwen3_5.parallelization import PARALLELIZER as QWEN3_5_PARALLELIZER
    from torch.distributed.fsdp import FSDPModule

    mesh_context = MeshContext.build(FSDP2Config(), ParallelismSizes(dp_size=2))
    model = llama()
    if run_name == "workaround":
        model.float()
    parallelize = QWEN3_5_PARALLELIZER.parallelize if run_name == "by-dtype" else parallelize_model
    model = parallelize(model, mesh_context)
    units = sum(isinstance(module, FSDPModule) for module in model.modules())
    if patch_after == "parallelize":
        patch_fsdp_uniform_reduce_dtype()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        data = tokens(rank, step)
        loss = lm_loss(model(input_ids=data).logits, data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        if patch_after == "first step" and step == 0:
            patch_fsdp_uniform_reduce_dtype()
    return {"losses": gathered_losses(losses), "params": full_params(model), "units": units}


def collected(rank: int, *args, **kwargs) -> dict:
    """``run``, then the cyclic garbage collected: nothing of its model is alive after it."""
    try:
        return run(rank, *args, **kwargs)
    finally:
        gc.collect()


def job(variant: str, root: str, result_path: str) -> None:
    """One rank of a torchrun job. Note: each run's model is collected (``gc.collect()``) before the next is
    built: the plugin's ``foreach_reduce`` wrapper lives as long as a ``preserve`` group does, and NeMo's patch
    applied while it is in place goes on top of it (refused at the backward: ``late``)."""
    if variant in ("plugin", "late"):
        import torch_fsdp_ext  # installs the fixes this torch needs (the strategy from the environment)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    if variant == "reference":
        results["workaround"] = collected(rank, "workaround")
        results["by-dtype"] = collected(rank, "by-dtype")
        try:
            collected(rank, "plain")
        except AssertionError as error:
            results["plain"] = f"AssertionError: {error}"
    elif variant == "plugin":
        results["upcast"] = collected(rank, "upcast")
        torch_fsdp_ext.install(dtype_strategy="preserve")
        results["preserve"] = collected(rank, "preserve")
        results["preserve, patched"] = collected(rank, "preserve", patch_after="parallelize")
        torch_fsdp_ext.install(dtype_strategy="upcast")
        results["upcast, patched"] = collected(rank, "upcast")  # NeMo's patch stays in place: it has no undo
    else:
        try:
            collected(rank, "preserve", patch_after="first step")
        except RuntimeError as error:
            results["refused"] = f"RuntimeError: {error}"
    if rank == 0:
        torch.save(results, result_path)


def main() -> int:
    from importlib.metadata import version

    with tempfile.TemporaryDirectory() as root:
        processes, results = {}, {}
        for variant, settings in (("reference", {}), ("plugin", {}),
                                  ("late", {"TORCH_FSDP_EXT_DTYPE_STRATEGY": "preserve"})):
            processes[variant], results[variant] = launch_job(__file__, variant, root, torchrun=True,
                                                              settings=settings)
    for variant in ("reference", "plugin", "late"):
        if processes[variant].returncode != 0 or results[variant] is None:
            print(processes[variant].stdout + processes[variant].stderr)
            print(f"{LABEL}: the {variant} job failed (exit {processes[variant].returncode})")
            return 1
    reference, plugin = results["reference"], results["plugin"]
    print(f"torch {torch.__version__}, nemo_automodel {version('nemo_automodel')}, transformers "
          f"{version('transformers')}, 2 gloo ranks, {STEPS} steps")
    failed = reference.get("plain", "").startswith(f"AssertionError: {ASSERTION}")
    print(f"{LABEL}: without plugin: {'AssertionError: ' + ASSERTION if failed else 'NO ASSERTION'}")
    preserve_units, by_dtype_units = plugin["preserve"]["units"], reference["by-dtype"]["units"]
    lines = [
        compare(LABEL, plugin["upcast"], reference["workaround"], "model.float()"),
        compare(f"{LABEL}: preserve ({preserve_units} FSDP units)", plugin["preserve"], reference["by-dtype"],
                f"fully_shard_by_dtype ({by_dtype_units} FSDP units)"),
        compare(f"{LABEL}: NeMo's foreach_reduce patch before the first forward, upcast", plugin["upcast, patched"],
                reference["workaround"], "model.float()"),
        compare(f"{LABEL}: NeMo's foreach_reduce patch before the first forward, preserve",
                plugin["preserve, patched"], reference["by-dtype"], "fully_shard_by_dtype"),
    ]
    for comparison, _ in lines:
        print("\n".join(comparison))
    refusal = results["late"].get("refused", "")
    refused = "torch_fsdp_ext refuses" in refusal
    print(f"{LABEL}: NeMo's foreach_reduce patch after the first step, preserve: "
          f"{refusal if refused else 'NOT REFUSED'}")
    return 0 if failed and all(exact for _, exact in lines) and refused else 1


if __name__ == "__main__":
    run_tool(__doc__, job, main)
