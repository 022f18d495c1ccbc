"""torchtune 0.6.1: a mixed-dtype Llama 3 sharded and loaded the way its distributed recipes do it, with the plugin.

    PYTHONPATH=. python tools/integrations/torchtune_shard.py

torchtune's stock recipes (``full_finetune_distributed``) need NCCL, so each job runs the recipe's own steps under
``torchrun --nproc-per-node 2`` on gloo: the model built on the meta device under ``training.set_default_dtype(bf16)``
(a tiny ``llama3``: 2 layers, vocab 32, dim 32), ``training.shard_model`` with ``training.get_shard_conditions`` (no
``MixedPrecisionPolicy``: FSDP2 computes in the parameters' own dtypes), RoPE initialised, then
``training.load_from_full_model_state_dict`` from a checkpoint that keeps its RMSNorm scales in fp32 (everything
else bf16); AdamW, 3 steps, one fixed batch per rank and step.

That loader casts every checkpoint tensor to the parameter's dtype, so the recipe as shipped trains pure bf16 and
mixed dtypes never reach ``fully_shard``. Keeping the fp32 norms means making them fp32 on the meta model:

- ``plain``: no plugin; FSDP2's uniform-dtype assertion is expected;
- ``plugin``: ``import torch_fsdp_ext`` (strategy ``upcast``): fp32 masters, and with no ``param_dtype`` each
  parameter is all-gathered in its loaded dtype, so bf16 weights compute in bf16 and the norms in fp32;
- ``workaround``: no plugin, the whole meta model fp32 (``model.float()``): everything computes in fp32, so its
  losses differ from the plugin's by design (reported, not required equal).

Then ``lora_llama3`` (adapters on q_proj and v_proj) with fp32 adapters on a frozen bf16 base, same set-up:

- ``lora-plain`` and ``lora-plugin``: the bf16 activations meet the fp32 adapter weights in the first forward
  (``expected m1 and m2 to have the same dtype``), as without FSDP;
- ``lora-compute``: the plugin with ``TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=lora_a,lora_b``: the adapters compute
  in fp32 with casts at their boundaries. ``lora_b`` starts at zero, so the first loss is the bf16 base model's.

Exit status 1 unless plain fails with the assertion, the plugin's first loss on every rank equals the loss of the
same checkpoint loaded into an unsharded model with the same dtypes on one process bit for bit, every parameter
is fp32 after the plugin's steps, both LoRA jobs fail with that error, and the LoRA job with the setting trains,
its first loss on every rank equal to the unsharded bf16 base model's bit for bit.
"""

from __future__ import annotations

import tempfile

import torch

from _jobs import ASSERTION, launch_job, launch_jobs, run_tool  # this script's folder
from _model import VOCAB, compare, full_params, gathered_losses, lm_loss, losses_text, tokens, train_steps

STEPS = 3
LORA_ERROR = "expected m1 and m2 to have the same dtype"


def llama(device: str | torch.device, lora: bool = False):
    """A tiny ``llama3``, or ``lora_llama3`` with adapters on q_proj and v_proj."""
    from torchtune.models.llama3 import llama3, lora_llama3

    sizes = dict(vocab_size=VOCAB, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, max_seq_len=16)
    with torch.device(device):
        if lora:
            return lora_llama3(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8.0, **sizes)
        return llama3(**sizes)


def keep_norms_fp32(model: torch.nn.Module) -> None:
    from torchtune.modules import RMSNorm

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.float()


def make_fp32(model: torch.nn.Module, lora: bool) -> None:
    """The parameters kept in fp32: the RMSNorm scales, or with ``lora`` the adapters (the base frozen)."""
    if not lora:
        keep_norms_fp32(model)
        return
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    for name, module in model.named_modules():
        if name.endswith(("lora_a", "lora_b")):
            module.float()
    set_trainable_params(model, get_adapter_params(model))


def checkpoint(lora: bool) -> dict[str, torch.Tensor]:
    """The full state dict on disk, bf16 but what ``make_fp32`` keeps in fp32 (the same on every rank)."""
    torch.manual_seed(0)
    model = llama("cpu", lora).to(torch.bfloat16)
    make_fp32(model, lora)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def job(variant: str, root: str, result_path: str) -> None:
    """One rank of a torchrun job."""
    if variant.endswith(("plugin", "compute")):
        import torch_fsdp_ext  # noqa: F401  (installs the fixes this torch needs)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtune import training

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    lora = variant.startswith("lora")
    full_sd = checkpoint(lora)

    # The recipe's _setup_model, on CPU and gloo.
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
        model = llama("meta", lora)
    if variant == "workaround":
        model.float()
    else:
        make_fp32(model, lora)
    training.shard_model(model, [training.get_shard_conditions], cpu_offload=False, dp_mesh=mesh)
    with training.set_default_dtype(torch.bfloat16), torch.device("cpu"):
        for module in model.modules():
            if hasattr(module, "rope_init"):  # RoPE buffers are not in the state dict
                module.rope_init()
    training.load_from_full_model_state_dict(model, dict(full_sd), torch.device("cpu"), strict=True)

    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-2)
    losses = gathered_losses(train_steps(model, optimizer, rank, range(STEPS)))

    # The reference for the first step: the checkpoint in an unsharded model with the same dtypes, one process
    # (built under the recipe's default dtype, as its RoPE cache was). LoRA's lora_b starts at zero, so there the
    # reference is the bf16 base model without adapters.
    with training.set_default_dtype(torch.bfloat16):
        unsharded = llama("cpu")
    if variant == "workaround":
        unsharded.float()
    elif not lora:
        keep_norms_fp32(unsharded)
    unsharded.load_state_dict({name: tensor for name, tensor in full_sd.items() if "lora_" not in name})
    with torch.no_grad():
        first_reference = lm_loss(unsharded(tokens(rank, 0)), tokens(rank, 0))
    first_references = gathered_losses([first_reference])[0]
    not_fp32 = [name for name, param in model.named_parameters() if param.dtype != torch.float32]
    params = full_params(model)
    if rank == 0:
        torch.save({"losses": losses, "params": params, "first_references": first_references,
                    "first_equal_on_every_rank": torch.equal(losses[0], first_references), "not_fp32": not_fp32},
                   result_path)


def first_loss_lines(label: str, result: dict, name: str, reference_name: str) -> list[str]:
    """Each rank's step-1 loss: ``name``'s and the unsharded reference's."""
    return [f"{label}:   rank {rank} losses: {name} {losses_text(result['losses'][:1, rank])}; {reference_name} "
            f"{losses_text(result['first_references'][rank:rank + 1])}" for rank in range(result["losses"].shape[1])]


def main() -> int:
    from importlib.metadata import version

    label = "torchtune"
    with tempfile.TemporaryDirectory() as root:
        plain, _ = launch_job(__file__, "plain", root, torchrun=True)
        results = launch_jobs(__file__, label, ("plugin", "workaround"), root, torchrun=True)
    if results is None:
        return 1
    print(f"torch {torch.__version__}, torchtune {version('torchtune')}, torchao {version('torchao')}, "
          f"2 gloo ranks, {STEPS} steps")
    failed = plain.returncode != 0 and ASSERTION in plain.stdout + plain.stderr
    print(f"{label}: without plugin: {'AssertionError: ' + ASSERTION if failed else 'NO ASSERTION'}")
    plugin, workaround = results["plugin"], results["workaround"]
    first = "bit for bit" if plugin["first_equal_on_every_rank"] else "DIFFERENT"
    print(f"{label}: plugin vs the checkpoint unsharded in its loaded dtypes (one process), step 1 loss on every "
          f"rank: {first}")
    print("\n".join(first_loss_lines(label, plugin, "plugin", "unsharded")))
    lines, _ = compare(label, plugin, workaround, "model.float() (all fp32 compute)")
    print("\n".join(lines))
    print(f"{label}: parameters not fp32 after the plugin's steps: {', '.join(plugin['not_fp32']) or 'none'}")
    ok = failed and plugin["first_equal_on_every_rank"] and not plugin["not_fp32"]

    # fp32 LoRA adapters on a frozen bf16 base: the bf16 activations meet the fp32 adapter weights.
    with tempfile.TemporaryDirectory() as root:
        outcomes = {}
        for variant in ("lora-plain", "lora-plugin"):
            process, _ = launch_job(__file__, variant, root, torchrun=True)
            outcomes[variant] = process.returncode != 0 and LORA_ERROR in process.stdout + process.stderr
        process, compute = launch_job(__file__, "lora-compute", root, torchrun=True,
                                      settings={"TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE": "lora_a,lora_b"})
    for variant, name in (("lora-plain", "without plugin"), ("lora-plugin", "plugin")):
        print(f"{label}: fp32 LoRA on a frozen bf16 base, {name}: "
              f"{'RuntimeError: ' + LORA_ERROR if outcomes[variant] else 'NO ERROR'}")
    trains = process.returncode == 0 and compute is not None and compute["first_equal_on_every_rank"]
    print(f"{label}: fp32 LoRA on a frozen bf16 base, plugin with TORCH_FSDP_EXT_COMPUTE_IN_LOADED_DTYPE=lora_a,"
          f"lora_b: {'trains' if trains else 'FAILS'}, step 1 loss on every rank bit for bit with the bf16 base "
          "unsharded")
    if compute is not None:
        print("\n".join(first_loss_lines(label, compute, "plugin", "unsharded bf16 base")))
    if not trains:
        print(process.stdout + process.stderr)
    return 0 if ok and all(outcomes.values()) and trains else 1


if __name__ == "__main__":
    run_tool(__doc__, job, main)
