"""Pipeline parallelism (`specs/mesh.md` §Pipeline): a model as a list of layers cut into stages
along the mesh's `pp` axis, run by a schedule inside the ordinary training step.

    PipelineModule, LayerSpec        the model: layers (built only where they run) and the loss
    PipelineStage, PipelineInfo      one stage's layers as a module, and its place in the pipeline
    partition_uniform, partition_balanced, stage_bounds
                                     how layers are cut (DeepSpeed's partition methods)
    (these five are the sharding layer's: cutting along `pp` is a sharding transform, like AutoTP)
    gpipe, one_f_one_b, schedule, bubble_fraction
                                     the schedules, as lists of (F|B, micro-batch) per stage
    pipeline_loss, PipelineLoss      the loss function `fnzero.train_step` runs for a pipeline stage
    hf_causal_lm, hf_pipeline_layers, causal_lm_loss, shifted_causal_lm_loss
                                     a Hugging Face GPT-2 / Llama-family causal LM as pipeline layers
                                     (shifted: labels shifted before a sequence axis cut them)
"""

from ..sharding import (
    LayerSpec, PipelineInfo, PipelineModule, PipelineStage, TiedWeight, partition_balanced, partition_uniform,
    stage_bounds,
)
from ._hf import causal_lm_loss, hf_causal_lm, hf_pipeline_layers, shifted_causal_lm_loss
from ._run import PipelineLoss, pipeline_loss
from ._schedule import Action, bubble_fraction, gpipe, one_f_one_b, schedule


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._run import sum_tied_gradients, units_for_norm

__all__ = [
    "Action", "LayerSpec", "TiedWeight", "causal_lm_loss", "hf_causal_lm", "hf_pipeline_layers", "PipelineInfo",
    "PipelineLoss", "PipelineModule", "PipelineStage", "bubble_fraction", "shifted_causal_lm_loss",
    "gpipe", "one_f_one_b", "partition_balanced", "partition_uniform", "pipeline_loss", "schedule", "stage_bounds",
]
