"""Which parameters a chain must see whole, and the chain as it runs on pieces of the others.

At ZeRO stages 1-3 each rank's optimizer state is a flat shard that may cut a tensor anywhere.
An elementwise transform updates a piece of a tensor as if it were a tensor of its own; one that
reads whole tensors (`scale_by_muon`, `scale_by_trust_ratio`, a user's) cannot. The step gives the
parameters such a transform reaches whole to one owning rank each and the others in pieces
(`sharding/zero/_owners.py`, `state/_owner_update.py`); these two functions read what that needs
off the chain's structure, on the parameters' true shapes (specs/optim.md §Muon).
"""

from __future__ import annotations

from ._muon import partition
from ._transform import GradientTransformation, chain

__all__ = ["whole_tensor_names", "routed_by_name"]

Shapes = dict[str, tuple[int, ...]]


def _split(tx: GradientTransformation, shapes: Shapes) -> tuple[Shapes, Shapes]:
    select = tx.route[0]
    inside = {n: s for n, s in shapes.items() if select(n, s)}
    return inside, {n: s for n, s in shapes.items() if n not in inside}


def whole_tensor_names(tx: GradientTransformation, shapes: Shapes) -> set[str]:
    """The parameters (of `shapes`: name -> true shape) that some transform of `tx` reading whole
    tensors receives: a `partition` asks each of its chains about the parameters it routes there;
    any other transform that is not elementwise (a chain with such a part included) needs every
    parameter it is given whole."""
    if tx.elementwise:
        return set()
    if tx.route is not None:
        inside, outside = _split(tx, shapes)
        return whole_tensor_names(tx.parts[0], inside) | whole_tensor_names(tx.parts[1], outside)
    return set(shapes)


def routed_by_name(tx: GradientTransformation, shapes: Shapes) -> GradientTransformation:
    """`tx` with each `partition`'s choice made once, by name, on the true shapes: where a
    parameter arrives as a 1-D piece of a flat shard its shape is not its own, and a `select`
    reading shapes would route the piece elsewhere than the tensor. The same transforms, the same
    state; `tx` itself where it has no partition."""
    if tx.route is not None:
        inside, outside = _split(tx, shapes)
        chosen = frozenset(inside)
        return partition(lambda name, shape: name in chosen, routed_by_name(tx.parts[0], inside),
                         routed_by_name(tx.parts[1], outside), outside_extra=tx.route[1])._replace(name=tx.name)
    if not tx.parts:
        return tx
    parts = tuple(routed_by_name(p, shapes) for p in tx.parts)
    if all(a is b for a, b in zip(parts, tx.parts)):
        return tx
    return chain(*parts)._replace(name=tx.name)
