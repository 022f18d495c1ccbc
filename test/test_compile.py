"""torch.compile sees the plugin's FSDP hooks exactly as it sees FSDP's own.

Each layout trains the seed-000 mixed-dtype model (bf16 Linear, fp32 LayerNorm) twice
under ``torch.compile``: once with the plugin, once with the manual workaround
(``model.float()``, no plugin), and compares dynamo's counters and the losses.
"""

from __future__ import annotations

import unittest
import warnings
from unittest import mock

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import run_tests
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext import _compat, _install
from torch_fsdp_ext._recompute import _state as recompute_state

from common import FSDPExtTestCase, MixedPrecisionPolicy, fully_shard, plugin, plugin_specific

DIM = 16
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.relu(self.lin(x)))


# Distinct classes: a wrapper that dynamo traces guards on the module class and recompiles per class.
class BlockA(Block):
    pass


class BlockB(Block):
    pass


class BlockC(Block):
    pass


class Model(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([BlockA(), BlockB(), BlockC()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, DIM)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


def mixed_dtype_model(workaround: bool, checkpointed: bool = False) -> Model:
    """bf16 Linears, fp32 LayerNorms in every FSDP group; the workaround makes it all fp32."""
    torch.manual_seed(0)
    model = Model(checkpointed).to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.float()
    return model.float() if workaround else model


def train(layout: str, backend: str, patched: bool, rank: int) -> tuple[list[float], dict[str, int]]:
    """Shard, compile as ``layout`` says, run STEPS AdamW steps; the losses and dynamo's counters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with plugin(patched):
        model = mixed_dtype_model(workaround=not patched, checkpointed=layout == "whole+checkpoint")
        if layout == "per-block before fully_shard":
            for block in model.blocks:
                block.compile(backend=backend)
        for block in model.blocks:
            fully_shard(block, mp_policy=BF16)
        fully_shard(model, mp_policy=BF16)
        if layout == "block.compile() after fully_shard":
            for block in model.blocks:
                block.compile(backend=backend)
        run = torch.compile(model, backend=backend) if layout.startswith("whole") else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = run(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    seen = {
        "graph breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],
        "unique graphs": counters["stats"]["unique_graphs"],
    }
    return losses, seen


class CompileTest(FSDPExtTestCase):
    def check_layout(self, layout: str, backend: str = "aot_eager") -> None:
        workaround_losses, workaround = train(layout, backend, patched=False, rank=self.rank)
        patched_losses, patched = train(layout, backend, patched=True, rank=self.rank)
        for counter, value in patched.items():
            self.assertLessEqual(value, workaround[counter], f"{layout}: {counter} {patched} vs workaround {workaround}")
        self.assertEqual(patched_losses, workaround_losses, f"{layout}: losses not bitwise equal")  # floats: exact
        # The layout compiled something: a counter that cannot move would assert nothing.
        self.assertGreater(workaround["frames"], 0)

    def test_whole_model(self) -> None:
        self.check_layout("whole")

    def test_whole_model_checkpoint_in_parent(self) -> None:
        self.check_layout("whole+checkpoint")

    def test_block_compile_after_fully_shard(self) -> None:
        self.check_layout("block.compile() after fully_shard")

    def test_per_block_compile_before_fully_shard(self) -> None:
        self.check_layout("per-block before fully_shard")

    def test_whole_model_inductor(self) -> None:
        self.check_layout("whole", backend="inductor")


@plugin_specific
class DecoratedAsFSDPTest(unittest.TestCase):
    """The replaced hooks carry the decorator FSDP gave the originals; uninstall restores them."""

    def test_wrappers_carry_fsdp_decorator(self) -> None:
        state_cls = _compat.load_internals().FSDPState
        with plugin(False):
            originals = {name: state_cls.__dict__[name] for name in ("_pre_forward", "_post_forward")}
        undecorated = {name: original.__wrapped__ for name, original in originals.items()}
        # As on a machine with an accelerator: without one, on a torch that casts in recompute by itself,
        # regions have nothing to replay and never switch the hooks (RecomputeReplay.records_regions).
        with mock.patch.object(recompute_state, "accelerator_available", lambda: True), plugin(True):
            fix = _install._active.get("recompute", (None, None))[0]
            if fix is None:
                self.skipTest("the recompute fix is not needed on this torch, so FSDP's hooks are not wrapped")
            _install.install_armed()  # the checkpoint hooks' wrappers, as from the first fully_shard (Note [Armed])
            for name, original in originals.items():
                decorator = _compat.dynamo_decorator(original)
                self.assertIsNotNone(decorator, f"FSDPState.{name} is not decorated for dynamo on this torch")
                if fix.switches_hooks:
                    # torch's decorated hook stays in place; only while a checkpoint region runs
                    # does it call our wrapper, inside torch's decorator.
                    self.assertIs(state_cls.__dict__[name], original)
                    cell = _compat.decorated_method_cell(original)
                    seen = []

                    def region(x: torch.Tensor, cell=cell) -> torch.Tensor:
                        seen.append(cell.cell_contents)
                        return x.sin()

                    self.assertIs(cell.cell_contents, undecorated[name])
                    x = torch.ones(2, requires_grad=True)
                    checkpoint(region, x, use_reentrant=False).sum().backward()
                    self.assertEqual(len(seen), 2)  # forward and recompute
                    self.assertIsNot(seen[0], undecorated[name])
                    self.assertIs(seen[0].__wrapped__, undecorated[name])
                    # No FSDP module ran in the region: its recompute is torch's alone.
                    self.assertIs(seen[1], undecorated[name])
                    self.assertIs(cell.cell_contents, undecorated[name])
                else:
                    wrapper = state_cls.__dict__[name]
                    self.assertIsNot(wrapper, original)
                    self.assertIs(_compat.dynamo_decorator(wrapper)[0], decorator[0])
        with plugin(False):
            for name, original in originals.items():
                self.assertIs(state_cls.__dict__[name], original)
                cell = _compat.decorated_method_cell(original)
                self.assertTrue(cell is None or cell.cell_contents is undecorated[name])

    def test_traceable_fsdp2_warns_once(self) -> None:
        decorated = _compat.dynamo_decorator(_compat.load_internals().FSDPState.__dict__["_pre_forward"])
        if decorated is None or not _compat.dynamo_decorator_reads_skip_fsdp_hooks(decorated[0]):
            self.skipTest("FSDP's hooks on this torch ignore torch._dynamo.config.skip_fsdp_hooks (2.12+)")
        with plugin(False), torch._dynamo.config.patch(skip_fsdp_hooks=False):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch_fsdp_ext.install()
                torch_fsdp_ext.uninstall()
                torch_fsdp_ext.install()
        messages = [str(w.message) for w in caught if "skip_fsdp_hooks" in str(w.message)]
        self.assertEqual(len(messages), 1, messages)


if __name__ == "__main__":
    run_tests()
