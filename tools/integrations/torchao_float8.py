"""torchao float8 training: ``convert_to_float8_training`` before FSDP2, a mixed-dtype model, with the plugin.

    PYTHONPATH=. python tools/integrations/torchao_float8.py

The model as loaded (bf16, fp32 RMSNorm weights; tools/integrations/_model.py) is converted with torchao's
``convert_to_float8_training`` (every linear but the output head, as torchao's and torchtitan's recipes skip
``output``), then ``fully_shard`` per block and at the root with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; AdamW, one fixed batch per rank and step. Each job runs under ``torchrun --nproc-per-node 2``
(gloo, CPU: float8 matmuls through ``torch._scaled_mm``) and trains both torchao configurations:

- ``Float8LinearConfig(enable_fsdp_float8_all_gather=False)``: the converted weights are plain bf16 parameters,
  all-gathered in bf16 and cast to float8 for each matmul;
- ``=True`` (torchtitan's ``enable_fsdp_float8_all_gather``): each weight is torchao's
  ``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather`` casts the shard to float8, so FSDP
  all-gathers float8.

The jobs and their runs:

- ``no-plugin``: ``plain``, the model as loaded, where FSDP2's uniform-dtype assertion is expected in both
  configurations; then ``workaround``, ``model.float()`` before converting and sharding (torchao's usual fp32
  masters);
- ``plugin``: ``import torch_fsdp_ext`` (strategy ``upcast``), then, with float8 all-gather, the same after
  ``model.float()`` (the plugin installed, nothing left for it to cast);
- ``preserve``: the plugin with ``TORCH_FSDP_EXT_DTYPE_STRATEGY=preserve``.

Each run records its losses, every full parameter after the steps, the type of each sharded parameter's local
tensor, and the dtypes torchao's ``fsdp_pre_all_gather`` hands FSDP to all-gather.

Exit status 1 unless: plain fails with the assertion in both configurations; with float8 all-gather off the plugin's
run equals the workaround's bit for bit (both ranks' losses and every full parameter); with it on the workaround's 8
weights are ``WeightWithDynamicFloat8CastTensor`` and all-gather float8, the plugin refuses the mixed model with its
``MixedParamDtypeError`` naming the 8 weights (it never casts a tensor subclass that implements
``fsdp_pre_all_gather``) and the fix, casting nothing, and after ``model.float()`` the plugin's run equals the
workaround's bit for bit, its weights still the subclass and all-gathered in float8; ``preserve`` trains with float8
all-gather off, 10 bf16 masters, its step-1 loss on both ranks the workaround's bit for bit (later steps differ by
design: bf16 masters), and refuses the mixed float8 all-gather model.
"""

from __future__ import annotations

import functools
import tempfile

import torch

from _jobs import ASSERTION, launch_job, launch_jobs, run_tool  # this script's folder
from _model import compare, full_params, gathered_losses, mixed_llama, train_steps

STEPS = 3
CONFIGS = {"all-gather off": False, "float8 all-gather": True}
SUBCLASS = "WeightWithDynamicFloat8CastTensor"
REFUSAL = "must not be cast: tensor subclass with fsdp_pre_all_gather"
FIX = "model.float() before convert_to_float8_training and fully_shard"
BY_HAND = "float8 all-gather, model.float()"
RUNS = {"no-plugin": ("plain", "workaround"), "plugin": ("plugin",), "preserve": ("preserve",)}  # per job


def convert_and_shard(variant: str, float8_all_gather: bool, mesh) -> torch.nn.Module:
    """The model as loaded (``model.float()`` first for the workaround), converted and sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = mixed_llama()
    if variant == "workaround":
        model.float()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "head")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A full parameter as a plain tensor (torchao's weight subclass unwrapped)."""
    return getattr(tensor, "_tensor", tensor)


def train(variant: str, float8_all_gather: bool, mesh, rank: int, gathered: list, by_hand: bool = False) -> dict:
    """One configuration (``by_hand``: ``model.float()`` first): its losses, full parameters, local tensor types and
    dtypes; or the error it raised, with the dtypes and local tensor types it left."""
    model = None
    try:
        model = convert_and_shard("workaround" if by_hand else variant, float8_all_gather, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gathered.clear()
        losses = train_steps(model, optimizer, rank, range(STEPS))
    except Exception as error:  # what the run raised is the result; the ranks raise it alike
        message = f"{type(error).__name__}: {error}"
        params = {} if model is None else dict(model.named_parameters())
        return {"error": message, "dtypes": {name: param.dtype for name, param in params.items()},
                "local_types": {name: type(param.to_local()).__name__ for name, param in params.items()}}
    return {
        "error": None,
        "losses": gathered_losses(losses),
        "params": {name: plain_tensor(tensor) for name, tensor in full_params(model).items()},
        "dtypes": {name: param.dtype for name, param in model.named_parameters()},
        "local_types": {name: type(param.to_local()).__name__ for name, param in model.named_parameters()},
        "all_gathered": sorted({str(dtype) for dtype in gathered}),
    }


def job(variant: str, root: str, result_path: str) -> None:
    """One rank of a torchrun job."""
    if variant in ("plugin", "preserve"):
        import torch_fsdp_ext  # noqa: F401  (installs the fixes this torch needs)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    # Note: what torchao hands FSDP to all-gather, recorded by wrapping its hook (FSDP calls it per shard).
    gathered = []
    pre_all_gather = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    @functools.wraps(pre_all_gather)  # FSDP reads the hook's signature
    def recording_pre_all_gather(self, *args, **kwargs):
        inputs, metadata = pre_all_gather(self, *args, **kwargs)
        gathered.extend(t.dtype for t in inputs)
        return inputs, metadata

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = recording_pre_all_gather

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {run: {name: train(run, on, mesh, rank, gathered) for name, on in CONFIGS.items()}
              for run in RUNS[variant]}
    if variant == "plugin":
        result["plugin"][BY_HAND] = train(variant, True, mesh, rank, gathered, by_hand=True)
    if rank == 0:
        torch.save(result, result_path)


def float8_all_gather_text(result: dict) -> tuple[str, bool]:
    """Which types hold the sharded weights and what torchao all-gathers; whether that is float8 all-gather."""
    subclass = sum(kind == SUBCLASS for kind in result["local_types"].values())
    used = subclass == 8 and result["all_gathered"] == ["torch.float8_e4m3fn"]
    return (f"{subclass}/8 float8 weights' local tensors {SUBCLASS}, all-gathered by torchao: "
            f"{', '.join(result['all_gathered']) or 'nothing'}"), used


def main() -> int:
    from importlib.metadata import version

    label = "torchao-float8"
    with tempfile.TemporaryDirectory() as root:
        results = launch_jobs(__file__, label, ("no-plugin", "plugin"), root, torchrun=True)
        if results is None:
            return 1
        preserve_process, preserve = launch_job(__file__, "preserve", root, torchrun=True,
                                                settings={"TORCH_FSDP_EXT_DTYPE_STRATEGY": "preserve"})
    print(f"torch {torch.__version__}, torchao {version('torchao')}, 2 gloo ranks, {STEPS} steps")
    plain, workaround = results["no-plugin"]["plain"], results["no-plugin"]["workaround"]
    plugin = results["plugin"]["plugin"]
    failures = [f"{name}: the workaround failed: {workaround[name]['error']}" for name in CONFIGS
                if workaround[name]["error"]]
    failures += [f"{BY_HAND}: plugin: {plugin[BY_HAND]['error']}"] if plugin[BY_HAND]["error"] else []
    if failures:
        print("\n".join(f"{label}: {failure}" for failure in failures))
        return 1
    ok = True
    for name in CONFIGS:
        error = plain[name]["error"] or ""
        failed = ASSERTION in error
        print(f"{label}: {name}: without plugin: {'AssertionError: ' + ASSERTION if failed else error or 'NO ERROR'}")
        ok &= failed

    # Float8 all-gather off: the converted weights are plain bf16 parameters; the plugin upcasts them.
    name = "all-gather off"
    if plugin[name]["error"]:
        print(f"{label}: {name}: plugin: {plugin[name]['error']}")
        ok = False
    else:
        lines, exact = compare(f"{label}: {name}", plugin[name], workaround[name], "model.float()")
        print("\n".join(lines))
        ok &= exact and not plugin[name]["all_gathered"]

    # Float8 all-gather on: the plugin never casts torchao's weight subclass, so the group stays mixed: refused.
    name = "float8 all-gather"
    text, used = float8_all_gather_text(workaround[name])
    print(f"{label}: {name}: model.float(): {text}")
    ok &= used
    refused = plugin[name]["error"] or "NO ERROR"
    weights = sum(REFUSAL in line for line in refused.splitlines())
    loaded = {n: param.dtype for n, param in mixed_llama().named_parameters()}
    cast = [n for n, dtype in plugin[name]["dtypes"].items() if dtype != loaded[n]]
    kept = sum(kind == SUBCLASS for kind in plugin[name]["local_types"].values())
    print(f"{label}: {name}: plugin: {refused.splitlines()[0]}")
    print(f"{label}: {name}: plugin: {weights} weights named '{REFUSAL}', "
          f"fix named: {FIX if FIX in refused else 'NONE'}; parameters cast: {', '.join(cast) or 'none'}; "
          f"{kept}/8 weights still {SUBCLASS}")
    ok &= refused.startswith("MixedParamDtypeError") and weights == 8 and FIX in refused and not cast and kept == 8
    lines, exact = compare(f"{label}: {BY_HAND}", plugin[BY_HAND], workaround[name], "model.float() without it")
    text, used = float8_all_gather_text(plugin[BY_HAND])
    print("\n".join(lines))
    print(f"{label}: {BY_HAND}: plugin: {text}")
    ok &= exact and used

    if preserve_process.returncode != 0 or preserve is None:
        print(preserve_process.stdout + preserve_process.stderr)
        print(f"{label}: the preserve job failed (exit {preserve_process.returncode})")
        return 1
    off, on = preserve["preserve"]["all-gather off"], preserve["preserve"]["float8 all-gather"]
    if off["error"]:
        print(f"{label}: all-gather off: preserve: {off['error']}")
        ok = False
    else:
        bf16 = sum(dtype == torch.bfloat16 for dtype in off["dtypes"].values())
        print(f"{label}: all-gather off: preserve: trains with {bf16} bf16 masters")
        # Note: bf16 masters round small updates: after the first step preserve differs from model.float() by design.
        lines, _ = compare(f"{label}: all-gather off", off, workaround["all-gather off"], "model.float()",
                           result_name="preserve")
        print("\n".join(lines))
        first = torch.equal(off["losses"][0], workaround["all-gather off"]["losses"][0])
        print(f"{label}: all-gather off: preserve vs model.float(), step 1 loss on both ranks: "
              f"{'bit for bit' if first else 'differs'}")
        ok &= bf16 == 10 and first
    print(f"{label}: float8 all-gather: preserve: {(on['error'] or 'NO ERROR').splitlines()[0]}")
    ok &= (on["error"] or "").startswith("MixedParamDtypeError")
    return 0 if ok else 1


if __name__ == "__main__":
    run_tool(__doc__, job, main)
