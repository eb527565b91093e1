"""The ZeRO runtime: placements, the `ShardPlan`, and running a module over sharded parameters
(the differentiable gather, re-gathers for backward, parameter stores, `remat`).

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""
