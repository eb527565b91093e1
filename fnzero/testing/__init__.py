"""fnzero.testing: property-based testing for sharded training code (chex + hypothesis, for fnzero).

    from hypothesis import given
    import fnzero.testing as ft

    @given(cfg=ft.configs(stages=[0, 1, 2, 3]), world=ft.world_sizes(1, 8), batch=ft.batches(vocab=256, seq=32))
    def test_my_model_shards_cleanly(cfg, world, batch):
        ft.assert_stage_equivalent(MyModel, my_loss, cfg, batch, world_size=world, steps=3)

    def test_checkpoint_roundtrip():
        with ft.simulated_world(4) as world:          # 4 ranks in one process, no launcher, no ports
            world.run(my_train_fn)

A loss is `my_loss(apply, batch) -> scalar` where `apply(*args)` runs the model: the same function
works on a plain module (`my_loss(model, batch)`) and, through `ft.step_loss(sm, my_loss)`, as the
`loss_fn(params, batch)` that `fnzero.train_step` takes. See `specs/testing.md`.

Worlds (§Worlds)
------
simulated_world(n, wrap_comm=None)  n ranks as threads with in-memory collectives (`world.run(fn)`)
spawned_world(n)                    the same `.run(fn)` on n real gloo processes (fn importable)
seeded(seed)                        build models under torch's RNG, seeded and alone (§RNG)
run_world(fn, n, ...), free_port(), WorldError   the loopback multi-process harness

Strategies (hypothesis; imported on first use): tensors, pytrees, models, configs, world_sizes, batches

Assertions (§Assertions)
----------
assert_trees_close(a, b, rtol, atol), assert_trees_equal(a, b), assert_pure(step, state, batch)
assert_stage_equivalent(model_factory, loss_fn, cfg, batch, world_size, steps)   (§Noise floor:
                                    NoiseFloorWarning, NOISE_FACTOR)
assert_reshard_roundtrip(model_factory, cfg, save_world, load_world, ...)
count_collectives(sm) -> CollectiveCounter (`.calls(op)`, `.bytes(op)`, `.ring_bytes()`)
count_saved_bytes(exclude=params) -> SavedBytes (`.bytes`, `.tensors`): what autograd saves, each storage once

Building blocks
---------------
ModelFactory, step_loss, consolidate, tree_snapshot, default_tolerances
GPT, GPTConfig, MLP, text_corpus(), token_batches(...); GPT(..., num_experts=E, moe={...}) is a MoE GPT
gpt_layers, GPTEmbedding, GPTHead   the GPT as pipeline layers (embeddings, blocks, norm + head)
ThreadCollectives, SimulatedWorld, SpawnedWorld
"""

from __future__ import annotations

from typing import Any

from ._context import seeded
from ._counting import CollectiveCounter, count_collectives
from ._data import text_corpus, token_batches
from ._equivalence import assert_stage_equivalent, default_tolerances
from ._factories import ModelFactory
from ._floor import NOISE_FACTOR, NoiseFloorWarning
from ._models import GPT, MLP, GPTConfig, GPTEmbedding, GPTHead, gpt_layers
from ._purity import assert_pure
from ._reshard import assert_reshard_roundtrip, consolidate
from ._runs import step_loss
from ._saved import SavedBytes, count_saved_bytes
from ._spawn import SpawnedWorld, WorldError, free_port, run_world, spawned_world
from ._threads import SimulatedWorld, ThreadCollectives, simulated_world
from ._trees import assert_trees_close, assert_trees_equal, tree_snapshot

_STRATEGIES = ("tensors", "pytrees", "models", "configs", "world_sizes", "batches")


def __getattr__(name: str) -> Any:
    # The strategies need hypothesis (a test dependency); everything else here does not, so it is
    # imported only when a strategy is first asked for.
    if name in _STRATEGIES:
        from . import _strategies

        return getattr(_strategies, name)
    raise AttributeError(f"module 'fnzero.testing' has no attribute {name!r}")


__all__ = [
    "GPT", "CollectiveCounter", "GPTConfig", "GPTEmbedding", "GPTHead", "gpt_layers", "MLP", "ModelFactory",
    "NOISE_FACTOR", "NoiseFloorWarning", "SavedBytes", "SimulatedWorld", "SpawnedWorld", "ThreadCollectives", "WorldError",
    "assert_pure", "assert_reshard_roundtrip", "assert_stage_equivalent", "assert_trees_close", "assert_trees_equal",
    "consolidate", "count_collectives", "count_saved_bytes", "default_tolerances", "free_port", "run_world", "seeded", "simulated_world",
    "spawned_world", "step_loss", "text_corpus", "token_batches", "tree_snapshot", *_STRATEGIES,
]
