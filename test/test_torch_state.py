"""install() / uninstall() leave torch as they found it, including state torch caches lazily.

A fresh interpreter imports the plugin without installing it (``TORCH_FSDP_EXT_DISABLE=1``),
records every module-level and class attribute of torch's FSDP2 modules and of
``torch.utils.checkpoint`` (by identity, and by value for plain values), then installs and
uninstalls once and many times, and compares. The first install runs the plugin's probes
(a tiny checkpoint and a tiny FSDP group), which is where lazily cached torch state changes.
"""

from __future__ import annotations

import json
import unittest

from torch.testing._internal.common_utils import TestCase, run_tests

from common import plugin_specific, run_python

SNAPSHOT = r"""
import importlib, importlib.util, json, pkgutil, sys
import torch, torch.utils.checkpoint
import torch_fsdp_ext
from torch_fsdp_ext import _compat

fsdp2 = next(importlib.import_module(name) for name in _compat.FSDP2_PACKAGES if importlib.util.find_spec(name))
modules = [torch.utils.checkpoint] + [
    importlib.import_module(f"{fsdp2.__name__}.{info.name}") for info in pkgutil.iter_modules(fsdp2.__path__)
]
PLAIN = (type(None), bool, int, float, str, bytes)

def snapshot():
    state = {}
    def record(key, value):
        # Note: identity for every attribute; value too for plain values, where it is cheap and exact.
        state[key] = (id(value), repr(value) if isinstance(value, PLAIN) else None, value)
    for module in modules:
        for name, value in vars(module).items():
            record(f"{module.__name__}.{name}", value)
            if isinstance(value, type) and value.__module__ == module.__name__:
                for attr, member in vars(value).items():
                    record(f"{module.__name__}.{name}.{attr}", member)
    return state

def differences(before, after):
    keys = set(before) | set(after)
    return sorted(
        k for k in keys
        if k not in before or k not in after or before[k][2] is not after[k][2] or before[k][1] != after[k][1]
    )

# Note: status() runs the probes, so it is not called before the first snapshot.
before = snapshot()
torch_fsdp_ext.install()
installed = [name for name, fix in torch_fsdp_ext.status().fixes.items() if fix.active]
torch_fsdp_ext.uninstall()
once = differences(before, snapshot())
for _ in range(CYCLES):
    torch_fsdp_ext.install()
    torch_fsdp_ext.uninstall()
many = differences(before, snapshot())
print(json.dumps({"modules": [module.__name__ for module in modules], "installed": installed, "once": once, "many": many, "attributes": len(before)}))
"""


@plugin_specific
class TestLeavesTorchAsFound(TestCase):
    def test_install_uninstall_restores_fsdp2_and_checkpoint_modules(self) -> None:
        result = run_python(SNAPSHOT.replace("CYCLES", "1000"), env={"TORCH_FSDP_EXT_DISABLE": "1"}, timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr)
        report = json.loads(result.stdout.strip().splitlines()[-1])
        self.assertTrue(report["installed"], "install() installed nothing: the comparison would be vacuous")
        self.assertIn("torch.utils.checkpoint", report["modules"])
        self.assertGreaterEqual(len(report["modules"]), 8)  # the FSDP2 package's modules
        self.assertGreater(report["attributes"], 500)
        self.assertEqual(report["once"], [])
        self.assertEqual(report["many"], [])


if __name__ == "__main__":
    run_tests()
