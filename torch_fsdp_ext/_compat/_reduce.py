"""What the reduce fix reads of torch: where a release's gradient reduction leaves ``reduce_dtype``."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import types
from typing import Any, Callable

import torch

from . import TorchInternals, load_internals, torch_own
from ._dtype import _ProbeParam

# Note: the failures of FSDP2's reduce path before 2.15 (pytorch#196996, #186998, #190626) are
# probed here by behaviour, each on stand-ins without a process group: they say which failures
# a release has (``status()``, the tests). The fix itself reads only the probes of where 2.15
# fixed them, at the unsharded gradient's birth (#197203): ``probe_unsharded_grad_dtype`` and
# the two below it.


class _ProbeStop(Exception):
    """Raised by the probe's stand-in communicator once the reduce-scatter input is filled."""


class _ProbeReduceScatter:
    """Stand-in ``reduce_scatter_comm``: hands out the reduce-scatter input, then stops the call."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.input is not None:  # the reduce output: the copy-in is done
            raise _ProbeStop
        self.input = torch.full(size, float("nan"), dtype=dtype, device=device)
        return self.input


def torch_foreach_reduce() -> Any:
    """Torch's own ``foreach_reduce`` behind whatever FSDP's param group calls (Note [Foreign patches])."""
    return torch_own(load_internals().fsdp_param_group_module.foreach_reduce, "foreach_reduce")


def _copy_in_of(grads: list[torch.Tensor]) -> torch.Tensor | None | bool:
    """Run torch's ``foreach_reduce`` on one CPU rank (no process group) with ``grads`` and
    ``reduce_dtype=float32`` up to its copy-in: the reduce-scatter input it filled, False when it
    raised before filling one, None when it could not be run."""
    foreach_reduce = torch_foreach_reduce()
    if foreach_reduce is None:
        return None
    comm = _ProbeReduceScatter()
    stream = torch.cpu.current_stream()
    known = {
        "fsdp_params": [types.SimpleNamespace(fsdp_placement=types.SimpleNamespace(dim=0)) for _ in grads],
        "unsharded_grads": list(grads), "reduce_scatter_group": None, "reduce_scatter_stream": stream,
        "reduce_scatter_comm": comm, "orig_dtype": torch.float32, "reduce_dtype": torch.float32,
        "device": torch.device("cpu"), "gradient_divide_factor": None, "all_reduce_group": None,
        "all_reduce_stream": stream, "all_reduce_grads": True, "partial_reduce_output": None, "all_reduce_hook": None,
    }
    parameters = inspect.signature(foreach_reduce).parameters
    required = [n for n, p in parameters.items() if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]
    if any(name not in known for name in required):
        return None
    # Note: torch's assertion prints the rank to stdout and a stack trace to stderr first
    # (``_raise_assert_with_print``): the probe's expected refusal must not reach a user's log.
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        try:
            foreach_reduce(**{name: value for name, value in known.items() if name in parameters})
        except _ProbeStop:
            return comm.input
        except Exception:  # noqa: BLE001 - torch refused (its assertion) or the stand-ins do not fit
            return False if comm.input is None else None
    return None


@functools.lru_cache(maxsize=None)
def probe_reduce_rejects_mixed_grad_dtypes() -> bool | None:
    """Does torch's ``foreach_reduce`` refuse a group whose gradients come in bf16 and fp32 (pytorch#196996)?

    Note: the stand-in call fills the fp32 reduce-scatter input of one CPU rank and stops.
    Uniform fp32 gradients must reach that copy-in (else None: the stand-ins do not fit this
    torch); bf16 + fp32 gradients that do not reach it mean the failure (True); reaching it
    with both values exactly in place means this torch brings them to the reduce dtype (False).
    """
    values = torch.tensor([1.0, 2.0**-10, 1.0 + 2.0**-20])
    uniform = _copy_in_of([values[:2].clone(), values[2:].clone()])
    if not isinstance(uniform, torch.Tensor) or not torch.equal(uniform, values):
        return None
    mixed = _copy_in_of([values[:2].to(torch.bfloat16), values[2:].clone()])
    if mixed is False:
        return True
    if isinstance(mixed, torch.Tensor) and torch.equal(mixed, values):
        return False
    return None


@functools.lru_cache(maxsize=None)
def probe_frozen_first_forward_drops_reduce_dtype() -> bool | None:
    """Does a group whose parameters were all frozen at its lazy init lose the reduce dtype (pytorch#186998)?

    Note: torch's own ``_init_mp_dtypes`` runs on a stand-in group of two frozen fp32
    parameters with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the
    group's ``_reduce_dtype`` is None where the failure is (up to 2.13), fp32 where it was
    fixed (pytorch#187376, 2.14).
    """
    internals = load_internals()
    group_cls = internals.symbols.get("FSDPParamGroup")
    init_mp_dtypes = torch_own(vars(group_cls).get("_init_mp_dtypes") if group_cls else None, "_init_mp_dtypes")
    if init_mp_dtypes is None:
        return None
    policy = internals.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    params = [_ProbeParam(torch.float32, False) for _ in range(2)]
    for param in params:
        param.mp_policy = policy  # 2.15 reads each parameter's policy
    group = types.SimpleNamespace(fsdp_params=params, mp_policy=policy, _orig_dtype=None, _reduce_dtype=None)
    try:
        init_mp_dtypes(group)
    except Exception:  # noqa: BLE001 - internals we do not understand
        return None
    if group._reduce_dtype is None:
        return True
    return False if group._reduce_dtype == torch.float32 else None


# Note: with a DTensor parameter (tensor parallel), ``FSDPParam._get_grad_inner_tensor``
# redistributes its gradient to the parameter's placements on the non-data-parallel mesh
# dims before FSDP's reduce-scatter. A TP-replicated parameter (a ``SequenceParallel``
# norm weight, a router) gets a ``Partial`` gradient, so that redistribute is an
# all-reduce over the TP mesh, run in the gradient's dtype: ``param_dtype``, whatever
# ``reduce_dtype`` says (pytorch#190626). 2.15 gives the unsharded parameter
# ``grad_dtype=reduce_dtype`` (autograd casts before the redistribute); PR #190627
# casts at the top of ``_get_grad_inner_tensor``. Up to 2.14 the gradient-accumulation
# path alone reduces in ``reduce_dtype`` (``to_accumulated_grad_if_needed`` upcasts first).
TP_REDUCE_METHOD = ("FSDPParam", "_get_grad_inner_tensor")


def grad_inner_tensor_method() -> Callable | None:
    """``FSDPParam._get_grad_inner_tensor`` as the class holds it; None where missing."""
    method = getattr(load_internals().symbols.get(TP_REDUCE_METHOD[0]), TP_REDUCE_METHOD[1], None)
    return method if callable(method) else None


def tp_reduce_symbol_name() -> str:
    owner = load_internals().symbols.get(TP_REDUCE_METHOD[0])
    prefix = f"{owner.__module__}.{owner.__qualname__}" if owner is not None else TP_REDUCE_METHOD[0]
    return f"{prefix}.{TP_REDUCE_METHOD[1]}"


def _recording_partial_grad(dtype: torch.dtype, seen: list[torch.dtype]) -> torch.Tensor:
    """A stand-in DTensor gradient (no mesh, no process group), ``Partial`` on one mesh dim.

    It records the dtype in which it is redistributed; ``.to()`` gives another stand-in.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    class RecordingGrad(DTensor):
        @staticmethod
        def make(dtype: torch.dtype, placements: tuple) -> "RecordingGrad":
            grad = torch.Tensor._make_wrapper_subclass(RecordingGrad, (4,), dtype=dtype)
            grad._spec = types.SimpleNamespace(placements=placements, mesh=None, tensor_meta=None)
            grad._local_tensor = torch.zeros(4, dtype=dtype)
            return grad

        def to(self, dtype: torch.dtype, *args: Any, **kwargs: Any) -> "RecordingGrad":
            return RecordingGrad.make(dtype, self._spec.placements)

        def redistribute(self, device_mesh: Any = None, placements: Any = None, **kwargs: Any) -> "RecordingGrad":
            seen.append(self.dtype)
            if not all(isinstance(p, Replicate) for p in placements):
                raise AssertionError(f"redistributed to {placements}")
            return RecordingGrad.make(self.dtype, tuple(placements))

    return RecordingGrad.make(dtype, (Partial(),))


def _grad_probe_param(internals: TorchInternals) -> Any:
    """An ``FSDPParam`` from ``object.__new__`` with what its TP gradient path and unsharded init read:
    a parameter replicated on a 1-D TP mesh, ``param_dtype=bf16``, ``reduce_dtype=fp32``."""
    param = object.__new__(internals.FSDPParam)
    sharded = torch.nn.Parameter(torch.zeros(4))
    sharded._local_tensor = sharded.detach()  # read as the sharded DTensor's local tensor
    param.__dict__.update(
        is_dtensor=True, is_spmd_types=False, mesh_info=types.SimpleNamespace(is_spmd_mesh=False),
        _dp_dim_indices=frozenset(), _unsharded_dtensor_spec=None, sharded_param=sharded,
        orig_dtype=torch.float32, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
        _has_sharded_grad_dtype_override=False, sharded_grad_dtype=torch.float32,
        all_gather_outputs=[torch.zeros(4, dtype=torch.bfloat16)], _orig_size=torch.Size([4]),
        _contiguous_orig_stride=(1,), _release_all_gather_outputs_after_post_all_gather=False,
    )
    return param


def _set_grad_probe_spec(param: Any) -> None:
    """After ``init_unsharded_param`` (which, given a spec, would build a DTensor on a mesh): the TP placements."""
    from torch.distributed.tensor import Replicate

    spec = types.SimpleNamespace(placements=(Replicate(),))
    param.__dict__.update(_unsharded_dtensor_spec=spec, _tp_spec=spec)


@functools.lru_cache(maxsize=None)
def probe_tp_grad_reduce_dtype() -> tuple[torch.dtype | None, str]:
    """The dtype in which this torch reduces a TP-replicated parameter's gradient over the TP mesh,
    under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; (None, why) where unknown.

    Two stand-ins, no process group: the gradient autograd would produce (bf16, unless
    ``init_unsharded_param`` gives the unsharded parameter a ``grad_dtype``, as 2.15 does) is
    handed to ``_get_grad_inner_tensor`` as a ``Partial`` DTensor that records the dtype of
    its redistribute (a cast there, as PR #190627 adds, is seen too).
    """
    internals = load_internals()
    get_grad_inner_tensor = grad_inner_tensor_method()
    if get_grad_inner_tensor is None:
        return None, f"{tp_reduce_symbol_name()} is missing"
    try:
        param = _grad_probe_param(internals)
        _init_unsharded_param(param)
        unsharded = param.__dict__["_unsharded_param"]
        grad_dtype = getattr(unsharded, "grad_dtype", None) or unsharded.dtype
        _set_grad_probe_spec(param)
    except Exception as e:  # noqa: BLE001 - internals we do not understand
        return None, f"FSDPParam.init_unsharded_param differs: {e!r}"
    seen: list[torch.dtype] = []
    try:
        local = get_grad_inner_tensor(param, _recording_partial_grad(grad_dtype, seen))
    except Exception as e:  # noqa: BLE001
        return None, f"{tp_reduce_symbol_name()} differs: {e!r}"
    if len(seen) != 1 or not isinstance(local, torch.Tensor) or local.dtype != seen[0]:
        return None, f"{tp_reduce_symbol_name()} did not redistribute the Partial gradient once"
    return seen[0], "reduced in the gradient's dtype" if seen[0] == torch.bfloat16 else "reduced in reduce_dtype"


def _init_unsharded_param(param: Any) -> None:
    """Torch's own ``FSDPParam.init_unsharded_param`` on a stand-in (whatever instance attribute it has)."""
    init = torch_own(vars(load_internals().FSDPParam).get("init_unsharded_param"), "init_unsharded_param")
    if init is None:
        raise AttributeError("FSDPParam.init_unsharded_param is missing")
    init(param)


@functools.lru_cache(maxsize=None)
def probe_unsharded_grad_dtype() -> tuple[torch.dtype | None, str]:
    """The ``grad_dtype`` torch gives a new unsharded parameter under ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``: fp32 where torch has pytorch#197203 (2.15), bf16 before; (None, why) where unknown.

    Note: one stand-in ``FSDPParam`` without a mesh goes through torch's own ``init_unsharded_param``
    (the first all-gather's copy-out); autograd then produces the gradient in that dtype.
    """
    if not hasattr(torch.Tensor, "grad_dtype"):
        return None, "this torch has no Tensor.grad_dtype"
    try:
        param = _grad_probe_param(load_internals())
        param.is_dtensor = False
        _init_unsharded_param(param)
        unsharded = param.__dict__["_unsharded_param"]
    except Exception as e:  # noqa: BLE001 - internals we do not understand
        return None, f"FSDPParam.init_unsharded_param differs: {e!r}"
    if unsharded.dtype != torch.bfloat16 or unsharded.grad_dtype not in (torch.bfloat16, torch.float32):
        return None, "FSDPParam.init_unsharded_param made an unsharded parameter this probe does not expect"
    return unsharded.grad_dtype, "pytorch#197203" if unsharded.grad_dtype == torch.float32 else "the compute dtype"


@functools.lru_cache(maxsize=None)
def probe_zero_grad_dtype_follows_grad_dtype() -> bool | None:
    """Does an unused parameter's zero placeholder (``set_reduce_scatter_unused_params(True)``) come in its
    unsharded parameter's ``grad_dtype`` (2.15), or in its compute dtype (before)? None: cannot tell."""
    prop = vars(load_internals().FSDPParam).get("unsharded_zero_grad_data")
    getter = torch_own(getattr(prop, "fget", None), "unsharded_zero_grad_data")
    if getter is None:
        return None
    unsharded = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    unsharded.grad_dtype = torch.float32
    stand_in = types.SimpleNamespace(unsharded_param=unsharded, _unsharded_param=unsharded,
                                     _get_grad_inner_tensor=lambda grad: grad)
    try:
        zeros = getter(stand_in)
    except Exception:  # noqa: BLE001 - internals we do not understand
        return None
    return {torch.float32: True, torch.bfloat16: False}.get(getattr(zeros, "dtype", None))


@functools.lru_cache(maxsize=None)
def probe_no_sync_reads_missing_unsharded_param() -> bool | None:
    """Does a backward without gradient sync fail on a unit that never ran forward (pytorch#194058)?

    Note: up to 2.14 ``FSDPParamGroup.post_backward`` runs ``FSDPParam.to_accumulated_grad_if_needed``
    on every parameter of every group without sync, and that reads ``_unsharded_param``, which only
    the first all-gather creates. 2.15 removed the method and reads the parameter with a guard.
    """
    method = torch_own(vars(load_internals().FSDPParam).get("to_accumulated_grad_if_needed"),
                       "to_accumulated_grad_if_needed")
    if method is None:
        if "to_accumulated_grad_if_needed" in vars(load_internals().FSDPParam):
            return None  # there, but behind something the plugin cannot see through
        return False
    stand_in = types.SimpleNamespace(reduce_dtype=torch.float32, unsharded_accumulated_grad=None)
    try:
        method(stand_in)
    except AttributeError:
        return True
    except Exception:  # noqa: BLE001 - internals we do not understand
        return None
    return False
