"""Another library's patch of FSDP2's ``foreach_reduce`` (NeMo Automodel's ``patch_fsdp_uniform_reduce_dtype``).

Its wrapper, ``(fsdp_params, unsharded_grads, *args, **kwargs)``, widens a group's gradients to
their widest float dtype and calls torch's function; it replaces ``foreach_reduce`` in
``_fsdp_collectives`` and ``_fsdp_param_group``. With ``dtype_strategy="preserve"`` on a group
of bf16 weights and fp32 norms, training must give, bit for bit, what it gives without the
wrapper, whichever comes first, or stop at the first backward with one error naming the
attribute and the wrapper (never drift silently).
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_fsdp_ext
from common import (
    ROOT, FSDPExtTestCase, MixedPrecisionPolicy, batch, full_params, lm_loss, needs_dtype_fix, plugin, plugin_specific,
    seed_000_model, shard_model,
)
from torch_fsdp_ext import _compat
from torch_fsdp_ext._compat import _dtype as _compat_dtype
from torch_fsdp_ext._compat import _reduce as _compat_reduce

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STEPS = 4


def reduce_modules():
    internals = _compat.load_internals()
    collectives = __import__(internals.fsdp_package + "._fsdp_collectives", fromlist=["foreach_reduce"])
    return collectives, internals.fsdp_param_group_module


def patch_uniform_reduce_dtype():
    """Stand-in for NeMo Automodel's patch: widen the gradients, then call the function it found. Returns an undo."""
    collectives, param_group_module = reduce_modules()
    previous = collectives.foreach_reduce, param_group_module.foreach_reduce
    torch_reduce = collectives.foreach_reduce

    def uniform_reduce_dtype_foreach_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
        widest = functools.reduce(torch.promote_types, {g.dtype for g in unsharded_grads})
        return torch_reduce(fsdp_params, [g.to(widest) for g in unsharded_grads], *args, **kwargs)

    collectives.foreach_reduce = param_group_module.foreach_reduce = uniform_reduce_dtype_foreach_reduce

    def undo():
        collectives.foreach_reduce, param_group_module.foreach_reduce = previous

    return undo


def train(model, rank, steps, between_steps=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = batch(rank, step)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if between_steps is not None and step == 0:
            between_steps()
    return losses


@needs_dtype_fix
@plugin_specific
class TestForeignReduceWrapper(FSDPExtTestCase):
    def _train_with_wrapper(self, when: str):
        """``when``: none, before (the wrapper before the plugin's install), after_install (after install, before
        the first forward: NeMo's parallelizer), after_first_step (after the plugin's reduce wrapper is in place)."""
        # The plugin's reduce wrapper of an earlier run goes with its last mixed group.
        gc.collect()
        self.assertNoMixedGroupWrapper()
        undo = []
        if when == "before":
            undo.append(patch_uniform_reduce_dtype())
        try:
            with plugin(True, dtype_strategy="preserve"):
                if when == "after_install":
                    undo.append(patch_uniform_reduce_dtype())
                model = shard_model(seed_000_model(), mp_policy=MP)
                later = (lambda: undo.append(patch_uniform_reduce_dtype())) if when == "after_first_step" else None
                losses = train(model, self.rank, STEPS, later)
                return losses, full_params(model)
        finally:
            model = None
            gc.collect()  # the plugin's reduce wrapper goes with the model's groups, before the wrapper's undo
            for u in reversed(undo):
                u()

    def assertNoMixedGroupWrapper(self):
        """Torch's foreach_reduce, or only the plugin's wrappers over it: the reduce fix's (installed where this
        torch needs them) and, buried under one of those until it goes, an earlier run's mixed-group wrapper
        (Note [Buried patches] in ``_patching``); no library's wrapper of an earlier run."""
        fn = reduce_modules()[1].foreach_reduce
        while _compat.function_origin(fn) == "torch_fsdp_ext":
            fn = fn.__wrapped__
        self.assertEqual(_compat.function_origin(fn), "torch")

    def test_the_wrapper_in_any_order_is_exact_or_refused(self):
        reference = self._train_with_wrapper("none")
        self.assertEqual({v.dtype for v in reference[1].values()}, {torch.bfloat16, torch.float32})  # kept mixed
        for when in ("before", "after_install", "after_first_step"):
            with self.subTest(when=when):
                if when == "after_first_step" and not _compat_dtype.probe_reduce_casts_grads_per_param():
                    # The plugin reduces mixed groups itself on this torch: a wrapper that dropped its own is refused.
                    with self.assertRaises(RuntimeError) as caught:
                        self._train_with_wrapper(when)
                    message = str(caught.exception)
                    self.assertIn(f"{_compat.load_internals().fsdp_param_group_module.__name__}.foreach_reduce is "
                                  "test_foreign_patches.patch_uniform_reduce_dtype.<locals>."
                                  "uniform_reduce_dtype_foreach_reduce, another library's patch", message)
                    self.assertIn("torch_fsdp_ext refuses", message)
                    continue
                losses, params = self._train_with_wrapper(when)
                self.assertEqual([l.item() for l in losses], [l.item() for l in reference[0]])
                for name, value in params.items():
                    self.assertTrue(torch.equal(value, reference[1][name]), f"{when}: {name} differs")

    def test_a_wrapper_put_over_the_plugins_stays_when_the_plugins_goes(self):
        """The plugin's reduce wrapper goes with the last group that needs it; a library's wrapper put over it
        since (NeMo's, after the first step) stays in place, with one warning naming it."""
        if _compat_dtype.probe_reduce_casts_grads_per_param():
            self.skipTest("this torch reduces mixed-dtype groups itself: the plugin puts no wrapper on foreach_reduce")
        gc.collect()
        param_group_module = reduce_modules()[1]
        with plugin(True, dtype_strategy="preserve"):
            model = shard_model(seed_000_model(), mp_policy=MP)
            train(model, self.rank, 1)
            self.assertEqual(_compat.function_origin(param_group_module.foreach_reduce), "torch_fsdp_ext")
            undo = patch_uniform_reduce_dtype()
            try:
                wrapper = param_group_module.foreach_reduce
                with self.assertWarnsRegex(RuntimeWarning, rf"left {param_group_module.__name__}\.foreach_reduce "
                                                           r"as it is \(.*uniform_reduce_dtype_foreach_reduce\)"):
                    model = None
                    gc.collect()
                self.assertIs(param_group_module.foreach_reduce, wrapper)
            finally:
                undo()

    def test_torch_own_function_is_found_behind_the_wrapper(self):
        collectives, param_group_module = reduce_modules()
        torch_reduce = _compat_reduce.torch_foreach_reduce()  # behind the reduce fix's wrappers, where installed
        self.assertIs(torch_reduce, collectives.foreach_reduce)
        self.assertEqual(_compat.function_origin(torch_reduce), "torch")
        undo = patch_uniform_reduce_dtype()
        try:
            wrapper = param_group_module.foreach_reduce
            self.assertEqual(_compat.function_origin(wrapper), "foreign")
            self.assertIs(_compat.torch_own(wrapper, "foreach_reduce"), torch_reduce)
            _compat_dtype.probe_reduce_casts_grads_per_param.cache_clear()
            answer_behind_wrapper = _compat_dtype.probe_reduce_casts_grads_per_param()
        finally:
            undo()
            _compat_dtype.probe_reduce_casts_grads_per_param.cache_clear()
        self.assertEqual(answer_behind_wrapper, _compat_dtype.probe_reduce_casts_grads_per_param())


@plugin_specific
class TestForeignPatchNamed(TestCase):
    def test_install_names_another_librarys_replacement_once(self):
        code = (
            "import warnings; warnings.simplefilter('always')\n"
            "import torch_fsdp_ext\n"
            "from torch_fsdp_ext import _compat\n"
            "group = _compat.load_internals().FSDPParamGroup\n"
            "torch_fsdp_ext.uninstall()\n"
            "original = group._init_mp_dtypes\n"
            "def init_mp_dtypes_of_another_library(self): return original(self)\n"
            "group._init_mp_dtypes = init_mp_dtypes_of_another_library\n"
            "torch_fsdp_ext.install(); torch_fsdp_ext.uninstall(); torch_fsdp_ext.install()\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
        self.assertEqual(result.returncode, 0, result.stderr)
        warned = [line for line in result.stderr.splitlines() if "another library replaced" in line]
        self.assertEqual(len(warned), 1, result.stderr)
        self.assertIn("FSDPParamGroup._init_mp_dtypes is ", warned[0])
        self.assertIn(":init_mp_dtypes_of_another_library", warned[0])


if __name__ == "__main__":
    run_tests()
