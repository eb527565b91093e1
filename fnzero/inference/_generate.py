"""`fnzero.generate`: text from a sharded model, every rank running `ShardedModule.apply` once per
new token; rank 0 chooses each token and the others take its choice (`specs/generation.md`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .._errors import ShardingError
from .._state import TrainState
from ..sharding import ambient, gather_from_tp, within
from ._model_calls import ModelCalls, max_positions, model_calls
from ._prompt import agree_on_prompt, attention_mask_for, check_length
from ._sampling import choose_tokens
from ._settings import GenerationSettings, resolve_settings

__all__ = ["generate"]


def generate(sm, params, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, generator: torch.Generator | None = None, use_cache: bool = True,
             generation_config: Any = None, max_live_parameters: int | None = None) -> torch.LongTensor:  # fmt: skip
    """Continue each row of `input_ids` (batch, prompt) with the model of `sm` and `params`
    (`state.params`, or a `TrainState`); returns (batch, prompt + new) token ids, the same on
    every rank. Collective: every rank calls it with the same prompt.

    As transformers' `generate()` (`specs/generation.md`): settings not given come from
    `generation_config`, then the model's, then transformers' defaults; sampling draws on rank 0
    only (from `generator`, else torch's global one); `attention_mask` marks left padding. Runs under
    `torch.no_grad()` and leaves `params` and the model untouched.

    At ZeRO stage 3 the units gathered in the first forward are held for the whole call, as many as
    fit `max_live_parameters` elements gathered at once (default: the config's
    `stage3_max_live_parameters`; 0 gathers every unit for every token), the rest streamed with the
    next one fetched ahead (`ShardedModule.holding`, `specs/generation.md` §Residency).

        state = sm.init_state()
        ids = fnzero.generate(sm, state, prompt_ids, attention_mask=mask, max_new_tokens=32)
    """
    params = params.params if isinstance(params, TrainState) else params
    sm.plan.check_params(params, "the params given to generate")  # before any collective
    if sm.pp is not None:
        raise ShardingError("generate: this model is cut into pipeline stages; generation runs whole models "
                            "(ZeRO stages, tensor parallelism, offloaded parameters), not pipelines")
    if sm.sp is not None:
        raise ShardingError("generate: this model is sharded with a sequence axis (sequence_parallel_size "
                            f"{sm.sp.size}); generation runs whole sequences on each rank: shard it without one, "
                            "or load the state into a model sharded without sequence parallelism")
    module = sm.module
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        raise ShardingError(f"generate: {type(module).__name__} is an encoder-decoder model; fnzero.generate "
                            "decodes decoder-only (causal) language models")
    calls = model_calls(module)
    ids = _check_ids(input_ids)
    explicit = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature, "top_k": top_k,
                "top_p": top_p, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
                "use_cache": None if use_cache else False}  # fmt: skip
    limit = max_positions(module)
    settings = resolve_settings(explicit, generation_config, getattr(module, "generation_config", None),
                                ids.shape[1], limit)  # fmt: skip
    check_length(ids.shape[1], settings.max_new_tokens, limit, type(module).__name__)
    mask = attention_mask_for(ids, attention_mask, settings, calls)
    device = sm.sharding.device
    ids = ids.to(device)
    mask = mask.to(device) if mask is not None else None
    agree_on_prompt(_groups(sm), ids, mask, settings.max_new_tokens)
    with torch.no_grad(), _holder(sm, max_live_parameters) as (held, own):
        out = _decode(sm, params, ids, mask, settings, calls, generator, held, own)
    return out.to(input_ids.device)


def _check_ids(input_ids: Any) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:  # fmt: skip
        got = (f"shape {tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ShardingError(f"generate: input_ids must be a non-empty (batch, prompt) tensor of token ids, got {got}")
    return input_ids.long()


def _groups(sm) -> list:
    """The collectives that together reach every rank: data-parallel, then tensor-parallel."""
    return [sm.comm] + ([sm.tp.comm] if sm.tp is not None else [])


def _decode(sm, params: dict, ids: torch.Tensor, mask: torch.Tensor | None, settings: GenerationSettings,
            calls: ModelCalls, generator: torch.Generator | None, held, own: bool) -> torch.Tensor:  # fmt: skip
    cache = calls.new_cache(sm.module) if settings.use_cache and calls.cache_key is not None else None
    positions = None
    if calls.position_ids:  # as transformers: counted over the unmasked tokens, 0 on padding
        positions = mask.long().cumsum(-1) - 1 if mask is not None else None
        positions = positions.masked_fill(mask == 0, 0) if positions is not None else \
            torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)  # fmt: skip
    # An all-ones mask is dropped, as transformers does: the model then builds its causal mask alone.
    step_mask = None if mask is None or bool((mask == 1).all()) else mask
    eos = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=ids.device)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    # A rank that will not decode makes the gathers of the prompt's forward without running it, when
    # those are all it takes (on a shared machine its compute slowed the chooser's gathers).
    seq, idle = ids, sm.comm.rank != 0 and _no_forward_collective(sm) and sm.gather_held(params)
    if idle:
        cache = None
        if own:  # an enclosing `sm.holding()` keeps them: every rank must hold alike for the next call
            held.release()
    for step in range(settings.max_new_tokens):
        feed = seq if cache is None or step == 0 else seq[:, -1:]
        held.last_forward = step == settings.max_new_tokens - 1  # nothing to fetch ahead for a next token
        logits = None
        if not idle:
            with _runs_released():
                if calls.keywords:
                    out = sm.apply(params, **calls.inputs(feed, step_mask, positions, cache))
                else:
                    out = sm.apply(params, feed)
            logits = _full_vocab(sm, calls.last_logits(out))
            del out  # the prefill's whole-sequence logits are not kept into the next token
        tokens = _agreed_tokens(sm, logits, ids.shape[0], ids.device, settings, generator)
        if step == 0 and not idle and _may_idle(sm, held):
            idle, cache = True, None
            if own:  # an enclosing `sm.holding()` keeps them: every rank must hold alike for the next call
                held.release()
        if len(eos):
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, settings.pad_token_id))
        seq = torch.cat([seq, tokens[:, None]], dim=-1)
        if len(eos):
            unfinished &= ~torch.isin(tokens, eos)
            if not bool(unfinished.any()):
                break
        if step_mask is not None:
            step_mask = torch.cat([step_mask, step_mask.new_ones(step_mask.shape[0], 1)], dim=-1)
        if positions is not None:
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=-1)
    return seq


@contextlib.contextmanager
def _holder(sm, max_live_parameters: int | None):
    """(the holder this call decodes under, whether it is the call's own): an enclosing
    `sm.holding()`'s, whose units stay held from one call to the next, else a new one."""
    outer = ambient().held
    if outer is None:
        with sm.holding(max_live_parameters) as held:
            yield held, True
        return
    if max_live_parameters is not None:
        raise ShardingError("generate: max_live_parameters was given inside sm.holding(...), whose budget "
                            "applies to every call in its block; give it to sm.holding instead")
    yield outer, False


@contextlib.contextmanager
def _runs_released() -> Iterator[None]:
    """Release the apply runs of one forward as soon as it returns. A stage-3 run and its units'
    runtimes reference each other, and the run keeps the root unit's gathered buffer bound: left
    to the cycle collector, several tokens' root buffers (a tied language model's embeddings
    and LM head, its largest unit) would be alive at once. With no backward to come, nothing needs
    them after the forward (the step does the same after its backward, `ApplyRun.release`)."""
    runs: list = []
    try:
        with within(step_runs=runs):
            yield
    finally:
        for run in runs:
            run.release()


def _full_vocab(sm, logits: torch.Tensor) -> torch.Tensor:
    """The last position's logits over the whole vocabulary: gathered from the tensor-parallel
    ranks when the LM head is split over the vocabulary (only this position, never the sequence)."""
    tp = sm.tp
    if tp is None or tp.vocab_head is None or tp.size == 1:
        return logits
    return gather_from_tp(logits.contiguous(), tp.comm, tp.splits[tp.vocab_head].pieces())


def _may_idle(sm, held) -> bool:
    """Whether this rank may skip the forwards after the prompt's: it is not on the data-parallel
    rank that chooses the tokens, and the forwards need no data-parallel collective (every unit
    held, no expert-parallel units), so its forward would only repeat that rank's work (with tensor
    parallelism, its whole tensor-parallel group idles alike). On a shared memory bus a second
    reader of the whole model per token slows the chooser's."""
    return sm.comm.rank != 0 and held.complete and _no_forward_collective(sm)


def _no_forward_collective(sm) -> bool:
    """Whether a forward whose units are all held makes no data-parallel collective: no
    expert-parallel units (their all-to-alls span the data-parallel ranks)."""
    return not any(u.is_expert for u in sm.plan.units)


def _agreed_tokens(sm, logits: torch.Tensor | None, batch: int, device: torch.device, settings: GenerationSettings,
                   generator: torch.Generator | None) -> torch.Tensor:  # fmt: skip
    """The next tokens rank 0 chooses, on every rank: only rank 0 draws (so a sampled run uses one
    generator, once per token), and a sum where the other ranks add zeros hands its choice on
    through each group (a broadcast's source is a global rank; a sum needs none). `logits`: None on
    a rank that skipped the forward (`_may_idle`)."""
    groups = _groups(sm)
    if all(g.rank == 0 for g in groups):
        tokens = choose_tokens(logits, settings, generator)
    else:
        tokens = torch.zeros(batch, dtype=torch.long, device=device)
    for g in groups:
        if g.world_size > 1:
            tokens = g.all_reduce(tokens if g.rank == 0 else torch.zeros_like(tokens))
    return tokens
