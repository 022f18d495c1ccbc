"""A model's decisions cost what its own tree costs, whatever other FSDP2 models are alive.

Every decision of the dtype fix (an optimizer taking the parameters, the first forward, a
second optimizer) finds the ``fully_shard`` roots that own the parameters. Counted here
structurally, not in wall time: the modules the plugin's code walks (``nn.Module.named_modules``,
which ``modules()`` uses), its scans of every live FSDP state (``_compat.fsdp_states``) and the
FSDP parameters it looks at (``_compat.current_module_param``), for a
new model with no other model alive and with 199 others sharded and still undecided (RL: a
reference, a reward and a value model built before the policy's optimizer).
``tools/benchmarks/live_models_cost.py`` measures the times.
"""

from __future__ import annotations

import json

from torch.testing._internal.common_utils import TestCase, run_tests

from common import needs_dtype_fix, plugin_specific, run_python

COUNT_DECISIONS = r"""
import json, sys
import torch, torch.distributed as dist, torch.nn as nn
import torch_fsdp_ext
from torch_fsdp_ext import _compat
from torch_fsdp_ext._compat import fsdp2_api

fully_shard = fsdp2_api().fully_shard
policy = fsdp2_api().MixedPrecisionPolicy(param_dtype=torch.bfloat16)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

def model():
    blocks = [nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.LayerNorm(8)) for _ in range(2)]
    m = nn.Sequential(*blocks)
    for b in blocks:
        fully_shard(b, mp_policy=policy)
    return fully_shard(m, mp_policy=policy)

counts = {"modules walked": 0, "scans of all FSDP states": 0, "parameters looked at": 0}
named_modules, fsdp_states, current_module_param = (
    nn.Module.named_modules, _compat.fsdp_states, _compat.current_module_param
)

def called_by_plugin():
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "torch.nn.modules.module":  # modules()
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("torch_fsdp_ext")

def counting_named_modules(self, *args, **kwargs):
    for item in named_modules(self, *args, **kwargs):
        if called_by_plugin():  # torch's own walks (the optimizer's, FSDP's) are what they are without it
            counts["modules walked"] += 1
        yield item

def counting_fsdp_states():
    counts["scans of all FSDP states"] += 1
    return fsdp_states()

def counting_current_module_param(fsdp_param):
    counts["parameters looked at"] += 1
    return current_module_param(fsdp_param)

nn.Module.named_modules, _compat.fsdp_states = counting_named_modules, counting_fsdp_states
_compat.current_module_param = counting_current_module_param
others = [model() for _ in range(LIVE_MODELS - 1)]
m = model()
phases = {}
def phase(name, fn):
    for key in counts:
        counts[key] = 0
    out = fn()
    phases[name] = dict(counts)
    return out
optimizer = phase("first optimizer", lambda: torch.optim.AdamW(m.parameters()))
phase("first step", lambda: (m(torch.randn(2, 8)).float().sum().backward(), optimizer.step()))
phase("second optimizer", lambda: torch.optim.AdamW(m.parameters()))
assert m[0][0].weight.dtype == torch.float32  # the upcast happened
print(json.dumps(phases))
"""


# Meta init, then every parameter replaced by load_state_dict(assign=True), then an optimizer that makes its
# state in its constructor (Adagrad): the optimizer must still find the model's group (by the new parameters).
ASSIGNED_THEN_ADAGRAD = r"""
import json
import torch, torch.distributed as dist, torch.nn as nn
import torch_fsdp_ext
from torch_fsdp_ext._compat import fsdp2_api

fully_shard = fsdp2_api().fully_shard
policy = fsdp2_api().MixedPrecisionPolicy(param_dtype=torch.bfloat16)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

class Mixed(nn.Module):  # its FSDP module holds its parameters itself
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
        self.g = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return (x.to(self.w.dtype) @ self.w).float() * self.g

torch.manual_seed(0)
source = fully_shard(Mixed(), mp_policy=policy)
torch_fsdp_ext.uninstall()
loaded = source.state_dict()  # in the dtypes as loaded
reference = Mixed()  # the workaround: model.float() before fully_shard
reference.load_state_dict({k: v.full_tensor() for k, v in loaded.items()})
fully_shard(reference.float(), mp_policy=policy)
reference_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
torch_fsdp_ext.install()
with torch.device("meta"):
    model = Mixed()
fully_shard(model, mp_policy=policy)
model.load_state_dict(loaded, assign=True)
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
dtypes = [str(p.dtype) for p in model.parameters()]
x = torch.randn(4, 8)
for m, opt in ((model, optimizer), (reference, reference_optimizer)):
    m(x).sum().backward()
    opt.step()
same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), reference.parameters()))
loaded_dtypes = sorted({str(v.dtype) for v in loaded.values()})
print(json.dumps({"loaded": loaded_dtypes, "dtypes after the optimizer": dtypes, "step equals the workaround": same}))
"""


def decisions(live_models: int) -> dict:
    done = run_python(COUNT_DECISIONS.replace("LIVE_MODELS", str(live_models)), timeout=300)
    if done.returncode != 0:
        raise AssertionError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@plugin_specific
@needs_dtype_fix
class LiveModelsTest(TestCase):
    def test_decisions_walk_only_their_own_model(self) -> None:
        alone, crowded = decisions(1), decisions(200)
        self.assertEqual(crowded, alone)
        for phase, counts in alone.items():
            self.assertEqual(counts["scans of all FSDP states"], 0, phase)
        self.assertGreater(alone["first optimizer"]["modules walked"], 0)  # the counter sees the plugin's walks

    def test_optimizer_finds_parameters_put_in_place_by_assign(self) -> None:
        done = run_python(ASSIGNED_THEN_ADAGRAD, timeout=300)
        self.assertEqual(done.returncode, 0, done.stderr[-4000:])
        self.assertEqual(
            json.loads(done.stdout.strip().splitlines()[-1]),
            {"loaded": ["torch.bfloat16", "torch.float32"], "dtypes after the optimizer": ["torch.float32"] * 2,
             "step equals the workaround": True},
        )


if __name__ == "__main__":
    run_tests()
