"""``state_dict_as_loaded`` of a bf16 model with fp32 norms, one gloo rank: prints the dtypes it gave.

    python test/scripts/save_as_loaded.py [--deprecated-gather]

``--deprecated-gather`` makes the plugin gather through ``torch.distributed.all_gather_into_tensor``, as it did
before, for test/test_own_warnings.py to show that its check sees a deprecated call made by the plugin.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import torch_fsdp_ext
from torch_fsdp_ext import _compat

if "--deprecated-gather" in sys.argv:
    def all_gather_into_tensor(output, input, group=None):
        dist.all_gather_into_tensor(output, input, group=group)

    _compat.all_gather_single = all_gather_into_tensor

with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    model[0].to(torch.bfloat16)
    fully_shard(model)
    torch.optim.AdamW(model.parameters())  # the plugin upcasts here
    state_dict = torch_fsdp_ext.state_dict_as_loaded(model)
    print(sorted({str(tensor.dtype) for tensor in state_dict.values()}))
    dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
