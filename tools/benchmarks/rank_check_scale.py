"""The rank-consistency check at thousands of simulated ranks: a real TCPStore server, one client per rank.

    python tools/benchmarks/rank_check_scale.py                      # N = 64, 512, 4096; exit 1 on a missed bound
    python tools/benchmarks/rank_check_scale.py --ranks 64 512 4096 16384 --params 720 --old-cap 120 --connections 256

The simulated ranks are spread over ``--connections`` ``TCPStore`` client
connections (a thread each, in several processes; the server runs in this one):
ranks sharing a connection make every call a rank makes, all of them making the
first, non-blocking part of the comparison before any waits. All ranks start
together and run one comparison of the same layout (``--params``
parameters, as the plugin describes them: FQN, dtype, trainable; 720 is a
Llama-70B-sized model) through

- ``new``: the plugin's protocol (``torch_fsdp_ext._rank_consistency._Comparison``);
- ``old``: the protocol of torch_fsdp_ext before it (each rank sets its whole
  layout, waits for every peer's key and reads each one), replayed here as the
  baseline. It moves ranks x (ranks - 1) layouts through the server; past
  ``--old-cap`` seconds it is stopped and reported as not finished.

Printed per protocol and N: wall time of the check (from the common start to the
last rank done), payload bytes through the server (keys and values sent, values
received, summed over ranks), the most calls and bytes of one rank, and the keys
left in the store. Bounds for ``new``: <= 12 calls and <= 2 KB per rank at every
N, one key left (the round counter), faster than ``old`` wherever ``old``
finished. What limits N: the old protocol's N x (N - 1) layouts (stopped at
``--old-cap``); for the new one, connecting clients (a connection per rank at
N = 4,096 took minutes on the loaded 2-core machine this was measured on, hence
shared connections) and the time to run N x 11 calls through one server.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_fsdp_ext import MixedParamDtypeError
from torch_fsdp_ext._rank_consistency import _Comparison

MAX_CALLS, MAX_BYTES = 12, 2048
TIMEOUT = timedelta(seconds=600)


def layout_payload(params: int) -> str:
    """A layout as the plugin posts it: one group per block of 8 parameters."""
    groups = []
    for block in range(0, params, 8):
        entries = [(f"layers.{block // 8}.{name}.weight", "torch.bfloat16" if name.startswith("w") else "torch.float32",
                    True) for name in ("attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2")]
        groups.append((f"layers.{block // 8}", entries[: params - block]))
    return json.dumps(groups)


class CountingClient:
    """A store client that counts each call and its payload bytes."""

    def __init__(self, store) -> None:
        self._store, self.calls, self.bytes = store, 0, 0

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args):
            result = attr(*args)
            self.calls += 1
            for value in (*args, result):
                if isinstance(value, (str, bytes)):
                    self.bytes += len(value)
                elif isinstance(value, list):
                    self.bytes += sum(len(v) for v in value)
            return result

        return counted


def old_protocol(store, me: int, world: int, payload: str):
    prefix = "torch_fsdp_ext/dtype_layout/0/"
    store.set(prefix + str(me), payload)
    yield  # every rank posts before any waits
    others = [prefix + str(r) for r in range(world) if r != me]
    store.wait(others, TIMEOUT)
    values = {key: store.get(key) for key in others}
    if any(value.decode() != payload for value in values.values()):
        raise AssertionError("layouts differ")


def new_protocol(store, me: int, world: int, payload: str):
    comparison = _Comparison(store, me, world, payload, "'<root>'", TIMEOUT, "the process group's timeout")
    comparison.count()
    yield  # every rank counts before any waits for the verdict
    comparison.conclude(MixedParamDtypeError)


def worker(protocol: str, clients: list[list[int]], world: int, ports, payload: str, ready, go, results) -> None:
    """Runs the ranks of ``clients`` (each a list of ranks sharing one connection), a thread per connection."""
    threading.stack_size(256 * 1024)
    port = ports.get()
    run = new_protocol if protocol == "new" else old_protocol
    stores = [dist.PrefixStore("0/", dist.TCPStore("127.0.0.1", port, world, False, timeout=TIMEOUT)) for _ in clients]
    counters = {me: CountingClient(store) for store, ranks in zip(stores, clients) for me in ranks}
    done: dict[int, float] = {}
    start = threading.Event()

    def connection(ranks: list[int]) -> None:
        start.wait()
        steps = [run(counters[me], me, world, payload) for me in ranks]
        for phase in steps:  # the non-blocking first phase of every rank, then the waits
            next(phase)
        for me, phase in zip(ranks, steps):
            next(phase, None)
            done[me] = time.monotonic()

    threads = [threading.Thread(target=connection, args=(ranks,)) for ranks in clients]
    for thread in threads:
        thread.start()
    ready.put(sum(len(ranks) for ranks in clients))
    go.wait()
    start.set()
    for thread in threads:
        thread.join()
    results.put([(me, done[me], counters[me].calls, counters[me].bytes) for ranks in clients for me in ranks])


def simulate(protocol: str, world: int, connections: int, payload: str, cap: float) -> dict:
    # Note: the workers are forked before the server starts its thread (a fork copies no threads, only their locks).
    context = multiprocessing.get_context("fork")
    ports, ready, go, results = context.Queue(), context.Queue(), context.Event(), context.Queue()
    connections = min(connections, world)
    by_connection = [list(range(c, world, connections)) for c in range(connections)]
    processes_count = min(8, connections)
    processes = [
        context.Process(target=worker, args=(protocol, by_connection[p::processes_count], world, ports, payload,
                                             ready, go, results), daemon=True)
        for p in range(processes_count)
    ]
    for process in processes:
        process.start()
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=TIMEOUT, wait_for_workers=False)
    for _ in processes:
        ports.put(server.port)
    connected = sum(ready.get(timeout=600) for _ in processes)
    assert connected == world
    keys_before = server.num_keys()  # with the key that counts connected clients
    started = time.monotonic()
    go.set()
    per_rank = []
    try:
        for _ in processes:
            per_rank += results.get(timeout=max(1.0, cap - (time.monotonic() - started)))
    except Exception:  # noqa: BLE001 - queue.Empty: past the cap
        for process in processes:
            process.kill()
        return {"finished": False, "wall": time.monotonic() - started}
    for process in processes:
        process.join()
    return {
        "finished": True,
        "wall": max(t for _, t, _, _ in per_rank) - started,
        "bytes": sum(b for _, _, _, b in per_rank),
        "max_calls": max(c for _, _, c, _ in per_rank),
        "max_bytes": max(b for _, _, _, b in per_rank),
        "keys_left": server.num_keys() - keys_before,
    }


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    raise AssertionError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--params", type=int, default=720)
    parser.add_argument("--old-cap", type=float, default=120.0, help="seconds after which the old protocol is stopped")
    parser.add_argument("--connections", type=int, default=256, help="client connections the ranks are spread over")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    payload = layout_payload(args.params)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, layout of {args.params} parameters = "
          f"{len(payload):,} bytes, open-file limit {hard}, {time.strftime('%Y-%m-%d', time.gmtime())}")
    header = ["ranks", "protocol", "wall s", "bytes through server", "max calls/rank", "max bytes/rank", "keys left"]
    rows, ok, new_costs = [], True, set()
    for world in args.ranks:
        results = {}
        for protocol in ("new", "old"):
            results[protocol] = r = simulate(protocol, world, args.connections, payload,
                                                   args.old_cap if protocol == "old" else 600)
            if r["finished"]:
                rows.append([f"{world:,}", protocol, f"{r['wall']:.2f}", human(r["bytes"]), str(r["max_calls"]),
                             human(r["max_bytes"]), f"{r['keys_left']:,}"])
            else:
                expected = world * (world - 1) * len(payload)
                rows.append([f"{world:,}", protocol, f"> {r['wall']:.0f} (stopped)",
                             f"({human(expected)} needed)", "", "", ""])
            print(" | ".join(rows[-1]), flush=True)
        new, old = results["new"], results["old"]
        met = (new["finished"] and new["max_calls"] <= MAX_CALLS and new["max_bytes"] <= MAX_BYTES
               and new["keys_left"] == 1 and (not old["finished"] or new["wall"] < old["wall"]))
        new_costs.add(new.get("max_calls"))
        ok = ok and met
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    ok = ok and len(new_costs) == 1
    print(f"\nnew protocol: max calls per rank {sorted(new_costs)} at every N (bound {MAX_CALLS}), "
          f"bytes per rank bound {MAX_BYTES}, one key left")
    print("all bounds met" if ok else "BOUND MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
