"""The orders that once diverged from the hand workaround (model.float() before fully_shard), each run on
the plugin found on PYTHONPATH against that workaround, on 2 gloo ranks:

    PYTHONPATH=<a checkout> torchrun --nproc-per-node 2 tools/order_findings.py

It prints one line per order: "trains bit for bit as the workaround", or what went wrong.
test/test_orders.py asserts the same orders (and generates many more).
"""
import os, sys, tempfile, unittest
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test"))
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
import torch_fsdp_ext
print("plugin at", torch_fsdp_ext.__file__) if rank == 0 else None
import test_orders as T
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

for name, f in [("1 optimizer-first DCP resume", f1), ("2 full-state-dict set_state_dict", f2), ("3 model.to('cpu') after the upcast", f3), ("4 Adagrad before the first forward", f4), ("5 unfrozen after the first forward", f5), ("6 a group no upcast can fix", f6)]:
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
