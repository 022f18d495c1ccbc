"""The opt-in setting: gradients accumulated and reduced in fp32 where a policy asks for 16 bits or nothing."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch

from .. import _compat
from .._patching import PatchSet

# The reduce dtypes the setting replaces: none, or a 16-bit float.
_NARROW = (None, torch.bfloat16, torch.float16)
# On an ``FSDPParam`` with a policy of its own (2.15): that policy as the user gave it.
_USER_POLICY_ATTR = "_torch_fsdp_ext_user_mp_policy"


class Fp32Reduction:
    """``install(reduce_dtype=torch.float32)``: every ``fully_shard`` policy whose ``reduce_dtype`` is unset or
    16-bit accumulates and reduces gradients in fp32.

    Note: accelerate 1.16 builds ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``
    for ``mixed_precision: bf16`` (so do the HF Trainer, TRL and axolotl on FSDP2) and accumulates
    micro-batches without sync: gradients are summed in bf16 on every release, where contributions
    1 and 2**-10 give 1.0. The group's policy is replaced before each lazy init reads it, so
    FSDP itself resolves fp32 as the reduce dtype of every parameter: its gradients are then made,
    accumulated and reduced in fp32 (on releases before 2.15, through the gradient-dtype part).
    """

    name = "fp32 reduction"
    summary = "policies with no or a 16-bit reduce_dtype accumulate and reduce in fp32 (opt-in)"

    def __init__(self, internals: _compat.TorchInternals, reduce_dtype: torch.dtype | None) -> None:
        self.internals = internals
        self.reduce_dtype = reduce_dtype
        self.active = False
        self._replaced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> the user's policy
        self._lock = threading.Lock()  # ranks may run as threads in one process

    def needed(self) -> tuple[bool | None, str]:
        if self.reduce_dtype is None:
            return False, "not asked for (TORCH_FSDP_EXT_REDUCE_DTYPE=float32 turns it on)"
        return True, "the fp32 reduction setting"

    def wrapped_symbols(self) -> list[str]:
        return _compat.symbol_names(self.internals, ("FSDPParamGroup.lazy_init",))

    def install(self, patches: PatchSet) -> None:
        patches.on_restore(self.restore_policies)
        self.active = True

    def before_lazy_init(self, group: Any) -> None:
        """Replace ``group``'s policy (per group up to 2.14, per parameter from 2.15) before torch resolves its
        dtypes from it."""
        if group in self._replaced:
            return
        with self._lock:
            if group in self._replaced:
                return
            self._replaced[group] = group.__dict__.get("mp_policy")
            if self._replaced[group] is not None and self._replaced[group].reduce_dtype in _NARROW:
                group.mp_policy = dataclasses.replace(group.mp_policy, reduce_dtype=self.reduce_dtype)
            for fsdp_param in group.fsdp_params:
                policy = fsdp_param.__dict__.get("mp_policy")
                if policy is not None and policy.reduce_dtype in _NARROW:
                    fsdp_param.__dict__[_USER_POLICY_ATTR] = policy
                    fsdp_param.mp_policy = dataclasses.replace(policy, reduce_dtype=self.reduce_dtype)

    def restore_policies(self) -> None:
        """The user's policies back; FSDP resolves dtypes from them again at each group's next lazy init."""
        with self._lock:
            for group, policy in list(self._replaced.items()):
                if policy is not None:
                    group.mp_policy = policy
                for fsdp_param in group.fsdp_params:
                    if _USER_POLICY_ATTR in fsdp_param.__dict__:
                        fsdp_param.mp_policy = fsdp_param.__dict__.pop(_USER_POLICY_ATTR)
            self._replaced.clear()
