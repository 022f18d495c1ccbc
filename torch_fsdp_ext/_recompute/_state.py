"""What the wrappers of torch's hooks read of the recompute fix: its frames and hook switch, whether
it is active, and what this torch and this machine leave it to replay, decided once when it is made."""

from __future__ import annotations

import torch

from .. import _compat
from .._compat import _recompute as _compat_recompute
from ._frames import ActiveFrames
from ._switch import HookSwitch


class ReplayState:
    """The recompute fix as its wrappers see it (``RecomputeReplay`` adds installing them)."""

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False
        self.frames = ActiveFrames()
        self.switch = HookSwitch()
        # What this release already replays by itself (probed once, cached).
        self.upstream_casts_inputs = bool(_compat_recompute.probe_recompute_casts_inputs())
        self.upstream_casts_outputs = bool(_compat_recompute.probe_recompute_casts_outputs())
        self.upstream_moves_inputs = bool(_compat_recompute.probe_recompute_moves_inputs())
        # Note: nothing to replay without an accelerator. Where this torch casts a recomputation's
        # inputs and outputs itself and the machine has no accelerator, every FSDP module computes on
        # the CPU: no root moves inputs (FSDP moves them onto an accelerator only), and the only
        # autocast its ops see is the CPU's, which checkpoint restores for every recomputation. A
        # recomputation then equals its forward without the plugin, so regions keep no records and
        # never switch FSDP's hooks to the wrappers: a checkpointed forward runs torch's code.
        self.records_regions = not (self.upstream_casts_inputs and self.upstream_casts_outputs) or (
            accelerator_available()
        )


def accelerator_available() -> bool:
    """Is there an accelerator on this machine (FSDP's device for a root input move, an autocast device)?

    Note: a CUDA build of torch names ``cuda`` as its accelerator on a machine without a GPU too;
    its ``is_available()`` tells. An accelerator without one is taken to be there.
    """
    device_type = _compat_recompute.accelerator_device_type()
    if device_type is None:
        return False
    is_available = getattr(getattr(torch, device_type, None), "is_available", None)
    return bool(is_available()) if is_available is not None else True
