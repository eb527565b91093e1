"""`expert_parallel`: DeepSpeed 0.19.8's AutoEP block, with its keys, defaults and checks (specs/config.md
§Expert parallel).

fnzero reads `enabled`, `autoep_size`, `preset_model` and where a model's experts are
(`STRUCTURE_KEYS`); the other keys warn when set (`NO_EFFECT_KEYS`, through `_noop.py`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, model_serializer
from pydantic_core import PydanticCustomError

from ._types import Bool, Float, Int, Model, NonNegInt, Str, _as_float, _as_int, describe

__all__ = ["ExpertParallelConfig", "EXPERT_ACTIVATIONS", "NO_EFFECT_KEYS", "STRUCTURE_KEYS", "expert_rules",
           "expert_world_rule"]

# deepspeed/moe/ep_experts.py EXPERT_ACTIVATIONS, in registry order.
EXPERT_ACTIVATIONS = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")

# Keys that say where a model's MoE layers, routers and experts are: DeepSpeed's overrides of a
# preset's names, which fnzero's sharding reads to find the experts it splits.
STRUCTURE_KEYS = ("preset_model", "moe_layer_pattern", "router_pattern", "expert_pattern")

_ROUTER = "the model's own router is used, unchanged (fnzero only moves tokens to the ranks holding their experts)"
_EXPERTS = ("the model's own expert modules compute the experts; DeepSpeed's replacement expert layer and its "
            "kernels are not used")
_COMM = "fnzero sends tokens to their experts with its own all-to-all; DeepSpeed's dispatch backends are not used"
# field -> why it has no effect in fnzero. Each warns when the block is enabled and the key is not DeepSpeed's default.
NO_EFFECT_KEYS: dict[str, str] = {
    **dict.fromkeys(("top_k", "top_k_attr", "score_func", "score_apply", "route_norm", "route_scale",
                     "routed_scaling_factor", "num_expert_groups", "num_limited_groups"), _ROUTER),
    **dict.fromkeys(("use_grouped_mm", "disable_triton_grouped_mm", "gate_up_impl", "combine_impl",
                     "row_weighting_impl", "expert_activation"), _EXPERTS),
    **dict.fromkeys(("comm_backend", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank", "async_split_plan"),
                    _COMM),
    "validate_folding_routing": "it checks DeepSpeed's AutoEP+AutoTP folded routing, which fnzero does not have",
    **dict.fromkeys(("expert_w1", "expert_w2", "expert_w3", "num_experts_attr"),
                    "fnzero splits the experts module's own stacked tensors (transformers 5's gate_up_proj or "
                    "up_proj, down_proj, and their biases) and counts experts from them"),
    **dict.fromkeys(("has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern"),
                    "shared experts stay the model's own dense modules, found by nothing but the model itself"),
}


def _attribute_name(value: str) -> str:
    # DeepSpeed's _validate_attr_name: these name a direct child (getattr), not a path or a regex.
    if value == "":
        raise PydanticCustomError("fnz_attr", 'must be a non-empty attribute name, got ""; give a name or null')
    if "." in value:
        raise PydanticCustomError("fnz_attr", "must be a direct attribute name (no dots), got {got}; name the child "
                                  "module or parameter itself", {"got": describe(value)})
    return value


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as err:
        raise PydanticCustomError("fnz_regex", "is not a valid regular expression ({why}), got {got}",
                                  {"why": str(err), "got": describe(value)}) from None
    return value


def _auto_or(convert: Any, what: str) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, str) and value == "auto":
            return value
        try:
            return convert(value)
        except PydanticCustomError:
            raise PydanticCustomError("fnz_auto_or", 'must be "auto" or {what}, got {got}',
                                      {"what": what, "got": describe(value)}) from None
    return check


def _positive_int(value: Any) -> int:
    number = _as_int(value)
    if number < 1:
        raise PydanticCustomError("fnz_int", "must be >= 1")
    return number


def _no_load_balance(value: Any) -> None:
    if value is not None:
        raise PydanticCustomError(
            "fnz_lbc", "is {got}, but auxiliary-loss-free load balancing is not supported (DeepSpeed 0.19.8 refuses "
            "it too: it would add an expert_bias to the router); set it to null or remove the key",
            {"got": describe(value)})
    return None


AttrName = Annotated[Str, AfterValidator(_attribute_name)]
Regex = Annotated[Str, AfterValidator(_regex)]
PosInt = Annotated[Int, Field(ge=1)]


class ExpertParallelConfig(Model):
    """`expert_parallel` (DeepSpeed's AutoEP): split each MoE layer's experts over `autoep_size` ranks.
    Off unless `enabled`; off, nothing in it has an effect (its values are still checked)."""

    enabled: Bool = Field(False, description="Turn expert parallelism on.")
    autoep_size: PosInt = Field(1, description="Expert-parallel ranks (the mesh's ep size); must divide the "
                                "data-parallel world size.")
    expert_tensor_parallel_size: PosInt = Field(1, description="Expert-internal tensor parallelism; not built "
                                                "(must be 1 when enabled, as DeepSpeed 0.19.8).")
    validate_folding_routing: Bool = Field(False, description="DeepSpeed's folded-routing check; no effect.")
    async_split_plan: Bool = Field(False, description="DeepSpeed's asynchronous split plan; no effect.")
    preset_model: Str | None = Field(None, description="Model family preset; null = from the model's "
                                     "config.model_type. Checked against the presets when the model is sharded.")
    moe_layer_pattern: Regex | None = Field(None, description="Regular expression that fully matches the MoE "
                                            "layers' module names.")
    expert_pattern: AttrName | None = Field(None, description="Attribute of an MoE layer holding its experts.")
    router_pattern: AttrName | None = Field(None, description="Attribute of an MoE layer holding its router.")
    use_grouped_mm: Bool = Field(True, description="DeepSpeed's grouped-GEMM expert kernel; no effect.")
    disable_triton_grouped_mm: Bool = Field(False, description="DeepSpeed kernel choice; no effect.")
    route_norm: Bool | None = Field(None, description="Routing override; no effect (the model's router is used).")
    route_scale: Float = Field(1.0, description="Routing override; no effect.")
    score_apply: Literal["auto", "pre", "post"] = Field("auto", description="Routing override; no effect.")
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = Field(
        "auto", description="DeepSpeed's combine kernel; no effect.")
    row_weighting_impl: Literal["auto", "eager", "fused"] = Field("auto", description="DeepEP kernel; no effect.")
    gate_up_impl: Literal["separate", "fused"] = Field("separate", description="DeepSpeed kernel; no effect.")
    comm_backend: Literal["comm", "deepep"] = Field("comm", description="DeepSpeed's dispatch backend; no effect.")
    comm_num_sm: PosInt = Field(12, description="DeepEP SM budget; no effect.")
    comm_qp_margin: NonNegInt = Field(4, description="DeepEP queue-pair margin; no effect.")
    comm_max_tokens_per_rank: NonNegInt = Field(0, description="DeepEP buffer size; no effect.")
    num_expert_groups: PosInt | None = Field(None, description="Group-limited routing; no effect.")
    num_limited_groups: PosInt | None = Field(None, description="Group-limited routing; no effect.")
    score_func: Literal["auto", "softmax", "sigmoid"] = Field("auto", description="Routing override; no effect.")
    top_k: Annotated[Literal["auto"] | int, BeforeValidator(_auto_or(_positive_int, "an integer >= 1"))] = Field(
        "auto", description="Routing override; no effect.")
    load_balance_coeff: Annotated[None, BeforeValidator(_no_load_balance)] = Field(
        None, description="Auxiliary-loss-free balancing; must be null (as DeepSpeed 0.19.8).")
    routed_scaling_factor: Annotated[Literal["auto"] | float, BeforeValidator(_auto_or(_as_float, "a number"))] = Field(
        "auto", description="Routing override; no effect.")
    expert_w1: AttrName | None = Field(None, description="The experts' first (gate or gate_up) weight's name.")
    expert_w2: AttrName | None = Field(None, description="The experts' down weight's name.")
    expert_w3: AttrName | None = Field(None, description="The experts' up weight's name; null = fused into w1. "
                                       "Absent = the preset's (`expert_w3_given`).")
    num_experts_attr: AttrName | None = Field(None, description="The model config's attribute with the expert count.")
    top_k_attr: AttrName | None = Field(None, description="The model config's attribute with top-k; no effect.")
    has_shared_experts: Bool | None = Field(None, description="Whether MoE layers have shared experts.")
    shared_experts_pattern: AttrName | None = Field(None, description="Attribute holding the shared experts.")
    shared_experts_gate_pattern: AttrName | None = Field(None, description="Attribute holding the shared "
                                                         "experts' gate.")
    expert_activation: Literal[EXPERT_ACTIVATIONS] | None = Field(  # type: ignore[valid-type]
        None, description="DeepSpeed's expert activation; no effect (the model's experts compute).")

    # DeepSpeed tells `expert_w3` absent (the preset's name) from null (no w3: gate and up fused in w1).
    _expert_w3_given: bool = PrivateAttr(False)

    def model_post_init(self, context: Any) -> None:
        self._expert_w3_given = "expert_w3" in self.model_fields_set

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if not self._expert_w3_given:
            out.pop("expert_w3", None)  # absent stays absent, so to_json loads back to the same meaning
        return out

    @property
    def expert_w3_given(self) -> bool:
        """Whether `expert_w3` was in the config (absent: the preset's; given null: gate and up fused in w1)."""
        return self._expert_w3_given

    @property
    def size(self) -> int:
        """The expert-parallel degree: `autoep_size` when enabled, else 1."""
        return int(self.autoep_size) if self.enabled else 1


def expert_rules(ep: ExpertParallelConfig, tp_size: int, tp_preset: str | None) -> list[str]:
    """DeepSpeed 0.19.8's checks across keys of an enabled block (validate_autoep_config,
    validate_folding_global), plus what fnzero has not built; one message per problem."""
    # Long: one self-contained rule per DeepSpeed check, in validate_autoep_config's order.
    if not ep.enabled:
        return []
    out: list[str] = []
    key = "`expert_parallel.{}`".format
    if ep.expert_tensor_parallel_size > 1:
        out.append(f"{key('expert_tensor_parallel_size')} is {ep.expert_tensor_parallel_size}, but expert tensor "
                   "parallelism (each expert split over ranks) is not built in fnzero (DeepSpeed 0.19.8 refuses it "
                   "too); set it to 1")
    if ep.async_split_plan and ep.autoep_size > 1 and tp_size > 1:
        out.append(f"{key('async_split_plan')} is true with `tensor_parallel.autotp_size` {tp_size}: DeepSpeed "
                   "0.19.8 refuses it with tensor parallelism; set autotp_size to 1 or async_split_plan false")
    if ep.combine_impl == "fused_weighted_sum":
        if tp_size > 1:
            out.append(f'{key("combine_impl")} is "fused_weighted_sum" with `tensor_parallel.autotp_size` {tp_size}: '
                       "DeepSpeed 0.19.8 refuses it with tensor parallelism; leave combine_impl unset")
        if ep.comm_backend == "deepep" and ep.autoep_size > 1:
            out.append(f'{key("combine_impl")} is "fused_weighted_sum" with {key("comm_backend")} "deepep": '
                       "DeepSpeed 0.19.8 refuses the pair (DeepEP already reduces the routed rows); leave combine_impl "
                       "unset")
    if ep.gate_up_impl == "fused" and not ep.use_grouped_mm:
        out.append(f'{key("gate_up_impl")} is "fused" with {key("use_grouped_mm")} false: DeepSpeed 0.19.8 refuses '
                   "the pair (the fused form is a grouped GEMM); set use_grouped_mm true or leave gate_up_impl unset")
    if ep.row_weighting_impl == "fused":
        if ep.comm_backend != "deepep":
            out.append(f'{key("row_weighting_impl")} is "fused" with {key("comm_backend")} "{ep.comm_backend}": '
                       'DeepSpeed 0.19.8 runs it only with "deepep"; set comm_backend "deepep" or leave '
                       "row_weighting_impl unset")
        if ep.autoep_size == 1:
            out.append(f'{key("row_weighting_impl")} is "fused" with {key("autoep_size")} 1: DeepSpeed 0.19.8 runs it '
                       "only with autoep_size > 1; raise autoep_size or leave row_weighting_impl unset")
    if ep.comm_backend == "deepep" and ep.comm_max_tokens_per_rank == 0:
        out.append(f'{key("comm_max_tokens_per_rank")} is 0 with {key("comm_backend")} "deepep": DeepSpeed 0.19.8 '
                   "needs the largest number of tokens one rank routes there; set it, or comm_backend \"comm\"")
    groups, limited = ep.num_expert_groups, ep.num_limited_groups
    if groups is not None and limited is not None and limited > groups:
        out.append(f"{key('num_limited_groups')} {limited} is more than {key('num_expert_groups')} {groups}; "
                   "it must be <= num_expert_groups (as DeepSpeed 0.19.8)")
    if tp_preset is not None and ep.preset_model is not None and tp_preset != ep.preset_model:
        out.append(f"`tensor_parallel.preset_model` {describe(tp_preset)} and {key('preset_model')} "
                   f"{describe(ep.preset_model)} differ; DeepSpeed 0.19.8 requires them to match when both are set")
    return out


def expert_world_rule(ep: ExpertParallelConfig, data_parallel: int) -> list[str]:
    """The expert-parallel ranks are a division of the data-parallel ones: `autoep_size` must divide them."""
    if not ep.enabled or data_parallel % ep.autoep_size == 0:
        return []
    return [f"`expert_parallel.autoep_size` {ep.autoep_size} does not divide the data-parallel world size "
            f"{data_parallel}: each expert-parallel group is autoep_size of the data-parallel ranks, so use a divisor "
            f"of {data_parallel}"]
