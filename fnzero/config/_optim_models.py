"""`optimizer`: the optimizer type and its per-type `params`.

Each type has its own model with DeepSpeed's/torch's parameter names and defaults, so a misspelt
parameter is refused by name (DeepSpeed passes it to the constructor) and the optimizer module's
`cfg.optimizer.params.model_dump()` is exactly its keyword arguments.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from ._types import Bool, Float, Model, NonNegFloat, Pair

__all__ = [
    "OptimizerConfig", "OptimizerParams", "OPTIMIZER_PARAMS", "OPTIMIZER_TYPES",
    "AdamParams", "AdamWParams", "SGDParams", "AdagradParams", "LambParams", "LionParams", "MuonParams",
    "OneBitAdamParams", "ZeroOneAdamParams", "OneBitLambParams", "ONEBIT_TYPES",
]

TORCH_ADAMW_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default weight_decay
PosFloat = Annotated[Float, Field(gt=0.0)]


def _check_order(params: Model, low: str, high: str) -> None:
    lo, hi = getattr(params, low), getattr(params, high)
    if lo > hi:
        raise ValueError(f"{low} {lo!r} exceeds {high} {hi!r}; make {low} <= {high}")


class _WithBetas(Model):
    """Params whose `betas` must each lie in [0, 1)."""

    @model_validator(mode="after")
    def _betas_in_range(self) -> "_WithBetas":
        for i, beta in enumerate(self.betas):  # type: ignore[attr-defined]
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"`betas[{i}]` is {beta!r}; each beta must be in [0, 1), e.g. [0.9, 0.999]")
        return self


class _AdamBase(_WithBetas):
    lr: NonNegFloat = Field(1e-3, description="Learning rate.")
    betas: Pair = Field((0.9, 0.999), description="Coefficients for the running averages of the gradient and its square.")
    eps: NonNegFloat = Field(1e-8, description="Term added to the denominator for numerical stability.")
    weight_decay: NonNegFloat = Field(
        0.0, description="Weight decay (decoupled when adam_w_mode is true); 0.01 when absent with torch_adam and "
        "adam_w_mode true (torch.optim.AdamW's default, as DeepSpeed).")
    bias_correction: Bool = Field(True, description="Apply Adam's bias correction.")
    amsgrad: Literal[False] = Field(False, description="AMSGrad variant; not implemented, must be false.")
    torch_adam: Bool = Field(
        False, description="DeepSpeed builds torch.optim.AdamW/Adam instead of its fused kernel: the same update, "
        "but weight_decay then defaults to 0.01 with decoupled decay (torch's default), and bias_correction "
        "is refused (torch's Adam has no such argument).")
    fp32_optimizer_states: Bool = Field(True, description="DeepSpeed CPU-Adam storage choice; accepted, no effect (states are fp32).")

    @model_validator(mode="before")
    @classmethod
    def _torch_adam_weight_decay(cls, data: object) -> object:
        # A default that depends on another key: with torch_adam, DeepSpeed 0.19.8 builds torch.optim.AdamW
        # when decay is decoupled (runtime/engine.py get_optimizer_configuration), whose weight_decay
        # defaults to 0.01 (torch.optim.Adam's, for adam_w_mode false, to 0 as here).
        if isinstance(data, dict) and data.get("torch_adam") is True and "weight_decay" not in data \
                and data.get("adam_w_mode", True) is True:
            return {**data, "weight_decay": TORCH_ADAMW_WEIGHT_DECAY}
        return data


class AdamParams(_AdamBase):
    """`optimizer.params` for type Adam. DeepSpeed defaults Adam to decoupled weight decay (AdamW)."""

    adam_w_mode: Bool = Field(True, description="Decoupled (AdamW) weight decay; DeepSpeed's default for Adam is true.")


class AdamWParams(_AdamBase):
    """`optimizer.params` for type AdamW; weight decay is always decoupled."""

    adam_w_mode: Literal[True] = Field(True, description="Always true for AdamW; false is an error (use type Adam).")


class SGDParams(Model):
    """`optimizer.params` for type SGD (torch.optim.SGD names)."""

    lr: NonNegFloat = Field(1e-3, description="Learning rate.")
    momentum: NonNegFloat = Field(0.0, description="Momentum factor.")
    dampening: NonNegFloat = Field(0.0, description="Dampening for momentum.")
    weight_decay: NonNegFloat = Field(0.0, description="L2 penalty.")
    nesterov: Bool = Field(False, description="Nesterov momentum; needs momentum > 0 and dampening 0.")

    @model_validator(mode="after")
    def _nesterov(self) -> "SGDParams":
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov: true needs momentum > 0 and dampening 0, got momentum {self.momentum!r} and "
                f"dampening {self.dampening!r}; set momentum (e.g. 0.9) and dampening 0, or nesterov false"
            )
        return self


class AdagradParams(Model):
    """`optimizer.params` for type Adagrad (DeepSpeed CPU-Adagrad defaults, torch names)."""

    lr: NonNegFloat = Field(1e-2, description="Learning rate.")
    eps: NonNegFloat = Field(1e-10, description="Term added to the denominator for numerical stability.")
    weight_decay: NonNegFloat = Field(0.0, description="L2 penalty.")
    lr_decay: NonNegFloat = Field(0.0, description="Learning-rate decay.")
    initial_accumulator_value: NonNegFloat = Field(0.0, description="Initial value of the squared-gradient sum.")


class LambParams(_WithBetas):
    """`optimizer.params` for type Lamb (DeepSpeed FusedLamb names and defaults)."""

    lr: NonNegFloat = Field(1e-3, description="Learning rate.")
    betas: Pair = Field((0.9, 0.999), description="Running-average coefficients.")
    eps: NonNegFloat = Field(1e-8, description="Term added to the denominator for numerical stability.")
    weight_decay: NonNegFloat = Field(0.0, description="Weight decay.")
    bias_correction: Bool = Field(True, description="Apply bias correction.")
    max_grad_norm: NonNegFloat = Field(0.0, description="Per-optimizer gradient-norm clip; 0 = off.")
    max_coeff: PosFloat = Field(10.0, description="Upper bound of the trust ratio.")
    min_coeff: NonNegFloat = Field(0.01, description="Lower bound of the trust ratio.")

    @model_validator(mode="after")
    def _ranges(self) -> "LambParams":
        _check_order(self, "min_coeff", "max_coeff")
        return self


class LionParams(_WithBetas):
    """`optimizer.params` for type Lion (DeepSpeed FusedLion defaults)."""

    lr: NonNegFloat = Field(1e-3, description="Learning rate.")
    betas: Pair = Field((0.9, 0.999), description="Interpolation and running-average coefficients.")
    weight_decay: NonNegFloat = Field(0.0, description="Decoupled weight decay.")


class MuonParams(_WithBetas):
    """`optimizer.params` for type Muon (DeepSpeed 0.19.8 runtime/engine.py `_muon_param_groups` and
    runtime/zero/muon/original_muon.py `MuonWithAuxAdam`): Muon for the hidden matrices, Adam for the rest.
    `lr` and `weight_decay` are shared; `muon_lr` / `adam_lr` override `lr` for one half."""

    lr: NonNegFloat = Field(0.02, description="Learning rate of both halves unless muon_lr / adam_lr is given; "
                            "when absent Muon's is 0.02 and Adam's 3e-4.")
    muon_lr: NonNegFloat = Field(0.02, description="Muon's learning rate; absent = lr.")
    adam_lr: NonNegFloat = Field(3e-4, description="The auxiliary Adam's learning rate; absent = lr, or 3e-4 "
                                 "when lr is absent too.")
    momentum: Annotated[Float, Field(ge=0.0, lt=1.0)] = Field(0.95, description="Muon's momentum (Nesterov).")
    weight_decay: NonNegFloat = Field(0.0, description="Decoupled weight decay of both halves.")
    ns_method: Literal["gram", "standard"] = Field("gram", description="Newton-Schulz variant.")
    betas: Pair = Field((0.9, 0.95), description="The auxiliary Adam's betas.")
    eps: NonNegFloat = Field(1e-10, description="The auxiliary Adam's eps.")
    adam_w_mode: Bool = Field(True, description="Decoupled weight decay for the auxiliary Adam (false: L2).")
    torch_adam: Bool = Field(False, description="DeepSpeed builds torch.optim.AdamW for the auxiliary Adam; "
                             "the same update (accepted, no effect).")
    per_head_muon: Bool = Field(False, description="Orthogonalise each attention head of the q/k/v "
                                "projections on its own; the head counts come from the model "
                                "(fnzero.optim.muon_head_counts, passed as head_counts=).")

    @model_validator(mode="before")
    @classmethod
    def _half_lrs(cls, data: object) -> object:
        # Defaults that depend on another key, as DeepSpeed's `_muon_half_defaults`: each half takes
        # the shared lr when given, else its own class default (Muon 0.02, Adam 3e-4).
        if isinstance(data, dict) and "lr" in data:
            data = {"muon_lr": data["lr"], "adam_lr": data["lr"], **data}
        return data


class _OneBitBase(_WithBetas):
    """The keys DeepSpeed's 1-bit optimizers share (`deepspeed/runtime/fp16/onebit/`, removed in 0.19.8):
    the ones their step never reads, or that choose a transport, are accepted and warn when set."""

    lr: NonNegFloat = Field(1e-3, description="Learning rate.")
    betas: Pair = Field((0.9, 0.999), description="Running-average coefficients.")
    eps: NonNegFloat = Field(1e-8, description="Term added to the denominator for numerical stability.")
    weight_decay: NonNegFloat = Field(0.0, description="Weight decay, added to the update (decoupled).")
    bias_correction: Bool = Field(True, description="Stored and never read by DeepSpeed's 1-bit optimizers (no "
                                  "bias correction); no effect (warns when false).")
    eps_inside_sqrt: Bool = Field(False, description="Stored and never read by DeepSpeed; no effect (warns when true).")
    max_grad_norm: NonNegFloat = Field(0.0, description="Stored and never read by DeepSpeed; no effect (warns when > 0).")
    amsgrad: Literal[False] = Field(False, description="AMSGrad variant; refused (DeepSpeed raises too).")
    cuda_aware: Bool = Field(False, description="CUDA-aware MPI for DeepSpeed's MPI backend; no effect (warns when true).")
    comm_backend_name: Literal["nccl", "mpi", "hccl", "compressed"] = Field(
        "nccl", description="DeepSpeed's transport of the compressed all-reduce; fnzero's runs over the data-parallel "
        "collectives whatever it says (warns when not nccl).")


Steps = Annotated[int, Field(ge=0)]
PosSteps = Annotated[int, Field(ge=1)]


class OneBitAdamParams(_OneBitBase):
    """`optimizer.params` for type OneBitAdam (DeepSpeed's OnebitAdam, specs/optim.md §1-bit optimizers)."""

    freeze_step: Steps = Field(100000, description="Steps of uncompressed warm-up before the variance freezes.")


class ZeroOneAdamParams(_OneBitBase):
    """`optimizer.params` for type ZeroOneAdam (DeepSpeed's ZeroOneAdam)."""

    var_freeze_step: Steps = Field(100000, description="The step after which the variance is frozen.")
    var_update_scaler: PosSteps = Field(16, description="Variance updates before their interval doubles (kappa).")
    local_step_scaler: PosSteps = Field(32678, description="Local steps before the local-step interval doubles.")
    local_step_clipper: PosSteps = Field(16, description="The largest local-step interval (H).")


class OneBitLambParams(_OneBitBase):
    """`optimizer.params` for type OneBitLamb (DeepSpeed's OnebitLamb)."""

    freeze_step: Steps = Field(100000, description="Steps of uncompressed warm-up before the variance freezes.")
    max_coeff: PosFloat = Field(10.0, description="Upper bound of the warm-up trust ratio.")
    min_coeff: NonNegFloat = Field(0.01, description="Lower bound of the warm-up trust ratio.")
    coeff_beta: Annotated[Float, Field(ge=0.0, le=1.0)] = Field(
        0.9, description="Averaging coefficient of the warm-up trust ratios.")
    factor_max: PosFloat = Field(4.0, description="Upper bound of the compressed stage's ratio factor.")
    factor_min: NonNegFloat = Field(0.5, description="Lower bound of the compressed stage's ratio factor.")
    factor_threshold: NonNegFloat = Field(0.1, description="The most the factor moves in one step (relative).")

    @model_validator(mode="after")
    def _ranges(self) -> "OneBitLambParams":
        _check_order(self, "min_coeff", "max_coeff")
        _check_order(self, "factor_min", "factor_max")
        return self


ONEBIT_TYPES = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
OPTIMIZER_PARAMS: dict[str, type[Model]] = {
    "Adam": AdamParams, "AdamW": AdamWParams, "SGD": SGDParams,
    "Adagrad": AdagradParams, "Lamb": LambParams, "Lion": LionParams, "Muon": MuonParams,
    "OneBitAdam": OneBitAdamParams, "ZeroOneAdam": ZeroOneAdamParams, "OneBitLamb": OneBitLambParams,
}
OPTIMIZER_TYPES = tuple(OPTIMIZER_PARAMS)
OptimizerParams = Union[AdamParams, AdamWParams, SGDParams, AdagradParams, LambParams, LionParams, MuonParams,
                        OneBitAdamParams, ZeroOneAdamParams, OneBitLambParams]


class OptimizerConfig(Model):
    """`optimizer`: `type` (matched case-insensitively, stored canonically) and its validated `params`."""

    type: Literal["Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", "Muon", "OneBitAdam", "ZeroOneAdam",
                  "OneBitLamb"] = Field(description="Optimizer type.")
    params: OptimizerParams = Field(description="Per-type parameters; model_dump() gives constructor kwargs.")
    legacy_fusion: Literal[False] = Field(False, description="DeepSpeed legacy fused-kernel switch; must be false.")

    @model_validator(mode="after")
    def _params_match_type(self) -> "OptimizerConfig":
        if type(self.params) is not OPTIMIZER_PARAMS[self.type]:
            raise ValueError(f"params of type {type(self.params).__name__} do not belong to optimizer type {self.type}")
        return self
