"""PyTorch Lightning's Trainer: FSDP2 through ``ModelParallelStrategy``, a mixed-dtype model, with the plugin.

    PYTHONPATH=. python tools/integrations/lightning_trainer.py

The LightningModule builds the model as loaded (bf16, fp32 RMSNorm weights; tools/integrations/_model.py) in
``configure_model`` and shards it there with ``fully_shard`` per block and at the root
(``MixedPrecisionPolicy(bf16, fp32)``) on the strategy's data-parallel mesh. Each job is one Lightning run as users
start one: ``Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1))`` (the default ``"auto"`` sizes would make the 2 CPU ranks tensor-parallel), Lightning
launching the second rank itself; AdamW, one fixed batch per rank and step, ``precision="32-true"``:

- ``plain``: no plugin; FSDP2's uniform-dtype assertion is expected (Lightning then ends the job);
- ``workaround``: no plugin, ``model.float()`` before ``fully_shard``; then ``precision="bf16-true"``, whose plugin
  casts every parameter to bf16 after ``configure_model``: the dtypes of the norms at the first step are recorded;
- ``plugin``: the script unchanged, started as ``python -m torch_fsdp_ext.run lightning_trainer.py ...`` (rank 1,
  which Lightning starts as ``python lightning_trainer.py ...``, gets the plugin from the launcher's
  ``TORCH_FSDP_EXT_AUTOLOAD=1``: the package must be installed, ``pip install -e .``); 4 steps uninterrupted, then
  2 steps, ``trainer.save_checkpoint`` (sharded, Lightning's default for this strategy), and a new Trainer
  that resumes with ``fit(ckpt_path=...)`` to step 4.

Exit status 1 unless: plain fails with the assertion, the plugin's 4 steps equal the workaround's bit for bit
(both ranks' losses and every full parameter), the resumed run equals the uninterrupted one bit for bit (both
ranks' losses 3-4, parameters), and bf16-true turned the fp32 norms into bf16.
"""

from __future__ import annotations

import os

import torch

from _jobs import run_tool  # this script's folder
from _lightning import RESUME_STEP, STEPS, run_jobs
from _model import RMSNorm, full_params, gathered_losses, lm_loss, mixed_llama, tokens


def lightning_run(variant: str, root: str, steps: int, precision: str = "32-true", ckpt_path: str | None = None):
    """One ``Trainer.fit``; returns the trainer and its LightningModule."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class LanguageModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.losses = []
            self.norm_dtypes = []

        def configure_model(self) -> None:
            if self.model is not None:  # Lightning calls the hook once per stage: shard once
                return
            model = mixed_llama()
            if variant == "workaround":
                model.float()
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            mesh = self.device_mesh["data_parallel"]
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            self.model = model

        def on_train_start(self) -> None:
            self.norm_dtypes = [m.weight.dtype for m in self.model.modules() if isinstance(m, RMSNorm)]

        def training_step(self, batch, batch_idx):
            # Note: the batch follows the global step, so a resumed epoch sees the batches the uninterrupted run saw.
            data = tokens(self.global_rank, self.global_step)
            loss = lm_loss(self.model(data), data)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    module = LanguageModel()
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def job(variant: str, root: str, result_path: str) -> None:
    """The ranks of one job: Lightning re-runs this script for rank 1."""
    result = {}
    trainer, module = lightning_run(variant, root, STEPS)
    result["losses"], result["params"] = gathered_losses(module.losses), full_params(module.model)
    if variant == "workaround":
        _, bf16_true = lightning_run(variant, root, 1, precision="bf16-true")
        result["bf16_true_norm_dtypes"] = bf16_true.norm_dtypes
    if variant == "plugin":
        checkpoint = os.path.join(root, "step2.ckpt")
        first, _ = lightning_run(variant, root, RESUME_STEP)
        first.save_checkpoint(checkpoint)
        _, resumed = lightning_run(variant, root, STEPS, ckpt_path=checkpoint)
        result["resumed"] = {"losses": gathered_losses(resumed.losses), "params": full_params(resumed.model)}
    if trainer.global_rank == 0:
        torch.save(result, result_path)


def main() -> int:
    label = "lightning-trainer"
    ok, results = run_jobs(__file__, label, f"save_checkpoint -> fit(ckpt_path) at step {RESUME_STEP}",
                           through_launcher={"plugin"})
    if results is None:
        return 1
    dtypes = results["workaround"]["bf16_true_norm_dtypes"]
    cast = sum(dtype == torch.bfloat16 for dtype in dtypes)
    print(f"{label}: precision='bf16-true' after model.float(): {cast}/{len(dtypes)} fp32 RMSNorm weights are bf16 "
          "at the first step (Lightning casts every parameter after configure_model)")
    ok &= cast == len(dtypes) > 0
    return 0 if ok else 1


if __name__ == "__main__":
    run_tool(__doc__, job, main)
