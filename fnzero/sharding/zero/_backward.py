"""Binding tensors into a module's parameter tables (`bind`, the one rule), and parameters bound during
backward, for recomputation that happens inside it.

[Note: binding by table entry, as FSDP2 and functional_call]
fnzero binds a parameter (a view of a gathered unit, or the placeholder back) by replacing its entry in
the owning module's own `_parameters` (a buffer: `_buffers`) dict, the entry alone: the dict, the module's
class and its `forward` stay the user's. FSDP2 registers its parameters the same way
(`torch/distributed/fsdp/_fully_shard/_fsdp_param.py`, `unsafe_setattr_param`), as does
`torch.func.functional_call` (`torch/nn/utils/_named_member_accessor.py`, `swap_tensor`); unlike FSDP2's
slow path, never through `setattr`, which refuses a tensor that is not an `nn.Parameter` (a view).
`fnzero.shard` installs the placeholders the same way, at construction (`construct/_initial.py`).

[Note: gradient checkpointing inside a model]
From backward reaching an apply's outputs until it ends (or the run is released), the apply's parameters
are bound again (`specs/sharding.md` §Apply, "Recomputation inside the model").
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ._plan import UnitPlan

__all__ = ["UnitBinder", "BackwardBinding", "bind", "entries", "swap_tensors"]

Entry = tuple[nn.Module, str]  # (owning module, the parameter's or buffer's name in it)


def entries(module: nn.Module, names: Iterable[str]) -> list[Entry]:
    """The table entry of each name (relative to `module`)."""
    out = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        out.append((module.get_submodule(owner) if owner else module, leaf))
    return out


def bind(bound: Iterable[tuple[Entry, torch.Tensor]]) -> list[tuple[Entry, torch.Tensor]]:
    """Put each tensor in its entry (the first Note above): the parameter table's when the name is a
    parameter, else the buffer table's. Returns (entry, what it held), last first, so that
    `bind(returned)` puts everything back (a name bound twice ends as it began)."""
    previous = []
    for (owner, leaf), t in bound:
        table = owner._parameters if leaf in owner._parameters else owner._buffers
        previous.append(((owner, leaf), table[leaf]))
        table[leaf] = t
    previous.reverse()
    return previous


@contextlib.contextmanager
def swap_tensors(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Bind `tensors` (names relative to `module`) for the block; restores on exit. (A unit's hooks
    use it inside the root's call, where functional_call would run the hooks again.)"""
    restore = bind(zip(entries(module, tensors), tensors.values()))
    try:
        yield
    finally:
        bind(restore)


class UnitBinder:
    """Binds one stage-3 unit's gathered views into its modules' parameter tables, and unbinds them.
    `units`: its trainable and frozen parts. `gather() -> (fulls, views)`: each part's full buffer
    by whether it is frozen (gathered once per recomputation, whichever module runs first) and
    their parameter views by state_dict name."""

    def __init__(self, units: list[UnitPlan], root: nn.Module,
                 gather: Callable[[], tuple[dict[bool, torch.Tensor], dict[str, torch.Tensor]]]):
        self.units = units
        self.gather = gather
        self.bound = False
        self.fulls: dict[bool, torch.Tensor] = {}
        self.names = [name for u in units for s in u.slots for name in (s.name, *s.aliases)]
        self.entries = entries(root, self.names)  # where each of them is bound
        self._placeholders: list[tuple[Entry, torch.Tensor]] = []

    def snapshot(self) -> None:
        """Remember what the tables hold when backward starts (the placeholders), to put back."""
        self._placeholders = [((owner, leaf), owner._parameters[leaf]) for owner, leaf in self.entries]

    @property
    def owners(self) -> list[nn.Module]:
        """The modules holding the unit's parameters (each once)."""
        return list({id(owner): owner for owner, _ in self.entries}.values())

    def bind(self) -> None:
        self.fulls, views = self.gather()
        self.bound = True
        bind(zip(self.entries, (views[name] for name in self.names)))

    def unbind(self) -> None:
        if not self.bound:
            return
        self.bound, self.fulls = False, {}
        bind(self._placeholders)


class BackwardBinding:
    """One apply's parameters, bound for the rest of a backward pass (see the Note above). Of two
    applies of one model in one loss, the later one wins while both are bound; bindings come off
    in reverse order, whatever order autograd runs its final callbacks in."""

    def __init__(self, module: nn.Module, root_tensors: dict[str, torch.Tensor], binders: list[UnitBinder],
                 run: Any, bound_runs: list):
        self.module = module
        self.root_tensors = root_tensors
        self.binders = binders
        self.run = run
        self.bound_runs = bound_runs  # the runs bound right now, in binding order (a stack)
        self._stack: contextlib.ExitStack | None = None
        self._released = False

    @property
    def active(self) -> bool:
        return self._stack is not None

    def enter(self) -> None:
        if self._stack is not None or self._released:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(swap_tensors(self.module, self.root_tensors))
        for b in self.binders:
            b.snapshot()
        # A call of any module owning a stage-3 unit's parameters binds the unit first: before its
        # other pre-hooks, so before a unit module's compile window opens (`_unit_hooks.py`), in
        # which dynamo would compile this hook's frame.
        for b in self.binders:
            for owner in b.owners:
                hook = functools.partial(self._bind_before_call, b)
                stack.callback(owner.register_forward_pre_hook(hook, prepend=True).remove)
        for b in self.binders:
            stack.callback(b.unbind)  # runs before the hooks are removed (LIFO)
        stack.callback(self.run.drop_regathered)  # frozen copies no unit input's backward freed
        self.bound_runs.append(self.run)
        stack.callback(self.bound_runs.remove, self.run)
        self._stack = stack

    def _bind_before_call(self, binder: UnitBinder, module: nn.Module, args: tuple) -> None:
        """A forward pre-hook on an owner of `binder`'s unit while this binding is in force (a
        recomputation is calling it); the binding made last serves. Inside a compiled trace the
        unit's eager hooks have bound it already: nothing to do, nothing for dynamo to guard on."""
        if torch.compiler.is_compiling() or binder.bound or not self.bound_runs or self.bound_runs[-1] is not self.run:
            return
        binder.bind()

    def exit(self) -> None:
        if self._stack is None:
            return
        # Bindings made after this one come off first (see the class docstring).
        while self.bound_runs and self.bound_runs[-1] is not self.run:
            later = getattr(self.bound_runs[-1], "backward", None)
            if later is None or not later.active:
                self.bound_runs.pop()
                continue
            later.exit()
        stack, self._stack = self._stack, None
        stack.close()

    def release(self) -> None:
        """Unbind for good and drop every reference (the output hooks keep this object alive)."""
        self.exit()
        self._released = True
        self.root_tensors, self.binders, self.module, self.run = {}, [], None, None

    def enter_until_backward_ends(self, _grad=None) -> None:
        """A tensor hook: bind now, unbind when the backward pass that called it is done."""
        if self._stack is not None or self._released:
            return
        self.enter()
        torch.autograd.Variable._execution_engine.queue_callback(self.exit)
