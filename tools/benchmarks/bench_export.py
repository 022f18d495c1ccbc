"""Peak host memory and time of shipping a model as loaded, side by side, on 2 CPU gloo ranks.

    python tools/benchmarks/bench_export.py # a 117M-parameter bf16 model with fp32 norms; exit 1 if a bound is missed
    python tools/benchmarks/bench_export.py --quick    # smoke test: a small model, bounds not enforced

After one upcast training step (fp32 masters), each rank measures, in turn:

- ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` followed by a cast to the
  loaded dtypes by hand (what users do today),
- ``torch_fsdp_ext.state_dict_as_loaded(model)``,
- ``torch_fsdp_ext.iter_state_dict_as_loaded(model)``, each tensor dropped before the next.

"Extra peak" is the rise of the process's resident high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) over its resident size before the call, with the result still held.
Every result is checked bit for bit against the first. Bound: the streamed form's extra peak is
at most 1.1 x the largest full tensor (in its loaded dtype) on every rank.

Note: glibc's malloc keeps freed blocks below its (self-raising) mmap threshold in the heap, so a
later measurement would reuse memory an earlier one freed and look smaller. The ranks run with a
fixed 1 MiB threshold: every tensor of interest is its own mapping and goes back when freed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCH_FSDP_EXT_DISABLE", "1")  # installed explicitly below
os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # read by the spawned ranks' libc at start

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import torch_fsdp_ext
from torch_fsdp_ext._compat import fsdp2_api
from torch_fsdp_ext._rank_end import end_rank

BOUND_STREAM_PEAK = 1.1
MiB = 1 << 20


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class LM(nn.Module):
    """A bf16 checkpoint with fp32 norms: the layout the upcast trains in fp32 masters."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def resident_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kb, _ = line.split()
                values[key] = int(kb) * 1024
    return values["VmRSS:"], values["VmHWM:"]


def reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return resident_bytes()[0]


def by_hand(model: nn.Module, loaded: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {fqn: tensor.to(loaded[fqn]) for fqn, tensor in full.items()}


def streamed(model: nn.Module, digest: dict[str, torch.Tensor] | None) -> dict[str, bool]:
    """Consume the stream one tensor at a time; per FQN, whether it equals ``digest`` (rank 0's reference)."""
    same = {}
    for fqn, tensor in torch_fsdp_ext.iter_state_dict_as_loaded(model):
        if digest is not None:
            same[fqn] = tensor.dtype == digest[fqn].dtype and torch.equal(tensor, digest[fqn])
        del tensor
    return same


def run_rank(rank: int, world: int, init_file: str, dims: tuple[int, int, int], reps: int, result_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    api = fsdp2_api()
    torch_fsdp_ext.install()
    vocab, dim, layers = dims
    torch.manual_seed(0)
    model = LM(vocab, dim, layers).to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.float()
    loaded = {fqn: t.dtype for fqn, t in model.state_dict().items()}
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(t.numel() for t in model.parameters())
    policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        api.fully_shard(layer, mp_policy=policy)
    api.fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(rank))
    logits = model(tokens)
    nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()

    reference = by_hand(model, loaded)  # rank 0: the values every method must give
    peaks: dict[str, list[int]] = {"by hand": [], "state_dict_as_loaded": [], "streamed": []}
    times: dict[str, list[float]] = {name: [] for name in peaks}
    mismatched: set[str] = set()
    for _ in range(reps):
        for name in peaks:
            dist.barrier()
            before = reset_peak()
            start = time.perf_counter()
            if name == "by hand":
                result = by_hand(model, loaded)
            elif name == "state_dict_as_loaded":
                result = torch_fsdp_ext.state_dict_as_loaded(model)
            else:
                result = streamed(model, reference if rank == 0 else None)
            times[name].append(time.perf_counter() - start)
            peaks[name].append(resident_bytes()[1] - before)
            if rank == 0 and name == "streamed":
                mismatched |= {fqn for fqn, same in result.items() if not same}
            elif rank == 0:
                mismatched |= {fqn for fqn in reference if not torch.equal(result[fqn], reference[fqn])
                               or result[fqn].dtype != reference[fqn].dtype}
            del result
    row = {
        "peak": {name: max(values) for name, values in peaks.items()},
        "time": {name: statistics.median(values) for name, values in times.items()},
        "largest": largest,
        "params": params,
        "loaded_bytes": sum(t.numel() * t.element_size() for t in reference.values()) if rank == 0 else 0,
        "mismatched": sorted(mismatched),
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        torch.save(rows, result_file)
    end_rank()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, bounds not enforced")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dims = (1024, 64, 2) if args.quick else (32768, 1024, 6)  # vocab, dim, layers
    reps = 1 if args.quick else args.reps
    world = 2
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.pt")
        mp.start_processes(run_rank, args=(world, os.path.join(tmp, "init"), dims, reps, result_file),
                           nprocs=world, start_method="spawn")
        rows = torch.load(result_file)

    largest = rows[0]["largest"]
    print(f"torch {torch.__version__}; model: {rows[0]['params'] / 1e6:.1f}M parameters (vocab, dim, layers = "
          f"{dims}), bf16 with fp32 norms, trained one upcast step on {world} CPU gloo ranks; "
          f"full state dict as loaded: {rows[0]['loaded_bytes'] / MiB:.1f} MiB; largest tensor: "
          f"{largest / MiB:.1f} MiB; {reps} repetitions (peak: max, time: median)")
    print(f"{'method':<24}" + "".join(f"{f'rank {r} extra peak MiB':>24}" for r in range(world))
          + f"{'x largest (max rank)':>22}{'rank 0 time s':>16}")
    for name in rows[0]["peak"]:
        peaks = [row["peak"][name] for row in rows]
        print(f"{name:<24}" + "".join(f"{p / MiB:>24.1f}" for p in peaks)
              + f"{max(peaks) / largest:>22.2f}{rows[0]['time'][name]:>16.2f}")
    ok = True
    if rows[0]["mismatched"]:
        print(f"FAIL: results differ from get_model_state_dict + cast by hand: {rows[0]['mismatched']}")
        ok = False
    stream_ratio = max(row["peak"]["streamed"] for row in rows) / largest
    verdict = "ok" if stream_ratio <= BOUND_STREAM_PEAK else "MISSED"
    print(f"bound: streamed extra peak <= {BOUND_STREAM_PEAK} x largest tensor on every rank: "
          f"{stream_ratio:.2f} ({verdict})")
    ok = ok and (stream_ratio <= BOUND_STREAM_PEAK or args.quick)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
