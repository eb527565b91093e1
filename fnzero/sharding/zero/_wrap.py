"""The default wrap policy: which modules of a model are units (`specs/sharding.md` §Plan, Units)."""

from __future__ import annotations

from torch import nn

__all__ = ["default_unit_modules", "no_split_classes", "embedding_units"]


def default_unit_modules(model: nn.Module) -> list[str]:
    """The default unit modules' paths: each layer (`_no_split_modules`) and the untied embedding and
    head, else each direct child holding parameters, containers opened (`specs/sharding.md` §Plan)."""
    layer_classes = no_split_classes(model)
    if layer_classes:
        layers = _layer_units(model, layer_classes)
        return _in_model_order(model, layers + embedding_units(model, layers))
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    return _walk(model, lambda m: not isinstance(m, containers) if any(True for _ in m.parameters()) else None)


def no_split_classes(model: nn.Module) -> set[str]:
    """Class names the model declares as layers not to split (`_no_split_modules`, any submodule)."""
    names: set[str] = set()
    for m in model.modules():
        declared = getattr(m, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(n for n in declared if isinstance(n, str))
    present = {type(m).__name__ for m in model.modules()}
    return names & present


def _layer_units(model: nn.Module, layer_classes: set[str]) -> list[str]:
    """Each layer (outermost, in module order); the rest stays in the root, as FSDP's transformer
    wrap policy leaves it: code outside a module may read its parameters, which only the root allows."""
    return _walk(model, lambda m: type(m).__name__ in layer_classes)


def _walk(model: nn.Module, is_unit) -> list[str]:
    """The paths of the modules, outermost first in module order, for which `is_unit` says True;
    a module it says False of is opened, one it says None of left out."""
    out: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            unit = is_unit(child)
            if unit:
                out.append(f"{prefix}{name}")
            elif unit is not None:
                visit(f"{prefix}{name}.", child)

    visit("", model)
    return out


def embedding_units(model: nn.Module, layers: list[str]) -> list[str]:
    """The paths of the model's input embedding and output head as units of their own, both or
    neither: neither when tied or when either lies inside a layer or encloses one (`specs/sharding.md`
    §Plan, Units)."""
    pair = _embedding_pair(model)
    if pair is None:
        return []
    embedding, head = pair
    if {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}:
        return []  # tied
    paths = {id(m): path for path, m in model.named_modules() if path}
    chosen = [paths.get(id(embedding)), paths.get(id(head))]
    for path in chosen:
        if path is None or not any(True for _ in model.get_submodule(path).parameters()):
            return []
        if any(_encloses(path, layer) or _encloses(layer, path) for layer in layers):
            return []
    return chosen  # type: ignore[return-value]


def _embedding_pair(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(input embedding, output head) of the outermost module that names both as modules, or None."""
    for m in model.modules():
        try:
            pair = (m.get_input_embeddings(), m.get_output_embeddings())
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            continue  # not a transformers model, or one that names no embeddings
        if all(isinstance(x, nn.Module) for x in pair):
            return pair  # type: ignore[return-value]
        if pair[0] is not None:
            return None  # the model's own answer: no head (a base model)
    return None


def _encloses(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer + ".")


def _in_model_order(model: nn.Module, paths: list[str]) -> list[str]:
    # A path named_modules skips (a module registered twice) keeps its place after the others.
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted(dict.fromkeys(paths), key=lambda p: order.get(p, len(order)))
