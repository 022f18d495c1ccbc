"""Ranks on this machine, started by the package's own commands (``doctor``, ``demo``) without a launcher.

Each rank is a spawned process that calls ``rank_fn(rank, init_file, result_file, *args)``; the ranks meet through
``init_file`` (a ``file://`` rendezvous, so no port is needed) and rank 0 writes its results, a JSON object, to
``result_file`` with :func:`write_result`. The caller gets that object back, or ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Callable

# torch's warning when it is imported without numpy, as a PYTHONWARNINGS entry.
NUMPY_WARNING_FILTER = "ignore:Failed to initialize NumPy:UserWarning"


def write_result(result_file: str, results: dict) -> None:
    """Rank 0's results, written whole or not at all."""
    with open(result_file + ".part", "w") as f:
        json.dump(results, f)
    os.replace(result_file + ".part", result_file)


def run_local_ranks(rank_fn: Callable[..., Any], args: tuple, world_size: int, timeout: float) -> dict:
    """Run ``rank_fn`` on ``world_size`` spawned ranks and return what rank 0 wrote."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result.json")
        # Note: a spawned rank imports torch before the plugin; the variable it inherits keeps
        # torch's warning about numpy, which the ranks never use, out of the output.
        inherited = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [inherited, NUMPY_WARNING_FILTER]))
        try:
            context = mp.start_processes(
                rank_fn, args=(init_file, result_file, *args), nprocs=world_size, start_method="spawn", join=False
            )
        finally:
            if inherited is None:
                del os.environ["PYTHONWARNINGS"]
            else:
                os.environ["PYTHONWARNINGS"] = inherited
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    return {"error": f"the ranks did not finish within {timeout:.0f} s"}
        except mp.ProcessExitedException as e:
            return {"error": f"a rank did not end cleanly: {e}"}
        if not os.path.exists(result_file):
            return {"error": "rank 0 ended without writing its results"}
        with open(result_file) as f:
            return json.load(f)
