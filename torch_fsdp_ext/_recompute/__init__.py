"""Recompute replay: an activation-checkpoint recompute of an FSDP2 module sees the
forward it replaces.

During non-reentrant recomputation FSDP2 is in ``TrainingState.PRE_BACKWARD`` and
``FSDPState._pre_forward`` skips most of what it did in forward: the
mixed-precision input cast (fixed upstream in 2.13, pytorch#182580), the output
cast, and the root's move of inputs onto the FSDP device (still missing). And
``torch.utils.checkpoint`` restores autocast state only for the device type it
infers from the *positional* tensor args (the current accelerator when they are
all on CPU), and RNG state only for the devices of those args: none for the
device FSDP moves CPU inputs to. The recomputed forward then differs from the
original one:

    torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the
    following tensors have different metadata than during the forward pass.

The fix, one concern per module, each importing only those listed before it:

- ``_frames``: what the replay keeps (a region's records on its checkpoint frame,
  a recomputation's place in them, the frames active per thread);
- ``_switch``: FSDP's forward hooks switched to the wrappers only while a frame is active;
- ``_state``: what the wrappers read of the fix, decided once when it is made;
- ``_records``: the checkpoint hook's wrappers, which record a region's forward;
- ``_replay``: the recomputation hook's and FSDP's pre/post-forward wrappers, which replay it;
- ``_fix``: the fix's interface, which installs the wrappers (``RecomputeReplay``).
"""

from ._fix import RecomputeReplay

__all__ = ["RecomputeReplay"]
