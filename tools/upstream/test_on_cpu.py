"""Runs an upstream PR's ``FSDPTest`` classes on CPU with gloo.

    UPSTREAM_TEST_FILE=.../test_fully_shard_mixed_dtype.py python -m pytest tools/upstream/test_on_cpu.py

Note: torch's harness does not run these tests on a CPU-only machine. Their world size
is ``min(n, torch.accelerator.device_count())``, as in torch's FSDP tests, i.e. 0, so
``MultiProcessTestCase`` spawns no process and reports a pass; and with a fixed world
size ``FSDPTest._run`` exits with the "multi-device" skip whenever
``torch.accelerator.device_count() < world_size`` (``common_fsdp.py``), even for tests
marked ``skip_if_lt_x_gpu(n, allow_cpu=True)``. Each class here is the upstream class
with only the world size and the process-group setup replaced: ``WORLD_SIZE`` gloo
ranks on CPU. The test bodies, their skip decorators and their assertions are the
upstream ones; a test that needs an accelerator still skips. ``check.py`` sets
``UPSTREAM_TEST_FILE``.
"""

from __future__ import annotations

import importlib.util
import os

import torch.distributed as dist
from torch.testing._internal.common_fsdp import FSDPTest

WORLD_SIZE = 4  # torch's FSDP tests use min(4, device count); 4 makes reshard_after_forward=2 a real subgroup


class _GlooOnCPU:
    @property
    def world_size(self) -> int:
        return WORLD_SIZE

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):  # type: ignore[override]
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        dist.init_process_group("gloo", init_method=self.init_method, rank=rank, world_size=self.world_size)
        try:
            self.run_test(test_name, pipe)
        finally:
            dist.destroy_process_group()


def _load_upstream_tests(path: str) -> dict[str, type]:
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"upstream_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Note: module-level names, so that the spawned rank processes (which re-import
    # this file with the same environment) find the classes their tests pickle.
    return {
        f"{cls_name}OnCPU": type(f"{cls_name}OnCPU", (_GlooOnCPU, cls), {"__module__": __name__})
        for cls_name, cls in vars(module).items()
        if isinstance(cls, type) and issubclass(cls, FSDPTest) and cls.__module__ == module.__name__
    }


if os.environ.get("UPSTREAM_TEST_FILE"):
    globals().update(_load_upstream_tests(os.environ["UPSTREAM_TEST_FILE"]))
