"""Generation from a sharded model: a KV cache, greedy and sampled decoding at any ZeRO stage, with
tensor parallelism or offloaded parameters; `init_inference`, DeepSpeed-Inference's interface."""

from ._engine import InferenceEngine
from ._inference_config import InferenceConfig
from ._init_inference import init_inference

__all__: list[str] = ["InferenceConfig", "InferenceEngine", "init_inference"]
