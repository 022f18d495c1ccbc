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


def gathered_losses(losses: list[torch.Tensor]) -> torch.Tensor:
    """This rank's losses, one per step, with every other rank's: a (steps, ranks) tensor (a collective: call it on
    every rank)."""
    import torch.distributed as dist

    mine = torch.stack([loss.detach().float() for loss in losses])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every, dim=1)


def figure(value: float) -> str:
    """A maximum absolute difference as printed: 0 when nothing differs."""
    return "0" if value == 0 else f"{value:.2e}"


def losses_text(losses: torch.Tensor) -> str:
    """One rank's losses, a step each (the (steps,) column of a gathered tensor)."""
    return ", ".join(f"{loss:.6f}" for loss in losses.tolist())


def compare(label: str, result: dict, reference: dict, reference_name: str,
            result_name: str = "plugin") -> tuple[list[str], bool]:
    """Lines comparing ``result`` with ``reference`` (each {"losses": a (steps, ranks) tensor, "params": {name: full
    tensor}}), and whether they are equal bit for bit: the verdict with the figures compared (how many losses and
    parameter tensors, and the largest absolute difference of each), then each rank's losses on both sides."""
    names = reference["params"].keys()
    common = [n for n in names if n in result["params"] and result["params"][n].shape == reference["params"][n].shape]
    equal = [n for n in common if torch.equal(result["params"][n], reference["params"][n])]
    param_diff = max(((result["params"][n].float() - reference["params"][n].float()).abs().max().item()
                      for n in common), default=float("inf"))
    ours, theirs = result["losses"], reference["losses"]
    same_shape = ours.shape == theirs.shape
    loss_diff = (ours - theirs).abs().max().item() if same_shape else float("inf")
    exact = same_shape and torch.equal(ours, theirs) and result["params"].keys() == names and len(equal) == len(names)
    steps, ranks = theirs.shape
    tool = label.split(":")[0]  # the rank lines carry the tool's label, not the comparison's context
    lines = [f"{label}: {result_name} vs {reference_name}: {'bit for bit' if exact else 'differs'}: "
             f"losses of {ranks} ranks x {steps} steps, max abs diff {figure(loss_diff)}; "
             f"{len(equal)}/{len(names)} parameter tensors equal, max abs diff {figure(param_diff)}"]
    for rank in range(ranks):
        mine = losses_text(ours[:, rank]) if same_shape else "-"
        lines.append(f"{tool}:   rank {rank} losses: {result_name} {mine}; {reference_name} "
                     f"{losses_text(theirs[:, rank])}")
    return lines, exact
