"""Orders: whatever user code does between ``fully_shard`` and training, and around a resume,
the plugin's upcast trains bit for bit as the hand workaround (``model.float()`` before
``fully_shard``, no plugin), or both raise.

The order matrix (``TestOrderMatrix``) generates sequences of what users do (build an
optimizer, get / set model, optimizer or both state dicts, sharded or full, DCP save and
load, ``Module.to``, freeze / unfreeze, an eval forward, a train step, ``unshard()`` /
``reshard()``, ``torch_fsdp_ext.upcast_now``) with hypothesis's stateful testing, on one rank for
breadth; ``TestOrderFindings`` has one test per order found broken before, on two ranks
where the ranks matter (DCP, rank-0 broadcast).

Note: both models of a pair live in one process with the plugin installed: the
workaround's model is uniform fp32, which the plugin leaves alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test
from torch.testing._internal import common_distributed
from torch.testing._internal.common_utils import run_tests

import torch_fsdp_ext
from torch_fsdp_ext import MixedParamDtypeError, _compat

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
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-1),
}
FULL = StateDictOptions(full_state_dict=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _clone(value):
    """A snapshot of a state dict: what a checkpoint on disk would hold."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def bf16_blocks_fp32_norm(seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama().to(torch.bfloat16)
    model.norm.float()
    return model


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()


class Run:
    """One model of a pair and what user code did to it: the plugin's (mixed, as loaded) or the workaround's.

    ``layout``: "one" model (bf16, fp32 norms and routers), "bf16 blocks" (every block bf16, only
    the final norm fp32: a block alone is uniform), or a "container" (a plain ``nn.ModuleDict``) of two
    models each ``fully_shard``-ed on its own: the mixed one as ``policy`` and an all-bf16 ``value``
    model, which the workaround leaves as it is (``model.float()`` is for a mixed model).
    """

    def __init__(self, workaround: bool, rank: int, seed: int = 0, layout: str = "one") -> None:
        model = bf16_blocks_fp32_norm(seed) if layout == "bf16 blocks" else seed_000_model(seed)
        model = shard_model(model.float() if workaround else model, mp_policy=MP)
        if layout == "container":
            torch.manual_seed(seed + 5)
            value = shard_model(TinyLlama().to(torch.bfloat16), mp_policy=MP)
            self.model, self.roots, self.mixed = nn.ModuleDict({"policy": model, "value": value}), [model, value], model
        else:
            self.model, self.roots, self.mixed = model, [model], model
        self.rank = rank
        self.optimizer: torch.optim.Optimizer | None = None
        self.saved: dict[str, object] = {}
        self.losses: list[torch.Tensor] = []
        self.step = 0

    # -- what users do ----------------------------------------------------------------

    def make_optimizer(self, kind: str) -> None:
        # Note: after a no_grad forward (or an unshard()) a module holds its unsharded parameters until it
        # is resharded; an optimizer must take the sharded ones (torch crashes stepping the others).
        self.reshard()
        self.optimizer = OPTIMIZERS[kind](self.model.parameters())

    def unshard(self, how: str) -> None:
        """``how``: "root", "root (async)" (``unshard(async_op=True).wait()``) or "layers[0]"."""
        for root in self.roots:
            module = root.layers[0] if how == "layers[0]" else root
            handle = module.unshard(async_op=how == "root (async)")
            if handle is not None:
                handle.wait()

    def reshard(self) -> None:
        for root in self.roots:
            for module in (root, *root.layers):
                module.reshard()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return sum(lm_loss(root(tokens), tokens) for root in self.roots)

    def train_step(self) -> None:
        tokens = batch(self.rank, self.step)
        loss = self.loss(tokens)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.append(loss.detach())
        self.step += 1

    def eval_forward(self) -> None:
        with torch.no_grad():
            self.losses.append(sum(root(batch(self.rank, 99)).float().sum() for root in self.roots))

    def get(self, what: str, options: StateDictOptions | None = None, key: str | None = None) -> None:
        """``what``: model, optim, both, or optim_then_model (a dict literal in that order); kept as ``key``."""
        m, o = self.model, self.optimizer
        if what == "model":
            state = {"model": get_model_state_dict(m, options=options)}
        elif what == "optim":
            state = {"optim": get_optimizer_state_dict(m, o, options=options)}
        elif what == "both":
            model_state, optim_state = get_state_dict(m, o, options=options)
            state = {"model": model_state, "optim": optim_state}
        else:
            state = {"optim": get_optimizer_state_dict(m, o, options=options),
                     "model": get_model_state_dict(m, options=options)}
        self.saved[key or what] = _clone(state)

    def set(self, what: str, options: StateDictOptions | None = None) -> None:
        self.set_saved(what, what, options)

    def set_saved(self, key: str, what: str, options: StateDictOptions | None = None) -> None:
        state = _clone(self.saved[key])
        m, o = self.model, self.optimizer
        if what == "model":
            set_model_state_dict(m, state["model"], options=options)
        elif what == "optim":
            set_optimizer_state_dict(m, o, state["optim"], options=options)
        elif what == "both":
            set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        else:
            set_optimizer_state_dict(m, o, state["optim"], options=options)
            set_model_state_dict(m, state["model"], options=options)

    def dcp_state(self, optim_first: bool) -> dict:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        if optim_first:
            return {"optim": get_optimizer_state_dict(self.model, self.optimizer),
                    "model": get_model_state_dict(self.model)}
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def dcp_save(self, path: str, optim_first: bool) -> None:
        dcp.save(self.dcp_state(optim_first), checkpoint_id=path)

    def dcp_load(self, path: str, optim_first: bool) -> None:
        state = self.dcp_state(optim_first)
        dcp.load(state, checkpoint_id=path)
        if "optim" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])

    def set_embed_trainable(self, trainable: bool) -> None:
        self.mixed.embed.weight.requires_grad_(trainable)

    def load_sub_module(self, how: str, source: nn.Module) -> None:
        """Trained fp32 weights (``source``: a sharded fp32 model) into a part of the mixed model only."""
        if how == "set_model_state_dict(layers[0])":
            block = {k.removeprefix("layers.0."): _full(v) for k, v in source.state_dict().items()
                     if k.startswith("layers.0.")}
            set_model_state_dict(self.mixed.layers[0], block, options=FULL)
        elif how == "layers[0].load_state_dict":
            self.mixed.layers[0].load_state_dict(_clone(source.layers[0].state_dict()))
        else:
            self.mixed.layers[0].wq.load_state_dict(_clone(source.layers[0].wq.state_dict()))

    # -- what is compared -----------------------------------------------------------------

    def params(self) -> dict[str, torch.Tensor]:
        return {name: _full(p) for name, p in self.model.named_parameters()}

    def optimizer_state(self) -> dict:
        if self.optimizer is None:
            return {}
        names = {id(p): name for name, p in self.model.named_parameters()}
        return {
            (names.get(id(p), "?"), key): _full(value) if isinstance(value, torch.Tensor) else value
            for p, state in self.optimizer.state.items()
            for key, value in state.items()
        }


def assert_trains_as_workaround(test: unittest.TestCase, mine: Run, theirs: Run) -> None:
    """Losses, parameters and optimizer state bit for bit; trainable parameters in the workaround's dtype.

    Frozen parameters keep their loaded dtype by design (their values equal the workaround's)."""
    test.assertEqual(len(mine.losses), len(theirs.losses))
    for i, (a, b) in enumerate(zip(mine.losses, theirs.losses)):
        test.assertTrue(torch.equal(a, b), f"loss {i}: {a.item()} vs {b.item()}")
    params, reference = mine.params(), theirs.params()
    trainable = {name for name, p in mine.model.named_parameters() if p.requires_grad}
    test.assertEqual(params.keys(), reference.keys())
    for name, value in params.items():
        if name in trainable:
            test.assertEqual(value.dtype, reference[name].dtype, name)
        test.assertTrue(torch.equal(value.to(reference[name].dtype), reference[name]), name)
    state, reference_state = mine.optimizer_state(), theirs.optimizer_state()
    test.assertEqual(state.keys(), reference_state.keys())
    for key, value in state.items():
        expected = reference_state[key]
        if isinstance(value, torch.Tensor):
            if key[0] in trainable:  # a frozen parameter's state (Adagrad's, made at construction) follows its dtype
                test.assertEqual(value.dtype, expected.dtype, key)
            test.assertTrue(torch.equal(value.to(expected.dtype), expected), key)
        else:
            test.assertEqual(value, expected, key)


def documented_difference(trace: list[str], error: BaseException) -> bool:
    """The one order docs/how-it-works.md lists where the plugin cannot train as the workaround: an
    optimizer that makes state in its constructor (Adagrad) built while a parameter is frozen, the
    parameter unfrozen later. Its state was made in the loaded dtype; the plugin names it at the step."""
    if not isinstance(error, MixedParamDtypeError) or "still bfloat16" not in str(error):
        return False
    built = trace.index("optimizer adagrad") if "optimizer adagrad" in trace else len(trace)
    return "embed.requires_grad_(False)" in trace[:built] and "embed.requires_grad_(True)" in trace[built:]


def both(test: unittest.TestCase, runs: tuple[Run, Run], operation, trace: list[str] | None = None) -> bool:
    """Apply ``operation`` to both runs; True if both ran, False if both raised (or the plugin raised
    in the documented difference: ``documented_difference``)."""
    outcomes = []
    for run in runs:
        try:
            operation(run)
            outcomes.append(None)
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - compared between the two runs
            outcomes.append(e)
    mine, theirs = outcomes
    if mine is None and theirs is None:
        return True
    if theirs is None and trace is not None and documented_difference(trace, mine):
        trace.append("documented difference")
        return False
    if theirs is None and trace is not None and installed_late_error(trace, mine):
        trace.append("said late")
        return False
    test.assertIsNotNone(mine, f"only the workaround raised: {theirs!r}")
    test.assertIsNotNone(theirs, f"only the plugin raised: {mine!r}")
    return False


@plugin_specific
@needs_dtype_fix
class TestOrderFindings(FSDPExtTestCase):
    """Each order that once silently diverged from, or crashed where, the workaround trains."""

    def pair(self) -> tuple[Run, Run]:
        return Run(False, self.rank), Run(True, self.rank)

    def shared_path(self, name: str) -> str:
        path = [os.path.join(tempfile.mkdtemp(prefix="orders_"), name)]
        dist.broadcast_object_list(path, src=0)
        return path[0]

    def test_dcp_resume_with_the_optimizer_state_dict_made_before_the_model(self):
        with plugin(True):
            path = self.shared_path("ckpt")
            first = self.pair()
            for run in first:
                run.make_optimizer("adamw")
                run.train_step()
                run.train_step()
                run.dcp_save(path + ("w" if run is first[1] else "p"), optim_first=True)
            resumed = self.pair()
            for run, before in zip(resumed, first):
                run.make_optimizer("adamw")
                run.dcp_load(path + ("w" if run is resumed[1] else "p"), optim_first=True)
                run.step = before.step
                run.losses = list(before.losses)
                run.train_step()
                run.train_step()
                before.train_step()
                before.train_step()
            assert_trains_as_workaround(self, resumed[0], resumed[1])
            assert_trains_as_workaround(self, resumed[0], first[0])  # the resume is exact

    def test_full_state_dict_resume_loads_the_optimizer_before_the_model(self):
        for options in (FULL, BROADCAST):
            with self.subTest(broadcast=options is BROADCAST), plugin(True):
                source = self.pair()
                for run in source:
                    run.make_optimizer("adamw")
                    run.train_step()
                    run.get("both", FULL)
                for order in ("both", "optim_then_model"):
                    resumed = self.pair()
                    for run, before in zip(resumed, source):
                        run.make_optimizer("adamw")
                        run.saved = {order: before.saved["both"]}
                        run.set(order, options)
                        run.train_step()
                    assert_trains_as_workaround(self, *resumed)

    def test_module_to_after_the_upcast(self):
        with plugin(True):
            for move in (lambda m: m.to("cpu"), lambda m: m.float(), lambda m: m.to(torch.bfloat16)):
                runs = self.pair()
                self.assertEqual(torch_fsdp_ext.upcast_now(runs[0].model)[:1], ["embed.weight"])
                for run in runs:
                    move(run.model)
                    run.make_optimizer("adamw")
                    run.train_step()
                assert_trains_as_workaround(self, *runs)
                self.assertEqual(torch_fsdp_ext.loaded_dtypes(runs[0].model)["layers.0.wq.weight"], torch.bfloat16)

    def test_optimizer_that_makes_state_in_its_constructor(self):
        with plugin(True):
            runs = self.pair()
            for run in runs:
                run.make_optimizer("adagrad")
                run.train_step()
                run.train_step()
            assert_trains_as_workaround(self, *runs)

    def test_unfrozen_after_the_first_forward_trains_as_the_workaround(self):
        with plugin(True):
            runs = self.pair()
            for run in runs:
                run.set_embed_trainable(False)
                run.make_optimizer("adamw")
                run.train_step()
                run.set_embed_trainable(True)
                run.train_step()
                run.train_step()
            self.assertEqual(runs[0].model.embed.weight.dtype, torch.float32)
            assert_trains_as_workaround(self, *runs)

    def test_refusal_leaves_the_model_as_loaded(self):
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            self.skipTest("torchao is not installed")
        with plugin(True):
            model = seed_000_model()
            convert_to_float8_training(
                model.layers[0], config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                module_filter_fn=lambda module, fqn: fqn == "wq",
            )
            loaded = {name: p.dtype for name, p in model.named_parameters()}
            shard_model(model, mp_policy=MP)
            with self.assertRaises(MixedParamDtypeError) as caught:
                torch_fsdp_ext.upcast_now(model)
            self.assertEqual({name: p.dtype for name, p in model.named_parameters()}, loaded)
            self.assertIn("layers.0.wq.weight: bfloat16", str(caught.exception))
            self.assertIn("model.float() before convert_to_float8_training", str(caught.exception))
            with self.assertRaises(MixedParamDtypeError):  # the first forward says the same, still casting nothing
                model(batch(self.rank))
            self.assertEqual({name: p.dtype for name, p in model.named_parameters()}, loaded)

    def test_unshard_before_the_optimizer(self):
        """A rollout or weight sync first: ``unshard()``, then a state dict, ``upcast_now`` and a no_grad forward
        meet the unsharded parameters; ``reshard()``, an optimizer, training (every layout, both ranks)."""
        for layout in ("one", "bf16 blocks", "container"):
            for how in ("root", "root (async)", "layers[0]"):
                with self.subTest(layout=layout, unshard=how), plugin(True):
                    runs = Run(False, self.rank, layout=layout), Run(True, self.rank, layout=layout)
                    for run in runs:
                        run.unshard(how)
                        run.get("model", FULL, key="model/full")
                        torch_fsdp_ext.upcast_now(run.model)
                        run.eval_forward()
                        run.reshard()
                        run.make_optimizer("adamw")
                        run.train_step()
                        run.train_step()
                    for key, value in runs[0].saved["model/full"]["model"].items():
                        self.assertTrue(torch.equal(value, runs[1].saved["model/full"]["model"][key]), key)
                    assert_trains_as_workaround(self, *runs)

    def test_upcast_now_gives_the_final_dtypes_before_the_first_forward(self):
        with plugin(True):
            runs = self.pair()
            self.assertIn("layers.1.w2.weight", torch_fsdp_ext.upcast_now(runs[0].model))
            self.assertEqual(torch_fsdp_ext.upcast_now(runs[0].model), [])  # once
            emas = []
            for run in runs:
                self.assertEqual({p.dtype for p in run.model.parameters()}, {torch.float32})
                emas.append({name: _full(p).clone() for name, p in run.model.named_parameters()})
                run.make_optimizer("adamw")
                for _ in range(2):
                    run.train_step()
                    for name, p in run.model.named_parameters():
                        emas[-1][name].lerp_(_full(p), 0.5)
            assert_trains_as_workaround(self, *runs)
            for name, value in emas[0].items():
                self.assertTrue(torch.equal(value, emas[1][name]), name)
            with torch.device("meta"):
                meta = shard_model(seed_000_model(), mp_policy=MP)
            with self.assertRaisesRegex(ValueError, "still on the meta device"):
                torch_fsdp_ext.upcast_now(meta)


# Sequences the matrix runs per release in CI; TORCH_FSDP_EXT_ORDER_EXAMPLES runs more (nightly), and
# TORCH_FSDP_EXT_ORDER_EXAMPLES_2RANKS more of its two-rank variant.
ORDER_EXAMPLES = int(os.environ.get("TORCH_FSDP_EXT_ORDER_EXAMPLES", "60"))
ORDER_EXAMPLES_2RANKS = int(os.environ.get("TORCH_FSDP_EXT_ORDER_EXAMPLES_2RANKS", "6"))
STATE_DICT_OPTIONS = {"sharded": None, "full": FULL, "broadcast": BROADCAST}
SUB_MODULE_LOADS = ["set_model_state_dict(layers[0])", "layers[0].load_state_dict", "layers[0].wq.load_state_dict"]
LATE = "before torch_fsdp_ext was installed"  # Note [Installed late]: what the upcast says


def installed_late_error(trace: list[str], error: BaseException) -> bool:
    """Note [Installed late]: an optimizer whose state predates a late install; the plugin's step says so."""
    return (
        isinstance(error, MixedParamDtypeError)
        and "installed after this model was sharded" in str(error)
        and "install (late)" in trace
    )


class LateWarnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.said += LATE in record.getMessage()


class OrderMachine(RuleBasedStateMachine):
    """A pair of runs (plugin, workaround) and a sequence of what users do to both.

    Each rule is applied to both runs: both must go on, or both raise (the sequence
    then ends there). At the end both take a train step, and must then be equal
    (``assert_trains_as_workaround``): the sequence is what happens before training goes on.

    A sequence starts with one model (``Run``'s layouts) or with two under one container, and with the plugin
    installed or not (then ``install (late)`` comes in it, before any forward). Weights loaded, or
    optimizer state made, before a late install were in the loaded dtypes before the plugin existed:
    such a sequence trains as the workaround, or the upcast said so (its one WARNING), or the step's
    error did, or the plugin cast nothing (the model was uniform by its first moment: torch's training).
    """

    test: unittest.TestCase  # set by the test that runs the machine
    sequences: list  # the rule names of every sequence run, for the test's counts

    def __init__(self) -> None:
        super().__init__()
        self.runs: tuple[Run, Run] | None = None
        self.raised = False
        directory = [tempfile.mkdtemp(prefix="order_matrix_")]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(directory, src=0)  # DCP writes every rank's shards into one directory
        self.directory = directory[0]
        self.checkpoint_saved = False
        self.installed = True
        self.loaded = False  # weights or state were loaded (a late install then cannot undo their rounding)
        self.unseen_before_install = False
        self.source: nn.Module | None = None
        self.warnings = LateWarnings()
        logging.getLogger("torch_fsdp_ext").addHandler(self.warnings)
        self.trace: list[str] = []
        OrderMachine.sequences.append(self.trace)

    @initialize(layout=st.sampled_from(["one", "bf16 blocks", "container"]), installed=st.booleans())
    def build(self, layout: str, installed: bool) -> None:
        if not installed:
            torch_fsdp_ext.uninstall()
            self.installed = False
        rank = self.test.rank
        self.runs = (Run(False, rank, layout=layout), Run(True, rank, layout=layout))
        self.trace.append(f"{layout}{'' if installed else ', not installed'}")

    def apply(self, name: str, operation) -> None:
        self.trace.append(name)
        if not both(self.test, self.runs, operation, self.trace):
            self.raised = True
            if self.trace[-1] not in ("documented difference", "said late"):
                self.trace.append("both raised")

    def has_optimizer(self) -> bool:
        return not self.raised and self.runs[0].optimizer is not None

    def can_run(self) -> bool:
        """A forward needs the plugin (the mixed model's first forward is FSDP's uniform-dtype assertion)."""
        return not self.raised and self.installed

    @precondition(lambda self: not self.raised and self.runs[0].optimizer is None)
    @rule(kind=st.sampled_from(sorted(OPTIMIZERS)))
    def make_optimizer(self, kind: str) -> None:
        self.apply(f"optimizer {kind}", lambda run: run.make_optimizer(kind))

    @precondition(lambda self: self.has_optimizer() and self.installed)
    @rule()
    def train_step(self) -> None:
        self.apply("train step", Run.train_step)

    @precondition(can_run)
    @rule()
    def eval_forward(self) -> None:
        self.apply("no_grad forward", Run.eval_forward)

    @precondition(lambda self: not self.raised)
    @rule(mode=st.sampled_from(["sharded", "full"]))
    def get_model_state_dict(self, mode: str) -> None:
        self.apply(f"get model ({mode})", lambda run: run.get("model", STATE_DICT_OPTIONS[mode], key=f"model/{mode}"))

    @precondition(has_optimizer)
    @rule(what=st.sampled_from(["optim", "both", "optim_then_model"]), mode=st.sampled_from(["sharded", "full"]))
    def get_state_dict(self, what: str, mode: str) -> None:
        self.apply(f"get {what} ({mode})", lambda run: run.get(what, STATE_DICT_OPTIONS[mode], key=f"{what}/{mode}"))

    @precondition(lambda self: not self.raised and self.runs[0].saved)
    @rule(data=st.data(), mode=st.sampled_from(sorted(STATE_DICT_OPTIONS)))
    def set_state_dict(self, data, mode: str) -> None:
        key = data.draw(st.sampled_from(sorted(self.runs[0].saved)))
        what, saved_mode = key.split("/")
        if (mode == "sharded") != (saved_mode == "sharded"):
            mode = "sharded" if saved_mode == "sharded" else "full"
        self.loaded = True
        self.apply(f"set {key} as {mode}", lambda run: run.set_saved(key, what, STATE_DICT_OPTIONS[mode]))

    @precondition(lambda self: not self.raised)
    @rule(how=st.sampled_from(SUB_MODULE_LOADS))
    def load_sub_module(self, how: str) -> None:
        if self.source is None:
            self.source = shard_model(TinyLlama(), mp_policy=MP)  # trained fp32 weights, uniform: never cast
        self.loaded = True
        self.apply(f"load fp32 {how}", lambda run: run.load_sub_module(how, self.source))

    @precondition(lambda self: not self.raised)
    @rule(optim_first=st.booleans())
    def dcp_save(self, optim_first: bool) -> None:
        self.checkpoint_saved = True
        self.apply(f"dcp.save (optim first: {optim_first})",
                   lambda run: run.dcp_save(os.path.join(self.directory, str(self.runs.index(run))), optim_first))

    @precondition(lambda self: not self.raised and self.checkpoint_saved)
    @rule(optim_first=st.booleans())
    def dcp_load(self, optim_first: bool) -> None:
        self.loaded = True
        self.apply(f"dcp.load (optim first: {optim_first})",
                   lambda run: run.dcp_load(os.path.join(self.directory, str(self.runs.index(run))), optim_first))

    @precondition(lambda self: not self.raised)
    @rule(dtype=st.sampled_from([torch.bfloat16, torch.float32]))
    def module_to_dtype(self, dtype: torch.dtype) -> None:
        self.apply(f"model.to({dtype})", lambda run: run.model.to(dtype))

    @precondition(lambda self: not self.raised)
    @rule()
    def module_to_cpu(self) -> None:
        self.apply("model.to('cpu')", lambda run: run.model.to("cpu"))

    @precondition(lambda self: not self.raised)
    @rule(trainable=st.booleans())
    def embedding_trainable(self, trainable: bool) -> None:
        self.apply(f"embed.requires_grad_({trainable})", lambda run: run.set_embed_trainable(trainable))

    @precondition(can_run)
    @rule(how=st.sampled_from(["root", "root (async)", "layers[0]"]))
    def unshard(self, how: str) -> None:
        """The weights gathered for a rollout or a weight sync: what follows sees the unsharded parameters
        (a state dict, a no_grad forward, ``upcast_now``, an optimizer after ``reshard()``)."""
        self.apply(f"unshard {how}", lambda run: run.unshard(how))

    @precondition(lambda self: not self.raised)
    @rule()
    def reshard(self) -> None:
        self.apply("reshard", Run.reshard)

    @precondition(can_run)
    @rule()
    def upcast_now(self) -> None:
        # The workaround's model is fp32 already: the same call is a no-op there.
        self.apply("upcast_now", lambda run: torch_fsdp_ext.upcast_now(run.model))

    @precondition(lambda self: not self.raised and not self.installed)
    @rule()
    def install(self) -> None:
        """``import torch_fsdp_ext`` after ``fully_shard`` (and after whatever came before it)."""
        self.trace.append("install (late)")
        torch_fsdp_ext.install()
        self.installed = True
        # What the plugin never saw: weights loaded, or optimizer state made in the loaded dtypes.
        optimizer = self.runs[0].optimizer
        self.unseen_before_install = self.loaded or bool(optimizer is not None and optimizer.state)

    @precondition(lambda self: self.raised)
    @rule()
    def nothing_after_both_raised(self) -> None:
        """The sequence ended where both runs raised; hypothesis needs a rule to go on with."""

    def said_late(self) -> bool:
        """The plugin's upcast said its model was sharded before the install: the WARNING on the first rank
        of the model's shard group, the model's groups marked as said on every rank."""
        # late: tools/reproductions/order_findings.py
        from torch_fsdp_ext._dtype._strategies import SHARDED_BEFORE_INSTALL_ATTR

        if self.test.rank == 0:
            return self.warnings.said > 0
        return any(
            group.__dict__.get(SHARDED_BEFORE_INSTALL_ATTR) == "said"
            for state in _compat.fsdp_states_under(self.runs[0].mixed)
            for group in _compat.param_groups_of(state)
        )

    def cast_nothing(self) -> bool:
        loaded = torch_fsdp_ext.loaded_dtypes(self.runs[0].model)
        return all(loaded[name] == p.dtype for name, p in self.runs[0].model.named_parameters())

    def teardown(self) -> None:
        try:
            if self.runs is None:
                return
            if not self.raised and not self.installed:
                self.install()
            if not self.raised and self.runs[0].optimizer is None:
                self.apply("optimizer adamw", lambda run: run.make_optimizer("adamw"))
            if self.has_optimizer():
                self.apply("train step", Run.train_step)
            if not self.raised:
                try:
                    assert_trains_as_workaround(self.test, *self.runs)
                except AssertionError:
                    # Note [Installed late]: values rounded, or optimizer state made, before the plugin existed:
                    # the upcast must have said so, or the plugin cast nothing (the model was made uniform
                    # before its first moment): then it trains as torch does, without the plugin.
                    if not self.unseen_before_install:
                        raise
                    if self.said_late():
                        self.trace.append("said late")
                    elif self.cast_nothing():
                        self.trace.append("as torch")
                    else:
                        raise
        finally:
            logging.getLogger("torch_fsdp_ext").removeHandler(self.warnings)
            if not self.installed:
                torch_fsdp_ext.install()
            shutil.rmtree(self.directory, ignore_errors=True)


# Note: the matrix is one long test; the harness's per-test limit is for a hung collective.
common_distributed.TIMEOUT_OVERRIDE["test_generated_sequences_train_as_the_workaround"] = 900


@plugin_specific
@needs_dtype_fix
class TestOrderMatrix(FSDPExtTestCase):
    WORLD_SIZE = 1
    EXAMPLES = ORDER_EXAMPLES

    def test_generated_sequences_train_as_the_workaround(self):
        OrderMachine.test = self
        OrderMachine.sequences = []
        with plugin(True):
            run_state_machine_as_test(OrderMachine, settings=settings(
                max_examples=self.EXAMPLES, stateful_step_count=8, derandomize=True, database=None,
                deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
            ))
        ran = [trace for trace in OrderMachine.sequences if trace]
        raised = [trace for trace in ran if "both raised" in trace]
        documented = [trace for trace in ran if "documented difference" in trace]
        said = [trace for trace in ran if "said late" in trace]
        as_torch = [trace for trace in ran if "as torch" in trace]
        print(f"order matrix ({self.world_size} rank(s)): {len(ran)} sequences, "
              f"{len(ran) - len(raised) - len(documented) - len(said) - len(as_torch)} bit for bit, "
              f"{len(raised)} raised in both, {len(documented)} documented differences, {len(said)} said the install "
              f"came late, {len(as_torch)} installed late and cast nothing (as torch) "
              f"(of {sum('install (late)' in trace for trace in ran)} late installs, "
              f"{sum(trace[0].startswith('container') for trace in ran)} containers, "
              f"{sum(any(step.startswith('unshard') for step in trace) for trace in ran)} with unshard())")
        self.assertGreaterEqual(len(ran), self.EXAMPLES // 2)


class TestOrderMatrixTwoRanks(TestOrderMatrix):
    """The same sequences on two ranks: shards, DCP and rank-0 broadcasts across ranks."""

    WORLD_SIZE = 2
    EXAMPLES = ORDER_EXAMPLES_2RANKS


if __name__ == "__main__":
    run_tests()
