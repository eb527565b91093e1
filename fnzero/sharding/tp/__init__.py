"""Tensor parallelism: which layers are split and how (AutoTP plans, the layout), the split
layers, and the differentiable collectives they use (`specs/mesh.md`; `specs/architecture.md`)."""

# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._autotp import PLANS, TPRule, check_heads, parallelize, rules_from_config
from ._layout import ParamSplit, TPLayout
from ._modules import ColumnParallelLinear, RowParallelLinear
from ._ops import copy_to_tp, gather_from_tp, reduce_from_tp, vocab_parallel_cross_entropy
