"""The one wrapper of ``foreach_reduce`` through which the parts that repair its arguments run."""

from __future__ import annotations

import operator
from typing import Any, Callable

from .._patching import wraps
from ._frozen_first_forward import FrozenFirstForward, with_group_dtypes
from ._grad_dtypes import MixedGradDtypes, to_reduce_dtype

# Note [One reduce wrapper]: ``FSDPParamGroup.post_backward`` calls ``foreach_reduce`` once per
# group in every step. Each Python frame put in front of it costs about a thousand instructions,
# so the parts that repair its arguments share one frame. On the path of every ordinary step
# (the original dtype resolved, the gradients of one dtype) a part costs a test that finds
# nothing to do: no Python bytecode per gradient (``set(map(...))`` iterates in C, one
# ``Tensor.dtype`` read per gradient, as torch's own assertion makes), and no read at all
# without a reduce dtype, where nothing upcasts a gradient.

_dtype_of = operator.attrgetter("dtype")


def wrap_foreach_reduce(
    frozen: FrozenFirstForward | None, mixed: MixedGradDtypes | None, positions: dict[str, int], original: Callable
) -> Callable:
    """``foreach_reduce`` running the installed parts (None: not installed) before torch's.

    ``positions``: where torch's signature puts ``unsharded_grads``, ``reduce_dtype`` and, where
    ``frozen`` is given, ``orig_dtype`` (its part is needed only on releases that pass one).
    """
    grads_at, reduce_at = positions["unsharded_grads"], positions["reduce_dtype"]
    orig_at = positions["orig_dtype"] if frozen is not None else None

    @wraps(original)
    def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
        if frozen is not None and frozen.active:
            orig_dtype = args[orig_at] if len(args) > orig_at else kwargs.get("orig_dtype")
            if orig_dtype is None:
                args = with_group_dtypes(args, kwargs, orig_at, reduce_at)
        if mixed is not None and mixed.active:
            # Note: without a reduce dtype no gradient was upcast; torch's own check (or the
            # dtype fix's mixed groups) decides.
            reduce_dtype = args[reduce_at] if len(args) > reduce_at else kwargs.get("reduce_dtype")
            if reduce_dtype is not None:
                grads = args[grads_at] if len(args) > grads_at else kwargs["unsharded_grads"]
                if len(set(map(_dtype_of, grads))) > 1:
                    to_reduce_dtype(grads, reduce_dtype)
        return original(*args, **kwargs)

    return foreach_reduce
