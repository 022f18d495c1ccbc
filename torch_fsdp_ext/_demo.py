"""``python -m torch_fsdp_ext demo``: the README's case on 2 CPU ranks, without and with the plugin.

A tiny DeepSeek-V3 (transformers' ``DeepseekV3ForCausalLM`` from its config, no download) in bf16, its MoE router
``gate.weight`` kept in fp32 by the class's ``_keep_in_fp32_modules_strict``, goes through accelerate's FSDP2 path
(``mixed_precision="no"``, one group per decoder layer, as the README's accelerate config). Without the plugin the
first forward stops with torch's uniform-dtype assertion; with it the model trains a few steps and
``state_dict_as_loaded`` + ``save_pretrained`` write a safetensors file in the loaded dtypes (BF16, the router F32).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import traceback

import torch
import torch.distributed as dist

from . import _compat
from ._install import install, uninstall
from ._local_ranks import run_local_ranks, write_result
from ._rank_end import end_rank

WORLD_SIZE = 2
STEPS = 4
MISSING_EXTRAS = "the demo needs accelerate and transformers: pip install -e '.[demo]'"


def _tiny_deepseek_v3() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # the router weight stays fp32


def _accelerator():
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    return Accelerator(mixed_precision="no", fsdp_plugin=fsdp_plugin, cpu=True), fsdp_plugin


def _prepare_fsdp2(accelerator, fsdp_plugin, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """``accelerator.prepare`` through accelerate's FSDP2 path on CPU ranks.

    Note: accelerate turns FSDP on only on an accelerator and on CPU falls back to DDP without a word; its GPU
    branch sets these two attributes of the shared state. Set here, before each ``prepare`` (the state's
    ``distributed_type`` was found back at MULTI_CPU after a first prepare and forward), they run its FSDP2 path.
    """
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = fsdp_plugin
    model, optimizer = accelerator.prepare(model, optimizer)
    if not isinstance(model, _compat.fsdp2_api().FSDPModule):
        raise RuntimeError(f"accelerate did not take its FSDP2 path: the model is a {type(model).__name__}")
    return model, optimizer


def _first_line(error: BaseException) -> str:
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}"


def _without_plugin(accelerator, fsdp_plugin, tokens: torch.Tensor) -> str:
    uninstall()
    model = _tiny_deepseek_v3()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = _prepare_fsdp2(accelerator, fsdp_plugin, model, optimizer)
    try:
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
    except Exception as e:  # noqa: BLE001 - the failure is what this run shows
        return _first_line(e)
    return "trains (this torch accepts mixed dtypes in one group)"


def _with_plugin(accelerator, fsdp_plugin, tokens: torch.Tensor, out_dir: str) -> dict:
    from safetensors import safe_open

    import torch_fsdp_ext

    install()
    model = _tiny_deepseek_v3()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = _prepare_fsdp2(accelerator, fsdp_plugin, model, optimizer)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state_dict = torch_fsdp_ext.state_dict_as_loaded(model)  # every rank; rank 0 holds the tensors
    saved = {}
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out_dir, state_dict=state_dict)
        with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
            saved = {name: str(f.get_slice(name).get_dtype()) for name in f.keys()}
    accelerator.wait_for_everyone()
    return {"losses": losses, "saved": saved}


def _rank_main(rank: int, init_file: str, result_file: str, out_dir: str) -> None:
    # accelerate reads the rank layout from the environment; the group itself is made here (no port needed).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    # The upcast's cost warning is meant for real training runs; this one is the demonstration of it.
    logging.getLogger("torch_fsdp_ext").setLevel(logging.ERROR)
    # Note: save_pretrained's progress bar (tqdm) makes a multiprocessing lock that a rank ending with os._exit
    # never releases, and the parent's resource tracker then warns of a leaked semaphore.
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    results: dict = {}
    try:
        accelerator, fsdp_plugin = _accelerator()
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        results["without"] = _without_plugin(accelerator, fsdp_plugin, tokens)
        if rank == 0:
            print(f"without the plugin: {results['without']}", flush=True)
        results.update(_with_plugin(accelerator, fsdp_plugin, tokens, out_dir))
    except Exception:  # noqa: BLE001 - reported by the parent
        results["error"] = traceback.format_exc()
    if rank == 0:
        write_result(result_file, results)
    end_rank(wait_for_peers="error" not in results)


def _describe_saved(saved: dict[str, str]) -> str:
    dtypes = sorted(set(saved.values()))
    by_dtype = [f"{dtype} {sum(d == dtype for d in saved.values())} tensors" for dtype in dtypes]
    f32 = [name for name, dtype in saved.items() if dtype == "F32"]
    return f"{dtypes} ({', '.join(by_dtype)}; F32: {', '.join(f32) or 'none'})"


def demo(timeout: float = 300.0) -> int:
    if not all(importlib.util.find_spec(name) for name in ("accelerate", "transformers")):
        print(f"torch_fsdp_ext demo: {MISSING_EXTRAS}")
        return 1
    import accelerate
    import transformers

    print("torch_fsdp_ext demo: a tiny bf16 DeepSeek-V3 (MoE router gate.weight fp32) through accelerate's FSDP2 path")
    print(f"(mixed_precision 'no', TRANSFORMER_BASED_WRAP) on {WORLD_SIZE} CPU ranks (gloo); torch {torch.__version__}, "
          f"transformers {transformers.__version__}, accelerate {accelerate.__version__}")
    with tempfile.TemporaryDirectory() as out_dir:
        results = run_local_ranks(_rank_main, (out_dir,), WORLD_SIZE, timeout)
    if "error" in results:
        print(f"torch_fsdp_ext demo could not run:\n{results['error']}")
        return 1
    losses = ", ".join(f"{loss:.4f}" for loss in results["losses"])
    print(f"with the plugin: trains; losses of steps 1-{len(results['losses'])}: {losses}")
    saved = results["saved"]
    print(f"saved with state_dict_as_loaded + save_pretrained: model.safetensors dtypes {_describe_saved(saved)}")
    healthy = sorted(set(saved.values())) == ["BF16", "F32"] and results["losses"][-1] < results["losses"][0]
    return 0 if healthy else 1
