"""Per-region cost of PR 2a's checkpoint change on a GPU: patched vs unpatched, in one run.

    python tools/upstream/gpu_checkpoint_rng_bench.py            # on a machine with a CUDA device
    python tools/upstream/gpu_checkpoint_rng_bench.py --smoke    # any machine: a few steps, numbers meaningless

For each checkpoint implementation (``use_reentrant`` True and False) and each place of the
region's tensor argument (``host``: on CPU, moved to the device inside the region, where PR 2a
stashes the current device's RNG state; ``device``: already on the device, where it changes
nothing), it times eager forward + backward of one small checkpointed region, in a loop, with
the installed ``torch.utils.checkpoint`` (unpatched) and with a copy patched by
``pr2a-checkpoint-current-device-rng.patch`` (loaded as a second module), interleaving the two.
Prints the median time per region in microseconds for each and the difference (patched minus
unpatched): the overhead the patch adds per region.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PATCH = os.path.join(HERE, "pr2a-checkpoint-current-device-rng.patch")
CHECKPOINT = "torch/utils/checkpoint.py"


def load_patched_checkpoint(tmp: str):
    """The installed torch/utils/checkpoint.py with PR 2a applied, as a module of its own."""
    target = os.path.join(tmp, CHECKPOINT)
    os.makedirs(os.path.dirname(target))
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), CHECKPOINT), target)
    subprocess.run(["git", "apply", f"--include={CHECKPOINT}", PATCH], cwd=tmp, check=True)
    spec = importlib.util.spec_from_file_location("patched_checkpoint", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert hasattr(module, "_get_region_device_states"), "the patch did not apply"
    return module


def region(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Moves a host argument to the device (a no-op for one already there) and draws there
    return torch.nn.functional.dropout(x.to(device) * 2, p=0.1)


def time_per_region(checkpoint, x: torch.Tensor, device: torch.device, use_reentrant: bool, steps: int) -> float:
    """Seconds per forward + backward of one checkpointed region."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        checkpoint(region, x, device, use_reentrant=use_reentrant).sum().backward()
    sync()
    return (time.perf_counter() - start) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="regions per measurement")
    parser.add_argument("--repeats", type=int, default=7, help="measurements per configuration (median)")
    parser.add_argument("--numel", type=int, default=1024, help="elements of the region's argument")
    parser.add_argument("--smoke", action="store_true", help="a few steps, also without a GPU (checks the script)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats = 5, 1
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(1, device=device)  # initializes CUDA: checkpoint stashes device states only then
    elif args.smoke:
        device = torch.device("cpu")
    else:
        print("no CUDA device: nothing to measure (--smoke checks the script without one)")
        return 1
    from torch.utils.checkpoint import checkpoint as unpatched

    with tempfile.TemporaryDirectory() as tmp:
        patched = load_patched_checkpoint(tmp).checkpoint
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
        print(f"{args.steps} regions per measurement, median of {args.repeats}; argument of {args.numel} elements")
        print(f"{'use_reentrant':>13} {'argument':>8} {'unpatched us':>13} {'patched us':>11} {'overhead us':>12}")
        for use_reentrant in (False, True):
            for place in ("host", "device"):
                x = torch.randn(args.numel, device="cpu" if place == "host" else device, requires_grad=True)
                for checkpoint in (unpatched, patched):  # warm-up
                    time_per_region(checkpoint, x, device, use_reentrant, max(1, args.steps // 10))
                times: dict[str, list[float]] = {"unpatched": [], "patched": []}
                for _ in range(args.repeats):
                    times["unpatched"].append(time_per_region(unpatched, x, device, use_reentrant, args.steps))
                    times["patched"].append(time_per_region(patched, x, device, use_reentrant, args.steps))
                before, after = (statistics.median(times[k]) * 1e6 for k in ("unpatched", "patched"))
                print(f"{use_reentrant!s:>13} {place:>8} {before:13.1f} {after:11.1f} {after - before:12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
