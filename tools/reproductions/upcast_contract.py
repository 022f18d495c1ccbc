"""The upcast contract per loader and per finding: what the installed torch_fsdp_ext gives, against its reference.

    python tools/reproductions/upcast_contract.py            # 2 gloo ranks on CPU

Each row runs one scenario of test/test_upcast_contract.py on 2 ranks and prints rank 0's
result against the scenario's no-plugin reference (0 = bit for bit). Point PYTHONPATH at
another checkout of the plugin to print its behaviour side by side with this one.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "test"))

WORLD_SIZE = 2


def max_difference(a: dict, b: dict) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in ((a[k], b[k]) for k in a))


def losses_difference(a: list, b: list) -> float:
    return max(abs(x.item() - y.item()) for x, y in zip(a, b))


def describe_losses(losses: list) -> str:
    return "finite" if all(math.isfinite(loss.item()) for loss in losses) else "NaN/inf"


def scenarios(rank: int) -> list[tuple[str, callable]]:
    import torch_fsdp_ext
    import test_upcast_contract as t
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from common import batch, full_params, lm_loss, mixed_llama, plugin, seed_000_model

    def accelerate_no_mixed_precision():
        with plugin(True):
            reference = t.shard_with_embedding_unit(mixed_llama(), t.NO_MP)
            reference_losses = t.train(reference, rank)
            model = t.accelerate_efficient_load(mixed_llama(), rank, t.NO_MP)
            losses = t.train(model, rank)
        return f"losses {describe_losses(losses)}, max |Δloss| {losses_difference(losses, reference_losses):.3g}"

    def accelerate_bf16_policy():
        with plugin(False):
            reference = t.accelerate_efficient_load(t.upcast_trainable(seed_000_model()), rank, t.BF16_MP)
            t.train(reference, rank)
        with plugin(True):
            model = t.accelerate_efficient_load(seed_000_model(), rank, t.BF16_MP)
            t.train(model, rank)
        return f"max |Δparam| {max_difference(full_params(model), full_params(reference)):.3g}"

    def accelerate_end_to_end():
        with plugin(True):
            reference_losses = t.train(t.accelerate_prepare(rank, WORLD_SIZE, cpu_ram_efficient_loading=False), rank)
            losses = t.train(t.accelerate_prepare(rank, WORLD_SIZE, cpu_ram_efficient_loading=True), rank)
        return f"losses {describe_losses(losses)}, max |Δloss| {losses_difference(losses, reference_losses):.3g}"

    def set_model_state_dict_materialized():
        masters = t.perturbed_fp32_masters(seed_000_model())
        with plugin(True):
            model = t.shard_with_embedding_unit(seed_000_model(), t.BF16_MP)
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, dict(masters) if rank == 0 else {}, options=options)
            model(batch(rank))
            model.reshard()
        return f"max |param - fp32 master| {max_difference(full_params(model), masters):.3g}"

    def torchtitan_dcp_order():
        import torch.distributed.checkpoint as dcp

        with plugin(True):
            trained = t.shard_with_embedding_unit(seed_000_model(), t.BF16_MP)
            t.train(trained, rank, steps=1)
            expected = full_params(trained)
            with t.shared_temp_dir("upcast_contract_tool") as path:
                dcp.save(trained.state_dict(), checkpoint_id=path)
                with torch.device("meta"):
                    model = seed_000_model()
                t.shard_with_embedding_unit(model, t.BF16_MP)
                model.to_empty(device="cpu")
                state = model.state_dict()
                dcp.load(state, checkpoint_id=path)
                model.load_state_dict(state)
                model(batch(rank))
                model.reshard()
        return f"max |param - fp32 master| {max_difference(full_params(model), expected):.3g}"

    def embedding_unit():
        with plugin(False):
            reference = t.shard_with_embedding_unit(seed_000_model().float(), t.BF16_MP)
            reference_losses = t.train(reference, rank)
        with plugin(True):
            model = t.shard_with_embedding_unit(seed_000_model(), t.BF16_MP)
            losses = t.train(model, rank)
        return (f"embedding {str(model.embed.weight.dtype).replace('torch.', '')}, max |Δloss| vs model.float() "
                f"{losses_difference(losses, reference_losses):.3g}, max |Δparam| "
                f"{max_difference(full_params(model), full_params(reference)):.3g}")

    def lora_without_param_dtype():
        tokens = batch(rank)
        with torch.no_grad():
            one_process = lm_loss(t.lora_model()(tokens), tokens)
        with plugin(True):
            model = t.lora_model()
            for layer in model.layers:
                fully_shard(layer, mp_policy=t.NO_MP)
            fully_shard(model, mp_policy=t.NO_MP)
            losses = t.train(model, rank)
        return f"step-0 |Δloss| vs one process {abs(losses[0].item() - one_process.item()):.3g}"

    def float8_bf16_weight():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.LayerNorm(32)).to(torch.bfloat16)
        model[1].float()
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        with plugin(True):
            fully_shard(model, mp_policy=t.BF16_MP)
            try:
                model(torch.randn(4, 32))
            except Exception as e:  # noqa: BLE001 - the outcome is the row
                return f"{type(e).__name__}, weight {str(model[0].weight.dtype).replace('torch.', '')}"
        model.reshard()  # the root keeps its parameters unsharded after forward
        return f"no error, sharded weight {str(model[0].weight.dtype).replace('torch.', '')}"

    def override_policy_without_fix():
        if "param_dtype_override_fn" in torch_fsdp_ext.MixedPrecisionPolicy.__dataclass_fields__ and hasattr(
            torch.distributed.fsdp.MixedPrecisionPolicy(), "param_dtype_override_fn"
        ):
            return "native on this torch"
        with plugin(False):
            try:
                torch_fsdp_ext.MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, param_dtype_override_fn=lambda param: None
                )
            except ValueError:
                return "ValueError at the policy"
        return "accepted, then ignored by FSDP2"

    return [
        ("(a) accelerate loader, mixed_precision no", accelerate_no_mixed_precision),
        ("(a) accelerate loader, bf16 policy vs accelerate's upcast", accelerate_bf16_policy),
        ("(f) accelerate prepare, efficient vs plain loading", accelerate_end_to_end),
        ("(b) set_model_state_dict(broadcast_from_rank0)", set_model_state_dict_materialized),
        ("(c) meta → to_empty → dcp.load", torchtitan_dcp_order),
        ("2 uniform-bf16 embedding unit", embedding_unit),
        ("3 LoRA shape, no param_dtype", lora_without_param_dtype),
        ("4 torchao float8 bf16 weight + fp32 norm", float8_bf16_weight),
        ("5 override policy, dtype fix off", override_policy_without_fix),
    ]


def run_rank(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("torch_fsdp_ext").setLevel(logging.ERROR)
    import torch_fsdp_ext

    if rank == 0:
        print(f"torch {torch.__version__}, torch_fsdp_ext from {os.path.dirname(torch_fsdp_ext.__file__)}")
    for name, scenario in scenarios(rank):
        try:
            outcome = scenario()
        except Exception as e:  # noqa: BLE001 - the outcome is the row
            outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
            if os.environ.get("UPCAST_CONTRACT_TRACEBACK"):
                traceback.print_exc()
        if rank == 0:
            print(f"{name:<58} {outcome}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run_rank, args=(os.path.join(tmp, "init"),), nprocs=WORLD_SIZE, start_method="fork")


if __name__ == "__main__":
    main()
