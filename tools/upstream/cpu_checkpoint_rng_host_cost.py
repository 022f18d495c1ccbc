"""Host-side cost per region of PR 2a's checkpoint change, on CPU: patched vs unpatched, in one run.

    python tools/upstream/cpu_checkpoint_rng_host_cost.py [--steps 2000] [--repeats 9]

Without an accelerator the patch's added path never runs, so a stand-in plays the current
accelerator (``cuda``, device 0, initialized) for both the installed ``torch.utils.checkpoint``
and a copy patched by ``pr2a-checkpoint-current-device-rng.patch``: its RNG state is a 16-byte
CPU tensor (CUDA's generator state is a seed and an offset, 16 bytes), read as a copy and written
in place. The region's tensor argument is on CPU, the case where the patch adds the current
device's state. For each implementation (``use_reentrant`` True and False) it counts the device
module's ``get_rng_state`` / ``set_rng_state`` calls per region and measures the CPU time of eager
forward + backward of one small region (one thread; ``backward`` of a CPU graph runs on the
calling thread), interleaving unpatched and patched, and prints the medians, the difference per
region and the ratio.

What it measures: the Python and dispatch work the patch adds per region (the helper, its
calls, ``fork_rng`` and ``set_device_states`` over one device instead of none). What it does
not: CUDA's own host-side work in those calls (``torch.cuda``'s lazy-init check, device guard
and generator lookup) and anything on the device; ``gpu_checkpoint_rng_bench.py`` measures the
region on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch
import torch.utils.checkpoint as unpatched_module

from gpu_checkpoint_rng_bench import load_patched_checkpoint


class StandInDevice:
    """The current accelerator's device module: one device, a 16-byte RNG state, calls counted."""

    _initialized = True

    def __init__(self) -> None:
        self.state = torch.zeros(16, dtype=torch.uint8)
        self.reads = 0
        self.writes = 0

    def get_rng_state(self, device=None) -> torch.Tensor:
        self.reads += 1
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        self.writes += 1
        self.state.copy_(state)

    def device_count(self) -> int:
        return 1

    def device(self, index):
        return contextlib.nullcontext()


@contextlib.contextmanager
def stand_in(device: StandInDevice, modules):
    """``modules`` (checkpoint modules) and ``fork_rng`` see ``device`` as ``cuda``, current, device 0."""
    get_device_module = torch.get_device_module
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(mock.patch.object(module, "_get_device_module", lambda device_type="cuda": device))
            stack.enter_context(mock.patch.object(module.DefaultDeviceType, "_default_device_type", "cuda"))
        stack.enter_context(
            mock.patch.object(
                torch, "get_device_module", lambda d=None: device if str(d) == "cuda" else get_device_module(d)
            )
        )
        stack.enter_context(
            mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
        )
        stack.enter_context(mock.patch.object(torch.accelerator, "current_device_index", lambda: 0))
        yield


def region(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


def run_regions(checkpoint, x: torch.Tensor, use_reentrant: bool, steps: int) -> float:
    """CPU seconds of this thread per forward + backward of one checkpointed region."""
    # Note: the thread's CPU time, not wall time: on a shared machine the wall time of a
    # measurement mostly counts other processes' turns
    start = time.thread_time()
    for _ in range(steps):
        checkpoint(region, x, use_reentrant=use_reentrant).sum().backward()
    return (time.thread_time() - start) / steps


def calls_per_region(device: StandInDevice, checkpoint, x: torch.Tensor, use_reentrant: bool) -> tuple[int, int]:
    device.reads = device.writes = 0
    run_regions(checkpoint, x, use_reentrant, 1)
    return device.reads, device.writes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="regions per measurement")
    parser.add_argument("--repeats", type=int, default=9, help="measurements per configuration (median)")
    parser.add_argument("--numel", type=int, default=1024, help="elements of the region's argument")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = StandInDevice()
    with tempfile.TemporaryDirectory() as tmp:
        patched_module = load_patched_checkpoint(tmp)
        with stand_in(device, (unpatched_module, patched_module)):
            print(f"torch {torch.__version__}, CPU, stand-in accelerator; {torch.get_num_threads()} thread")
            print(f"{args.steps} regions per measurement, median of {args.repeats}; argument of {args.numel} elements")
            print(
                f"{'use_reentrant':>13} {'calls unpatched':>15} {'calls patched':>13} {'unpatched us':>12} "
                f"{'patched us':>10} {'added us':>8} {'ratio':>6}"
            )
            x = torch.randn(args.numel, requires_grad=True)
            for use_reentrant in (False, True):
                checkpoints = {"unpatched": unpatched_module.checkpoint, "patched": patched_module.checkpoint}
                calls = {name: calls_per_region(device, fn, x, use_reentrant) for name, fn in checkpoints.items()}
                for fn in checkpoints.values():  # warm-up
                    run_regions(fn, x, use_reentrant, max(1, args.steps // 10))
                times: dict[str, list[float]] = {name: [] for name in checkpoints}
                for _ in range(args.repeats):
                    for name, fn in checkpoints.items():
                        times[name].append(run_regions(fn, x, use_reentrant, args.steps))
                before, after = (statistics.median(times[name]) * 1e6 for name in checkpoints)
                counts = {name: f"{reads} get, {writes} set" for name, (reads, writes) in calls.items()}
                print(
                    f"{use_reentrant!s:>13} {counts['unpatched']:>15} {counts['patched']:>13} {before:12.1f} "
                    f"{after:10.1f} {after - before:8.1f} {after / before:6.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
