"""accelerate's FSDP2 path on CPU ranks, for the tools that train through the HF Trainer (directly or through TRL).

Note: accelerate turns FSDP on only on an accelerator; on CPU it falls back to DDP without a word and the Trainer's
FSDP plugin is ignored. As its GPU branch does (``AcceleratorState.__init__``), the Accelerator the Trainer creates
gets ``distributed_type = FSDP``, the Trainer's FSDP plugin, and with mixed precision on that plugin's
``MixedPrecisionPolicy`` (``param_dtype`` and ``reduce_dtype`` bf16 for ``bf16=True``), set by hand.
"""

from __future__ import annotations


def accelerate_fsdp_on_cpu() -> None:
    """Make the Trainer's Accelerator take accelerate's FSDP2 path on CPU ranks."""
    import transformers.trainer
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    def accelerator_with_fsdp(**kwargs):
        accelerator = Accelerator(**kwargs)
        state, fsdp_plugin = accelerator.state, kwargs["fsdp_plugin"]
        state.distributed_type = DistributedType.FSDP
        if state.mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = fsdp_plugin
        return accelerator

    transformers.trainer.Accelerator = accelerator_with_fsdp
