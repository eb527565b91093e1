"""Parameters bound during backward, for recomputation that happens inside it.

[Note: gradient checkpointing inside a model]
`apply` binds the parameters into the module only while its forward runs; outside it the module
holds meta placeholders. Activation checkpointing that the *model* does itself (transformers'
`gradient_checkpointing_enable()`, `torch.utils.checkpoint` in a user's block, torch's
`checkpoint_wrapper`) runs part of the forward again during backward, reading the module's
attributes, long after `apply` returned. So from the moment backward reaches an apply's outputs
until that backward ends, the apply's parameters are bound again, as FSDP2 re-unshards a module
before its backward:

* the root tensors (every gathered unit's views, frozen parameters, buffers) are swapped back in,
  the same differentiable views the forward used: with reentrant checkpointing, whose inner
  backward accumulates into the leaves it reaches, gradients reach the step's aliases as usual;
* a stage-3 unit's parameters are not gathered up front: its modules get a parameter table whose
  first read gathers the unit (the copy re-gathered for its backward, cached) and binds its views,
  differentiably with respect to the shard. Units no recomputation reads cost nothing. The unit's
  reduce-scatter (`_GatherUnit.backward`, of the first forward's gather or, with reentrant
  checkpointing, of the recomputation's) unbinds it again, so one unit is gathered at a time.

The binding ends with the backward pass that entered it (autograd's final callback), or when the
run is released, whichever comes first.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from ._plan import UnitPlan

__all__ = ["LazyParameters", "UnitBinder", "BackwardBinding", "swap_tensors"]


@contextlib.contextmanager
def swap_tensors(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Temporarily make `module`'s parameters (relative names) be `tensors`; restores on exit.

    This is what torch.func.functional_call does for the root; units need it for a submodule whose
    own `forward` is wrapped, where functional_call would recurse into the wrapper.
    """
    saved = []
    try:
        for name, t in tensors.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            table = owner._parameters if leaf in owner._parameters else owner._buffers
            # dict's own methods: reading a `LazyParameters` entry to save it must not gather it.
            saved.append((table, leaf, dict.__getitem__(table, leaf)))
            dict.__setitem__(table, leaf, t)
        yield
    finally:
        for table, leaf, old in reversed(saved):
            dict.__setitem__(table, leaf, old)


class LazyParameters(dict):
    """A module's `_parameters` while backward runs: reading an entry of a stage-3 unit that is
    not bound yet asks its binder to gather the unit first. Everything else is a plain dict."""

    __slots__ = ("binders",)

    def __init__(self, table: dict, binders: dict[str, "UnitBinder"]):
        super().__init__(table)
        self.binders = binders  # leaf name -> the binder of the unit it belongs to

    def __getitem__(self, key):
        binder = self.binders.get(key)
        if binder is not None and not binder.bound:
            binder.bind()
        return dict.__getitem__(self, key)


class UnitBinder:
    """Binds one stage-3 unit's gathered views into its modules' lazy tables, and unbinds them."""

    def __init__(self, unit: UnitPlan, root: nn.Module, gather: Callable[[], dict[str, torch.Tensor]]):
        self.unit = unit
        self.gather = gather  # -> the unit's views by state_dict name, gathered for backward
        self.bound = False
        self.tables: dict[str, tuple[nn.Module, str]] = {}  # state_dict name -> (owner, leaf)
        for slot in unit.slots:
            for name in (slot.name, *slot.aliases):
                owner, _, leaf = name.rpartition(".")
                self.tables[name] = (root.get_submodule(owner) if owner else root, leaf)
        self._placeholders: dict[str, Any] = {}

    def bind(self) -> None:
        views = self.gather()
        self.bound = True
        for name, (owner, leaf) in self.tables.items():
            table = owner._parameters
            self._placeholders.setdefault(name, dict.__getitem__(table, leaf))
            dict.__setitem__(table, leaf, views[name])

    def unbind(self) -> None:
        if not self.bound:
            return
        self.bound = False
        for name, (owner, leaf) in self.tables.items():
            dict.__setitem__(owner._parameters, leaf, self._placeholders[name])


class BackwardBinding:
    """One apply's parameters, bound for the rest of a backward pass (see the Note above)."""

    def __init__(self, module: nn.Module, root_tensors: dict[str, torch.Tensor], binders: list[UnitBinder],
                 run: Any, bound_runs: list):
        self.module = module
        self.root_tensors = root_tensors
        self.binders = binders
        self.run = run
        self.bound_runs = bound_runs  # the runs bound right now, where stage-3 unit wrappers look
        self._stack: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        return self._stack is not None

    def enter(self) -> None:
        if self._stack is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(swap_tensors(self.module, self.root_tensors))
        # Lazy tables on every module that owns a stage-3 unit's parameters.
        by_owner: dict[int, tuple[nn.Module, dict[str, UnitBinder]]] = {}
        for b in self.binders:
            for owner, leaf in b.tables.values():
                by_owner.setdefault(id(owner), (owner, {}))[1][leaf] = b
        for owner, leaves in by_owner.values():
            original = owner._parameters
            owner.__dict__["_parameters"] = LazyParameters(original, leaves)
            stack.callback(owner.__dict__.__setitem__, "_parameters", original)
        for b in self.binders:
            stack.callback(b.unbind)  # runs before the tables are restored (LIFO)
        self.bound_runs.append(self.run)
        stack.callback(self.bound_runs.remove, self.run)
        self._stack = stack

    def exit(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def enter_until_backward_ends(self, _grad=None) -> None:
        """A tensor hook: bind now, unbind when the backward pass that called it is done."""
        if self._stack is not None:
            return
        self.enter()
        torch.autograd.Variable._execution_engine.queue_callback(self.exit)
