"""Long-lived processes: nothing the plugin keeps grows with the models a process builds.

RL trainers rebuild a policy and a frozen reference model every iteration; sweeps and
evaluation loops build many FSDP models in one process. Each model here is sharded,
trained one step (its forward checkpointed, so the recompute replay runs too), and
freed; the plugin's hooks, handles and registries, and the process's RSS, are measured
after the first models and after the last.
"""

from __future__ import annotations

import gc
import os

import torch
from torch.testing._internal.common_utils import run_tests
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext import _install
from torch_fsdp_ext._dtype import _fix as _dtype_fix, _optimizer_state, _roots

from common import (
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    batch,
    lm_loss,
    plugin,
    plugin_specific,
    seed_000_model,
    shard_model,
)

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MODELS = int(os.environ.get("TORCH_FSDP_EXT_LONG_LIVED_MODELS", "12"))
RSS_NOISE_BYTES = 8 * 2**20


def plugin_footprint() -> dict[str, int]:
    """Everything the installed plugin keeps that could grow per model."""
    sizes = {}
    for name, (fix, patches) in _install._active.items():
        sizes[f"{name}: patched attributes"] = len(patches._attributes)
        sizes[f"{name}: removable handles"] = len(patches._handles)
        sizes[f"{name}: rebound hooks"] = len(patches._hooks)
        if isinstance(fix, _dtype_fix.DtypeFix):
            sizes["dtype: groups hooked"] = len(fix._hooked)
            sizes["dtype: groups undecided"] = len(fix._undecided)
            sizes["dtype: parameters of undecided groups indexed"] = len(fix._undecided_by_param)
            sizes["dtype: module hook handles"] = sum(map(len, fix._module_hooks.values()))
            sizes["dtype: refused roots"] = len(fix._refused)
            sizes["dtype: rank check, groups compared"] = len(fix.ranks._compared)
            sizes["dtype: rank check, states settled"] = len(fix.ranks._settled)
    sizes["optimizer check: parameters pending"] = len(_optimizer_state._upcast)
    sizes["optimizer check: optimizers seen"] = len(_optimizer_state._held)
    sizes["dtype: mixed groups kept"] = _dtype_fix._keeper.kept_groups
    sizes["dtype: modules with a root indexed"] = len(_roots.index._owner)
    sizes["plugin objects alive"] = sum(
        1 for obj in gc.get_objects() if str(getattr(type(obj), "__module__", "")).startswith("torch_fsdp_ext")
    )
    return sizes


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Iteration:
    """One RL-style iteration: a policy trained one step, a frozen reference model evaluated."""

    def __init__(self, rank: int, seed: int) -> None:
        self.rank, self.seed = rank, seed

    def run(self) -> float:
        policy = shard_model(seed_000_model(self.seed), mp_policy=MP)
        reference = seed_000_model(self.seed).requires_grad_(False)
        shard_model(reference, mp_policy=MP)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        tokens = batch(self.rank, self.seed)
        with torch.no_grad():
            target = reference(tokens).argmax(-1)
        loss = lm_loss(checkpoint(policy, tokens, use_reentrant=False), target)
        loss.backward()
        optimizer.step()
        return loss.item()


@plugin_specific
class TestLongLived(FSDPExtTestCase):
    def test_models_built_and_freed_leave_nothing_behind(self):
        with plugin(True):
            sizes, rss = [], []
            for i in range(MODELS):
                loss = Iteration(self.rank, i).run()
                self.assertTrue(torch.isfinite(torch.tensor(loss)))
                gc.collect()
                if i in (2, MODELS - 1):
                    sizes.append(plugin_footprint())
                    rss.append(rss_bytes())
            after_first, after_last = sizes
            self.assertEqual(after_last, after_first)
            self.assertEqual(torch_fsdp_ext._compat.fsdp_states(), [])  # every model was freed
            self.assertLess(rss[1] - rss[0], RSS_NOISE_BYTES, f"RSS grew by {rss[1] - rss[0]:,} bytes")
            if self.rank == 0:
                print(f"long-lived: {MODELS} iterations (policy + frozen reference); plugin footprint after 3 and "
                      f"after {MODELS}: {after_last}; RSS {rss[0]:,} -> {rss[1]:,} bytes")


if __name__ == "__main__":
    run_tests()
