"""Sharding: placements, plans, collectives, and running a model over sharded parameters
(`specs/sharding.md`, `specs/collectives.md`).

    Placement, placement_for_stage   what of a unit is sharded; a ZeRO stage names a preset
    ShardPlan, UnitPlan              which parameters form a unit and which slice each rank owns
    shard, ShardedModule             a model laid out by a plan: `.apply`, `.gather`, and `.init_state`
                                     where the state layer gave it its builder (`fnzero.shard`)
    Collectives (and implementations)  the communication interface the step and the runtime use;
        CollectivesBase derives the async and option-taking forms for a custom backend
    default_collectives, providing_collectives, current_world_size
                                     the collectives (and world) code runs over when it names none
    init_distributed, DistInfo       join torchrun's process group
    make_mesh, Mesh, MeshShape       the ranks as a pp x dp x tp grid (dp divided into ep x edp for
                                     expert parallelism, MiCS shard x replica groups, hpZ groups),
                                     with each axis' collectives
    ExpertGroup, EPLayout            expert parallelism: the base of modules holding a layer's experts
                                     (split over the ep ranks by `shard`), and where they are
    CausalAttention, shard_sequence, SPLayout
                                     sequence parallelism: attention a sequence axis reaches, a batch
                                     cut along the sequence, and the axis (`specs/mesh.md` §Sequence)
    TPRule, TPLayout, ParamSplit     tensor parallelism: which modules are split, and how each
                                     parameter is (`specs/mesh.md`)
    vocab_parallel_cross_entropy     the cross-entropy of logits split over the vocabulary
    CommQuantization, BlockQuantizer, IdentityCodec
                                     ZeRO++: what travels quantized (stage 3's gathers, the gradient
                                     reduce-scatters) and the codecs (`shard(comm_quantization=)`)
    quantize, dequantize             block-wise symmetric int8/int4 with float32 scales per block
    quantized_all_gather_async, quantized_reduce_scatter_async, QuantizedCollectives
                                     the quantized collectives over any `Collectives` (qwZ, qgZ)
    compressed_all_reduce            the 1-bit optimizers' exchange: signs 8 to a byte, per-tensor scales,
                                     error feedback on both sides (`compressed_bytes`: what one call sends)
"""

from __future__ import annotations

from .comm import (
    Collectives, CollectivesBase, LocalCollectives, ProcessGroupCollectives, current_world_size, default_collectives,
    providing_collectives, RecordingCollectives, CompressedAllReduce, compressed_all_reduce, compressed_bytes,
    compressed_padded_numel, DistInfo, init_distributed, Mesh, MeshShape, make_mesh, BlockQuantizer,
    CommQuantization, IdentityCodec, dequantize, quantize, QuantizedCollectives, quantized_all_gather_async,
    quantized_reduce_scatter_async,
)
from .construct import shard, PretrainedWarning, ShardedModule
from .zero import Placement, placement_for_stage, ShardPlan, UnitPlan
from .tp import TPRule, ParamSplit, TPLayout, vocab_parallel_cross_entropy
from .ep import ExpertGroup, EPLayout
from .sp import CausalAttention, SPLayout, shard_sequence, tile_mlp, token_positions


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from .comm import (
    CollectiveRecord, FunctionalCollectives, PendingTensor, check_agreement, free_port, provided_collectives,
    quantizing, resolve_splits,
)
from .construct import Cuts, GLOBAL_RNG_LOCK, default_device, frozen_checksum_key, full_unit, hf_auto_values, load_config
from .comm import all_to_all_grad
from .pp import (
    LayerSpec, PipelineInfo, PipelineModule, PipelineStage, TiedWeight, partition_balanced, partition_uniform,
    stage_bounds,
)
from .tp import ColumnParallelLinear, RowParallelLinear, check_heads, copy_to_tp, gather_from_tp, reduce_from_tp
from .zero import (
    DTYPES, ParamSlot, ShardSource, WholeTensorPartition, ambient, comm_for, config_precision, from_owners, held,
    is_placeholder, offload_device, optimizer_view, padded_size, param_pieces, placeholder, read_placeholders, remat,
    sources_of, stepped_in_place, stored_bytes, to_owners, unit_views, whole_tensor_partition, within,
)


# What fnzero's other packages use of this one, beyond the documented surface above: they import
# it from here, not from the private modules (`specs/architecture.md` §Package faces).
from .comm import bus_factor, root_cause

__all__ = [
    "Collectives", "CollectivesBase", "DistInfo", "LocalCollectives", "Placement", "PretrainedWarning",
    "ProcessGroupCollectives", "RecordingCollectives", "ShardPlan", "ShardedModule", "UnitPlan", "current_world_size", "default_collectives",
    "init_distributed", "placement_for_stage", "providing_collectives", "shard", "Mesh", "MeshShape", "make_mesh",
    "ParamSplit", "TPLayout", "TPRule", "vocab_parallel_cross_entropy", "ExpertGroup", "EPLayout", "CausalAttention", "SPLayout", "shard_sequence", "tile_mlp", "token_positions",
    "BlockQuantizer", "CommQuantization", "IdentityCodec", "dequantize", "quantize", "QuantizedCollectives",
    "quantized_all_gather_async", "quantized_reduce_scatter_async",
    "CompressedAllReduce", "compressed_all_reduce", "compressed_bytes", "compressed_padded_numel",
]
