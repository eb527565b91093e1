"""Construction: `fnzero.shard` and the `ShardedModule` it returns, and the initial sharded
values from a built model or a meta model materialised region by region.

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""

# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._construct import default_device, shard
from ._initial import Cuts, PretrainedWarning, frozen_checksum_key
from ._materialize import GLOBAL_RNG_LOCK
from ._module import ShardedModule, full_unit
from ._world_config import hf_auto_values, load_config
