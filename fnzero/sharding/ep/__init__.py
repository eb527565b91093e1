"""Expert parallelism: a model's experts split over the mesh's `ep` ranks, tokens sent to their
experts and back by all-to-all (`specs/mesh.md §Expert parallelism`; layer 3 of `specs/architecture.md`).

    ExpertGroup, expert_range     the modules holding a layer's experts, and which ones a rank keeps
    all_to_all_grad               the differentiable all-to-all the dispatch uses
    HFExpertGroup                 a Hugging Face (transformers 5) MoE block's experts as an ExpertGroup
    autoep_replace, AUTOEP_PRESETS, AutoEPPreset   AutoEP: find a model's experts modules and replace them
"""

from ._autoep import (AUTOEP_KEYS_NO_EFFECT, AUTOEP_KEYS_READ, AUTOEP_PRESETS, AutoEPPreset, autoep_replace,
                      resolve_autoep_preset)
from ._group import ExpertGroup, check_expert_split, expert_range
from ._hf_experts import HFExpertGroup
from ..comm import all_to_all_grad


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._layout import EPLayout
from ._split import replace_for_autoep, split_for_ep, wanted_ep_size

__all__ = ["AUTOEP_KEYS_NO_EFFECT", "AUTOEP_KEYS_READ", "AUTOEP_PRESETS", "AutoEPPreset", "ExpertGroup",
           "HFExpertGroup", "all_to_all_grad", "autoep_replace", "check_expert_split", "expert_range", "resolve_autoep_preset"]
