"""Runs an upstream PR's ``FSDPTest`` classes on CPU with gloo.

    UPSTREAM_TEST_FILE=.../test_fully_shard_mixed_precision.py python -m pytest tools/upstream/test_on_cpu.py

Note: torch's harness does not run these tests on a CPU-only machine. Their world size
is ``min(n, device count)``, as in torch's FSDP tests, i.e. 0, so
``MultiProcessTestCase`` spawns no process and reports a pass; with a fixed world size
``FSDPTest._run`` exits with the "multi-device" skip whenever there are fewer
accelerators than ranks (``common_fsdp.py``); and ``skip_if_lt_x_gpu(n)`` exits with it
in the test itself. Each class here is the upstream class with the world size and the
process-group setup replaced: ``WORLD_SIZE`` gloo ranks on CPU. With
``UPSTREAM_TEST_RANKS_FOR_DEVICES=1`` (for tests whose devices only stand for ranks), a
test marked ``skip_if_lt_x_gpu(n)`` also runs when ``n <= WORLD_SIZE``, as
``allow_cpu=True`` would let it; without it, that skip stays (tests that need a real
accelerator). ``FSDPTestMultiThread`` classes run as they are (their threads are their
ranks), with the same ``skip_if_lt_x_gpu`` rule. A rank that dies ends its test at once
(``rank_exit.py``). The test bodies, their other skips (e.g. "Requires NCCL backend") and
their assertions are the upstream ones. ``check.py`` sets both variables.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from unittest import mock

import torch.distributed as dist
import torch.multiprocessing
from torch.testing._internal import common_device_type, common_distributed
from torch.testing._internal.common_fsdp import FSDPTest, FSDPTestMultiThread

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_exit import EndOnRankDeath  # noqa: E402

WORLD_SIZE = 4  # torch's FSDP tests use min(4, device count); 4 makes reshard_after_forward=2 a real subgroup
RANKS_FOR_DEVICES = os.environ.get("UPSTREAM_TEST_RANKS_FOR_DEVICES") == "1"
# Note: a torch-style test runs all its subtests in one multi-process test, which fails
# when it runs longer than this (check.py sets it; torch's default, 300 s, is short on
# a loaded machine).
if "TORCH_FSDP_EXT_TEST_TIMEOUT" in os.environ:
    common_distributed.TIMEOUT_DEFAULT = int(os.environ["TORCH_FSDP_EXT_TEST_TIMEOUT"])


class _GlooOnCPU(EndOnRankDeath):
    @property
    def world_size(self) -> int:
        return WORLD_SIZE

    def _spawn_processes(self) -> None:
        # Note: forked, not spawned: a spawned rank re-imports torch and the test module
        # before every test, most of a small test's time on a loaded machine. The parent
        # uses no accelerator, so forking is safe here.
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):  # type: ignore[override]
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        dist.init_process_group("gloo", init_method=self.init_method, rank=rank, world_size=self.world_size)
        exit_status = 0
        try:
            self.run_test(test_name, pipe)
        except SystemExit as e:  # run_test's skip and error exit codes
            exit_status = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            dist.destroy_process_group()
        # Note: a rank ends without interpreter shutdown, where a gloo worker can abort it
        # (gloo_exit_abort_repro.py): the rank's exit status stays the test's own.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_status)


def _run_with_gloo_ranks(test_fn) -> None:
    """Lets ``skip_if_lt_x_gpu(n)`` in ``test_fn``'s decorators pass for ``n <= WORLD_SIZE``."""
    # Note: its wrapper keeps ``allow_cpu`` in a closure cell and records ``n`` as
    # ``_min_gpus_required`` (which functools.wraps copies to outer decorators).
    # Other decorators keep their checks.
    fn = test_fn
    while fn is not None:
        if "allow_cpu" in fn.__code__.co_freevars and fn._min_gpus_required <= WORLD_SIZE:
            fn.__closure__[fn.__code__.co_freevars.index("allow_cpu")].cell_contents = True
        fn = getattr(fn, "__wrapped__", None)


def _load_upstream_tests(path: str) -> dict[str, type]:
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"upstream_{name}", path)
    module = importlib.util.module_from_spec(spec)
    # Note: instantiate_device_type_tests(..., except_for=["cpu"]) replaces each generic class
    # by one class per accelerator type, i.e. by none here; the generic classes are kept.
    with mock.patch.object(common_device_type, "instantiate_device_type_tests", lambda *args, **kwargs: None):
        spec.loader.exec_module(module)
    classes = {
        name: cls
        for name, cls in vars(module).items()
        if isinstance(cls, type)
        and issubclass(cls, (FSDPTest, FSDPTestMultiThread))
        and cls.__module__ == module.__name__
    }
    for cls in classes.values() if RANKS_FOR_DEVICES else ():
        for name, test_fn in vars(cls).items():
            if name.startswith("test"):
                _run_with_gloo_ranks(test_fn)
    # Note: module-level names, so that the spawned rank processes (which re-import
    # this file with the same environment) find the classes their tests pickle. A
    # multi-thread class keeps its world size and threaded process group: its threads
    # are its ranks.
    return {
        f"{name}OnCPU": type(
            f"{name}OnCPU", (_GlooOnCPU, cls) if issubclass(cls, FSDPTest) else (cls,), {"__module__": __name__}
        )
        for name, cls in classes.items()
    }


if os.environ.get("UPSTREAM_TEST_FILE"):
    globals().update(_load_upstream_tests(os.environ["UPSTREAM_TEST_FILE"]))
