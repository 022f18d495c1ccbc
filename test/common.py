"""Distributed test harness: MultiProcessTestCase with gloo on CPU, NCCL when enough GPUs exist."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import unittest.mock
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import MultiProcessTestCase

import torch_fsdp_ext
from torch_fsdp_ext import _compat
from torch_fsdp_ext._compat import _dtype as _compat_dtype
from torch_fsdp_ext._compat import _recompute as _compat_recompute
from torch_fsdp_ext._compat import _reduce as _compat_reduce

# The public FSDP2 API wherever this release exports it (torch.distributed.fsdp from 2.6).
CPUOffloadPolicy = _compat.fsdp2_api().CPUOffloadPolicy
MixedPrecisionPolicy = _compat.fsdp2_api().MixedPrecisionPolicy
fully_shard = _compat.fsdp2_api().fully_shard

# Note: a distributed test that hangs (a collective one rank never joins) must fail,
# not stall CI; torch's default join timeout is 300 s per test.
common_distributed.TIMEOUT_DEFAULT = int(os.environ.get("TORCH_FSDP_EXT_TEST_TIMEOUT", "120"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tools/upstream/check.py runs the behaviour tests against a torch patched with the upstream
# prototype, with the plugin switched off: plugin(True) then installs nothing, and tests of
# the plugin's own machinery are skipped.
UPSTREAM_ONLY = os.environ.get("TORCH_FSDP_EXT_TESTS_UPSTREAM_ONLY") == "1"
plugin_specific = unittest.skipIf(UPSTREAM_ONLY, "tests the plugin itself; the plugin is off in upstream-only runs")
if UPSTREAM_ONLY:
    assert not any(fix.active for fix in torch_fsdp_ext.status().fixes.values()), "set TORCH_FSDP_EXT_DISABLE=1"

# What torch release we run on, by probing (same answers the plugin uses).
HAS_DTYPE_BUG = bool(_compat_dtype.probe_rejects_mixed_trainable_dtypes())
needs_dtype_fix = unittest.skipUnless(HAS_DTYPE_BUG, "this torch accepts mixed trainable dtypes: the dtype fix is off")
HAS_RECOMPUTE_CAST_BUG = _compat_recompute.probe_recompute_casts_inputs() is False
HAS_GRAD_DTYPES_BUG = bool(_compat_reduce.probe_reduce_rejects_mixed_grad_dtypes())  # pytorch#196996, up to 2.14
HAS_FROZEN_BUG = bool(_compat_reduce.probe_frozen_first_forward_drops_reduce_dtype())  # pytorch#186998, up to 2.13


def use_nccl(world_size: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size and dist.is_nccl_available()


class FSDPExtTestCase(MultiProcessTestCase):
    """Each test runs in ``WORLD_SIZE`` fresh processes with a process group ready."""

    WORLD_SIZE = 2
    # The process group's timeout (and its store's); None: torch's default. Tests that
    # expect a rank to wait for a peer that never comes set a short one.
    PG_TIMEOUT: timedelta | None = None

    @property
    def world_size(self) -> int:
        return self.WORLD_SIZE

    def setUp(self) -> None:
        super().setUp()
        # Note: on CPU the ranks are forked, not spawned: a spawned rank re-imports torch (and the
        # test module) before every test, which is most of a small test's time on a 2-core machine.
        # CUDA cannot be used in a forked child once the parent touched it, so NCCL runs spawn.
        method = "spawn" if use_nccl(self.world_size) else "fork"
        self._start_processes(torch.multiprocessing.get_context(method).Process)

    def tearDown(self) -> None:
        super().tearDown()
        # MultiProcessTestCase leaves its rendezvous file in the temp dir (only torch's
        # DistributedTestBase removes it): one file a test, thousands a suite.
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.file_name)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.rank) if use_nccl(self.world_size) else torch.device("cpu")

    def run_test(self, test_name: str, parent_pipe) -> None:
        backend = "nccl" if use_nccl(self.world_size) else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.rank)
        timeout = {} if self.PG_TIMEOUT is None else {"timeout": self.PG_TIMEOUT}
        dist.init_process_group(
            backend, init_method=f"file://{self.file_name}", rank=self.rank, world_size=self.world_size, **timeout
        )
        super().run_test(test_name, parent_pipe)


@contextlib.contextmanager
def plugin(enabled: bool, **install_kwargs) -> Iterator[None]:
    """Run a block with every fix installed, or with none; restores the previous state."""
    if UPSTREAM_ONLY:
        yield
        return
    before = [name for name, fix in torch_fsdp_ext.status().fixes.items() if fix.active]
    torch_fsdp_ext.uninstall()
    if enabled:
        torch_fsdp_ext.install(**install_kwargs)
    try:
        yield
    finally:
        torch_fsdp_ext.uninstall()
        if before:
            torch_fsdp_ext.install(before)


class CountingStore:
    """A process group's store that records what the plugin asks of it: calls, payload bytes, comparisons."""

    def __init__(self, store, traffic: "StoreTraffic") -> None:
        self._store, self._traffic = store, traffic

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def recorded(*args, **kwargs):
            result = attr(*args, **kwargs)
            self._traffic.record(name, args, result)
            return result

        return recorded


class StoreTraffic:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes = 0  # keys and values sent, values received
        self.keys: set[str] = set()
        self.comparisons = 0

    def record(self, name: str, args: tuple, result) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        for value in (*args, result):
            if isinstance(value, (str, bytes)):
                self.bytes += len(value)
            elif isinstance(value, list):
                self.bytes += sum(len(key) for key in value)
        keys = args[0] if name in ("wait", "check") else [args[0]]
        self.keys.update(keys)
        if name == "add" and args[0].endswith("/round") and args[1] == 1:
            self.comparisons += 1

    def total(self) -> int:
        return sum(self.calls.values())


@contextlib.contextmanager
def counting_store_calls():
    traffic = StoreTraffic()
    original = _compat.process_group_store
    with unittest.mock.patch.object(_compat, "process_group_store", lambda pg: CountingStore(original(pg), traffic)):
        yield traffic


def error_text(exc: BaseException) -> str:
    """The first line of an error, with set orderings made stable for expecttest."""
    text = str(exc).splitlines()[0]
    return re.sub(r"\{([^}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)


def run_python(code: str, *, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a snippet in a fresh interpreter (import order and environment tests)."""
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT
    )


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Block(nn.Module):
    """A Llama-like block: attention-lite mixer, MLP, RMSNorms, a router with a bias."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.router = nn.Linear(dim, 2)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        scores = torch.softmax(self.wq(h) @ h.transpose(-1, -2) / h.shape[-1] ** 0.5, dim=-1)
        x = x + self.dropout(self.wo(scores @ h))
        h = self.mlp_norm(x)
        gate = torch.sigmoid(self.router(h)).mean(-1, keepdim=True)
        return x + gate * self.w2(nn.functional.silu(self.w1(h)))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, dropout) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def seed_000_model(seed: int = 0, **kwargs) -> TinyLlama:
    """The seed-000 layout: a bf16 checkpoint whose norms and router stay in fp32."""
    torch.manual_seed(seed)
    model = TinyLlama(**kwargs).to(torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm) or name.endswith("router"):
            module.float()
    return model


def shard_model(model: nn.Module, **fully_shard_kwargs) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


def batch(rank: int, step: int = 0, vocab: int = 32, size: tuple[int, int] = (2, 8)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, size, generator=generator)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def train_lm(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: int) -> list[torch.Tensor]:
    """``steps`` optimizer steps of the LM loss on this rank's batches; the losses."""
    losses = []
    for step in range(steps):
        tokens = batch(rank, step)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameter values (DTensor -> full tensor)."""
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().clone()
    return out


def dcp_round_trip(model: nn.Module, fresh: nn.Module, file_name: str) -> nn.Module:
    """Save ``model`` with torch.distributed.checkpoint and load it into ``fresh`` (same sharding)."""
    import torch.distributed.checkpoint as dcp

    path = [file_name + ".dcp"]
    dist.broadcast_object_list(path, src=0)  # one directory for every rank
    dcp.save(model.state_dict(), checkpoint_id=path[0])
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    fresh.load_state_dict(state)
    return fresh


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def fsdp2_gradient_scale(world_size: int, rank: int, **fully_shard_kwargs) -> float:
    """The factor by which this torch's FSDP2 scales the rank-averaged gradient, measured without the plugin.

    Note: torch 2.7's FSDP2 *sums* gradients over gloo instead of averaging them
    (factor = world size); other releases average (factor 1). Measured on a
    one-weight fp32 model that unpatched FSDP2 handles, so that a reference
    applies the same reduction and any remaining difference is the plugin's.
    """
    with plugin(False):
        model = nn.Linear(4, 1, bias=False)
        fully_shard(model, **fully_shard_kwargs)
        model(torch.full((1, 4), float(rank + 1))).sum().backward()  # local grad: rank + 1 everywhere
        grad = model.weight.grad.full_tensor()
    mean = (world_size + 1) / 2
    return grad[0, 0].item() / mean


def bf16_compute_reference(master: nn.Module, inputs_per_rank: list[torch.Tensor], grad_scale: float = 1.0):
    """Single-process reference for fp32 master weights + bf16 compute + fp32 gradient averaging.

    Each rank's micro-batch runs on a bf16 copy of the fp32 master model (as FSDP's
    ``param_dtype=bf16`` all-gather does); the bf16 gradients are upcast and averaged
    in fp32 (``reduce_dtype=fp32``). Sets ``.grad`` on the master's params and
    returns the per-rank losses.
    """
    grads: dict[str, torch.Tensor] = {}
    losses = []
    for tokens in inputs_per_rank:
        compute = copy.deepcopy(master).to(torch.bfloat16)
        loss = lm_loss(compute(tokens), tokens)
        loss.backward()
        losses.append(loss.detach())
        for name, param in compute.named_parameters():
            grads[name] = grads.get(name, 0) + param.grad.float()
    for name, param in master.named_parameters():
        param.grad = grads[name] / len(inputs_per_rank) * grad_scale
    return losses


# ---------------------------------------------------------------------------
# A model whose forward handles mixed parameter dtypes (dtype_strategy="preserve"
# without param_dtype computes each parameter in its own dtype, as without FSDP)
# ---------------------------------------------------------------------------


class Fp32RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever its weight's dtype; returns the input's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.float()).to(x.dtype)


class InputCastingLinear(nn.Linear):
    """A Linear that computes in its weight's dtype and returns the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


class MixedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = Fp32RMSNorm(dim)
        self.w1 = InputCastingLinear(dim, 2 * dim, bias=False)
        self.w2 = InputCastingLinear(2 * dim, dim, bias=False)
        self.router = InputCastingLinear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.sigmoid(self.router(h)) * self.w2(nn.functional.silu(self.w1(h)))


class MixedLlama(nn.Module):
    """bf16 embedding and linears, fp32 norms and routers: trains with or without param_dtype."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MixedBlock(dim) for _ in range(layers))
        self.norm = Fp32RMSNorm(dim)
        self.head = InputCastingLinear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def mixed_llama(seed: int = 0, **kwargs) -> MixedLlama:
    torch.manual_seed(seed)
    model = MixedLlama(**kwargs).to(torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, Fp32RMSNorm) or name.endswith("router"):
            module.float()
    return model


@contextlib.contextmanager
def shared_temp_dir(name: str) -> Iterator[str]:
    """One new directory for every rank (ranks share this machine), removed by rank 0 afterwards."""
    path = [tempfile.mkdtemp(prefix=name) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def pretrained_llama(path: str):
    """``from_pretrained(dtype=bf16)`` of a tiny Llama whose class keeps its norms in fp32.

    Note: ``_keep_in_fp32_modules_strict``, the form transformers 5 applies to bf16 loads too
    (``_keep_in_fp32_modules`` alone applies to fp16 loads).
    """
    from transformers import LlamaForCausalLM

    class KeepNormsLlama(LlamaForCausalLM):
        _keep_in_fp32_modules_strict = ["input_layernorm", "post_attention_layernorm", "norm"]

    return KeepNormsLlama.from_pretrained(path, dtype=torch.bfloat16)
