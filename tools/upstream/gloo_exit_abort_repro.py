"""A gloo rank aborts at interpreter exit: "terminate called without an active exception".

    python tools/upstream/gloo_exit_abort_repro.py [--runs N] [--mitigated]

Plain torch, 2 gloo ranks on CPU, no FSDP. Each run starts two rank processes of this script:

- rank 0 starts an ``all_reduce`` of a tensor, drops the returned work and lets the script end;
  its last exit handler keeps the GIL for ``HOLD_S`` (as a slow exit handler would; here a C
  call that keeps the GIL);
- rank 1 joins that ``all_reduce`` ``LATE_S`` later, while rank 0's handler runs.

Rank 0's gloo worker thread (``pt_gloo_runloop``) completes the work during the handler and,
destroying it (``~AsyncWork``), decrefs the tensor's Python object: ``decref_pyobject`` finds the
interpreter initialized and waits for the GIL (``gil_scoped_acquire``). The handler returns and the
main thread marks the interpreter as finalizing without handing the GIL over; the waiting worker,
at its next 5 ms timeout in ``take_gil``, is ended by CPython with ``pthread_exit``, whose forced
unwind through the noexcept destructor calls ``std::terminate``: rank 0 dies by SIGABRT. A real
script meets the same when the last collective's work is released in the few milliseconds before
finalization.

``--mitigated`` ends both ranks as recommended instead: rank 0 waits for its collective, every rank
passes a barrier, the process group is destroyed, output flushed, and the process ends with
``os._exit(0)``, without interpreter finalization (so without exit handlers either).

Prints one line, ``gloo exit abort: K of N runs aborted``, and exits 0 whatever K is.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

HOLD_S = 2.0  # how long rank 0's last exit handler keeps the GIL
LATE_S = 1.0  # how long after rank 0 rank 1 joins the all_reduce
RUN_TIMEOUT_S = 120


def end_rank() -> None:
    """The recommended end of a rank: every rank past its collectives, the group destroyed, output
    flushed, and no interpreter finalization for a gloo worker to meet."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_main(rank: int, port: int, mitigated: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.ones(1024)
    if rank == 1:
        time.sleep(LATE_S)
        dist.all_reduce(tensor)
        if mitigated:
            end_rank()
        os._exit(0)  # rank 1 only serves rank 0's collective late: it must not abort itself
    work = dist.all_reduce(tensor, async_op=True)
    if mitigated:
        work.wait()
        end_rank()
    # The script ends with the collective in flight; the work's last reference is the worker's.
    del work
    # Note: a Python exit handler that runs after the one that holds the GIL hands the GIL to the
    # waiting worker before finalization (the worker asks for it after 5 ms), and the work then ends
    # cleanly: so the handlers registered so far (site's, e.g. certifi's cleanup) run now. A PyDLL
    # function keeps the GIL through the call (a CDLL one or time.sleep would release it), and
    # called by atexit itself it returns to no bytecode that could hand the GIL over.
    atexit._run_exitfuncs()
    atexit.register(ctypes.PyDLL(None).usleep, int(HOLD_S * 1e6))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(mitigated: bool) -> bool:
    """Whether a rank aborted (SIGABRT, or the message on its own stderr); any other failure is shown."""
    port = free_port()
    command = [sys.executable, os.path.abspath(__file__), "--port", str(port)] + (["--mitigated"] if mitigated else [])
    ranks = [
        subprocess.Popen(command + ["--rank", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    aborted = False
    for rank, process in enumerate(ranks):
        try:
            _, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        rank_aborted = process.returncode == -6 or "terminate called without an active exception" in stderr
        if process.returncode != 0 and not rank_aborted:
            print(f"rank {rank} exited with {process.returncode}:\n{stderr}", file=sys.stderr)
        aborted |= rank_aborted
    return aborted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mitigated", action="store_true", help="end rank 0 the recommended way")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.mitigated)
        return
    aborted = sum(one_run(args.mitigated) for _ in range(args.runs))
    print(f"gloo exit abort: {aborted} of {args.runs} runs aborted")


if __name__ == "__main__":
    main()
