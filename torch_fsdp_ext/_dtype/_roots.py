"""The ``fully_shard`` roots of a module (Note [Scope of the upcast] in ``_fix``), found in its own tree.

A root is a top-most module with FSDP state (no ``fully_shard``-ed ancestor). Every
decision of the dtype fix (an optimizer taking parameters, a first forward, a state
dict, ``upcast_now``) starts from a module and needs the roots that own its parameters.

Note: cost. Modules do not know their parents, so finding the ``fully_shard``-ed
ancestor of a module by looking at every live FSDP state costs O(all live models) per
decision: with 1,000 live models a first optimizer took seconds. So each
``fully_shard`` records, for every module below the one it shards, that module as its
owner (``FSDPState.init`` runs once per ``fully_shard``; a walk of its own tree). FSDP
shards bottom-up, so an owner that is sharded later into a larger model is found again
as owned: the chain of owners ends at the root. A decision then costs O(its module's
tree). The index keys modules weakly and holds its owners weakly: nothing is attached
to a module, and an entry goes with its module. Only states of one module are owners,
as only they can be roots (``fully_shard([a, b])`` makes no root).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import _compat


class RootIndex:
    """module -> the module of the innermost ``fully_shard`` above it, for every sharded tree."""

    def __init__(self) -> None:
        self._owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> weakref(owner module)

    def register(self, state: Any) -> None:
        """``state`` was just made by ``fully_shard`` (or met at install): its module owns its tree."""
        top = _compat.root_module_of(state)
        if top is None or _compat.fsdp_state_of(top) is not state:
            return
        owner = weakref.ref(top)
        for module in top.modules():
            if module is not top:
                self._owner[module] = owner

    @staticmethod
    def _is_sharded_alone(module: torch.nn.Module) -> bool:
        state = _compat.fsdp_state_of(module)
        return state is not None and _compat.root_module_of(state) is module

    def root_of(self, module: torch.nn.Module) -> torch.nn.Module | None:
        """The root whose tree holds ``module`` (``module`` itself if it is one), or None."""
        top, owner = None, self._owner.get(module)
        if owner is None:
            return module if self._is_sharded_alone(module) else None
        seen = {id(module)}
        while owner is not None:
            parent = owner()
            if parent is None or id(parent) in seen:
                break
            top = parent
            seen.add(id(parent))
            owner = self._owner.get(parent)
        return top

    def roots_of(self, modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """The roots that own parameters of ``modules``: each one's root, or the roots inside it.

        A module that is neither (one that ``fully_shard([a, b])`` lists with others, or one
        with no FSDP module at all) stands for itself, decided on its own tree.
        """
        roots: list[torch.nn.Module] = []

        def add(root: torch.nn.Module) -> None:
            if not any(root is r for r in roots):
                roots.append(root)

        for module in modules:
            root = self.root_of(module)
            if root is not None:
                add(root)
                continue
            inside = [
                self.root_of(sub) for sub in module.modules() if sub is not module and self._is_sharded_alone(sub)
            ]
            for root in inside:
                if root is not None:
                    add(root)
            if not any(root is not None for root in inside):
                add(module)
        return roots


# Note: kept across ``importlib.reload`` (as ``_fix._keeper``), so that what was registered stays.
index: RootIndex = globals().get("index") or RootIndex()
