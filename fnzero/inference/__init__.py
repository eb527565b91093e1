"""Generation from a sharded model: a KV cache, greedy and sampled decoding at any ZeRO stage, with
tensor parallelism or offloaded parameters; `init_inference`, DeepSpeed-Inference's interface.

generate(sm, params, input_ids, attention_mask=None, *, max_new_tokens=None, ...)
    token ids continued by the model of `sm` with `params`, the same on every rank
    (`specs/generation.md`).
init_inference(model, config=None, **kwargs) -> InferenceEngine
    DeepSpeed-Inference's entry point: tensor parallelism, dtype (int8 weight-only too),
    max_out_tokens, checkpoint (`specs/inference.md`).
"""

from ._engine import InferenceEngine
from ._generate import generate
from ._inference_config import InferenceConfig
from ._init_inference import init_inference

__all__: list[str] = ["InferenceConfig", "InferenceEngine", "generate", "init_inference"]
