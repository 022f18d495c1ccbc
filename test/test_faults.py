"""Fault injection: what a faulty job or a careless user does, each compared with plain torch.

Rank-local calls, ranks that disagree (about dtypes, or about the plugin itself),
install()/uninstall() from another thread, exceptions mid-iteration, settings
that must not leak out of a scope.
"""

from __future__ import annotations

import contextlib
import gc
import os
import textwrap
import threading
import warnings
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import distributed_c10d
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils.checkpoint import checkpoint

import torch_fsdp_ext
from torch_fsdp_ext import MixedParamDtypeError, _env
from torch_fsdp_ext._rank_consistency import RankCheckTimeoutError

from common import (
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    RMSNorm,
    batch,
    counting_store_calls,
    full_grads,
    full_params,
    fully_shard,
    lm_loss,
    needs_dtype_fix,
    plugin,
    plugin_specific,
    run_python,
    seed_000_model,
    shard_model,
)

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# Every collective a Python caller can issue, counted in both namespaces they are reached through.
_COLLECTIVES = (
    "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_to_all",
    "barrier", "broadcast", "broadcast_object_list", "gather", "reduce", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "scatter",
)
# FSDP2's all-gather: all_gather_single from 2.13, all_gather_into_tensor before.
_FSDP_ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor")


def fsdp_all_gathers(counts: dict) -> int:
    return sum(counts.get(name, 0) for name in _FSDP_ALL_GATHERS)


@contextlib.contextmanager
def counting_collectives():
    """Counts calls of the c10d collectives (FSDP's own and anyone else's), by name."""
    counts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for name in _COLLECTIVES:
            original = getattr(distributed_c10d, name, None)
            if original is None:
                continue

            def counted(*args, _name=name, _original=original, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _original(*args, **kwargs)

            for namespace in (distributed_c10d, dist):
                stack.enter_context(mock.patch.object(namespace, name, counted))
        yield counts


def train_steps(model: nn.Module, optimizer, rank: int, steps: int, *, checkpointed: bool = False) -> list[float]:
    losses = []
    for step in range(steps):
        tokens = batch(rank, step)
        logits = checkpoint(model, tokens, use_reentrant=False) if checkpointed else model(tokens)
        loss = lm_loss(logits, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def mixed_model(plugin_on: bool, **fully_shard_kwargs) -> nn.Module:
    """The seed-000 layout with the plugin; the same model already in fp32 for plain torch."""
    model = seed_000_model()
    if not plugin_on:
        model.float()  # what the upcast makes of it, so that plain torch can run it at all
    return shard_model(model, mp_policy=MP, **fully_shard_kwargs)


# ---------------------------------------------------------------------------
# Collectives: only where every rank reaches FSDP itself
# ---------------------------------------------------------------------------


class TestRankSymmetricCommunication(FSDPExtTestCase):
    PG_TIMEOUT = timedelta(seconds=60)  # a hang fails after a minute instead of torch's 30

    @needs_dtype_fix
    @plugin_specific
    def test_explicit_unshard_reshard_cycles_add_no_communication(self):
        """200 x 3 explicit unshard()/reshard(): as many collectives as plain torch, no store traffic."""
        results = {}
        for plugin_on in (False, True):
            with plugin(plugin_on), counting_store_calls() as store_calls:
                model = mixed_model(plugin_on)
                train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), self.rank, steps=1)
                first_forward = store_calls.total()
                modules = [model, *model.layers]
                with counting_collectives() as collectives:
                    for _ in range(200):
                        for module in modules:
                            module.unshard()
                            module.reshard()
                results[plugin_on] = (dict(collectives), store_calls.total() - first_forward)
                if plugin_on:
                    self.assertEqual(store_calls.comparisons, 1)  # the one comparison, at the first forward
        self.assertEqual(fsdp_all_gathers(results[False][0]), 600)  # FSDP's own all-gathers
        self.assertEqual(results[True], (results[False][0], 0))

    @needs_dtype_fix
    def test_rank_local_unshard_does_not_hang(self):
        """Rank 0 alone unshards (a no-op in FSDP2 here) between forward and backward, like plain torch."""
        losses = {}
        for plugin_on in (False, True):
            with plugin(plugin_on):
                model = mixed_model(plugin_on, reshard_after_forward=False)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                losses[plugin_on] = []
                for step in range(3):
                    tokens = batch(self.rank, step)
                    loss = lm_loss(model(tokens), tokens)
                    if self.rank == 0:
                        model.unshard()  # e.g. to look at a full weight on rank 0 only
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses[plugin_on].append(loss.item())
        self.assertEqual(losses[True], losses[False])

    @needs_dtype_fix
    @plugin_specific
    def test_dtype_change_after_the_first_forward_is_compared_at_the_next_forward(self):
        """Every rank casts a block to bf16 after the first forward; FSDP sees it at the next unshard()."""
        results = {}
        for plugin_on in (False, True):
            with plugin(plugin_on), counting_store_calls() as store_calls:
                model = mixed_model(plugin_on)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                losses = train_steps(model, optimizer, self.rank, steps=1)
                comparisons_after_first_forward = store_calls.comparisons
                model.layers[0].to(torch.bfloat16)
                with counting_collectives() as collectives:
                    model.layers[0].unshard()  # FSDP re-reads the dtypes here; the ranks compare at the next forward
                    model.layers[0].reshard()
                self.assertEqual((sum(collectives.values()), fsdp_all_gathers(collectives)), (1, 1))  # FSDP's own
                self.assertEqual(store_calls.comparisons, comparisons_after_first_forward)
                losses += train_steps(model, optimizer, self.rank, steps=2)
                results[plugin_on] = losses, store_calls.comparisons - comparisons_after_first_forward
        self.assertEqual(results[True], (results[False][0], 1))  # one comparison, at the next forward

    @needs_dtype_fix
    @plugin_specific
    def test_a_model_built_after_reinstalling_is_compared_afresh(self):
        """Comparisons left their keys in the store: a new install() must not read them for the next model."""
        with plugin(True), counting_store_calls() as store_calls:
            first = mixed_model(True)
            train_steps(first, torch.optim.SGD(first.parameters(), lr=0.1), self.rank, steps=1)
            torch_fsdp_ext.uninstall()
            with torch_fsdp_ext.installed():
                second = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), RMSNorm(4))
                fully_shard(second, mp_policy=MP)
                second(torch.randn(2, 4)).sum().backward()  # compared with the peer's second model, not its first
        self.assertEqual(store_calls.comparisons, 2)
        self.assertEqual(second[0].weight.dtype, torch.float32)

    @plugin_specific
    def test_ranks_that_build_different_dtypes_get_a_clear_error_on_every_rank(self):
        """Plain torch trains on silently with fp32 master weights on one rank and bf16 on the other."""
        for plugin_on in (False, True):
            with plugin(plugin_on):
                model = nn.Sequential(nn.Linear(4, 4), RMSNorm(4))
                if self.rank == 1:
                    model.to(torch.bfloat16)  # uniform on each rank, but not the same dtype
                fully_shard(model, mp_policy=MP)
                if not plugin_on:
                    model(torch.randn(2, 4)).sum().backward()
                    continue
                with self.assertRaises(MixedParamDtypeError) as caught:
                    model(torch.randn(2, 4))
        self.assertEqual(
            str(caught.exception).splitlines(),
            [
                "torch_fsdp_ext: ranks disagree on the parameter dtypes of FSDP2 group '<root>'; every rank must "
                "build the model with the same dtypes and requires_grad flags before fully_shard:",
                "  0.weight: rank 0: torch.float32, rank 1: torch.bfloat16",
                "  0.bias: rank 0: torch.float32, rank 1: torch.bfloat16",
                "  1.weight: rank 0: torch.float32, rank 1: torch.bfloat16",
            ],
        )


class TestRanksThatDoNotAnswer(FSDPExtTestCase):
    """A rank waits for a peer that never comes: the timeout is what the test waits.

    Long enough for the ranks of a loaded 2-core CI machine to reach their first forward.
    """

    PG_TIMEOUT = timedelta(seconds=15)

    @needs_dtype_fix
    @plugin_specific
    def test_dtype_change_on_one_rank_after_the_first_forward_fails_clearly_on_that_rank(self):
        with plugin(True):
            model = mixed_model(True)
            train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), self.rank, steps=1)
            if self.rank == 1:
                model.layers[0].to(torch.bfloat16)
            model.layers[0].unshard()  # both ranks; only rank 1 sees a new layout
            model.layers[0].reshard()
            with self.assertRaises(RuntimeError) as caught:
                model(batch(self.rank))
        if self.rank == 1:
            self.assertIsInstance(caught.exception, RankCheckTimeoutError)
            self.assertIn("rank(s) 0 did not report the parameter dtypes of FSDP2 group(s) 'layers.0' within 15 s",
                          str(caught.exception))
        else:
            self.assertNotIsInstance(caught.exception, RankCheckTimeoutError)  # FSDP's all-gather, not ours


class TestPluginOnSomeRanksOnly(FSDPExtTestCase):
    PG_TIMEOUT = TestRanksThatDoNotAnswer.PG_TIMEOUT

    @needs_dtype_fix
    @plugin_specific
    def test_a_rank_without_the_plugin_gets_a_clear_error_not_an_abort(self):
        """Rank 1 runs without the plugin (TORCH_FSDP_EXT_DISABLE=1 there) on a model with nothing to fix.

        Before: rank 0 died with SIGABRT (gloo ``op.preamble.length <= op.nbytes``) or both hung.
        Now rank 0, which can see it, raises an error naming rank 1; rank 1 gets what plain torch
        gives when a peer stops: FSDP's own all-gather fails.
        """
        with plugin(self.rank == 0):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            fully_shard(model, mp_policy=MP)
            with self.assertRaises(RuntimeError) as caught:
                model(torch.randn(2, 4)).sum().backward()
        if self.rank == 0:
            self.assertIsInstance(caught.exception, RankCheckTimeoutError)
            self.assertEqual(
                str(caught.exception),
                "torch_fsdp_ext: rank(s) 1 did not report the parameter dtypes of FSDP2 group(s) '<root>' within "
                "15 s (the process group's timeout). Every rank must run the same torch_fsdp_ext installation (none "
                "disabled with TORCH_FSDP_EXT_DISABLE, the same install()/uninstall() calls and dtype_strategy) and "
                "change parameter dtypes alike. No later comparison on this process group is trusted: each fails "
                "at once, on every rank.",
            )
        else:
            self.assertNotIsInstance(caught.exception, RankCheckTimeoutError)  # FSDP's all-gather, not ours


# ---------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------


def small_mixed_model() -> nn.Module:
    """Two FSDP blocks and a root, each a bf16 linear with an fp32 norm: the cheapest seed-000 layout."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16).to(torch.bfloat16), nn.LayerNorm(16)) for _ in range(3)))
    for block in model[:2]:
        fully_shard(block)
    return fully_shard(model)


def train_small(model: nn.Module, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        loss = checkpoint(model, x, use_reentrant=False).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class TestThreads(FSDPExtTestCase):
    WORLD_SIZE = 1
    STEPS = 200

    def _train(self, toggle_from_another_thread: bool) -> tuple[list[float], dict]:
        model = small_mixed_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = train_small(model, optimizer, range(1))  # first forward: the upcast
        stop, toggles, errors = threading.Event(), [0], []

        def toggle():
            try:
                while not stop.wait(0.001):  # a pause, so that the training thread gets the GIL too
                    torch_fsdp_ext.install()
                    torch_fsdp_ext.uninstall()
                    toggles[0] += 1
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
            finally:
                torch_fsdp_ext.install()

        thread = threading.Thread(target=toggle) if toggle_from_another_thread else None
        if thread is not None:
            thread.start()
        try:
            losses += train_small(model, optimizer, range(1, self.STEPS))
        finally:
            stop.set()
            if thread is not None:
                thread.join()
        self.assertEqual(errors, [])
        if thread is not None:
            self.assertGreater(toggles[0], 0)
        return losses, full_params(model)

    @plugin_specific
    def test_install_and_uninstall_from_another_thread_while_training(self):
        """Checkpointed training in the main thread gives the uninterrupted results, three times over.

        Before, install() walked gc.get_objects(), which crashed the training thread
        (SystemError in RegisterPostBackwardFunction.apply) in 1 of 2 runs.
        """
        with plugin(True), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the upcast's one-line cost warning
            reference = self._train(toggle_from_another_thread=False)
            for _ in range(3):
                losses, params = self._train(toggle_from_another_thread=True)
                self.assertEqual(losses, reference[0])
                self.assertEqual(params, reference[1], atol=0, rtol=0)


class TestUninstallDuringAHookSwitch(TestCase):
    @plugin_specific
    def test_a_region_entering_while_uninstall_runs_leaves_torch_hooks_in_place(self):
        """A checkpointed region's forward that passed the fix's ``active`` check just before
        ``uninstall()`` on another thread must not switch FSDP's hook cells back to the wrapper
        afterwards: a later ``install()`` would take that wrapper for torch's method."""
        from torch_fsdp_ext import _install
        from torch_fsdp_ext._recompute._frames import RECORDS_ATTR, FrameRecords
        from torch_fsdp_ext._recompute._records import wrap_forward_enter

        with plugin(True):
            fix = _install._active["recompute"][0]
            if not fix.switches_hooks:
                self.skipTest("FSDP's forward hooks have no closure cell on this torch: nothing is switched")
            torch_methods = [(cell, original) for cell, original, _ in fix.switch.cells]
            for cell, original in torch_methods:  # whatever happens below, later tests get torch's hooks
                self.addCleanup(setattr, cell, "cell_contents", original)
            enter = wrap_forward_enter(fix, lambda hook: None)
            records = FrameRecords.__new__(FrameRecords)
            records.contexts = {}
            hook = type("Hook", (), {RECORDS_ATTR: records})()
            with fix.switch.lock:  # the region's thread stops right where it takes the lock
                region = threading.Thread(target=enter, args=(hook,))
                region.start()
                region.join(0.5)
                self.assertTrue(region.is_alive())
                torch_fsdp_ext.uninstall()
            region.join()
            for cell, original in torch_methods:
                self.assertIs(cell.cell_contents, original)


class TestTwoThreadsTwoModels(FSDPExtTestCase):
    WORLD_SIZE = 1

    def test_two_threads_training_two_models_give_the_sequential_results(self):
        def build(seed: int) -> nn.Module:  # in the main thread: model init draws from the global RNG
            return shard_model(seed_000_model(seed), mp_policy=MP)

        def run(seed: int, model: nn.Module, results: dict) -> None:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            results[seed] = (train_steps(model, optimizer, self.rank, steps=10), full_params(model))

        with plugin(True):
            sequential: dict = {}
            for seed in (1, 2):
                run(seed, build(seed), sequential)
            concurrent: dict = {}
            threads = [threading.Thread(target=run, args=(seed, build(seed), concurrent)) for seed in (1, 2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        self.assertEqual(sorted(concurrent), [1, 2])
        for seed in (1, 2):
            self.assertEqual(concurrent[seed][0], sequential[seed][0])
            self.assertEqual(concurrent[seed][1], sequential[seed][1], atol=0, rtol=0)


# ---------------------------------------------------------------------------
# Exceptions and uninstall mid-iteration
# ---------------------------------------------------------------------------


class FailsOnCall(nn.Module):
    """Raises while ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("boom in forward")
        return self.linear(x)


class TestExceptions(FSDPExtTestCase):
    WORLD_SIZE = 1

    def _failing_iterations(self, iterations: int) -> int:
        """Live Python objects gained over ``iterations`` checkpointed forwards that raise."""
        block = FailsOnCall()
        model = nn.Sequential(block, nn.GELU())
        fully_shard(block, mp_policy=MP)
        fully_shard(model, mp_policy=MP)
        x = torch.randn(2, 8, requires_grad=True)
        checkpoint(model, x, use_reentrant=False).float().sum().backward()  # lazy init, first-use caches
        block.fail = True
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(iterations):
            try:
                checkpoint(model, x, use_reentrant=False)
            except ValueError:
                pass
        gc.collect()
        return len(gc.get_objects()) - before

    @plugin_specific
    def test_2000_failing_iterations_grow_no_live_objects(self):
        with plugin(False):
            plain = self._failing_iterations(2000)
        with plugin(True):
            fix = torch_fsdp_ext._install._active["recompute"][0]
            patched = self._failing_iterations(2000)
            self.assertEqual(fix.frames.stack, [])
            self.assertIsNone(fix.frames.recompute)
        self.assertLessEqual(patched, max(plain, 0))
        self.assertFalse(torch.is_autocast_enabled("cpu"))

    @needs_dtype_fix
    @plugin_specific
    def test_uninstall_between_forward_and_backward_gives_correct_gradients(self):
        grads = {}
        for plugin_on in (False, True):
            with plugin(plugin_on):
                model = mixed_model(plugin_on)
                tokens = batch(self.rank)
                loss = lm_loss(model(tokens), tokens)
                if plugin_on:
                    torch_fsdp_ext.uninstall()
                loss.backward()
                grads[plugin_on] = full_grads(model)
        self.assertEqual(grads[True], grads[False], atol=0, rtol=0)


# ---------------------------------------------------------------------------
# Settings: scoped, validated, from the environment
# ---------------------------------------------------------------------------


def dtype_strategy() -> str:
    return torch_fsdp_ext.status().fixes["dtype"].details["strategy"]


def active_fixes() -> list[str]:
    return [name for name, fix in torch_fsdp_ext.status().fixes.items() if fix.active]


@plugin_specific
class TestSettings(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.before = active_fixes(), dtype_strategy()

    def tearDown(self) -> None:
        torch_fsdp_ext.uninstall()
        torch_fsdp_ext.install(self.before[0], dtype_strategy=self.before[1])
        super().tearDown()

    def test_installed_restores_fixes_and_strategy(self):
        torch_fsdp_ext.install(dtype_strategy="upcast")
        before = active_fixes()
        with torch_fsdp_ext.installed(dtype_strategy="error"):
            self.assertEqual(dtype_strategy(), "error")
            torch_fsdp_ext.uninstall(["recompute"])
        self.assertEqual((active_fixes(), dtype_strategy()), (before, "upcast"))
        torch_fsdp_ext.uninstall()
        with torch_fsdp_ext.installed(["recompute"], dtype_strategy="error"):
            pass
        self.assertEqual((active_fixes(), dtype_strategy()), ([], "upcast"))

    def test_install_without_a_strategy_keeps_the_current_one(self):
        torch_fsdp_ext.install(dtype_strategy="error")
        torch_fsdp_ext.install()
        self.assertEqual(dtype_strategy(), "error")
        torch_fsdp_ext.uninstall()
        torch_fsdp_ext.install()
        self.assertEqual(dtype_strategy(), "error")

    def test_strategy_is_validated_whatever_fixes_are_named(self):
        before = active_fixes(), dtype_strategy()
        for fixes in (["recompute"], ["dtype"], None):
            with self.assertRaisesRegex(ValueError, "dtype_strategy must be one of upcast, preserve, error"):
                torch_fsdp_ext.install(fixes, dtype_strategy="bogus")
        self.assertEqual((active_fixes(), dtype_strategy()), before)

    def test_argument_and_environment_parse_alike(self):
        for raw in (" Preserve ", "PRESERVE", "error"):
            torch_fsdp_ext.install(dtype_strategy=raw)
            self.assertEqual(dtype_strategy(), raw.strip().lower())
            with mock.patch.dict(os.environ, {"TORCH_FSDP_EXT_DTYPE_STRATEGY": raw}):
                self.assertEqual(_env.choice("TORCH_FSDP_EXT_DTYPE_STRATEGY", torch_fsdp_ext.STRATEGIES),
                                 raw.strip().lower())
        for raw in ("preserv", "down cast"):
            with mock.patch.dict(os.environ, {"TORCH_FSDP_EXT_DTYPE_STRATEGY": raw}):
                with self.assertRaisesRegex(ValueError, "TORCH_FSDP_EXT_DTYPE_STRATEGY must be one of upcast, "):
                    _env.choice("TORCH_FSDP_EXT_DTYPE_STRATEGY", torch_fsdp_ext.STRATEGIES)
        with self.assertRaises(ValueError) as raised:
            torch_fsdp_ext.install("preserve")
        self.assertExpectedInline(str(raised.exception), """\
torch_fsdp_ext: unknown fix(es) ['preserve']; choose from ('dtype', 'recompute', 'reduce'); 'preserve' is a dtype strategy: install(dtype_strategy='preserve')""")

    def test_switch_parsing(self):
        cases = {"1": True, "TRUE": True, " 1": True, "on": True, "Yes ": True, "0": False, "off": False,
                 "": False, " False": False}
        for raw, expected in cases.items():
            with mock.patch.dict(os.environ, {"TORCH_FSDP_EXT_DISABLE": raw}), warnings.catch_warnings():
                warnings.simplefilter("error")  # known values never warn
                self.assertEqual(_env.switch("TORCH_FSDP_EXT_DISABLE"), expected, raw)
        with mock.patch.dict(os.environ, {"TORCH_FSDP_EXT_DISABLE": "maybe"}):
            with self.assertWarnsRegex(RuntimeWarning, "ignoring TORCH_FSDP_EXT_DISABLE='maybe'"):
                self.assertFalse(_env.switch("TORCH_FSDP_EXT_DISABLE"))


@plugin_specific
class TestSettingsAtImport(TestCase):
    """Each case in a fresh interpreter: what import does with the environment."""

    REPORT = "import torch_fsdp_ext; print(sorted(n for n, f in torch_fsdp_ext.status().fixes.items() if f.active), " \
             "torch_fsdp_ext.status().fixes['dtype'].details['strategy'])"

    def run_import(self, env: dict, code: str = REPORT) -> tuple[str, str]:
        result = run_python(code, env=env)
        self.assertEqual(result.returncode, 0, result.stderr)
        return result.stdout.strip().splitlines()[-1], result.stderr

    def test_environment_at_import(self):
        needed = sorted(n for n, f in torch_fsdp_ext.status().fixes.items() if f.needed)
        out, _ = self.run_import({"TORCH_FSDP_EXT_DISABLE": " On "})
        self.assertEqual(out, "[] upcast")
        out, err = self.run_import({"TORCH_FSDP_EXT_DTYPE_STRATEGY": " Error "})
        self.assertEqual((out, "Warning" in err), (f"{needed} error", False))
        # A strategy that cannot be honoured stops the import instead of training with the default.
        result = run_python(self.REPORT, env={"TORCH_FSDP_EXT_DTYPE_STRATEGY": "preserv"})
        self.assertNotEqual(result.returncode, 0)
        self.assertEqual(
            result.stderr.strip().splitlines()[-1],
            "torch_fsdp_ext.SettingError: torch_fsdp_ext: TORCH_FSDP_EXT_DTYPE_STRATEGY must be one of upcast, preserve, "
            "error (any case), got 'preserv'",
        )
        code = "import torch_fsdp_ext; torch_fsdp_ext.install(dtype_strategy='upcast'); " + self.REPORT
        out, _ = self.run_import({"TORCH_FSDP_EXT_DTYPE_STRATEGY": "error"}, code)
        self.assertEqual(out, f"{needed} upcast")  # an explicit argument wins

    def test_reload_does_not_stack_wrappers(self):
        code = textwrap.dedent(
            """
            import importlib
            from torch_fsdp_ext import _compat
            internals = _compat.load_internals()

            def attributes():
                return {(o, m): internals.symbols[o].__dict__.get(m) for o, m in _compat.WRAPPED_METHODS}

            import torch_fsdp_ext
            torch_fsdp_ext.uninstall()
            pristine = attributes()
            torch_fsdp_ext.install()
            patched = attributes()
            import torch_fsdp_ext._install as install_module
            importlib.reload(install_module)
            install_module.install()
            same = all(attributes()[k] is v for k, v in patched.items())
            install_module.uninstall()
            restored = all(attributes()[k] is v for k, v in pristine.items())
            print(same, restored)
            """
        )
        out, _ = self.run_import({}, code)
        self.assertEqual(out, "True True")


if __name__ == "__main__":
    run_tests()
