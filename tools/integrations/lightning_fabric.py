"""Lightning Fabric: FSDP2 through ``ModelParallelStrategy(parallelize_fn)``, a mixed-dtype model, with the plugin.

    PYTHONPATH=. python tools/integrations/lightning_fabric.py

The model as loaded (bf16, fp32 RMSNorm weights; tools/integrations/_model.py) is sharded by the strategy's
``parallelize_fn``: ``fully_shard`` per block and at the root (``MixedPrecisionPolicy(bf16, fp32)``) on the
data-parallel mesh. Each job is one Fabric program as users start one: ``Fabric(accelerator="cpu", devices=2,
strategy=ModelParallelStrategy(parallelize_fn, data_parallel_size=2, tensor_parallel_size=1))``, ``fabric.launch()``
starting the second rank, ``fabric.setup`` / ``setup_optimizers`` (AdamW), ``fabric.backward``, one fixed batch per
rank and step, ``precision="32-true"``:

- ``plain``: no plugin; FSDP2's uniform-dtype assertion is expected;
- ``workaround``: no plugin, ``model.float()`` before ``fully_shard``;
- ``plugin``: ``import torch_fsdp_ext``; 4 steps uninterrupted, then 2 steps, ``fabric.save`` of model and
  optimizer (one file: ``save_distributed_checkpoint=False``), and a new model and optimizer that ``fabric.load`` it
  and train to step 4.

Exit status 1 unless: plain fails with the assertion, the plugin's 4 steps equal the workaround's bit for bit
(both ranks' losses and every full parameter), and the resumed run equals the uninterrupted one bit for bit
(both ranks' losses 3-4, parameters).
"""

from __future__ import annotations

import os

import torch

from _jobs import run_tool  # this script's folder
from _lightning import RESUME_STEP, STEPS, run_jobs
from _model import full_params, gathered_losses, mixed_llama, train_steps


def shard(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    """The strategy's ``parallelize_fn``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = device_mesh["data_parallel"]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def train(fabric, variant: str, first_step: int, last_step: int, checkpoint: str | None = None,
          save: str | None = None):
    """A fresh model and optimizer, loaded from ``checkpoint`` if given, trained over steps ``(first, last]``."""
    model = mixed_llama()
    if variant == "workaround":
        model.float()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if checkpoint is not None:
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    losses = train_steps(model, optimizer, fabric.global_rank, range(first_step, last_step), fabric.backward)
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer})
    return {"losses": gathered_losses(losses), "params": full_params(model)}


def job(variant: str, root: str, result_path: str) -> None:
    """The ranks of one job: ``fabric.launch()`` re-runs this script for rank 1."""
    if variant == "plugin":
        import torch_fsdp_ext  # noqa: F401  (installs the fixes this torch needs)
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(shard, data_parallel_size=2, tensor_parallel_size=1,
                                     save_distributed_checkpoint=False)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    result = train(fabric, variant, 0, STEPS)
    if variant == "plugin":
        checkpoint = os.path.join(root, "step2.ckpt")
        train(fabric, variant, 0, RESUME_STEP, save=checkpoint)
        result["resumed"] = train(fabric, variant, RESUME_STEP, STEPS, checkpoint=checkpoint)
    if fabric.global_rank == 0:
        torch.save(result, result_path)


def main() -> int:
    ok, _ = run_jobs(__file__, "lightning-fabric", f"fabric.save -> fabric.load at step {RESUME_STEP} (one file)")
    return 0 if ok else 1


if __name__ == "__main__":
    run_tool(__doc__, job, main)
