"""The rank-consistency check at scale: constant store traffic per rank, nothing left behind,
no group, process-group incarnation or timeout mistaken for another.

Each case is compared with plain torch where plain torch can run it.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import unittest.mock
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import torch_fsdp_ext
from torch_fsdp_ext import MixedParamDtypeError, RankCheckTimeoutError, _compat
from torch_fsdp_ext._rank_consistency import _Comparison, comparisons_made

from common import (
    ROOT,
    FSDPExtTestCase,
    MixedPrecisionPolicy,
    RMSNorm,
    TinyLlama,
    CountingStore,
    StoreTraffic,
    batch,
    counting_store_calls,
    fully_shard,
    lm_loss,
    needs_dtype_fix,
    plugin,
    plugin_specific,
    seed_000_model,
    shard_model,
)
from torch.testing._internal.common_utils import TestCase, run_tests

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# What the check may cost each rank at the first forward, whatever the world size and the model.
MAX_CALLS_PER_RANK, MAX_BYTES_PER_RANK = 12, 2048


def train(model: nn.Module, rank: int, steps: int, *, before_first_forward=None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        if step == 0 and before_first_forward is not None:
            before_first_forward()
        tokens = batch(rank, step)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def mixed_model(plugin_on: bool, layers: int = 2, **fully_shard_kwargs) -> nn.Module:
    """The seed-000 layout with the plugin; the same model already in fp32 for plain torch."""
    model = seed_000_model(layers=layers)
    if not plugin_on:
        model.float()
    return shard_model(model, mp_policy=MP, **fully_shard_kwargs)


def open_files_and_threads() -> tuple[int, int]:
    gc.collect()
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def simulated_comparison_traffic(world: int, payload: str) -> list[tuple[tuple[int, int], int, int]]:
    """The plugin's comparison run by ``world`` threads, each with its own client of a real TCPStore.

    Returns each rank's (role, calls, bytes), as ``traffic_of`` does.
    """
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    results: list = [None] * world

    def rank(me: int) -> None:
        traffic = StoreTraffic()
        client = dist.TCPStore("127.0.0.1", server.port, world, False, timeout=timedelta(seconds=30))
        comparison = _Comparison(CountingStore(dist.PrefixStore("0/", client), traffic), me, world, payload, "'<root>'",
                                 timedelta(seconds=30), "the process group's timeout")
        comparison.count()
        comparison.conclude(MixedParamDtypeError)
        results[me] = traffic_of(traffic)

    threads = [threading.Thread(target=rank, args=(me,)) for me in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def traffic_of(traffic: StoreTraffic) -> tuple[tuple[int, int], int, int]:
    role = (traffic.calls.get("compare_set", 0), traffic.calls.get("delete_key", 0))  # verdict posted, keys deleted
    return role, traffic.total(), traffic.bytes


@needs_dtype_fix
@plugin_specific
class TestStoreTraffic(FSDPExtTestCase):
    WORLD_SIZE = 4

    def test_per_rank_traffic_is_the_same_at_every_world_size_and_model_size(self):
        """Groups of 2 and 4 FSDP ranks, models of 2 and 16 blocks, and 8 simulated ranks on a TCPStore:
        each rank's calls and bytes depend only on its role (posts the verdict, deletes the keys).

        Before: world + 1 calls and ~59 bytes x parameters x world per rank, and world keys left per model.
        """
        records = []
        for size in (2, 4):
            pg = dist.new_group(list(range(size)))  # every rank takes part in new_group
            if self.rank >= size:
                continue
            mesh = DeviceMesh.from_group(pg, "cpu")
            for layers in (2, 16):
                with plugin(True), counting_store_calls() as traffic:
                    model = mixed_model(True, layers=layers, mesh=mesh)
                    train(model, self.rank, steps=1)
                dist.barrier(group=pg)  # every rank is done with the comparison
                store = _compat.process_group_store(pg)
                left = sorted(key for key in traffic.keys if not key.endswith("/round") and store.check([key]))
                self.assertEqual((traffic.comparisons, left), (1, []))  # compared once; only the round counter stays
                records.append(traffic_of(traffic))
        every: list = [None] * self.world_size
        dist.all_gather_object(every, records)
        if self.rank == 0:
            every.append(simulated_comparison_traffic(8, payload="x" * 100_000))
        by_role: dict = {}
        for role, calls, size_bytes in (record for rank in every for record in rank):
            self.assertLessEqual(calls, MAX_CALLS_PER_RANK)
            self.assertLessEqual(size_bytes, MAX_BYTES_PER_RANK)
            by_role.setdefault(role, set()).add((calls, size_bytes))
        self.assertEqual({role: len(costs) for role, costs in by_role.items()}, {role: 1 for role in by_role}, by_role)
        self.assertIn((0, 0), by_role)  # most ranks neither post the verdict nor delete


@plugin_specific
class TestDisagreement(FSDPExtTestCase):
    WORLD_SIZE = 4

    def test_every_rank_names_the_parameters_dtypes_and_ranks_that_differ(self):
        """Rank 2 of 4 builds its model in bf16: every rank fails with the same detailed error, no key stays."""
        with plugin(True), counting_store_calls() as traffic:
            model = nn.Sequential(nn.Linear(4, 4), RMSNorm(4))
            if self.rank == 2:
                model.to(torch.bfloat16)
            fully_shard(model, mp_policy=MP)
            with self.assertRaises(MixedParamDtypeError) as caught:
                model(torch.randn(2, 4))
        self.assertEqual(
            str(caught.exception).splitlines(),
            [
                "torch_fsdp_ext: ranks disagree on the parameter dtypes of FSDP2 group '<root>'; every rank must "
                "build the model with the same dtypes and requires_grad flags before fully_shard:",
                "  0.weight: rank 0: torch.float32, rank 1: torch.float32, rank 2: torch.bfloat16, rank 3: torch.float32",
                "  0.bias: rank 0: torch.float32, rank 1: torch.float32, rank 2: torch.bfloat16, rank 3: torch.float32",
                "  1.weight: rank 0: torch.float32, rank 1: torch.float32, rank 2: torch.bfloat16, rank 3: torch.float32",
            ],
        )
        dist.barrier()
        self.assertEqual(comparisons_made(dist.group.WORLD), 1)
        store = _compat.process_group_store(dist.group.WORLD)
        left = [key for key in traffic.keys if not key.endswith("/round") and store.check([key])]
        self.assertEqual((traffic.comparisons, left), (1, []))  # the layouts and counters deleted


@needs_dtype_fix
@plugin_specific
class TestFixesInstalled(FSDPExtTestCase):
    def test_a_rank_without_a_fix_fails_on_every_rank_naming_the_fix_and_the_rank(self):
        """Rank 1 runs without the recompute fix (as when it stood aside there only): one error, every rank."""
        with plugin(True):
            if "recompute" not in torch_fsdp_ext.status().fixes or not torch_fsdp_ext.status().fixes["recompute"].active:
                self.skipTest("this torch needs no recompute fix: nothing can differ")
            if self.rank == 1:
                torch_fsdp_ext.uninstall(["recompute"])
            model = mixed_model(True)
            tokens = batch(self.rank, 0)
            with self.assertRaises(MixedParamDtypeError) as caught:
                model(tokens)
        self.assertTrue(str(caught.exception).startswith(
            "torch_fsdp_ext: fix 'recompute' is installed on rank(s) 0 and not on rank(s) 1; every rank must install "
            "the same fixes"
        ), str(caught.exception))

    def test_ranks_with_the_same_fixes_train_as_before(self):
        """Both ranks without the recompute fix agree: the comparison looks at what differs, not at what is off."""
        with plugin(True):
            torch_fsdp_ext.uninstall(["recompute"])
            losses = train(mixed_model(True), self.rank, 2)
        with plugin(False):
            reference = train(mixed_model(False), self.rank, 2)
        self.assertEqual(losses, reference)


@needs_dtype_fix
@plugin_specific
class TestGroupsAndIncarnations(FSDPExtTestCase):
    def test_60_new_group_trials_leave_open_files_and_threads_as_plain_torch(self):
        """Before: +5 open files and +3 threads per trial with the plugin (every group kept alive)."""
        growth = {}
        for plugin_on in (False, True):
            before = open_files_and_threads()
            with plugin(plugin_on):
                for _ in range(60):
                    pg = dist.new_group([0, 1])
                    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), RMSNorm(4))
                    if not plugin_on:
                        model.float()
                    fully_shard(model, mesh=DeviceMesh.from_group(pg, "cpu"), mp_policy=MP)
                    model(torch.randn(2, 4)).float().sum().backward()
                    del model
                    dist.destroy_process_group(pg)
            after = open_files_and_threads()
            growth[plugin_on] = (after[0] - before[0], after[1] - before[1])
        for files_or_threads in (0, 1):
            self.assertLessEqual(growth[True][files_or_threads], growth[False][files_or_threads], growth)

    def _reinit(self, store, timeout: timedelta | None = None) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size, **kwargs)

    def test_destroy_and_reinit_of_the_default_group_with_another_model_trains(self):
        """The default group destroyed and made again (same name), a different model: trains as plain torch.

        Note: each incarnation gets a prefix of one store, because gloo's own connection setup
        cannot re-use a store (it reads the addresses of the first incarnation). That stale
        comparison keys of a group with the same store and name are never read is tested
        with the protocol itself (``test_stale_keys_of_an_earlier_incarnation_or_attempt``).
        """
        losses = {}
        for plugin_on in (False, True):
            store = dist.FileStore(f"{self.file_name}.reinit.{plugin_on}", self.world_size)
            with plugin(plugin_on):
                self._reinit(dist.PrefixStore("incarnation0/", store))
                first = train(mixed_model(plugin_on), self.rank, steps=2)
                self._reinit(dist.PrefixStore("incarnation1/", store))
                torch.manual_seed(1)
                second_model = shard_model(TinyLlama(layers=3), mp_policy=MP)  # fp32: nothing to fix
                second = train(second_model, self.rank, steps=2)
                if plugin_on:
                    self.assertEqual(comparisons_made(dist.group.WORLD), 1)
                losses[plugin_on] = first, second
        self.assertEqual(losses[True], losses[False])

    def test_a_late_rank_is_awaited_for_the_process_groups_timeout_not_the_stores(self):
        """TCPStore timeout 5 s, process-group timeout 60 s, rank 1 10 s late to its first forward.

        Before: RankCheckTimeoutError on rank 0 after 5 s ("the process group's timeout"); plain torch trains.
        """
        port_store = dist.FileStore(f"{self.file_name}.port", self.world_size)
        if self.rank == 0:
            store = dist.TCPStore(
                "127.0.0.1", 0, self.world_size, True, timeout=timedelta(seconds=5), wait_for_workers=False
            )
            port_store.set("port", str(store.port))
        else:
            port_store.wait(["port"])
            port = int(port_store.get("port"))
            store = dist.TCPStore("127.0.0.1", port, self.world_size, False, timeout=timedelta(seconds=5))
        losses = {}
        self._reinit(store, timeout=timedelta(seconds=60))
        self.assertEqual(_compat.process_group_timeout(dist.group.WORLD), timedelta(seconds=60))
        for plugin_on in (False, True):
            late = (lambda: time.sleep(10)) if plugin_on and self.rank == 1 else None
            with plugin(plugin_on):
                losses[plugin_on] = train(mixed_model(plugin_on), self.rank, steps=2, before_first_forward=late)
        self.assertEqual(losses[True], losses[False])
        dist.barrier()


@plugin_specific
class TestStaleKeys(TestCase):
    def test_stale_keys_of_an_earlier_incarnation_or_attempt_are_never_read(self):
        """Two ranks as threads on one TCPStore, always under the same group prefix:

        - an earlier incarnation compared a different model (its comparison complete);
        - an elastic attempt 0 stopped mid-comparison (rank 0 counted, rank 1 never came);
        then attempt 1 compares equal layouts: both agree, with no error and no wait.
        Before: the second incarnation read the first one's keys (false ``ranks disagree``), and a
        restarted attempt counted with the failed attempt's keys.
        """
        # Note: the server must die in this process. Left in cyclic garbage (closures, exception
        # tracebacks), it is collected in whichever process collects next: a rank forked from
        # pytest then joins a server thread that only exists here, and hangs (seen in test_recompute).
        self.addCleanup(gc.collect)
        server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)

        def compare(me: int, payload: str, *, conclude: bool = True) -> None:
            store = dist.PrefixStore("0/", dist.TCPStore("127.0.0.1", server.port, 2, False))
            comparison = _Comparison(store, me, 2, payload, "'<root>'", timedelta(seconds=10), "test")
            comparison.count()
            if conclude:
                comparison.conclude(MixedParamDtypeError)

        def both(payloads: tuple[str, str]) -> list:
            errors: list = []

            def rank(me: int) -> None:
                try:
                    compare(me, payloads[me])
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=rank, args=(me,)) for me in (0, 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return errors

        # A rank's description: the fixes installed, then (group name, layout) per group.
        first = json.dumps([["dtype"], [["<root>", [["w", "torch.float32", True]]]]])
        second = json.dumps([["dtype"], [["<root>", []]]])
        with unittest.mock.patch.dict(os.environ, {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}):
            self.assertEqual(both((first, first)), [])  # the first incarnation
            self.assertEqual(both((second, second)), [])  # the next one: same store, same group name
            compare(0, first, conclude=False)  # attempt 0 fails mid-comparison
        with unittest.mock.patch.dict(os.environ, {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "1"}):
            started = time.monotonic()
            self.assertEqual(both((second, second)), [])
            self.assertLess(time.monotonic() - started, 5)
        self.assertEqual(both((first, second))[0].__class__, MixedParamDtypeError)  # and differences still show


@plugin_specific
class TestAfterATimeout(TestCase):
    def test_a_caught_timeout_never_lets_a_later_comparison_agree(self):
        """Two ranks as threads on one TCPStore. Rank 1 is late; rank 0 times out, catches it and compares again.

        Before: rank 0's second comparison counted into the first one's round and agreed with its own
        earlier digest; rank 1, arriving, waited its whole timeout and then said rank 0 "did not report".
        Now every later comparison, on either rank, fails at once naming rank 0's timeout, and only the
        round counter, the process group's abandoned mark and the abandoned verdict stay in the store.
        """
        self.addCleanup(gc.collect)  # the server dies in this process (see TestStaleKeys)
        server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
        traffic = StoreTraffic()
        store = CountingStore(dist.PrefixStore("0/", dist.TCPStore("127.0.0.1", server.port, 2, False)), traffic)
        layout = json.dumps([["<root>", [["w", "torch.float32", True]]]])

        def compare(me: int, timeout_s: float = 1.0) -> None:
            comparison = _Comparison(store, me, 2, layout, "'<root>'", timedelta(seconds=timeout_s), "test")
            comparison.count()
            comparison.conclude(MixedParamDtypeError)

        with self.assertRaisesRegex(RankCheckTimeoutError, r"rank\(s\) 1 did not report"):
            compare(0)
        for me in (0, 1, 0):  # rank 0 goes on; rank 1 arrives; rank 0 again
            started = time.monotonic()
            with self.assertRaisesRegex(RankCheckTimeoutError, "rank 0 gave up a comparison on this process group "
                                        "after its timeout of 1 s"):
                compare(me, timeout_s=10)
            self.assertLess(time.monotonic() - started, 5)  # at once, not after a timeout
        left = sorted(key.split("/w2/", 1)[-1] for key in traffic.keys if store.check([key]))
        self.assertEqual(left, ["abandoned", "r0/verdict", "round"])


# ---------------------------------------------------------------------------
# torchrun: two nodes, elastic restart
# ---------------------------------------------------------------------------

SCRIPT = os.path.join(ROOT, "test", "scripts", "train_rank_check.py")


def torchrun(out: str, *argv: str, script_args: tuple[str, ...] = ()) -> subprocess.Popen:
    # One intra-op thread on every node, as torchrun sets it for several processes per node: the same float sums.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    env.pop("TORCH_FSDP_EXT_DISABLE", None)
    command = [sys.executable, "-m", "torch.distributed.run", *argv, SCRIPT, "--out", out, *script_args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=out)


def finished(*launches: subprocess.Popen) -> None:
    for launch in launches:
        output, _ = launch.communicate(timeout=300)
        # Every rank ends cleanly: exit status 0 and no abort at exit (docs/reliability.md).
        assert launch.returncode == 0 and "terminate called" not in output, output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reports(out: str) -> dict[str, dict]:
    found = {}
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name), encoding="utf-8") as f:
            found[name] = json.load(f)
    return found


@needs_dtype_fix
@plugin_specific
class TestTorchrun(TestCase):
    def test_two_nodes_and_an_elastic_restart_train_as_one_node(self):
        """Under upcast and preserve, each rank's losses equal the one-node job's:

        - two torchrun agents as two nodes (--nnodes 2, c10d rendezvous on localhost);
        - --max-restarts 1, rank 1 lost after the first forward of attempt 0: attempt 1
          compares again (before: it read attempt 0's keys and skipped the comparison).
        """
        with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two, \
                tempfile.TemporaryDirectory() as elastic:
            port = free_port()
            nodes = [
                torchrun(two, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes")
                for node in (0, 1)
            ]
            single = torchrun(one, "--standalone", "--nproc-per-node", "2")
            restarting = torchrun(elastic, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                  script_args=("--fail-in-first-attempt",))
            finished(single, restarting, *nodes)  # all at once: most of each launch is importing torch
            reference, across_nodes, restarted = reports(one), reports(two), reports(elastic)
        self.assertEqual(sorted(reference), ["rank0.attempt0.json", "rank1.attempt0.json"])
        self.assertEqual(across_nodes, reference)
        # Attempt 0 never finished (rank 1 exited, rank 0 was stopped by the agent).
        self.assertEqual(sorted(restarted), ["rank0.attempt1.json", "rank1.attempt1.json"])
        for rank in (0, 1):
            expected = reference[f"rank{rank}.attempt0.json"]
            self.assertEqual(restarted[f"rank{rank}.attempt1.json"], expected)
            self.assertEqual(expected["comparisons"], 2)  # one per model: nothing skipped
            self.assertEqual(expected["upcast"][1], ["torch.float32"])
            self.assertEqual(expected["preserve"][1], ["torch.bfloat16", "torch.float32"])


if __name__ == "__main__":
    run_tests()
