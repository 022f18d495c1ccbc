"""Ship a model in the dtypes it was loaded in, however it trained.

Under ``upcast`` a bf16 checkpoint trains as fp32 master weights (Note [Upcast
moment] in ``_fix``), and every full state dict torch makes of it is fp32:
twice the size of what was loaded. The plugin is the one component that knows each
parameter's dtype from before the upcast: ``_strategies.upcast_param``, the
one place a sharded parameter changes dtype, records it here.

Note: each tensor is rounded to its loaded dtype on its local shard, before it is
gathered. Rounding is elementwise, so the result equals the full master rounded
(``Tensor.to``: round to nearest even) bit for bit, while the gather moves and
allocates the loaded dtype's bytes only; a full tensor exists one at a time.

A DCP training checkpoint keeps the fp32 masters (an exact resume); its loaded
dtypes go into a small JSON file beside it (``save_loaded_dtypes``), which DCP's
reader never opens, and ``python -m torch_fsdp_ext export`` turns the two into a
safetensors file in the loaded dtypes, one tensor at a time.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .. import _compat

# Note: kept on the FSDPParam, not in a weak mapping of parameters: a weak reference
# to a tensor makes torch.utils.swap_tensors (the upcast itself, nn.Module._apply
# with swapping on) refuse it.
_ATTR = "_torch_fsdp_ext_loaded_dtype"

SIDECAR = "torch_fsdp_ext_loaded_dtypes.json"
_SIDECAR_FORMAT = "torch_fsdp_ext.loaded_dtypes/1"

# Module names that torch's wrappers put into parameter names but not into the names
# get_model_state_dict gives (torch.compile, checkpoint_wrapper, FSDP1).
_WRAPPER_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def remember_loaded_dtype(fsdp_param: Any, dtype: torch.dtype) -> None:
    """Called right before the plugin changes a sharded parameter's dtype; the first call counts."""
    fsdp_param.__dict__.setdefault(_ATTR, dtype)


def loaded_dtype_of(fsdp_param: Any) -> torch.dtype | None:
    """The dtype ``fsdp_param`` was loaded in, where the plugin changed it since; else None."""
    return fsdp_param.__dict__.get(_ATTR)


def _changed_dtypes(model: torch.nn.Module) -> dict[int, torch.dtype]:
    """id of each sharded parameter whose dtype the plugin changed -> its loaded dtype."""
    changed = {}
    for state in _compat.fsdp_states_under(model):
        for group in _compat.param_groups_of(state):
            for fsdp_param in group.fsdp_params:
                if _ATTR in fsdp_param.__dict__:
                    # Note: load_state_dict(assign=True) puts another object in the module until FSDP's
                    # lazy init takes it: both are this parameter.
                    for param in (fsdp_param.sharded_param, _compat.current_module_param(fsdp_param)):
                        changed[id(param)] = fsdp_param.__dict__[_ATTR]
    return changed


def _clean_fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _tensors(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """The model's state-dict tensors by FQN, as the module holds them (sharded parameters), with loaded dtypes."""
    # Note: state_dict() first runs FSDP's pre-hook that registers the sharded parameters
    # (the root keeps its unsharded ones after forward), and the plugin's own upcast moment.
    tensors = model.state_dict(keep_vars=True)
    changed = _changed_dtypes(model)
    return {
        _clean_fqn(name): (value, changed.get(id(value), value.dtype))
        for name, value in tensors.items()
        if isinstance(value, torch.Tensor)
    }


def loaded_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """Every parameter and buffer of ``model`` by FQN, in the dtype it had before the plugin changed it.

    The FQNs are those of ``get_model_state_dict(model)``. Tensors the plugin never
    changed report their current dtype.
    """
    return {fqn: dtype for fqn, (_, dtype) in _tensors(model).items()}


def _full_in_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full tensor of ``value`` in ``dtype``; a collective over its mesh when it is a DTensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return value.detach().to(dtype)
    mesh = value.device_mesh
    local = value.to_local().detach()
    if mesh.ndim == 1 and tuple(type(p) for p in value.placements) == (Shard,) and value.placements[0].dim == 0:
        return _gather_dim0_in_dtype(local, value.shape, dtype, mesh)
    local = local.to(dtype)
    if local.device.type != mesh.device_type:  # CPU offload: gather on the mesh's device
        local = local.to(mesh.device_type)
    shard = DTensor.from_local(local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    return shard.full_tensor()


# Note: gloo copies the output of every all-gather through a flat buffer of its own, so
# gathering a whole tensor at once would cost two on a CPU mesh; there it is gathered
# in pieces of at most this many bytes (all ranks together).
_CPU_PIECE_BYTES = 2 << 20


def _gather_dim0_in_dtype(local: torch.Tensor, shape: torch.Size, dtype: torch.dtype, mesh: Any) -> torch.Tensor:
    """FSDP's layout (dim 0 in ``torch.chunk`` pieces) gathered into one allocation of the full tensor.

    Note: the local shard is cast straight into this rank's slot of the output, and
    the all-gather reads its input from that slot, so no cast copy of the shard and
    no padded copy of the result ever exist: the extra memory is one full tensor
    (plus at most ``world_size - 1`` rows of padding when dim 0 does not divide).
    """
    world, rank = mesh.size(), mesh.get_local_rank()
    group = mesh.get_group()
    rows = -(-shape[0] // world)
    device = local.device
    if device.type != mesh.device_type:  # CPU offload: gather on the mesh's device
        device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    out = torch.empty((rows * world, *shape[1:]), dtype=dtype, device=device)
    slot = out.narrow(0, rank * rows, rows)
    slot.narrow(0, 0, local.shape[0]).copy_(local)
    if device.type != "cpu":
        _compat.all_gather_single(out, slot, group=group)
        return out.narrow(0, 0, shape[0])
    row_bytes = max(1, out[0].numel() * out.element_size()) if rows else 1
    step = max(1, _CPU_PIECE_BYTES // (world * row_bytes))
    for start in range(0, rows, step):
        count = min(step, rows - start)
        piece = torch.empty((world * count, *shape[1:]), dtype=dtype, device=device)
        _compat.all_gather_single(piece, slot.narrow(0, start, count), group=group)
        for source in range(world):
            if source != rank:
                out.narrow(0, source * rows + start, count).copy_(piece.narrow(0, source * count, count))
        del piece
    return out.narrow(0, 0, shape[0])


@torch.no_grad()
def iter_state_dict_as_loaded(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(fqn, full tensor)`` pairs in the loaded dtypes, the same on every rank, one full tensor at a time.

    Every rank must iterate to the end (each sharded tensor is one all-gather). A
    tensor is on the device its mesh uses; drop it before taking the next one to keep
    the extra memory to one full tensor.
    """
    for fqn, (value, dtype) in _tensors(model).items():
        yield fqn, _full_in_dtype(value, dtype)


def state_dict_as_loaded(model: torch.nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict in the loaded dtypes.

    As ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=cpu_offload))``: with ``cpu_offload`` rank 0 holds every tensor on
    the CPU and the other ranks get an empty dict; without it every rank holds them.
    Tied weights stay one tensor under each of their names, so ``save_pretrained``
    recognizes them.
    """
    keep = not cpu_offload or not dist.is_initialized() or dist.get_rank() == 0
    state_dict: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}  # id of a model tensor -> its first FQN
    with torch.no_grad():
        for fqn, (value, dtype) in _tensors(model).items():
            tied_to = first_name.setdefault(id(value), fqn)
            if tied_to != fqn:
                if keep:
                    state_dict[fqn] = state_dict[tied_to]
                continue
            tensor = _full_in_dtype(value, dtype)
            if keep:
                state_dict[fqn] = tensor.cpu() if cpu_offload else tensor
    return state_dict


# -- DCP training checkpoints ------------------------------------------------------


def save_loaded_dtypes(model: torch.nn.Module, checkpoint_dir: str | os.PathLike, *, key: str = "model") -> None:
    """Write the loaded dtypes beside a DCP checkpoint of ``{key: get_model_state_dict(model), ...}``.

    Call it on every rank (rank 0 writes); ``key`` is where the model's state dict
    sits in what was passed to ``dcp.save`` (``""``: the model's state dict itself).
    """
    dtypes = loaded_dtypes(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(checkpoint_dir, exist_ok=True)
    record = {
        "format": _SIDECAR_FORMAT,
        "key": key,
        "dtypes": {fqn: str(dtype).removeprefix("torch.") for fqn, dtype in dtypes.items()},
    }
    path = os.path.join(checkpoint_dir, SIDECAR)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


class ExportError(ValueError):
    """A checkpoint ``export`` cannot read: names the file and what is wrong with it."""


def _read_sidecar(checkpoint_dir: str) -> tuple[str, dict[str, torch.dtype]]:
    path = os.path.join(checkpoint_dir, SIDECAR)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise ExportError(
            f"{path}: missing. Write it when saving the checkpoint: "
            f"torch_fsdp_ext.save_loaded_dtypes(model, checkpoint_dir) next to dcp.save(...)."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: unreadable ({e}); write it again with torch_fsdp_ext.save_loaded_dtypes") from None
    if not isinstance(record, dict) or record.get("format") != _SIDECAR_FORMAT:
        raise ExportError(f"{path}: not a loaded-dtypes file of this plugin (no format {_SIDECAR_FORMAT!r})")
    if not isinstance(record.get("key"), str) or not isinstance(record.get("dtypes"), dict):
        raise ExportError(f"{path}: incomplete (needs a string 'key' and a 'dtypes' object)")
    dtypes = {}
    for fqn, name in record["dtypes"].items():
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype):
            raise ExportError(f"{path}: unknown dtype {name!r} for {fqn}")
        dtypes[fqn] = dtype
    return record["key"], dtypes


def _read_metadata(checkpoint_dir: str, reader: Any) -> Any:
    path = os.path.join(checkpoint_dir, ".metadata")
    if not os.path.isfile(path):
        raise ExportError(f"{path}: missing; {checkpoint_dir} is not a complete DCP checkpoint (dcp.save writes it last)")
    try:
        return reader.read_metadata()
    except Exception as e:  # unpickling a damaged file raises anything
        raise ExportError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _check_storage(checkpoint_dir: str, metadata: Any, names: set[str]) -> None:
    """Every file that holds bytes of ``names`` exists and is long enough, before anything is written.

    Note: read from the metadata's ``storage_data`` (index -> relative path, offset, length), so
    a missing or truncated shard is named here instead of failing inside ``dcp.load``.
    """
    needed: dict[str, int] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if getattr(index, "fqn", None) in names:
            relative = info.relative_path
            needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    for relative, end in sorted(needed.items()):
        path = os.path.join(checkpoint_dir, relative)
        if not os.path.isfile(path):
            raise ExportError(f"{path}: missing (the checkpoint's .metadata lists it)")
        size = os.path.getsize(path)
        if size < end:
            raise ExportError(f"{path}: truncated ({size} bytes; the checkpoint's .metadata needs {end})")


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def export(checkpoint_dir: str, out_dir: str, *, filename: str = "model.safetensors") -> str:
    """Consolidate the model of a DCP checkpoint into one safetensors file in its loaded dtypes.

    Offline (no process group), one tensor in memory at a time: the file's header is
    written from the checkpoint's metadata first, then each tensor's bytes.
    """
    import torch.distributed.checkpoint as dcp

    key, dtypes = _read_sidecar(checkpoint_dir)
    reader = dcp.FileSystemReader(checkpoint_dir)
    metadata = _read_metadata(checkpoint_dir, reader)
    stored = metadata.state_dict_metadata
    entries, offset = [], 0
    for fqn, dtype in dtypes.items():
        name = f"{key}.{fqn}" if key else fqn
        meta = stored.get(name)
        if meta is None or not hasattr(meta, "size"):
            raise ExportError(
                f"{os.path.join(checkpoint_dir, SIDECAR)}: names {fqn!r}, but the checkpoint holds no tensor {name!r}"
            )
        if dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(f"safetensors has no dtype for {fqn} ({dtype})")
        nbytes = meta.size.numel() * dtype.itemsize
        entries.append((fqn, name, meta, dtype, offset, offset + nbytes))
        offset += nbytes
    _check_storage(checkpoint_dir, metadata, {name for _, name, *_ in entries})
    header = {"__metadata__": {"format": "pt"}}
    for fqn, _, meta, dtype, start, end in entries:
        header[fqn] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(meta.size), "data_offsets": [start, end]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    # Note: written under a temporary name beside the output and renamed only when complete,
    # so an existing output is never replaced by a partial one; any failure removes it.
    partial = os.path.join(out_dir, f".{filename}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for _, name, meta, dtype, _, _ in entries:
                master = {name: torch.empty(meta.size, dtype=meta.properties.dtype)}
                try:
                    dcp.load(master, storage_reader=reader, no_dist=True)
                except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
                    reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    raise ExportError(f"{checkpoint_dir}: reading {name!r} failed ({reason})") from None
                tensor = master.pop(name).to(dtype).contiguous().reshape(-1)
                f.write(memoryview(tensor.view(torch.uint8).numpy()))
                del tensor
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
    return path

