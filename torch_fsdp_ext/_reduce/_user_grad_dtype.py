"""The part that keeps a ``grad_dtype`` set on a parameter before ``fully_shard`` (pytorch#170648)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


from .. import _compat
from .._patching import PatchSet, wraps
from ._grad_dtype import USER_GRAD_DTYPE_ATTR, needed_before_197203


class UserGradDtype:
    """A parameter's own ``grad_dtype`` (bf16 weights, fp32 gradients) survives ``fully_shard``.

    Note: ``fully_shard`` replaces each parameter with a new sharded one, which before 2.15
    drops ``grad_dtype``: the sharded gradient came back in the parameter's dtype. 2.15 (the
    change of pytorch#197203, which fixed #170648) captures it from the original parameter and
    gives it to the sharded one; the unsharded gradient is then made in it where the policy has
    no reduce dtype (``_grad_dtype.unsharded_grad_dtype``). Up to 2.14 ``foreach_reduce`` casts
    a group's reduced gradients to one dtype, the group's ``_orig_dtype``: a group whose
    trainable parameters all carry one ``grad_dtype`` gets that as the dtype to cast to, and a
    group where only some do is refused by name (2.15 alone reduces per parameter there).
    """

    name = "grad_dtype before fully_shard"
    summary = "a parameter's own grad_dtype (pytorch#170648) is kept by fully_shard, as torch 2.15 keeps it"

    def __init__(self, internals: _compat.TorchInternals) -> None:
        self.internals = internals
        self.active = False

    def needed(self) -> tuple[bool | None, str]:
        return needed_before_197203(
            "whether fully_shard keeps grad_dtype",
            "this torch keeps a parameter's grad_dtype through fully_shard (pytorch#197203)", "pytorch#170648",
        )

    def wrapped_symbols(self) -> list[str]:
        return _compat.symbol_names(self.internals, ("FSDPParam.__init__", "FSDPParamGroup.lazy_init"))

    def install(self, patches: PatchSet) -> None:
        patches.wrap(self.internals.FSDPParam, "__init__", functools.partial(wrap_fsdp_param_init, self))
        self.active = True

    def at_lazy_init(self, group: Any) -> None:
        """The dtype ``foreach_reduce`` casts the group's reduced gradients to, where its parameters carry one."""
        trainable = [p for p in group.fsdp_params if _compat.fsdp_param_is_trainable(p)]
        own = {p: p.__dict__.get(USER_GRAD_DTYPE_ATTR) for p in trainable}
        dtypes = {dtype or p.orig_dtype for p, dtype in own.items()}
        if not any(own.values()):
            return
        if len(dtypes) > 1:
            listing = ", ".join(
                f"{_compat.fsdp_param_fqn(p)} (grad_dtype {str(dtype or p.orig_dtype).replace('torch.', '')})"
                for p, dtype in own.items()
            )
            raise ValueError(
                f"torch_fsdp_ext: FSDP2 group {_compat.group_name(group)!r} has trainable parameters with several "
                f"gradient dtypes: {listing}. Before torch 2.15 FSDP2 gives one group's reduced gradients one "
                "dtype. Fix: set the same grad_dtype on every trainable parameter of the group before fully_shard, "
                "or give the parameters with their own grad_dtype a fully_shard call of their own."
            )
        group._orig_dtype = next(iter(dtypes))


def wrap_fsdp_param_init(part: UserGradDtype, original: Callable) -> Callable:
    parameters = list(inspect.signature(original).parameters)
    param_at = parameters.index("param") - 1 if "param" in parameters else 0  # after self

    @wraps(original)
    def __init__(fsdp_param: Any, *args: Any, **kwargs: Any) -> None:
        param = args[param_at] if len(args) > param_at else kwargs.get("param")
        # Note: before 2.15 a tensor cannot tell an explicit grad_dtype equal to its dtype from none.
        own = getattr(param, "grad_dtype", None)
        original(fsdp_param, *args, **kwargs)
        if part.active and own is not None and own != param.dtype and param.dtype.is_floating_point:
            fsdp_param.__dict__[USER_GRAD_DTYPE_ATTR] = own
            fsdp_param.sharded_param.grad_dtype = own

    return __init__
