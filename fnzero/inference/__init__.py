"""Generation from a sharded model: a KV cache, greedy and sampled decoding at any ZeRO stage, with
tensor parallelism or offloaded parameters; `init_inference`, DeepSpeed-Inference's interface.

generate(sm, params, input_ids, attention_mask=None, *, max_new_tokens=None, ...)
    token ids continued by the model of `sm` with `params`, the same on every rank
    (`specs/generation.md`).
"""

from ._generate import generate

__all__: list[str] = ["generate"]
