"""Ends a multi-process test as soon as one of its ranks dies.

Note: ``MultiProcessTestCase._join_processes`` ends a test early only when a rank exits with
``TEST_ERROR_EXIT_CODE`` (an exception in the test body). A rank that dies otherwise (a
signal, e.g. an abort in a gloo worker, or another exit status) leaves the other ranks
waiting in their next collective until the test's timeout (minutes). ``EndOnRankDeath``
watches the ranks while torch's loop joins them and terminates the others once one exits
with a status that is neither 0, the error code nor a skip code; torch's
``_check_return_codes`` then fails the test on the mismatched exit statuses at once.
"""

from __future__ import annotations

import threading

from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcessTestCase

POLL_S = 0.1
_EXPECTED_EXIT_CODES = frozenset(
    {0, MultiProcessTestCase.TEST_ERROR_EXIT_CODE, *(skip.exit_code for skip in TEST_SKIPS.values())}
)


def _end_on_rank_death(processes: list, done: threading.Event) -> None:
    while not done.wait(POLL_S):
        if any(p.exitcode is not None and p.exitcode not in _EXPECTED_EXIT_CODES for p in processes):
            for p in processes:
                if p.exitcode is None:
                    p.terminate()
            return


class EndOnRankDeath:
    """Mixin for a ``MultiProcessTestCase``: a rank that dies ends the test at once."""

    def _join_processes(self, fn) -> None:
        done = threading.Event()
        watcher = threading.Thread(target=_end_on_rank_death, args=(self.processes, done), daemon=True)
        watcher.start()
        try:
            super()._join_processes(fn)
        finally:
            done.set()
            watcher.join()
