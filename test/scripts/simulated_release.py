"""Train under a simulated future torch release: torch's checkpoint or FSDP2 internals are changed
*before* torch_fsdp_ext is imported, as a release that renamed or re-signatured them would be.

    python test/scripts/simulated_release.py CASE [--plugin] [--bf16] [--mixed]

CASE is one of ``SIMULATIONS`` (``none``: torch as installed). One process, world size 1 (gloo).
Trains a model whose blocks run under non-reentrant ``checkpoint``, once without FSDP and once
with every block and the root ``fully_shard``-ed, and prints one JSON line: the losses and
gradient sums bit for bit (``float.hex``), the warnings torch_fsdp_ext issued, and its status.
"""

import argparse
import ast
import inspect
import json
import os
import socket
import sys
import textwrap
import types
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as checkpoint_module
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_state


def _rename_in_code(code: types.CodeType, old: str, new: str) -> types.CodeType:
    """``code`` with attribute/global name ``old`` read as ``new``, nested functions included."""
    consts = tuple(_rename_in_code(c, old, new) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    names = tuple(new if name == old else name for name in code.co_names)
    return code.replace(co_names=names, co_consts=consts)


def _functions_of(namespace: dict):
    for value in list(namespace.values()):
        if isinstance(value, type) and value.__module__ == namespace.get("__name__"):
            yield from _functions_of({**vars(value), "__name__": namespace.get("__name__")})
        function = value
        while function is not None:
            if isinstance(function, property):
                function = function.fget
            if isinstance(function, (staticmethod, classmethod)):
                function = function.__func__
            if isinstance(function, types.FunctionType):
                yield function
            function = getattr(function, "__wrapped__", None)


def released_in(module: types.ModuleType, function: types.FunctionType) -> types.FunctionType:
    """``function`` as code of ``module``'s file: the plugin tells torch's own functions from other
    libraries' wrappers by where their code lives, and a release's new code lives in torch."""
    function.__code__ = function.__code__.replace(co_filename=module.__file__)
    return function


def rename_attribute(modules: list, old: str, new: str) -> None:
    """Every function of ``modules`` (and of their classes) reads and writes ``.old`` as ``.new``."""
    for module in modules:
        for function in _functions_of(vars(module)):
            if old in function.__code__.co_names or any(
                isinstance(c, types.CodeType) for c in function.__code__.co_consts
            ):
                function.__code__ = _rename_in_code(function.__code__, old, new)


def recompute_fn_renamed() -> None:
    rename_attribute([checkpoint_module], "recompute_fn", "recompute_function")


def recomputation_hook_takes_frame() -> None:
    """``_recomputation_hook(frame, gid)``: the checkpoint hook passes the frame, not a weak reference."""
    hook_init = checkpoint_module._checkpoint_hook.__init__
    checkpoint_module._simulated_weakref = types.SimpleNamespace(**{**vars(__import__("weakref")), "ref": lambda obj: obj})
    consts = tuple(
        _rename_in_code(c, "weakref", "_simulated_weakref") if getattr(c, "co_name", None) == "unpack_hook" else c
        for c in hook_init.__code__.co_consts
    )
    hook_init.__code__ = hook_init.__code__.replace(co_consts=consts)
    original = checkpoint_module._recomputation_hook.__init__

    def __init__(self, target_frame, gid):
        original(self, lambda: target_frame, gid)

    checkpoint_module._recomputation_hook.__init__ = released_in(checkpoint_module, __init__)


def iter_forward_root_renamed() -> None:
    package = sys.modules["torch.distributed.fsdp._fully_shard"]
    modules = [m for name, m in sys.modules.items() if name.startswith(package.__name__ + ".")]
    rename_attribute(modules, "iter_forward_root", "iteration_forward_root")


def no_decorator_cell() -> None:
    """FSDP's forward hooks as plain methods: nothing calls them through a closure cell."""
    for name in ("_pre_forward", "_post_forward"):
        method = _fsdp_state.FSDPState.__dict__[name]
        setattr(_fsdp_state.FSDPState, name, getattr(method, "__wrapped__", method))


def init_mp_dtypes_renamed() -> None:
    """The dtype fix's symbol only: ``FSDPParamGroup._init_mp_dtypes`` under another name."""
    package = sys.modules["torch.distributed.fsdp._fully_shard"]
    modules = [m for name, m in sys.modules.items() if name.startswith(package.__name__ + ".")]
    rename_attribute(modules, "_init_mp_dtypes", "_init_mixed_precision_dtypes")
    group = sys.modules[package.__name__ + "._fsdp_param_group"].FSDPParamGroup
    group._init_mixed_precision_dtypes = group.__dict__["_init_mp_dtypes"]
    del group._init_mp_dtypes


def recomputation_hook_renamed() -> None:
    """The recompute fix's symbol only: ``torch.utils.checkpoint._recomputation_hook`` under another name."""
    rename_attribute([checkpoint_module], "_recomputation_hook", "_recompute_hook")
    checkpoint_module._recompute_hook = checkpoint_module._recomputation_hook
    del checkpoint_module._recomputation_hook


def uniform_check_in_lazy_init() -> None:
    """torch's uniform-dtype assertion moved out of ``_init_mp_dtypes`` into ``FSDPParamGroup.lazy_init``."""
    group_class = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_param_group"].FSDPParamGroup
    init_mp_dtypes, lazy_init = group_class.__dict__["_init_mp_dtypes"], group_class.__dict__["lazy_init"]

    def trainable_dtypes(group) -> set:
        return {p.sharded_param.dtype for p in group.fsdp_params if p.sharded_param.requires_grad}

    def moved_init_mp_dtypes(self) -> None:
        if len(trainable_dtypes(self)) > 1:  # no check here any more
            for fsdp_param in self.fsdp_params:
                fsdp_param.init_dtype_attrs(self.mp_policy)
            return
        init_mp_dtypes(self)

    def moved_lazy_init(self, *args, **kwargs):
        if len(dtypes := trainable_dtypes(self)) > 1:
            raise AssertionError(f"FSDP expects uniform original parameter dtype but got {dtypes}")
        return lazy_init(self, *args, **kwargs)

    module = sys.modules[group_class.__module__]
    group_class._init_mp_dtypes = released_in(module, moved_init_mp_dtypes)
    group_class.lazy_init = released_in(module, moved_lazy_init)


def uniform_check_removed() -> None:
    """Upstream fixed it: ``_init_mp_dtypes`` without its uniform original-dtype assertion, as torch wrote it."""
    module = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_param_group"]
    source = textwrap.dedent(inspect.getsource(module.FSDPParamGroup._init_mp_dtypes))
    tree = ast.parse(source)
    removed = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "uniform original parameter dtype" in ast.unparse(node.body[0]):
            node.test, removed = ast.copy_location(ast.Constant(False), node.test), removed + 1
    assert removed == 1, "the simulation did not find the assertion"
    namespace: dict = {}
    exec(compile(tree, module.__file__, "exec"), vars(module), namespace)
    module.FSDPParamGroup._init_mp_dtypes = namespace["_init_mp_dtypes"]


def group_init_args_hidden() -> None:
    """``FSDPParamGroup.__init__(self, *args, **kwargs)``: no argument names to bind by."""
    group_class = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_param_group"].FSDPParamGroup
    init = group_class.__init__

    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)

    group_class.__init__ = released_in(sys.modules[group_class.__module__], __init__)


SIMULATIONS = {
    "none": lambda: None,
    "recompute_fn_renamed": recompute_fn_renamed,
    "recomputation_hook_takes_frame": recomputation_hook_takes_frame,
    "iter_forward_root_renamed": iter_forward_root_renamed,
    "no_decorator_cell": no_decorator_cell,
    "init_mp_dtypes_renamed": init_mp_dtypes_renamed,
    "recomputation_hook_renamed": recomputation_hook_renamed,
    "uniform_check_in_lazy_init": uniform_check_in_lazy_init,
    "uniform_check_removed": uniform_check_removed,
    "group_init_args_hidden": group_init_args_hidden,
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2, self.dropout = nn.Linear(8, 8), nn.Linear(8, 8), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.dropout(torch.nn.functional.gelu(self.lin1(x)))
        return x + self.lin2(hidden.to(self.lin2.weight.dtype)).to(x.dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint_module.checkpoint(block, x, use_reentrant=False)
        return x


def train(shard: bool, bf16: bool = False, mixed: bool = False) -> dict:
    torch.manual_seed(0)
    model = Net()
    if mixed:  # bf16 second linears beside fp32 first ones, in every group
        for block in model.blocks:
            block.lin2.to(torch.bfloat16)
    if shard:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(2):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
        loss.backward()
        grads.append(sum(float(p.grad.full_tensor().sum() if shard else p.grad.sum()) for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": [v.hex() for v in losses], "grads": [v.hex() for v in grads]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=SIMULATIONS)
    parser.add_argument("--plugin", action="store_true", help="import torch_fsdp_ext after the simulation")
    parser.add_argument("--bf16", action="store_true", help="FSDP computes in bf16 (the recompute fix's case)")
    parser.add_argument("--mixed", action="store_true", help="bf16 and fp32 trainable parameters (the dtype fix's case)")
    args = parser.parse_args()
    SIMULATIONS[args.case]()
    result: dict = {"case": args.case}
    if args.plugin:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_fsdp_ext

        result["warnings"] = [str(w.message) for w in caught if "torch_fsdp_ext" in str(w.message)]
        status = torch_fsdp_ext.status()
        result["active"] = {name: fix.active for name, fix in status.fixes.items()}
        result["recompute_needed"] = status.fixes["recompute"].needed
        result["dtype_reason"] = status.fixes["dtype"].reason
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        result["plain"] = train(shard=False, mixed=args.mixed)
        result["fsdp"] = train(shard=True, bf16=args.bf16, mixed=args.mixed)
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    # Note: no interpreter shutdown, where a gloo worker can abort the process (docs/reliability.md, "Abort at
    # exit"). Written out, not torch_fsdp_ext's end_rank: without --plugin this script never imports the plugin.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
