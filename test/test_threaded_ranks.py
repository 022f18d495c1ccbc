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

from common import ROOT, plugin_specific

SCRIPT = os.path.join(ROOT, "test", "scripts", "threaded_ranks.py")
# The test that waited 300 s for the other rank-thread's rank check.
WITNESS = "TestFullyShardMixedPrecisionCasts.test_checkpoint_recompute_casts_forward_inputs"


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
        cls.reference = run_threaded("off")

    def setUp(self) -> None:
        super().setUp()
        if self.reference.get(WITNESS, {}).get("outcome") != "pass":
            self.skipTest(f"torch's threaded test does not pass on this torch without the plugin: "
                          f"{self.reference.get(WITNESS)}")

    def assert_as_without_the_plugin(self, outcomes: dict) -> None:
        self.assertEqual(sorted(outcomes), sorted(self.reference))
        for name, expected in self.reference.items():
            self.assertEqual(outcomes[name], expected, msg=name)

    def test_autoload_as_without_the_plugin(self) -> None:
        self.assert_as_without_the_plugin(run_threaded("autoload", TORCH_FSDP_EXT_AUTOLOAD="1"))

    def test_import_as_without_the_plugin(self) -> None:
        self.assert_as_without_the_plugin(run_threaded("import"))


if __name__ == "__main__":
    run_tests()
