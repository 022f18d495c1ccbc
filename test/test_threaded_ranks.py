"""Ranks as threads of one process (torch's ``FSDPTestMultiThread``) run with the plugin as without it.

Nothing the plugin does while one rank waits for another (the rank check, its install, the
upcast) may hold per-process state the other rank needs: with the start-up hook, both
rank-threads reach the one-time stand-in of ``FSDPParamGroup.__init__`` at once, and a rank
that built its groups with torch's own ``__init__`` meanwhile never joined the rank check
(the other waited for it until its timeout). Each run is a subprocess
(test/scripts/threaded_ranks.py) whose rank check times out after 20 s, so a hang fails in
about a minute, not after torch's 300 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from torch.testing._internal.common_utils import TestCase, run_tests

from common import HAS_RECOMPUTE_CAST_BUG, ROOT, plugin_specific

SCRIPT = os.path.join(ROOT, "test", "scripts", "threaded_ranks.py")
# The test that waited 300 s for the other rank-thread's rank check.
WITNESS = "TestFullyShardMixedPrecisionCasts.test_checkpoint_recompute_casts_forward_inputs"
# Before 2.13 torch does not redo FSDP's casts in a checkpoint's recompute: these fail without the plugin,
# whose recompute fix replays the casts.
REPAIRED = (WITNESS, "TestFullyShardMixedPrecisionCasts.test_checkpoint_recompute_casts_outputs")


def run_threaded(mode: str, **env: str) -> dict:
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("TORCH_FSDP_EXT_DISABLE", "TORCH_FSDP_EXT_AUTOLOAD"):
        full_env.pop(name, None)
    full_env.update(env)
    done = subprocess.run([sys.executable, SCRIPT, mode], capture_output=True, text=True, env=full_env,
                          timeout=240, cwd=ROOT)
    if done.returncode != 0 or not done.stdout.strip():
        raise AssertionError(f"threaded_ranks.py {mode} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@plugin_specific
class ThreadedRanksTest(TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        reference = run_threaded("off")
        cls.reference_witness = reference[WITNESS]
        # With the plugin: what torch gives without it, and a pass where the plugin repairs torch.
        cls.expected = {
            name: {"outcome": "pass"} if HAS_RECOMPUTE_CAST_BUG and name in REPAIRED else outcome
            for name, outcome in reference.items()
        }

    def test_reference(self) -> None:
        # The hang's witness runs on every release: it passes without the plugin, or fails where the plugin repairs it.
        self.assertEqual(self.reference_witness["outcome"], "error" if HAS_RECOMPUTE_CAST_BUG else "pass",
                         self.reference_witness)

    def assert_as_without_the_plugin(self, outcomes: dict) -> None:
        self.assertEqual(sorted(outcomes), sorted(self.expected))
        for name, expected in self.expected.items():
            self.assertEqual(outcomes[name], expected, msg=name)

    def test_autoload_as_without_the_plugin(self) -> None:
        self.assert_as_without_the_plugin(run_threaded("autoload", TORCH_FSDP_EXT_AUTOLOAD="1"))

    def test_import_as_without_the_plugin(self) -> None:
        self.assert_as_without_the_plugin(run_threaded("import"))


if __name__ == "__main__":
    run_tests()
