"""Adapters injected into a built model (PEFT's LoRA layers), initialised on the meta device as
PEFT initialises them: not by the model's init pass, but each layer's own reset after it
(`specs/peft.md` §Initialisation). Recognised by what PEFT's layers are, without importing peft."""

from __future__ import annotations

from torch import nn

from ..._errors import ShardingError

__all__ = ["AdapterInit"]

# Module dicts of a LoRA layer whose entries are adapters (per adapter name).
_ADAPTER_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout", "lora_magnitude_vector")
# init_lora_weights values that need no base weights: PEFT's reset, or no init beyond nn.Linear's.
_REPLAYED = (True, False, "gaussian", "eva")


def _is_lora_layer(m: nn.Module) -> bool:
    return callable(getattr(type(m), "reset_lora_parameters", None)) and isinstance(m._modules.get("lora_A"), nn.ModuleDict)


def _peft_configs(model: nn.Module) -> dict:
    """The adapters' configs by adapter name (the first module's `peft_config`); {} for a model without."""
    for m in model.modules():
        configs = m.__dict__.get("peft_config")
        if isinstance(configs, dict):
            return configs
    return {}


class AdapterInit:
    """The LoRA layers of `model` and the init each adapter replays; checked when built."""

    def __init__(self, model: nn.Module, paths: dict[int, str]):
        configs = _peft_configs(model)
        self.layers: dict[int, list[tuple[str, object]]] = {}  # id(layer) -> [(adapter, init_lora_weights)]
        self.inside: set[int] = set()  # modules of the adapter dicts: not the model's init pass
        for m in model.modules():
            if not _is_lora_layer(m):
                continue
            names = [*m.lora_A.keys(), *getattr(m, "lora_embedding_A", {}).keys()]
            inits = []
            for name in dict.fromkeys(names):
                init = getattr(configs.get(name), "init_lora_weights", True)
                init = init.lower() if isinstance(init, str) else init  # PEFT compares these lower-cased
                variant = getattr(m, "lora_variant", {}).get(name)
                if init not in _REPLAYED or variant is not None:
                    what = f"init_lora_weights={init!r}" if init not in _REPLAYED else f"the {type(variant).__name__}"
                    raise ShardingError(
                        f"adapter {name!r} of {paths.get(id(m), '?')!r}: {what} initialises from the base weights, which "
                        "a model built on the meta device does not have; build the PEFT model on a real device, or use "
                        "init_lora_weights=True or 'gaussian'"
                    )
                inits.append((name, init))
            self.layers[id(m)] = inits
            for dict_name in _ADAPTER_DICTS:
                sub = m._modules.get(dict_name)
                if sub is not None:
                    self.inside.update(id(x) for x in sub.modules())

    def model_init_skips(self, m: nn.Module) -> bool:
        """Whether the model's `_init_weights` pass leaves `m` alone (an adapter's module)."""
        return id(m) in self.inside

    def run(self, modules: list[nn.Module]) -> None:
        """Each LoRA layer among `modules` initialises its adapters, after the model's init pass."""
        for m in modules:
            for name, init in self.layers.get(id(m), ()):
                if init == "eva":  # lora_A keeps nn.Linear's init until EVA's data pass; lora_B starts at zero
                    nn.init.zeros_(m.lora_B[name].weight)
                elif init is not False:
                    m.reset_lora_parameters(name, init)
