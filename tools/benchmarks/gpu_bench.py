"""Step time and peak memory of a ~1B Llama-like model under FSDP2: plugin vs the manual workarounds.

    python tools/benchmarks/gpu_bench.py # H200-sized run: NCCL, world size 1 (about 10 minutes of device time)
    python tools/benchmarks/gpu_bench.py --tiny     # tiny model on CPU with gloo: checks the script end to end

Setups, each side by side in one run (bf16 weights with fp32 norms unless noted;
param_dtype=bf16, reduce_dtype=fp32, per-block non-reentrant checkpointing, AdamW):

  (a) no plugin, workarounds: model.float() before sharding, checkpoint_wrapper applied before fully_shard
  (b) plugin, no workaround: mixed dtypes as loaded, checkpoint(block, h) around each fully_shard'ed block
  (c) a model that needs nothing (fp32, checkpoint_wrapper first), without and with the plugin (pure overhead)

Bounds (full run only): (b)/(a) and (c) patched/unpatched step-time ratios <= 1.01, peak memory ratios <= 1.01.
Asserted on a GPU: memory still allocated after the last step (parameters, gradients, optimizer state, and
anything the steps left alive) with the plugin equals unpatched to the byte, (b) vs (a) and in (c). The
cyclic garbage collector is off while the steps run, so a region kept alive by a reference cycle shows there.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("TORCH_FSDP_EXT_DISABLE", "1")  # each setup chooses explicitly

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext._compat import fsdp2_api

fully_shard, MixedPrecisionPolicy = fsdp2_api().fully_shard, fsdp2_api().MixedPrecisionPolicy

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BOUND = 1.01


@dataclass
class Size:
    dim: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    warmup: int
    steps: int


FULL = Size(dim=2048, layers=16, heads=16, ffn=5632, vocab=32000, seq=2048, batch=8, warmup=4, steps=20)
TINY = Size(dim=64, layers=2, heads=4, ffn=128, vocab=128, seq=32, batch=2, warmup=1, steps=3)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), 1e-6)


class Block(nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.heads = s.heads
        self.attn_norm, self.mlp_norm = RMSNorm(s.dim), RMSNorm(s.dim)
        self.qkv = nn.Linear(s.dim, 3 * s.dim, bias=False)
        self.wo = nn.Linear(s.dim, s.dim, bias=False)
        self.w13 = nn.Linear(s.dim, 2 * s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, d))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, s: Size, checkpoint_blocks: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpoint_blocks else block(h)
        return self.head(self.norm(h))


def build(s: Size, device: torch.device, *, mixed_dtypes: bool, plugin: bool, wrapper_first: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    (torch_fsdp_ext.install if plugin else torch_fsdp_ext.uninstall)()
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(s, checkpoint_blocks=not wrapper_first)
    if mixed_dtypes:  # as loaded from a bf16 checkpoint with fp32 norms (_keep_in_fp32_modules)
        model.to(torch.bfloat16)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.float()
    if wrapper_first:
        model.float()  # workaround 1: uniform dtype before sharding
        for i, block in enumerate(model.blocks):  # workaround 2: checkpoint region inside the FSDP unit
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    for block in model.blocks:
        fully_shard(block, mp_policy=MP)
    return fully_shard(model, mp_policy=MP)


def measure(s: Size, device: torch.device, **setup) -> dict:
    model = build(s, device, **setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, s.vocab, (s.batch, s.seq), device=device, generator=generator)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    gc.disable()  # what a step leaves alive lives by reference counting alone
    for i in range(s.warmup + s.steps):
        start = time.perf_counter()
        logits = model(tokens)
        loss_tensor = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss_tensor.backward()
        loss = loss_tensor.item() if i == s.warmup + s.steps - 1 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= s.warmup:
            times.append(time.perf_counter() - start)
    del logits, loss_tensor
    after_step = torch.cuda.memory_allocated() if device.type == "cuda" else float("nan")
    gc.enable()
    step = statistics.median(times)
    tokens_per_s = s.batch * s.seq / step
    result = {
        "step_ms": step * 1e3,
        "tokens_s": tokens_per_s,
        "tflops": 6 * params * tokens_per_s / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
        "after_step_bytes": after_step,
        "loss": loss,
        "params": params,
    }
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (gloo); bounds not enforced")
    args = parser.parse_args()
    s = TINY if args.tiny else FULL
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        setups = {
            "(a) workarounds, no plugin": dict(mixed_dtypes=True, plugin=False, wrapper_first=True),
            "(b) plugin, no workaround": dict(mixed_dtypes=True, plugin=True, wrapper_first=False),
            "(c) needs nothing, no plugin": dict(mixed_dtypes=False, plugin=False, wrapper_first=True),
            "(c) needs nothing, plugin": dict(mixed_dtypes=False, plugin=True, wrapper_first=True),
        }
        results = {name: measure(s, device, **setup) for name, setup in setups.items()}
        dist.destroy_process_group()
    where = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
    print(f"torch {torch.__version__}, {where}, world size 1, {next(iter(results.values()))['params'] / 1e9:.3f}B params, "
          f"seq {s.seq}, batch {s.batch}, median of {s.steps} steps after {s.warmup} warm-up")
    print(f"{'setup':30} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'peak GiB':>9} {'after-step bytes':>17} "
          f"{'loss':>8}")
    for name, r in results.items():
        print(f"{name:30} {r['step_ms']:9.1f} {r['tokens_s']:10.0f} {r['tflops']:8.1f} {r['peak_gib']:9.2f} "
              f"{r['after_step_bytes']:17.0f} {r['loss']:8.4f}")
    a, b = results["(a) workarounds, no plugin"], results["(b) plugin, no workaround"]
    c0, c1 = results["(c) needs nothing, no plugin"], results["(c) needs nothing, plugin"]
    ratios = {
        "(b)/(a) step time": b["step_ms"] / a["step_ms"],
        "(c) patched/unpatched step time": c1["step_ms"] / c0["step_ms"],
        "(b)/(a) peak memory": b["peak_gib"] / a["peak_gib"],
        "(c) patched/unpatched peak memory": c1["peak_gib"] / c0["peak_gib"],
    }
    for name, ratio in ratios.items():
        print(f"{name:36} {ratio:.4f}")
    failed = []
    if cuda:
        # (b) trains the fp32 master weights that (a) makes by hand: the same parameters and optimizer state.
        left_alive = {
            "(b)-(a) after-step memory": b["after_step_bytes"] - a["after_step_bytes"],
            "(c) patched-unpatched after-step memory": c1["after_step_bytes"] - c0["after_step_bytes"],
        }
        for name, extra in left_alive.items():
            print(f"{name:36} {extra:+.0f} bytes")
        failed += [f"{n}: {extra:+.0f} bytes" for n, extra in left_alive.items() if extra != 0]
    if not args.tiny:
        failed += [f"{n} > {BOUND}" for n, r in ratios.items() if r > BOUND]
    else:
        print("tiny run: time and peak bounds not enforced")
    print("all bounds met" if not failed else f"BOUND MISSED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
