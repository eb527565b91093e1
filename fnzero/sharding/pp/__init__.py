"""Pipeline models: the layers of a `PipelineModule` and how they are cut into stages
(`specs/mesh.md` §Pipeline; `specs/architecture.md`); the schedules that run them: `fnzero/pipeline/`."""

# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._module import LayerSpec, PipelineInfo, PipelineModule, PipelineStage, TiedWeight
from ._partition import partition_balanced, partition_uniform, stage_bounds
