"""Ranks of one FSDP2 group must agree on its parameter dtypes before any collective uses them."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from . import _compat
from ._dtype_plan import MixedParamDtypeError


def check_rank_consistency(group: Any) -> None:
    """Fail clearly, on every rank, when ranks disagree on this group's dtypes.

    Note: ranks that all-gather buffers of different dtypes hang or corrupt
    data, so one tiny all-gather of a layout digest here is cheap insurance.
    """
    pg = _compat.group_process_group(group)
    # The fake backend (world-size simulation) moves no data, so there is nothing to compare.
    if pg is None or dist.get_world_size(pg) == 1 or dist.get_backend(pg) == "fake":
        return
    layout = [(str(p.sharded_param.dtype), _compat.fsdp_param_is_trainable(p)) for p in group.fsdp_params]
    device = torch.device("cpu") if dist.get_backend(pg) == "gloo" else group.device
    digest = torch.tensor([zlib.crc32(repr(layout).encode())], dtype=torch.int64, device=device)
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(digests, digest, group=pg)
    if all(torch.equal(d, digest) for d in digests):
        return
    named = [(_compat.fsdp_param_fqn(p), dtype, trainable) for p, (dtype, trainable) in zip(group.fsdp_params, layout)]
    layouts: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(layouts, named, group=pg)
    lines = [
        f"torch_fsdp_ext: ranks disagree on the parameter dtypes of FSDP2 group "
        f"{_compat.group_name(group)!r}; every rank must build the model with the same dtypes "
        "and requires_grad flags before fully_shard:"
    ]
    for entries in zip(*layouts):
        if len({(dtype, trainable) for _, dtype, trainable in entries}) > 1:
            per_rank = ", ".join(f"rank {r}: {dtype}{'' if t else ' (frozen)'}" for r, (_, dtype, t) in enumerate(entries))
            lines.append(f"  {entries[0][0]}: {per_rank}")
    raise MixedParamDtypeError("\n".join(lines))
