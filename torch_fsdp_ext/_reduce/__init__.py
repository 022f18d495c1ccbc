"""Reduce: FSDP2's gradients in mixed precision, made, accumulated and reduced as torch 2.15 does.

With ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, releases up to 2.14
make each unsharded gradient in bf16 and upcast it later, on paths that each failed:
accumulation without sync where a gradient first appears on the synchronizing micro-batch,
or with ``set_reduce_scatter_unused_params(True)`` (pytorch#196996)::

    AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got {torch.bfloat16, torch.float32}

a group whose first forward ran frozen (#186998, up to 2.13), and silently the TP all-reduce
of a replicated parameter's gradient, run in bf16 (#190626). 2.15 makes the gradient in
``reduce_dtype`` at its birth (#197203); so does this fix, and the failures above do not arise.

Its parts, one concern per module, each importing only those listed before it:

- ``_grad_dtype``: the unsharded gradient's dtype as 2.15 chooses it, and unused parameters' zeros in it;
- ``_never_ran``: a unit that has not run forward, in a backward without sync (#194058);
- ``_user_grad_dtype``: a ``grad_dtype`` set on a parameter before ``fully_shard`` (#170648);
- ``_fp32_reduction``: the opt-in setting that reduces in fp32 where a policy asks for 16 bits or nothing;
- ``_fix``: the fix's interface, which decides and installs the parts (``ReduceFix``).
"""

from ._fix import ReduceFix

__all__ = ["ReduceFix"]
