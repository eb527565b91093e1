"""Pipeline models: the layers of a `PipelineModule` and how they are cut into stages
(`specs/mesh.md` §Pipeline); the schedules that run them are in `fnzero/pipeline/`.

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""

# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._module import LayerSpec, PipelineInfo, PipelineModule, PipelineStage, TiedWeight
from ._partition import partition_balanced, partition_uniform, stage_bounds
