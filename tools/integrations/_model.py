"""The model, data, comparisons and job launcher the integration tools share.

A tiny Llama-like language model as a mixed-dtype checkpoint loads: embedding and linears in bf16, RMSNorm weights
in fp32. Every rank builds the same initial weights (a fixed seed) and trains on its own fixed batches.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

VOCAB, DIM, LAYERS = 32, 16, 2
BATCH, SEQ_LEN = 2, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool, device=h.device).tril()
        scores = (self.wq(h) @ h.transpose(-1, -2) / h.shape[-1] ** 0.5).masked_fill(~causal, float("-inf"))
        x = x + self.wo(torch.softmax(scores, dim=-1) @ h)
        return x + self.w2(nn.functional.silu(self.w1(self.mlp_norm(x))))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def mixed_llama(seed: int = 0) -> TinyLlama:
    """The model as loaded: bf16, its RMSNorm weights fp32."""
    torch.manual_seed(seed)
    model = TinyLlama().to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.float()
    return model


def tokens(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator)


def lm_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, in fp32."""
    return nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch[:, 1:].flatten())


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor on the CPU (a collective: call it on every rank)."""
    full = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        full[name] = tensor.detach().cpu().clone()
    return full


def compare(label: str, result: dict, reference: dict, reference_name: str) -> tuple[str, bool]:
    """One line comparing ``result`` with ``reference`` (each {"losses": [...], "params": {...}}) bit for bit."""
    losses_equal = len(result["losses"]) == len(reference["losses"]) and all(
        torch.equal(a, b) for a, b in zip(result["losses"], reference["losses"])
    )
    names = reference["params"].keys()
    equal = [n for n in names if n in result["params"] and torch.equal(result["params"][n], reference["params"][n])]
    exact = losses_equal and len(equal) == len(names) and result["params"].keys() == names
    losses = ", ".join(f"{loss.item():.6f}" for loss in result["losses"])
    verdict = "bit for bit" if exact else "DIFFERENT"
    return f"{label}: plugin vs {reference_name}: {verdict} (losses {losses}; {len(equal)}/{len(names)} params)", exact


def launch_job(script: str, variant: str, root: str, through_launcher: bool = False, torchrun: bool = False,
               settings: dict[str, str] | None = None):
    """Run ``script --job VARIANT ROOT RESULT``: a job that starts its ranks itself, or, with ``torchrun``, one that
    ``torchrun --nproc-per-node 2`` starts; with ``python -m torch_fsdp_ext.run`` in front if ``through_launcher``,
    and ``settings`` (TORCH_FSDP_EXT_* variables) in its environment. The process and the job's result, if any."""
    result_path = os.path.join(root, f"{variant}.pt")
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2"] if torchrun else []
    launcher += ["-m", "torch_fsdp_ext.run"] if through_launcher else []
    # Note: no TORCH_FSDP_EXT_* setting of the caller reaches a job; only the job's own turn the plugin on.
    env = {name: value for name, value in os.environ.items() if not name.startswith("TORCH_FSDP_EXT_")}
    env.update(settings or {})
    process = subprocess.run(
        [sys.executable, *launcher, os.path.abspath(script), "--job", variant, root, result_path],
        capture_output=True, text=True, timeout=600, env=env,
    )
    return process, torch.load(result_path) if os.path.exists(result_path) else None
