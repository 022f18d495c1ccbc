"""What the dtype fix reads of torch: where a release checks a group's dtypes, and how it reduces them."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable

import torch

from . import TorchInternals, load_internals, param_group_init_of_torch, torch_own


# Owners whose methods the dtype fix wraps where the reduce-scatter casts its whole output to one dtype.
MIXED_REDUCE_OWNERS = ("FSDPParamGroup", "FSDPParam.to_sharded_dtensor", "fsdp_param_group_module")


@functools.lru_cache(maxsize=None)
def probe_reduce_casts_grads_per_param() -> bool | None:
    """Does this release give each parameter its gradient in its own dtype after the reduce-scatter?

    Note: up to 2.14 ``foreach_reduce`` takes the group's ``orig_dtype`` and casts
    the whole reduce output to it; 2.15 dropped that argument and casts per
    parameter (``sharded_grad_dtype``). Read on torch's own function, never on what
    another library put in its place (Note [Foreign patches]); None where torch's own
    cannot be found.
    """
    foreach_reduce = torch_own(load_internals().fsdp_param_group_module.foreach_reduce, "foreach_reduce")
    if foreach_reduce is None:
        return None
    return "orig_dtype" not in inspect.signature(foreach_reduce).parameters


class _ProbeParam:
    """Duck-typed ``FSDPParam`` with just what ``_init_mp_dtypes`` and a group's lazy init read."""

    def __init__(self, dtype: torch.dtype, requires_grad: bool) -> None:
        self.sharded_param = types.SimpleNamespace(dtype=dtype, requires_grad=requires_grad, device=torch.device("cpu"))
        self.mp_policy = None
        self.unsharded_grad_dtype = self.sharded_grad_dtype = None  # 2.15: no grad_dtype set
        self._param_fqn = f"probe.{dtype}"

    def init_dtype_attrs(self, mp_policy: Any) -> None:
        self.orig_dtype = self.sharded_param.dtype
        self.param_dtype = getattr(mp_policy, "param_dtype", None)
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None)


def _rejects(run: Callable[[], Any]) -> bool | None:
    """True if ``run`` fails torch's uniform-dtype assertion, False if it completes, None otherwise."""
    try:
        run()
    except AssertionError as e:
        return "uniform original parameter dtype" in str(e) or None
    except Exception:  # noqa: BLE001 - internals we do not understand
        return None
    return False


def _probe_group(internals: TorchInternals, params: list[_ProbeParam]) -> Any:
    return types.SimpleNamespace(
        fsdp_params=params, mp_policy=internals.MixedPrecisionPolicy(), _orig_dtype=None, _reduce_dtype=None
    )


def _lazy_init_probe_group(internals: TorchInternals, params: list[_ProbeParam]) -> Any:
    """A real ``FSDPParamGroup`` of no parameters, from its own ``__init__``, then given ``params``:
    its lazy init finds them already reset and its state-dict hooks in place."""
    init = param_group_init_of_torch(internals.FSDPParamGroup.__init__)
    if init is None:
        return None
    known = {
        "params": [], "modules": (), "device": torch.device("cpu"), "mp_policy": internals.MixedPrecisionPolicy(),
    }
    names = [name for name in inspect.signature(init).parameters if name != "self"]
    group = object.__new__(internals.FSDPParamGroup)
    init(group, **{name: known.get(name) for name in names})
    hooked = {torch.nn.Identity(): None}
    group.__dict__.update(
        fsdp_params=params, _reset_sharded_params=True, _module_to_pre_save_state_dict_hook_handle=hooked,
        _module_to_pre_load_state_dict_hook_handle=dict(hooked),
    )
    return group


def _run_dtype_check(params: list[_ProbeParam]) -> bool | None:
    """True if ``_init_mp_dtypes`` rejects this layout, False if it accepts it."""
    internals = load_internals()
    return _rejects(lambda: internals.FSDPParamGroup._init_mp_dtypes(_probe_group(internals, params)))


@functools.lru_cache(maxsize=None)
def probe_uniform_dtype_check() -> str | None:
    """Where this release rejects bf16 + fp32 trainable params of one group: ``"_init_mp_dtypes"``,
    ``"lazy_init"`` (elsewhere in ``FSDPParamGroup.lazy_init``) or ``"nowhere"``; None when it cannot tell."""
    # Note: ``_init_mp_dtypes`` alone is not enough: a release that moved the check into the group's
    # lazy init would pass it, and the plugin would say "fixed upstream" while torch still refuses.
    internals = load_internals()
    layout = [_ProbeParam(torch.bfloat16, True), _ProbeParam(torch.float32, True)]
    in_init = _run_dtype_check(layout)
    if in_init:
        return "_init_mp_dtypes"
    try:
        group = _lazy_init_probe_group(internals, layout)
    except Exception:  # noqa: BLE001 - an __init__ we do not understand
        group = None
    in_lazy_init = None if group is None else _rejects(lambda: internals.FSDPParamGroup.lazy_init(group))
    if in_lazy_init:
        return "lazy_init"
    if in_init is False and in_lazy_init is False:
        return "nowhere"
    return None


@functools.lru_cache(maxsize=None)
def probe_rejects_mixed_trainable_dtypes() -> bool | None:
    """Does this release reject bf16 + fp32 trainable params in one group (pytorch#156784)?"""
    return {"_init_mp_dtypes": True, "lazy_init": True, "nowhere": False}.get(probe_uniform_dtype_check())


@functools.lru_cache(maxsize=None)
def probe_dtype_check_counts_frozen() -> bool | None:
    """Does the check also count frozen params (torch 2.5 did; pytorch#154103)?"""
    return _run_dtype_check([_ProbeParam(torch.bfloat16, False), _ProbeParam(torch.float32, True)])
