"""The ZeRO runtime: placements, the `ShardPlan`, and running a module over sharded parameters
(the differentiable gather, re-gathers for backward, parameter stores, `remat`).

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""

# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._ambient import ambient, within
from ._gather import unit_views
from ._owners import WholeTensorPartition, from_owners, optimizer_view, param_pieces, to_owners, whole_tensor_partition
from ._param_store import (
    ShardSource, ShardSources, held, is_placeholder, placeholder, read_placeholders, sources_of, stepped_in_place,
    stored_bytes,
)
from ._placement import Placement, placement_for_stage
from ._plan import (
    ParamSlot, ROOT_UNIT, ShardPlan, UnitPlan, comm_for, make_plan, owner_module, padded_size, unit_predicate,
)
from ._policy import DTYPES, ShardPolicy, checked_quantization, config_precision, offload_device, shard_policy
from ._remat import remat
from ._residency import HeldUnits, plan_residency, residency_sizes
from ._runtime import ApplyRun, GatherSchedule
from ._saved_names import non_persistent_buffers
from ._unit_hooks import compile_unit_calls, hook_unit
