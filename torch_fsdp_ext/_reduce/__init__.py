"""Reduce: FSDP2's gradient reduction in mixed precision, as torch 2.15 reduces.

With ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, releases up to 2.14
fail in ``FSDPParamGroup.post_backward``'s reduce on paths an ordinary fp32 model takes:

- gradient accumulation without sync where a parameter's gradient first appears on the
  synchronizing micro-batch, or an unused parameter's zero placeholder joins the reduce
  (``set_reduce_scatter_unused_params(True)``): the accumulated gradients are already in
  the reduce dtype and the fresh ones in the compute dtype (pytorch#196996, #160279)::

      AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got {torch.bfloat16, torch.float32}

- a group whose first forward ran with every parameter frozen, then unfrozen and trained:
  its reduce and original dtypes were never resolved (pytorch#186998, fixed in 2.14)::

      RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'

- with tensor parallel, a TP-replicated parameter's gradient (a ``SequenceParallel`` norm, a
  router) is all-reduced over the TP mesh in the compute dtype, silently (pytorch#190626).

The fix is made of parts, each probed and installed alone (``_fix`` describes their
interface), one concern per module, each importing only those listed before it:

- ``_grad_dtypes``: the part that brings a group's gradients to the reduce dtype before the copy-in;
- ``_frozen_first_forward``: the part that resolves a group's dtypes when its first forward ran frozen;
- ``_tp``: the part that all-reduces a TP-replicated parameter's gradient in the reduce dtype;
- ``_foreach_reduce``: the one wrapper of ``foreach_reduce`` in which the first two parts run;
- ``_fix``: the fix's interface, which decides and installs the parts (``ReduceFix``).
"""

from ._fix import ReduceFix

__all__ = ["ReduceFix"]
