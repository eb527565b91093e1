"""Hugging Face causal LMs (GPT-2, and the Llama layout: Mistral, Qwen2, Qwen3, ...) as pipeline
layers, wrapping the model's own modules (`specs/mesh.md` §Pipeline); a head tied to the input
embedding on another stage is a `TiedWeight`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ShardingError
from ..sharding import PipelineModule, token_positions

__all__ = ["causal_lm_loss", "hf_causal_lm", "hf_pipeline_layers", "shifted_causal_lm_loss"]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position t predicts label t+1, labels of -100 are ignored,
    the mean over the rest; 16-bit logits are upcast to fp32 (wider ones are kept)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def shifted_causal_lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """`causal_lm_loss` of labels already shifted (position t's label is token t+1): what a pipeline
    with a sequence axis takes, its labels shifted before the sequence was cut (`shard_sequence`'s
    `shift_labels`)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100)


def _positions(inner: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # From this rank's run of the tokens under sequence parallelism (`token_positions`), else 0, 1, ...;
    # asked of the model's own module the layer wraps, which the stage holds under the model's name.
    return token_positions(inner, x).unsqueeze(0)


def _causal_mask(config, x: torch.Tensor, pos: torch.Tensor):
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)


class _GPT2Embeddings(nn.Module):
    def __init__(self, tr: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = tr.wte, tr.wpe, tr.drop

    def forward(self, input_ids):
        return self.drop(self.wte(input_ids) + self.wpe(_positions(self.wpe, input_ids)))


class _GPT2Layer(nn.Module):
    def __init__(self, block: nn.Module, config):
        super().__init__()
        self.block, self._config = block, config

    def forward(self, x):
        pos = _positions(self.block, x)
        out = self.block(x, None, _causal_mask(self._config, x, pos), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out


class _LlamaEmbeddings(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed_tokens = embed

    def forward(self, input_ids):
        return self.embed_tokens(input_ids)


class _LlamaLayer(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module, config):
        super().__init__()
        self.layer, self.rotary, self._config = layer, rotary, config

    def forward(self, x):
        pos = _positions(self.layer, x)
        out = self.layer(x, attention_mask=_causal_mask(self._config, x, pos), position_ids=pos,
                         position_embeddings=self.rotary(x, pos))
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x):
        return self.lm_head(self.norm(x))


def hf_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """`model` (a Hugging Face causal LM) as a list of pipeline layers sharing its modules."""
    config = getattr(model, "config", None)
    tr, base = getattr(model, "transformer", None), getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if tr is not None and all(hasattr(tr, a) for a in ("wte", "wpe", "h", "ln_f")) and head is not None:
        return [_GPT2Embeddings(tr), *(_GPT2Layer(b, config) for b in tr.h), _Head(tr.ln_f, head)]
    if base is not None and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            and head is not None:
        return [_LlamaEmbeddings(base.embed_tokens), *(_LlamaLayer(layer, base.rotary_emb, config) for layer in base.layers),
                _Head(base.norm, head)]
    kind = getattr(config, "model_type", None) or type(model).__name__
    raise ShardingError(
        f"fnzero does not know how to cut a {kind} into pipeline layers (it knows GPT-2's and Llama's layouts); give "
        "fnzero.PipelineModule a list of layers, each taking the previous one's output")


def hf_causal_lm(model: nn.Module, loss_fn=causal_lm_loss, **kwargs) -> PipelineModule:
    """A PipelineModule of a Hugging Face causal LM with its loss (`causal_lm_loss`; with a
    sequence axis, `shifted_causal_lm_loss`), its parameters under the model's own names; a batch
    is `(input_ids, labels)`, usually `(ids, ids)`. `kwargs` go to PipelineModule (num_stages,
    partition_method, activation_checkpoint_interval)."""
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # no KV cache in training
    return PipelineModule(hf_pipeline_layers(model), loss_fn, names_from=model, **kwargs)
