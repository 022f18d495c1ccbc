"""``unshard()`` as the first FSDP call: the rollout and weight-sync pattern of RL trainers.

The weights are gathered once before an optimizer exists (``root.unshard()`` or
``unshard(async_op=True).wait()``), read by a no-grad forward or a state dict while the
module holds its unsharded parameters, resharded, and then trained. With the plugin
(``upcast``) this must train bit for bit as the hand workaround (``model.float()`` before
``fully_shard``, no plugin needed): losses, gradients, updated parameters and what the
rollout read, on every rank. With ``preserve`` it must train as the same model does when
the rollout is left out (the gathered weights are only read).
"""

from __future__ import annotations

import torch
from torch.testing._internal import common_distributed
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from common import (
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    TinyLlama,
    batch,
    full_grads,
    full_params,
    lm_loss,
    mixed_llama,
    needs_dtype_fix,
    plugin,
    plugin_specific,
    seed_000_model,
    shard_model,
)

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STEPS = 2


def bf16_blocks_fp32_norm(seed: int = 0) -> TinyLlama:
    """Every block uniformly bf16 (a block alone needs no upcast), the final norm fp32."""
    torch.manual_seed(seed)
    model = TinyLlama().to(torch.bfloat16)
    model.norm.float()
    return model


def rollout(model, rank: int, how: str) -> dict:
    """What an RL trainer does before its optimizer exists; returns what it read."""
    target = model.layers[0] if how == "unshard layers[0]" else model
    if how == "unshard async":
        target.unshard(async_op=True).wait()
    else:
        target.unshard()
    read = {"unsharded": {name: p.detach().clone() for name, p in target.named_parameters(recurse=False)}}
    if how == "unshard, state_dict":
        read["state_dict"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if how == "upcast_now while unsharded":
        read["upcast"] = sorted(torch_fsdp_ext.upcast_now(model))
    with torch.no_grad():
        read["logits"] = model(batch(rank, 99))
    # Note: the root keeps its parameters unsharded after a forward (it reshards after backward); an
    # optimizer must take the sharded ones.
    for module in {id(m): m for m in (target, model)}.values():
        module.reshard()
    return read


def train(model, rank: int, steps: int = STEPS) -> tuple[list, list, dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        tokens = batch(rank, step)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        grads.append(full_grads(model))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, grads, full_params(model)


# Note: many short trainings per test; the harness's per-test limit is for a hung collective.
for _name in ("test_rollout_before_the_optimizer_trains_as_the_workaround",
              "test_rollout_before_the_optimizer_keeps_preserve_as_without_it"):
    common_distributed.TIMEOUT_OVERRIDE[_name] = 400
ROLLOUTS = ("unshard", "unshard async", "unshard layers[0]", "unshard, state_dict", "upcast_now while unsharded")


@plugin_specific
@needs_dtype_fix
class TestUnshardFirst(FSDPExtTestCase):
    def assert_same(self, mine, theirs, what: str) -> None:
        if isinstance(mine, dict):
            self.assertEqual(mine.keys(), theirs.keys(), what)
            for key in mine:
                self.assert_same(mine[key], theirs[key], f"{what}: {key}")
        elif isinstance(mine, (list, tuple)):
            self.assertEqual(len(mine), len(theirs), what)
            for i, (a, b) in enumerate(zip(mine, theirs)):
                self.assert_same(a, b, f"{what}[{i}]")
        elif isinstance(mine, torch.Tensor):
            self.assertEqual(mine.dtype, theirs.dtype, what)
            self.assertTrue(torch.equal(mine, theirs), what)
        else:
            self.assertEqual(mine, theirs, what)

    def assert_trains_as_workaround(self, make, rollouts) -> None:
        for how in rollouts:
            with self.subTest(rollout=how), plugin(True):
                results = []
                for workaround in (False, True):
                    model = make()
                    model = shard_model(model.float() if workaround else model, mp_policy=MP)
                    read = rollout(model, self.rank, how)
                    results.append((read, train(model, self.rank)))
                (mine_read, mine), (their_read, theirs) = results
                if how == "upcast_now while unsharded":
                    # The workaround's model is fp32 already; the plugin's was decided by its unshard().
                    self.assertEqual(mine_read.pop("upcast"), their_read.pop("upcast"))
                self.assert_same(mine_read, their_read, "rollout")
                self.assert_same(mine, theirs, "training")
                self.assertEqual({p.dtype for p in model.parameters()}, {torch.float32})

    def test_rollout_before_the_optimizer_trains_as_the_workaround(self):
        self.assert_trains_as_workaround(seed_000_model, ROLLOUTS)

    def test_a_blocks_unshard_decides_its_whole_model(self):
        """A uniform bf16 block unsharded first is upcast with its model (the norm outside it is fp32)."""
        self.assert_trains_as_workaround(bf16_blocks_fp32_norm, ("unshard layers[0]", "unshard, state_dict"))

    def test_rollout_before_the_optimizer_keeps_preserve_as_without_it(self):
        mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
        for how in ROLLOUTS:
            with self.subTest(rollout=how), plugin(True, dtype_strategy="preserve"):
                plain = train(shard_model(mixed_llama(), mp_policy=mp), self.rank)
                model = shard_model(mixed_llama(), mp_policy=mp)
                loaded = {name: p.dtype for name, p in model.named_parameters()}
                read = rollout(model, self.rank, how)
                if how == "upcast_now while unsharded":
                    self.assertEqual(read["upcast"], [])
                self.assertEqual({name: p.dtype for name, p in model.named_parameters()}, loaded)
                self.assert_same(train(model, self.rank), plain, "training")


if __name__ == "__main__":
    run_tests()
