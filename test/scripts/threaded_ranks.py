"""torch's ``FSDPTestMultiThread`` tests of the mixed-precision file, ranks as threads of one process.

    python test/scripts/threaded_ranks.py off|import|autoload

``off``: without the plugin; ``import``: ``import torch_fsdp_ext`` first; ``autoload``: the plugin
comes from the start-up hook (run with ``TORCH_FSDP_EXT_AUTOLOAD=1``), i.e. inside the first
``fully_shard``, which both rank-threads reach at once. Prints one JSON object: each test's outcome
(``pass``, ``fail``, ``error``, ``skip``) and, for the ones that did not pass, its error's last line.

The upstream file is torch's at the commit stored in tools/upstream/; it runs here as torch's
harness runs it, with three changes so that it loads and runs on CPU on the releases tested:
``instantiate_device_type_tests`` leaves the generic classes in place, ``skip_if_lt_x_gpu`` lets its
tests run on CPU (their devices only stand for ranks), and a missing ``HardwareClassification``
(before 2.15) gets a stand-in. A rank that waits for the other fails fast: the process group's store
times out after ``STORE_TIMEOUT`` (the rank check waits that long) and the harness joins its threads
after ``JOIN_TIMEOUT``.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import sys
import types
import unittest
from datetime import timedelta
from unittest import mock

MODE = sys.argv[1]
STORE_TIMEOUT = timedelta(seconds=20)
JOIN_TIMEOUT = 60
UPSTREAM_FILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "tools", "upstream", "upstream_test_fully_shard_mixed_precision.py",
)

faulthandler.dump_traceback_later(3 * JOIN_TIMEOUT, exit=True)  # every thread's stack, should anything still hang
if MODE == "import":
    import torch_fsdp_ext  # noqa: F401

import torch.distributed as dist  # noqa: E402
from torch.testing._internal import common_device_type, common_distributed, common_utils  # noqa: E402
from torch.testing._internal.common_fsdp import FSDPTestMultiThread  # noqa: E402

common_distributed.TIMEOUT_DEFAULT = JOIN_TIMEOUT
if not hasattr(common_utils, "HardwareClassification"):
    common_utils.HardwareClassification = types.SimpleNamespace(ACCELERATOR="accelerator")


def load_upstream() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("upstream_test_fully_shard_mixed_precision", UPSTREAM_FILE)
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(common_device_type, "instantiate_device_type_tests", lambda *args, **kwargs: None):
        spec.loader.exec_module(module)
    return module


def allow_cpu(test_fn) -> None:
    """``skip_if_lt_x_gpu``'s wrapper keeps ``allow_cpu`` in a closure cell: set it."""
    fn = test_fn
    while fn is not None and hasattr(fn, "__code__"):
        if "allow_cpu" in fn.__code__.co_freevars:
            fn.__closure__[fn.__code__.co_freevars.index("allow_cpu")].cell_contents = True
        fn = getattr(fn, "__wrapped__", None)


def threaded_classes(module: types.ModuleType) -> list[type]:
    classes = []
    for name, cls in vars(module).items():
        if isinstance(cls, type) and issubclass(cls, FSDPTestMultiThread) and cls.__module__ == module.__name__:
            for test_name, test_fn in vars(cls).items():
                if test_name.startswith("test"):
                    allow_cpu(test_fn)

            def perThreadSetUp(self, _base=cls.perThreadSetUp) -> None:  # noqa: N802 - torch's hook name
                _base(self)
                dist.distributed_c10d._get_default_store().set_timeout(STORE_TIMEOUT)

            classes.append(type(name, (cls,), {"perThreadSetUp": perThreadSetUp, "__module__": module.__name__}))
    return classes


def main() -> None:
    suite = unittest.TestSuite(
        unittest.defaultTestLoader.loadTestsFromTestCase(cls) for cls in threaded_classes(load_upstream())
    )
    outcomes: dict[str, dict] = {test.id().split(".", 1)[1]: {"outcome": "pass"} for test in _tests(suite)}
    result = unittest.TestResult()
    suite.run(result)  # drops each test once it ran
    for kind, entries in (("fail", result.failures), ("error", result.errors)):
        for test, text in entries:
            lines = [line for line in text.strip().splitlines() if line.strip()]
            outcomes[test.id().split(".", 1)[1]] = {"outcome": kind, "error": lines[-1] if lines else ""}
    for test, reason in result.skipped:
        outcomes[test.id().split(".", 1)[1]] = {"outcome": "skip", "error": reason}
    print(json.dumps(outcomes, sort_keys=True))
    sys.stdout.flush()
    os._exit(0)  # the outcomes are printed; threads the harness gave up on must not keep the process alive


def _tests(suite: unittest.TestSuite):
    for item in suite:
        yield from (_tests(item) if isinstance(item, unittest.TestSuite) else [item])


if __name__ == "__main__":
    main()
