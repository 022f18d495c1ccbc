"""The rows that torchtitan_resume.py and hf_trainer_resume.py (this folder) print: two runs' losses and final
parameters compared bit for bit.

A run's result is ``{"losses": {step: tensor}, "params": {fqn: full tensor}}``; a loss may be a scalar or a
one-element tensor per rank.
"""

from __future__ import annotations

HEADER = (
    "| comparison | rank-0 losses (a/b) per step | losses | params equal | max abs diff | bit for bit |\n"
    "|---|---|---|---|---|---|"
)


def compare(name: str, a: dict, b: dict, steps) -> tuple[str, bool]:
    """The table row of ``a`` against ``b`` over ``steps``, and whether they are equal bit for bit."""
    import torch

    loss_equal = all(torch.equal(a["losses"][s], b["losses"][s]) for s in steps)
    differing = [
        n for n in a["params"]
        if a["params"][n].dtype != b["params"][n].dtype or not torch.equal(a["params"][n], b["params"][n])
    ]
    worst = max(((a["params"][n].double() - b["params"][n].double()).abs().max().item() for n in differing),
                default=0.0)
    losses = " ".join(
        f"{a['losses'][s].reshape(-1)[0].item():.6f}/{b['losses'][s].reshape(-1)[0].item():.6f}" for s in steps
    )
    exact = loss_equal and not differing
    row = (
        f"| {name} | {losses} | {'equal' if loss_equal else 'DIFFER'} | "
        f"{len(a['params']) - len(differing)}/{len(a['params'])} | {worst:.3g} | {'yes' if exact else 'NO'} |"
    )
    return row, exact
