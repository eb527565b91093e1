"""Generation from a sharded model: a KV cache, greedy and sampled decoding at any ZeRO stage, with
tensor parallelism or offloaded parameters; `init_inference`, DeepSpeed-Inference's interface."""

__all__: list[str] = []
