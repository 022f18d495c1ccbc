"""The dtype fix: an FSDP2 group whose trainable parameters mix dtypes trains, and ships
in the dtypes it was loaded in.

FSDP2's ``FSDPParamGroup._init_mp_dtypes`` asserts one original dtype per group:

    AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}

One concern per module, each importing only those listed before it:

- ``_plan``: a group's dtype plan (which dtypes it mixes, what must never be cast) and the error;
- ``_roots``: the ``fully_shard`` roots that own a module's parameters, found in its own tree;
- ``_loaded_dtypes``: the dtypes a model was loaded in, and state dicts and exports in them;
- ``_mixed_groups``: groups that keep mixed dtypes, and their per-parameter gradient reduction;
- ``_compute_dtype``: per-parameter compute dtype (``param_dtype_override_fn``) on every release;
- ``_optimizer_state``: optimizers see the upcast before they make or load state;
- ``_strategies``: what ``upcast``, ``preserve`` and ``error`` do with a mixed group;
- ``_fix``: the fix's interface, which hooks FSDP2's param groups (``DtypeFix``).
"""

from ._fix import DtypeFix

__all__ = ["DtypeFix"]
