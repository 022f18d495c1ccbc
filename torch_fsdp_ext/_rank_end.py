"""The end of a rank process that the package, its tools and its tests start.

Note: torch's gloo backend can abort a rank at interpreter exit ("terminate called without
an active exception", torch 2.12+): a gloo worker thread that releases the last collective's
work decrefs its tensors' Python objects and waits for the GIL; if the main thread then marks
the interpreter as finalizing, CPython ends the waiting worker with ``pthread_exit``, and the
unwind through the work's noexcept destructor calls ``std::terminate``. Nothing a rank can
call tells it that the workers are idle, and destroying the process group does not stop them
while anything still holds the group (a ``DeviceMesh``, hence every ``fully_shard`` module).
So a rank ends without interpreter finalization: ``os._exit`` ends every thread at once.
Exit handlers then do not run; what they would do for a rank (logging's flush) is done here.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist


def end_rank(wait_for_peers: bool = True, exit_status: int = 0) -> NoReturn:
    """End this process with ``exit_status``: every rank past its collectives (a barrier, unless
    ``wait_for_peers`` is false, e.g. after a fault), the default group destroyed, logging and
    standard streams flushed, then ``os._exit(exit_status)``. Write results before calling it."""
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status)
