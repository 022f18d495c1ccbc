"""Fault probes (issue 13): run a faulty job's scenario on 2 gloo CPU ranks and print what happened.

    python tools/reproductions/fault_probe.py unshard-cycles      # collectives over 200 x 3 explicit
                                                                  # unshard()/reshard()
    python tools/reproductions/fault_probe.py rank-local-unshard  # rank 0 alone calls unshard() between forward and
                                                                  # backward
    python tools/reproductions/fault_probe.py plugin-on-rank-0    # rank 1 runs without the plugin; nothing to fix
    python tools/reproductions/fault_probe.py thread-toggle       # install()/uninstall() from a 2nd thread while
                                                                  # training

The scenarios use only the public API, so the same command measures another checkout
(``PYTHONPATH=<checkout>``) that has ``torch_fsdp_ext._rank_end``, whose ``end_rank`` ends each
rank. Each rank is a process; its exit code is printed (-6 is SIGABRT). ``--timeout`` is the
process group's timeout in seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import threading
import time
from datetime import timedelta

SCENARIOS = ("unshard-cycles", "rank-local-unshard", "plugin-on-rank-0", "thread-toggle")


def _model(torch, nn, plugin_on: bool):
    """Three blocks of a bf16 linear and an fp32 norm (the seed-000 layout); already fp32 for plain torch."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16).to(torch.bfloat16), nn.LayerNorm(16)) for _ in range(3)))
    if not plugin_on:
        model.float()
    return model


def _shard(torch, model, **kwargs):
    """Three FSDP groups: the first two blocks and the root (which holds the last block)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model[:2]:
        fully_shard(block, mp_policy=policy, **kwargs)
    return fully_shard(model, mp_policy=policy, **kwargs)


def _step(torch, model, optimizer, rank: int, step: int, between=None) -> float:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = model(x).float().pow(2).mean()
    if between is not None:
        between()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _count_collectives(dist, counts: dict) -> None:
    from torch.distributed import distributed_c10d

    for name in ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single", "all_reduce",
                 "broadcast", "barrier", "reduce_scatter_tensor", "reduce_scatter_single"):
        original = getattr(distributed_c10d, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(distributed_c10d, name, counted)
        setattr(dist, name, counted)


def _rank_main(scenario: str, rank: int, init_file: str, timeout: float, plugin_on: bool, results) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import torch_fsdp_ext
    from torch_fsdp_ext._rank_end import end_rank

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=timeout)
    )
    if not plugin_on or (scenario == "plugin-on-rank-0" and rank == 1):
        torch_fsdp_ext.uninstall()
    started = time.monotonic()
    try:
        if scenario == "unshard-cycles":
            model = _shard(torch, _model(torch, nn, plugin_on))
            _step(torch, model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0)
            counts: dict = {}
            _count_collectives(dist, counts)
            modules = [model, model[0], model[1]]
            for _ in range(200):
                for module in modules:
                    module.unshard()
                    module.reshard()
            outcome = f"collectives over 200 x 3 unshard/reshard: {dict(sorted(counts.items()))}"
        elif scenario == "rank-local-unshard":
            model = _shard(torch, _model(torch, nn, plugin_on), reshard_after_forward=False)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            local = model.unshard if rank == 0 else None
            losses = [_step(torch, model, optimizer, rank, step, local) for step in range(3)]
            outcome = f"trained 3 steps, losses {[round(v, 6) for v in losses]}"
        elif scenario == "plugin-on-rank-0":
            torch.manual_seed(0)
            model = _shard(torch, _model(torch, nn, False))  # fp32 everywhere: nothing to fix
            losses = [_step(torch, model, torch.optim.SGD(model.parameters(), lr=0.1), rank, s) for s in range(3)]
            outcome = f"trained 3 steps, losses {[round(v, 6) for v in losses]}"
        else:  # thread-toggle
            outcome = _thread_toggle(torch, nn, rank, plugin_on, torch_fsdp_ext)
    except Exception as e:  # noqa: BLE001 - the outcome is what we report
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    results.put((rank, f"{outcome} ({time.monotonic() - started:.1f} s)"))
    results.close()
    results.join_thread()  # the queue's feeder thread has sent the outcome: end_rank skips exit handlers
    # Note: no barrier: in a faulty scenario a rank may have stopped communicating.
    end_rank(wait_for_peers=False)


def _thread_toggle(torch, nn, rank: int, plugin_on: bool, torch_fsdp_ext) -> str:
    def train(toggle: bool):
        model = _shard(torch, _model(torch, nn, True))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = [_step(torch, model, optimizer, rank, 0)]
        stop, toggles = threading.Event(), [0]

        def toggler():
            while not stop.wait(0.001):
                torch_fsdp_ext.install()
                torch_fsdp_ext.uninstall()
                toggles[0] += 1
            torch_fsdp_ext.install()

        thread = threading.Thread(target=toggler) if toggle else None
        if thread is not None:
            thread.start()
        try:
            losses += [_step(torch, model, optimizer, rank, step) for step in range(1, 200)]
        finally:
            stop.set()
            if thread is not None:
                thread.join()
        return losses, toggles[0]

    reference, _ = train(False)
    runs = [train(True) for _ in range(3)]
    equal = [losses == reference for losses, _ in runs]
    return f"3 runs of 200 steps with toggling: equal to the uninterrupted run {equal}, toggles {[t for _, t in runs]}"


def run(scenario: str, plugin_on: bool, timeout: float) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [
            context.Process(target=_rank_main, args=(scenario, r, os.path.join(tmp, "init"), timeout, plugin_on, results))
            for r in range(2)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout * 4 + 120)
            if process.is_alive():
                process.kill()
                process.join()
        outcomes = {}
        while not results.empty():
            rank, outcome = results.get()
            outcomes[rank] = outcome
    label = "plugin" if plugin_on else "plain torch"
    for rank, process in enumerate(ranks):
        print(f"{scenario:20} {label:11} rank {rank}: exit {process.exitcode}: {outcomes.get(rank, '(no result)')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=SCENARIOS + ("all",))
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    for scenario in SCENARIOS if args.scenario == "all" else (args.scenario,):
        for plugin_on in (False, True):
            if scenario == "thread-toggle" and not plugin_on:
                continue  # toggles the plugin itself
            run(scenario, plugin_on, args.timeout)


if __name__ == "__main__":
    main()
