"""Memory: what a run's model state costs, measured and predicted.

Measured, from a live `TrainState` (`specs/sharding.md` §Memory):
    model_state_bytes(state)     this rank's parameters, master weights, optimizer state and the
                                 step's gradient buffer, unique storage only (`ModelStateBytes`)
    zero_formula(Ψ, stage, N, mixed)   the ZeRO paper's per-rank bytes, for comparison
    ep_zero_formula(Ψ_d, Ψ_e, stage, N, ep, mixed)   the same with experts split over ep ranks:
                                 dense over N ranks, Ψ_e/ep over N/ep (`specs/mesh.md` §Expert parallelism memory)
    expert_param_counts(model)   (dense, expert) parameter counts of a model with MoE layers
    muon_state_bytes(plan, rank, itemsize)   Muon's optimizer state on a rank: its whole-matrix
                                 partition at stages 1-3 (`specs/optim.md` §Muon at ZeRO stages 1-3)
    peak_rss_bytes()             this process's peak resident set size

Activations, from a model's shape (`specs/mesh.md` §Sequence memory):
    TransformerShape(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, family)
    TransformerShape.from_config(cfg)   from fnzero's GPTConfig or a transformers config
    activation_bytes(shape, seq_len=, micro_batch=, sp=, dtype=, checkpointing=)   one rank's bytes
                                 saved for backward (`ActivationBytes`: layer, outside, loss, peak)
    longest_sequence(shape, memory, sp=, ...)   the longest sequence whose activations fit
    ulysses_bytes(shape, seq_len=, micro_batch=, sp=, dtype=)   one layer's forward all-to-all bytes

Predicted, from numbers alone (`fnzero plan`, `specs/cli.md`):
    estimate(Ψ, stage=, world_size=, precision=, offload_optimizer=, offload_param=, ratio=)
    largest_model(memory, stage=, world_size=, ...)

The host allocator (glibc; a no-op elsewhere):
    return_freed_memory(mmap_threshold)   give large freed blocks back to the OS
    trim_freed_memory()                   give the heap's free pages back now
    allocator_env(environ)                the environment `fnzero launch` gives its workers
"""

from __future__ import annotations

from .._ext import allocator_env, return_freed_memory, trim_freed_memory
from ._activations import ActivationBytes, TransformerShape, activation_bytes, longest_sequence, ulysses_bytes
from ._estimate import Breakdown, Estimate, estimate, largest_model
from ._experts import expert_param_counts
from ._muon import muon_state_bytes
from ._state_bytes import ModelStateBytes, ep_zero_formula, model_state_bytes, peak_rss_bytes, zero_formula


# What fnzero's other packages use of this one, beyond the documented surface above: they import
# it from here, not from the private modules (`specs/architecture.md` §Package faces).
from ._estimate import format_bytes, parse_bytes
from ._experts import hf_config
from ._predict import Link, PASS_KINDS, StepPrediction, predict_step, ring_link

__all__ = [
    "ActivationBytes", "Breakdown", "Estimate", "TransformerShape", "activation_bytes", "longest_sequence", "ulysses_bytes", "ModelStateBytes", "allocator_env", "ep_zero_formula", "estimate", "expert_param_counts",
    "largest_model", "model_state_bytes", "muon_state_bytes", "peak_rss_bytes", "return_freed_memory", "trim_freed_memory", "zero_formula",
]
