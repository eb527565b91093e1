"""Pipeline parallelism (`specs/mesh.md` §Pipeline): a model as a list of layers cut into stages
along the mesh's `pp` axis, run by a schedule inside the ordinary training step.

    PipelineModule, LayerSpec        the model: layers (built only where they run) and the loss
    PipelineStage                    one stage's layers as a module (what `fnzero.shard` keeps)
    partition_uniform, partition_balanced, stage_bounds
                                     how layers are cut (DeepSpeed's partition methods)
    gpipe, one_f_one_b, schedule, bubble_fraction
                                     the schedules, as lists of (F|B, micro-batch) per stage
    PipelineLoss, PipelineInfo       what `sm.pipeline_loss()` gives `fnzero.train_step`
"""

from ._module import LayerSpec, PipelineModule, PipelineStage
from ._partition import partition_balanced, partition_uniform, stage_bounds
from ._run import PipelineInfo, PipelineLoss
from ._schedule import Action, bubble_fraction, gpipe, one_f_one_b, schedule

__all__ = [
    "Action", "LayerSpec", "PipelineInfo", "PipelineLoss", "PipelineModule", "PipelineStage", "bubble_fraction",
    "gpipe", "one_f_one_b", "partition_balanced", "partition_uniform", "schedule", "stage_bounds",
]
