"""A pipeline model: a list of layers, the loss at its end, and how it is cut into stages; it builds
only the stage a rank runs, so no rank holds the whole model (`specs/mesh.md` §Pipeline)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..._errors import ConfigError, ShardingError
from ._partition import stage_bounds
from ..zero import remat

__all__ = ["LayerSpec", "PipelineInfo", "PipelineModule", "PipelineStage", "TiedWeight", "find_ties"]


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """This rank's place in a pipeline: its stage, the stage count, its pipeline's collectives (ranks
    by stage), the loss, its layers' range, and the whole job's collectives (for checkpoints)."""

    # Why a step with this axis cannot run as one graph (`fnzero.jit(scope="step")`).
    not_traceable = "a pipeline schedule sends activations between its stages' forwards"

    stage_index: int
    stages: int
    comm: Any
    loss_fn: Callable[[Any, Any], Any]
    layers: tuple[tuple[int, int], ...]  # the layer range of each of this rank's chunks
    world: Any = None
    ties: tuple = ()  # TiedWeight per weight shared across stages

    @property
    def chunks(self) -> int:
        """Virtual stages per rank (1 but for the interleaved schedule)."""
        return len(self.layers)

    def first(self, chunk: int = 0) -> bool:
        """Whether this rank's `chunk` is the model's first (it reads the inputs)."""
        return self.stage_index == 0 and chunk == 0

    def last(self, chunk: int = 0) -> bool:
        """Whether this rank's `chunk` is the model's last (it computes the loss)."""
        return self.stage_index == self.stages - 1 and chunk == self.chunks - 1


class LayerSpec:
    """A layer not built yet: `typename(*args, **kwargs)`, called only by the stage that runs it
    (DeepSpeed's LayerSpec)."""

    def __init__(self, typename: type, *args: Any, **kwargs: Any):
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise ShardingError(f"LayerSpec needs a torch.nn.Module class, got {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class PipelineModule:
    """`layers` (modules, `LayerSpec`s built only on the stage running them, or parameter-free
    callables) run in order, each given the previous one's output; `loss_fn(outputs, labels)` gives
    a micro-batch's mean loss. `num_stages` (default: the config's or the mesh's) cut by
    `partition_method` (`parameters`, `uniform`, `type:<regex>`, or the layers starting stages 1,
    2, ...); `activation_checkpoint_interval`: remat every run of that many layers; `seed_layers`;
    `virtual_stages`: chunks per rank for the interleaved schedule; `names_from`: the model the
    layers were cut from, whose names the parameters keep. `specs/mesh.md` §Pipeline.

    Give it to `fnzero.shard(pipe, config=cfg)`; `fnzero.pipeline_loss(sm)` is then the loss of
    `fnzero.train_step`, and a batch is the pair `(inputs, labels)`.
    """

    def __init__(self, layers: Sequence[Any], loss_fn: Callable[[Any, Any], Any], *, num_stages: int | None = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 seed_layers: bool = False, base_seed: int = 1234, names_from: nn.Module | None = None,
                 virtual_stages: int = 1):
        layers = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        if not layers:
            raise ShardingError("a PipelineModule needs at least one layer")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (nn.Module, LayerSpec)) or callable(layer)):
                raise ShardingError(f"pipeline layer {i} is a {type(layer).__name__}, not a module, LayerSpec or callable")
        if not callable(loss_fn):
            raise ShardingError("a PipelineModule needs loss_fn(outputs, labels) -> scalar loss")
        for what, v in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{what} must be a positive integer, got {v!r}")
        if isinstance(activation_checkpoint_interval, bool) or not isinstance(activation_checkpoint_interval, int) \
                or activation_checkpoint_interval < 0:
            raise ConfigError(f"activation_checkpoint_interval must be an integer >= 0, got {activation_checkpoint_interval!r}")
        self.layers, self.loss_fn, self.num_stages, self.virtual_stages = layers, loss_fn, num_stages, virtual_stages
        self.partition_method, self.activation_checkpoint_interval = partition_method, activation_checkpoint_interval
        self.seed_layers, self.base_seed = bool(seed_layers), int(base_seed)
        self.names = {id(m): n for n, m in names_from.named_modules() if n} if names_from is not None else {}
        self.source = names_from

    def param_counts(self) -> list[int]:
        """Trainable parameters per layer (a LayerSpec is built, counted and dropped)."""
        counts = []
        for layer in self.layers:
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad)
                          if isinstance(module, nn.Module) else 0)
        return counts

    def bounds(self, num_stages: int) -> list[int]:
        """Layer boundaries of `num_stages` stages, or chunks with virtual stages (stage s runs
        layers [b[s], b[s+1]))."""
        by_params = isinstance(self.partition_method, str) and self.partition_method.lower() == "parameters"
        counts = self.param_counts() if by_params else [0] * len(self.layers)
        return stage_bounds(self.partition_method, self.layers, num_stages, counts)

    def stage(self, stage_id: int, num_stages: int, checkpoint_interval: int | None = None,
              seed_layers: bool = False) -> "PipelineStage":
        """Stage `stage_id` of `num_stages` as a module (its LayerSpecs built, `.ties` the weights it
        shares with other stages); `seed_layers` turns seeding on as the module's own flag does."""
        v = self.virtual_stages
        b = self.bounds(num_stages * v)  # with virtual stages, chunk c·p + s is rank s's chunk c
        chunks = [(b[c * num_stages + stage_id], b[c * num_stages + stage_id + 1]) for c in range(v)]
        interval = self.activation_checkpoint_interval if checkpoint_interval is None else checkpoint_interval
        seed = self.base_seed if self.seed_layers or seed_layers else None
        stage = PipelineStage(self.layers, chunks, interval, seed, self.names)
        owner = {i: c % num_stages for c in range(num_stages * v) for i in range(b[c], b[c + 1])}
        stage.ties = find_ties(self.layers, owner, stage_id, self.names)
        if self.source is not None:
            # AutoTP's built-in plan is the model's (its type, its config's head counts); kept out of
            # the module tree (`__dict__`), which must hold only this stage's layers.
            stage.__dict__["plan_source"] = self.source
            if getattr(self.source, "config", None) is not None:
                stage.__dict__["config"] = self.source.config
        return stage


@dataclasses.dataclass(frozen=True)
class TiedWeight:
    """A parameter shared by layers of different stages (`specs/mesh.md` §Pipeline): its element
    count, the stages holding it, and this stage's module owning it (None when not held here)."""

    numel: int
    stages: tuple[int, ...]
    module: str | None


def find_ties(layers: list, stage_of: dict[int, int], stage_id: int, names: dict | None = None) -> tuple[TiedWeight, ...]:
    """The parameters held by layers of more than one stage (`stage_of`: layer -> its stage), in the
    order of first use (`names`: module id -> its name in the model)."""
    names = names or {}
    uses: dict[int, list[tuple[int, str, nn.Module, torch.Tensor]]] = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            continue
        for path, module in layer.named_modules():
            for p in module.parameters(recurse=False):
                where = names.get(id(module)) or (f"{i}.{path}" if path else str(i))
                uses.setdefault(id(p), []).append((stage_of[i], where, module, p))
    ties = []
    for found in uses.values():
        stages = tuple(sorted({s for s, *_ in found}))
        if len(stages) < 2:
            continue
        mine = next(((path, module) for s, path, module, _ in found if s == stage_id), None)
        if mine is not None and sum(1 for _ in mine[1].parameters()) != 1:
            raise ShardingError(
                f"pipeline module {mine[0]!r} holds a weight shared with another stage and other parameters too; "
                "fnzero keeps a tied weight as a unit of its own, so its module must hold only it (move the "
                "others, e.g. a bias, to another module)")
        ties.append(TiedWeight(found[0][3].numel(), stages, mine[0] if mine is not None else None))
    return tuple(ties)


class PipelineStage(nn.Module):
    """A rank's layers of a pipeline: one range `[lo, hi)`, or one per chunk (`chunks`), registered
    under their names in the model (`names`: module id -> name) where known, else by layer index.
    `unit_paths`: the modules `shard` makes units."""

    def __init__(self, layers: list, chunks: list[tuple[int, int]], checkpoint_interval: int = 0,
                 base_seed: int | None = None, names: dict | None = None):
        super().__init__()
        self.chunks, self.checkpoint_interval = [tuple(c) for c in chunks], checkpoint_interval
        self._fns: list[Callable[[Any], Any]] = []  # every chunk's layers, in order
        self.unit_paths: list[str] = []
        for lo, hi in self.chunks:
            for i in range(lo, hi):
                layer = _build(layers[i], None if base_seed is None else base_seed + i)
                if isinstance(layer, nn.Module):
                    for path, module in _placements(i, layer, names or {}):
                        if _register(self, path, module) and any(True for _ in module.parameters()):
                            self.unit_paths.append(path)
                self._fns.append(layer)

    def replace_module(self, old: nn.Module, new: nn.Module) -> None:
        """Put `new` wherever this stage's layers hold `old` (AutoTP replaces modules by name in
        the stage's tree; a layer wrapping the model's modules holds its own references)."""
        for i, f in enumerate(self._fns):
            if f is old:
                self._fns[i] = new
            elif isinstance(f, nn.Module):
                for m in f.modules():
                    for name, child in list(m._modules.items()):
                        if child is old:
                            m._modules[name] = new

    def forward(self, x: Any, chunk: int = 0) -> Any:
        start = sum(hi - lo for lo, hi in self.chunks[:chunk])
        lo, hi = self.chunks[chunk]
        fns = self._fns[start:start + hi - lo]
        step = self.checkpoint_interval
        if step <= 0 or not self.training:
            for f in fns:
                x = f(x)
            return x
        for start in range(0, len(fns), step):
            x = remat(_run_layers(fns[start:start + step]))(x)
        return x


def _placements(i: int, layer: nn.Module, names: dict) -> list[tuple[str, nn.Module]]:
    """Where layer i's modules go in a stage: the layer under its model name, else its children
    holding tensors under theirs (a wrapper's own name is not the model's), else under index i."""
    if id(layer) in names or not names or any(True for _ in layer.parameters(recurse=False)):
        return [(names.get(id(layer), str(i)), layer)]
    return [(names.get(id(m), f"{i}.{c}"), m) for c, m in layer.named_children()
            if any(True for _ in m.parameters()) or any(True for _ in m.buffers())]


def _register(root: nn.Module, path: str, module: nn.Module) -> bool:
    """Add `module` at dotted `path` under `root` (plain containers in between); False when it is
    there already (a module shared by layers, e.g. rotary embeddings)."""
    *parents, last = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    held = node._modules.get(last)
    if held is module:
        return False
    if held is not None:
        raise ShardingError(f"two pipeline modules claim the name {path!r}")
    node.add_module(last, module)
    return True


def _build(layer: Any, seed: int | None) -> Any:
    """A LayerSpec built (from torch seed `seed` when given, on a forked RNG); anything else as is."""
    if not isinstance(layer, LayerSpec):
        return layer
    if seed is None:
        return layer.build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return layer.build()


def _run_layers(fns: list) -> Callable[[Any], Any]:
    def run(x):
        for f in fns:
            x = f(x)
        return x
    return run
