"""Communication: the `Collectives` interface and its gloo/NCCL, direct, functional, observed and
simulated forms; the process group (`init_distributed`), the collective watchdog, the device mesh.

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""

# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._all_to_all import check_agreement, resolve_splits
from ._autograd import all_to_all_grad
from ._collectives import (
    Collectives, CollectivesBase, LocalCollectives, PendingTensor, ProcessGroupCollectives, current_world_size,
    default_collectives, provided_collectives, providing_collectives,
)
from ._compressed import CompressedAllReduce, compressed_all_reduce, compressed_bytes, compressed_padded_numel
from ._dist import DistInfo, free_port, init_distributed
from ._functional import FunctionalCollectives
from ._mesh import Mesh, MeshShape, make_mesh, mesh_from_config, zero_groups_of
from ._observed import CheckedCollectives, CollectiveRecord, RecordingCollectives, checksum
from ._quantize import BlockQuantizer, CommQuantization, IdentityCodec, dequantize, quantize
from ._quantized import QuantizedCollectives, quantized_all_gather_async, quantized_reduce_scatter_async, quantizing

# What fnzero's other packages use of this one, beyond the documented surface above: they import
# it from here, not from the private modules (`specs/architecture.md` §Package faces).
from ._comms_summary import bus_factor
from ._failure import root_cause
