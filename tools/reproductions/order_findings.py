"""The orders that once diverged from the hand workaround (model.float() before fully_shard), each run on
the plugin found on PYTHONPATH against that workaround, on 2 gloo ranks:

    PYTHONPATH=<a checkout> torchrun --nproc-per-node 2 tools/reproductions/order_findings.py

It prints one line per order: "trains bit for bit as the workaround", or what went wrong. Orders 9 and 10
(the plugin installed after weights were loaded) cannot train as the workaround: their line says whether the
plugin said so.
test/test_orders.py asserts the same orders (and generates many more).
"""
import os, sys, tempfile, unittest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "test"))
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
import logging, torch, torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict
import torch_fsdp_ext
print("plugin at", torch_fsdp_ext.__file__) if rank == 0 else None
import test_orders as T
import test_scope as S
t = unittest.TestCase()

def pair(): return T.Run(False, rank), T.Run(True, rank)

def compare(runs):
    T.assert_trains_as_workaround(t, *runs)

def f1():
    path = [tempfile.mkdtemp()]; dist.broadcast_object_list(path)
    first = pair()
    for i, run in enumerate(first):
        run.make_optimizer("adamw"); run.train_step(); run.train_step(); run.dcp_save(path[0] + str(i), True)
    resumed = pair()
    for i, (run, before) in enumerate(zip(resumed, first)):
        run.make_optimizer("adamw"); run.dcp_load(path[0] + str(i), True)
        run.step, run.losses = before.step, list(before.losses)
        run.train_step(); run.train_step()
    compare(resumed)

def f2():
    source = pair()
    for run in source:
        run.make_optimizer("adamw"); run.train_step(); run.get("both", T.FULL)
    resumed = pair()
    for run, before in zip(resumed, source):
        run.make_optimizer("adamw"); run.saved = {"both": before.saved["both"]}; run.set("both", T.FULL); run.train_step()
    compare(resumed)

def f3():
    runs = pair()
    runs[0].model.state_dict()  # the upcast moment
    for run in runs:
        run.model.to("cpu"); run.make_optimizer("adamw"); run.train_step()
    compare(runs)

def f4():
    runs = pair()
    for run in runs:
        run.make_optimizer("adagrad"); run.train_step(); run.train_step()
    compare(runs)

def f5():
    runs = pair()
    for run in runs:
        run.set_embed_trainable(False); run.make_optimizer("adamw"); run.train_step()
        run.set_embed_trainable(True); run.train_step(); run.train_step()
    compare(runs)

def f6():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    model = T.seed_000_model()
    convert_to_float8_training(model.layers[0], config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda module, fqn: fqn == "wq")
    loaded = {n: p.dtype for n, p in model.named_parameters()}
    T.shard_model(model, mp_policy=T.MP)
    try:
        model(T.batch(rank))
    except T.MixedParamDtypeError:
        pass
    changed = [n for n, p in model.named_parameters() if p.dtype != loaded[n]]
    assert not changed, f"refused, yet {len(changed)} parameters were cast (e.g. {changed[0]})"

def against_workaround(mine, workaround):
    if not S.equal(mine, workaround):
        raise AssertionError(f"differs from the workaround, silently: max |param - workaround's| {S.max_difference(mine, workaround):.1e}")

def f7():  # issue 43: two fully_shard roots under one plain container, set_model_state_dict(container) first
    source = nn.ModuleDict({"policy": S.fp32_model(1), "value": S.fp32_model(2)}).state_dict()
    results = []
    for workaround in (False, True):
        container = S.policy_and_value(workaround)
        set_model_state_dict(container, source, options=S.FULL)
        results.append(S.train(container, list(container.values()), rank))
    against_workaround(*results)

def f8(load):  # issue 43: fp32 weights into one block of a model whose blocks are uniform bf16, then AdamW
    results = []
    for workaround in (False, True):
        model = S.bf16_model_with_fp32_norm()
        S.shard_model(model.float() if workaround else model, mp_policy=T.MP)
        load(model)
        results.append(S.train(model, [model], rank))
    against_workaround(*results)

source = S.fp32_model(1)
block = {k.removeprefix("layers.0."): v for k, v in source.state_dict().items() if k.startswith("layers.0.")}
torch_fsdp_ext.uninstall()
sharded_block = S.shard_model(S.fp32_model(1)).layers[0].state_dict()
torch_fsdp_ext.install()

class Said(logging.Handler):
    said = 0
    def emit(self, record): Said.said += S.LATE in record.getMessage()
logging.getLogger("torch_fsdp_ext").addHandler(Said())

def f9():  # issue 43: fully_shard, fp32 masters loaded (full state dict), then the install, then AdamW
    torch_fsdp_ext.uninstall()
    masters = get_model_state_dict(T.shard_model(S.fp32_model(1)), options=S.FULL)
    model = T.shard_model(T.seed_000_model(0), mp_policy=T.MP)
    set_model_state_dict(model, masters, options=S.FULL)
    Said.said = 0
    torch_fsdp_ext.install()
    mine = S.train(model, [model], rank)
    workaround = T.shard_model(T.seed_000_model(0).float(), mp_policy=T.MP)
    set_model_state_dict(workaround, masters, options=S.FULL)
    workaround = S.train(workaround, [workaround], rank)
    said = "; the upcast said the install came late" if Said.said else "; nothing said"
    if not S.equal(mine, workaround):
        raise AssertionError(f"differs from the workaround (rounded before the install): max |Δparam| "
                             f"{S.max_difference(mine, workaround):.1e}{said}")

def f10():  # issue 43: a full resume (model and AdamW) before the install, then the install, then the step
    torch_fsdp_ext.uninstall()
    try:
        trained = T.shard_model(T.seed_000_model(0).float(), mp_policy=T.MP)
        S.train(trained, [trained], rank, steps=1)
        model_state, optim_state = get_state_dict(trained, torch.optim.AdamW(trained.parameters()), options=S.FULL)
        model = T.shard_model(T.seed_000_model(0), mp_policy=T.MP)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=S.FULL)
    finally:
        torch_fsdp_ext.install()
    tokens = T.batch(rank)
    T.lm_loss(model(tokens), tokens).backward()
    optimizer.step()

for name, f in [("1 optimizer-first DCP resume", f1), ("2 full-state-dict set_state_dict", f2), ("3 model.to('cpu') after the upcast", f3), ("4 Adagrad before the first forward", f4), ("5 unfrozen after the first forward", f5), ("6 a group no upcast can fix", f6),
                ("7 two roots under one container, set_model_state_dict(container) before AdamW", f7),
                ("8a fp32 weights via set_model_state_dict(model.layers[0]) before AdamW", lambda: f8(lambda m: set_model_state_dict(m.layers[0], block, options=S.FULL))),
                ("8b fp32 weights via model.layers[0].load_state_dict before AdamW", lambda: f8(lambda m: m.layers[0].load_state_dict(sharded_block))),
                ("9 installed after fully_shard and a full-state-dict load", f9),
                ("10 installed after a full resume", f10)]:
    try:
        f(); result = "trains bit for bit as the workaround" if f is not f6 else "refused, model as loaded"
    except Exception as e:
        result = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    if rank == 0: print(f"finding {name}: {result}", flush=True)
# Note: the end docs/reliability.md recommends ("Abort at exit"), written out: the checkout under test may
# predate torch_fsdp_ext._rank_end.
dist.barrier()
dist.destroy_process_group()
sys.stderr.flush()
os._exit(0)
