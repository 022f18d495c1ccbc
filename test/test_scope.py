"""The scope of the upcast and a late install (torch_fsdp_ext issue 43), on two gloo ranks.

Scope (Note [Scope of the upcast]): whatever module an entry point is given, the plugin
decides per FSDP root. Each case trains bit for bit as the hand workaround
(``model.float()`` before ``fully_shard`` on the mixed model, no plugin), and the unfixed
path (the plugin deciding over the module it was handed, as it did before) is shown to
differ from it silently.

Late install (Note [Installed late]): a model sharded before the plugin was installed
trains as the workaround when nothing was loaded in between; when weights were, the
rounding cannot be undone, and the upcast says so (one WARNING), or the step's error
does where the optimizer state is stale.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import unittest.mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from torch_fsdp_ext import MixedParamDtypeError
from torch_fsdp_ext._dtype import _fix as _dtype_fix

from common import (
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    TinyLlama,
    batch,
    lm_loss,
    needs_dtype_fix,
    plugin,
    plugin_specific,
    seed_000_model,
    shard_model,
)

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FULL = StateDictOptions(full_state_dict=True)
LATE = "before torch_fsdp_ext was installed"


def bf16_model_with_fp32_norm(seed: int = 0) -> TinyLlama:
    """Every block bf16, only the final norm fp32."""
    torch.manual_seed(seed)
    model = TinyLlama().to(torch.bfloat16)
    model.norm.float()
    return model


def fp32_model(seed: int) -> TinyLlama:
    """Trained fp32 weights: values that bf16 cannot hold."""
    torch.manual_seed(seed)
    return TinyLlama()


def policy_and_value(workaround: bool) -> nn.ModuleDict:
    """Two models, each fully_shard-ed on its own, under one plain container."""
    policy = seed_000_model(0)
    torch.manual_seed(5)
    value = TinyLlama().to(torch.bfloat16)
    return nn.ModuleDict({
        "policy": shard_model(policy.float() if workaround else policy, mp_policy=MP),
        "value": shard_model(value, mp_policy=MP),
    })


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()


def train(module: nn.Module, models: list[nn.Module], rank: int, steps: int = 2) -> tuple[list, dict]:
    """AdamW over ``module``; the summed loss of ``models``; the losses and updated parameters."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = batch(rank, step)
        loss = sum(lm_loss(model(tokens), tokens) for model in models)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, {name: full(p) for name, p in module.named_parameters()}


def equal(a: tuple[list, dict], b: tuple[list, dict]) -> bool:
    (losses_a, params_a), (losses_b, params_b) = a, b
    return (
        all(torch.equal(x, y) for x, y in zip(losses_a, losses_b))
        and params_a.keys() == params_b.keys()
        and all(p.dtype == params_b[n].dtype and torch.equal(p, params_b[n]) for n, p in params_a.items())
    )


def max_difference(a: tuple[list, dict], b: tuple[list, dict]) -> float:
    return max((p.float() - b[1][n].float()).abs().max().item() for n, p in a[1].items())


@contextlib.contextmanager
def unfixed_scope():
    """The plugin as it was: each moment decided over the module it was handed."""
    with unittest.mock.patch.object(_dtype_fix.DtypeFix, "upcast_model", lambda fix, module: fix.upcast_root(module)):
        yield


@plugin_specific
@needs_dtype_fix
class TestScopeIsTheFSDPRoot(FSDPExtTestCase):
    def container_run(self, workaround: bool, load_first: bool) -> tuple[list, dict]:
        container = policy_and_value(workaround)
        source = nn.ModuleDict({"policy": fp32_model(1), "value": fp32_model(2)}).state_dict()
        if not load_first:
            torch.optim.AdamW(container.parameters())  # the optimizer's upcast moment comes first
        set_model_state_dict(container, source, options=FULL)
        return train(container, list(container.values()), self.rank)

    def test_several_roots_under_one_container_are_decided_each_on_its_own(self):
        with plugin(False):
            workaround = self.container_run(True, True)
        self.assertEqual(workaround[1]["value.layers.0.wq.weight"].dtype, torch.bfloat16)
        with plugin(True):
            with unfixed_scope():
                unfixed = self.container_run(False, True)
            load_first = self.container_run(False, True)
            optimizer_first = self.container_run(False, False)
        self.assertEqual(unfixed[1]["value.layers.0.wq.weight"].dtype, torch.float32)  # the value model upcast
        self.assertFalse(equal(unfixed, workaround))
        self.assertTrue(equal(load_first, workaround))
        self.assertTrue(equal(optimizer_first, workaround))

    def block_run(self, workaround: bool, load) -> tuple[list, dict]:
        model = bf16_model_with_fp32_norm()
        shard_model(model.float() if workaround else model, mp_policy=MP)
        load(model)
        return train(model, [model], self.rank)

    def test_a_load_into_a_sub_block_upcasts_its_whole_model_first(self):
        source = fp32_model(1)
        block = {k.removeprefix("layers.0."): v for k, v in source.state_dict().items() if k.startswith("layers.0.")}
        with plugin(False):
            sharded_source = shard_model(fp32_model(1))  # DTensor values for the modules' own load_state_dict
        sharded_block = sharded_source.layers[0].state_dict()
        sharded_wq = sharded_source.layers[0].wq.state_dict()
        loads = {
            "set_model_state_dict(model.layers[0])": lambda m: set_model_state_dict(m.layers[0], block, options=FULL),
            "model.layers[0].load_state_dict": lambda m: m.layers[0].load_state_dict(sharded_block),
            "model.layers[0].wq.load_state_dict": lambda m: m.layers[0].wq.load_state_dict(sharded_wq),
        }
        for name, load in loads.items():
            with self.subTest(name):
                with plugin(False):
                    workaround = self.block_run(True, load)
                with plugin(True):
                    with unfixed_scope():
                        unfixed = self.block_run(False, load)
                    fixed = self.block_run(False, load)
                self.assertFalse(equal(unfixed, workaround), name)  # rounded to bf16 on the way in
                self.assertTrue(equal(fixed, workaround), f"{name}: {max_difference(fixed, workaround)}")


@plugin_specific
@needs_dtype_fix
class TestInstalledLate(FSDPExtTestCase):
    def masters(self) -> dict:
        """A full state dict of fp32 master weights, as a training run saves it."""
        with plugin(False):
            model = shard_model(seed_000_model(0).float(), mp_policy=MP)
            train(model, [model], self.rank, steps=1)
            return get_model_state_dict(model, options=FULL)

    def late_run(self, load) -> tuple[tuple[list, dict], list[str]]:
        """fully_shard and ``load`` without the plugin, then install it, then the optimizer and training."""
        with plugin(False):
            model = shard_model(seed_000_model(0), mp_policy=MP)
            load(model)
            with self.assertLogs("torch_fsdp_ext", logging.WARNING) as logs:
                torch_fsdp_ext.install()
                result = train(model, [model], self.rank)
                logging.getLogger("torch_fsdp_ext").warning("end")  # a record on every rank: assertLogs needs one
            torch_fsdp_ext.uninstall()
        return result, [record.getMessage() for record in logs.records if LATE in record.getMessage()]

    def workaround_run(self, load) -> tuple[list, dict]:
        with plugin(False):
            model = shard_model(seed_000_model(0).float(), mp_policy=MP)
            load(model)
            return train(model, [model], self.rank)

    def test_installed_after_fully_shard_trains_as_the_workaround(self):
        result, said = self.late_run(lambda model: None)
        self.assertTrue(equal(result, self.workaround_run(lambda model: None)))
        self.assertEqual(len(said), 1 if self.rank == 0 else 0)  # weights may have been loaded: said once

    def test_installed_after_a_load_says_so(self):
        masters = self.masters()
        path = [os.path.join(tempfile.mkdtemp(prefix="late_"), "ckpt")]
        dist.broadcast_object_list(path, src=0)
        dcp.save({"model": masters}, checkpoint_id=path[0])

        def dcp_model_only(model: nn.Module) -> None:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=path[0])
            set_model_state_dict(model, state["model"])

        loads = {
            "full state dict": lambda model: set_model_state_dict(model, masters, options=FULL),
            "DCP model-only": dcp_model_only,
        }
        for name, load in loads.items():
            with self.subTest(name):
                result, said = self.late_run(load)
                workaround = self.workaround_run(load)
                self.assertFalse(equal(result, workaround), name)  # rounded before the plugin existed
                self.assertEqual(len(said), 1 if self.rank == 0 else 0, name)
                if said:
                    self.assertIn("TinyLlama was sharded (fully_shard) before torch_fsdp_ext was installed", said[0])
                    self.assertIn("Install the plugin before fully_shard and before loading weights", said[0])

    def test_a_full_resume_before_the_install_raises_what_happened(self):
        with plugin(False):
            source = shard_model(seed_000_model(0).float(), mp_policy=MP)
            optimizer = torch.optim.AdamW(source.parameters(), lr=1e-2)
            tokens = batch(self.rank)
            lm_loss(source(tokens), tokens).backward()
            optimizer.step()
            model_state, optim_state = get_state_dict(source, optimizer, options=FULL)
            model = shard_model(seed_000_model(0), mp_policy=MP)
            resumed = torch.optim.AdamW(model.parameters(), lr=1e-2)
            set_state_dict(model, resumed, model_state_dict=model_state, optim_state_dict=optim_state, options=FULL)
            torch_fsdp_ext.install()
            try:
                lm_loss(model(tokens), tokens).backward()
                with self.assertRaises(MixedParamDtypeError) as caught:
                    resumed.step()
            finally:
                torch_fsdp_ext.uninstall()
        text = str(caught.exception)
        self.assertTrue(text.startswith("torch_fsdp_ext was installed after this model was sharded"), text)
        self.assertIn("move `import torch_fsdp_ext` before fully_shard and before loading", text)
        self.assertNotIn("install the plugin before building the optimizer", text)


if __name__ == "__main__":
    run_tests()
