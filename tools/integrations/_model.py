"""The model, data, training steps and comparisons the integration tools share.

A tiny Llama-like language model as a mixed-dtype checkpoint loads: embedding and linears in bf16, RMSNorm weights
in fp32. Every rank builds the same initial weights (a fixed seed) and trains on its own fixed batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: Iterable[int],
                backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> list[torch.Tensor]:
    """One optimizer step of the LM loss on this rank's batch for each step in ``steps``, the gradients by
    ``backward`` (a framework's own, e.g. ``fabric.backward``); the losses."""
    losses = []
    for step in steps:
        data = tokens(rank, step)
        loss = lm_loss(model(data), data)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses


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
