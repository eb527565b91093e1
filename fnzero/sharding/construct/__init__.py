"""Construction: `fnzero.shard` and the `ShardedModule` it returns, and the initial sharded
values from a built model or a meta model materialised region by region.

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""
