"""Sequence parallelism: each rank of a sequence-parallel group holds a run of every sample's tokens,
and attention spans them all by trading runs for heads (Ulysses) (`specs/mesh.md` §Sequence; layer 3
of `specs/architecture.md`).

    CausalAttention      causal attention as a module, which a sequence axis reaches
    shard_sequence       a batch cut along the sequence for this rank (labels shifted first)
    SPLayout             the sequence axis of a state's mesh: its ranks, `loss_share`
    tile_mlp             a model's MLPs run a few tokens at a time, recomputed in backward
    token_positions      a run's token places in the whole sequence (for layers given no position ids)
"""

from ._attention import CausalAttention, token_positions
from ._data import shard_sequence
from ._layout import SPLayout
from ._tiled_mlp import tile_mlp

# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._install import split_for_sp
from ._tiled import tiled_causal_lm_loss

__all__ = ["CausalAttention", "SPLayout", "shard_sequence", "tile_mlp", "token_positions"]
