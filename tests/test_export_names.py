"""An export holds what the model's own save writes (`specs/checkpoint-format.md` §Export,
`fnzero/sharding/zero/_saved_names.py`): for a transformers model the key set of its own
`save_pretrained`, so `from_pretrained` reloads it without a load report or a warning and with
the same logits; never a non-persistent buffer, so `tied="copy"` loads strictly into any model.

Five architectures, each for what its save leaves out or renames: Llama (rotary `inv_freq` and
`original_inv_freq`, non-persistent), GPT-2 (tied head), T5 (three names of the shared
embedding), BERT (tied decoder weight and bias, non-persistent `position_ids`), GPT-NeoX (its
head is `embed_out.weight` in its files). Small float64 models from configs, nothing downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import logging
import os
import warnings

import msgpack
import pytest
import safetensors
import safetensors.torch as st
import torch
import transformers

import fnzero
from fnzero.checkpoint import _format as F
from fnzero.checkpoint import export, export_live, save
from fnzero.testing import simulated_world

T = transformers
IDS = torch.randint(1, 60, (2, 6), generator=torch.Generator().manual_seed(0))
MODELS = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                                      num_hidden_layers=2, num_attention_heads=2,
                                                      num_key_value_heads=1, max_position_embeddings=16)),
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                                   bos_token_id=0, eos_token_id=0)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=1,
                                                          num_heads=2, decoder_start_token_id=0, pad_token_id=0)),
    "bert": lambda: T.BertForMaskedLM(T.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=24,
                                                   max_position_embeddings=16)),
    "neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=24,
                                                         max_position_embeddings=16)),
}
CFG = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})


def _model(kind):
    torch.manual_seed(0)
    return MODELS[kind]().double().eval()


def _logits(model):
    extra = {"decoder_input_ids": IDS[:, :3]} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        return model(input_ids=IDS, **extra).logits


def _keys(directory) -> set[str]:
    out = set()
    for f in glob.glob(os.path.join(directory, "*.safetensors")):
        with safetensors.safe_open(f, "pt") as g:
            out |= set(g.keys())
    return out


@contextlib.contextmanager
def _transformers_says():
    """Every warning and every transformers log record of WARNING or above in the block (other
    test modules may have set transformers' verbosity to error: set to warning here)."""
    records, said = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    level = T.logging.get_verbosity()
    T.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
    finally:
        logger.removeHandler(handler)
        T.logging.set_verbosity(level)
    said += [r.getMessage() for r in records] + [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", list(MODELS))
def test_export_writes_what_save_pretrained_writes_and_reloads_quietly(tmp_path, kind):
    """export_live (the sharded model's) and export from the checkpoint (no model: the index
    carries the names) write exactly save_pretrained's keys; from_pretrained of either says
    nothing and computes the model's logits bit for bit (float64, the same ops)."""
    base = _model(kind)
    base.save_pretrained(tmp_path / "theirs")
    want = _keys(tmp_path / "theirs")
    ck, live = str(tmp_path / "ck"), str(tmp_path / "live")

    def rank(comm):
        sm = fnzero.shard(copy.deepcopy(base), config=CFG, comm=comm)
        state = sm.init_state()
        save(ck, state)
        export_live(sm, state, live, dtype="fp64", progress=False)

    simulated_world(2).run(rank)
    export(ck, tmp_path / "files", dtype="fp64", hf_config=base, progress=False)
    for where in (live, str(tmp_path / "files")):
        assert _keys(where) == want, (where, sorted(_keys(where) ^ want))
        with _transformers_says() as said:
            reloaded = type(base).from_pretrained(where).eval()
        assert said == [], (where, said)
        assert torch.equal(_logits(reloaded), _logits(base)), where


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tied_copy_is_every_state_dict_name_and_first_each_tensor_once(tmp_path, kind):
    """`tied="copy"`: model.state_dict()'s keys, tied names as copies and no non-persistent
    buffer, so a strict load_state_dict works; `tied="first"`: each tensor once."""
    base = _model(kind)
    sm = fnzero.shard(copy.deepcopy(base), config=CFG)
    state = sm.init_state()
    copies = export_live(sm, state, tmp_path / "copy", tied="copy", dtype="fp64", progress=False, hf_config=False)[0]
    fresh = MODELS[kind]().double()
    fresh.load_state_dict(st.load_file(copies))  # strict
    assert torch.equal(_logits(fresh.eval()), _logits(base))
    first = export_live(sm, state, tmp_path / "first", tied="first", progress=False, hf_config=False)[0]
    held = {n for n, _ in base.named_parameters()} | {n for n, _ in base.named_buffers()}
    assert st.load_file(first).keys() == held - set(sm.plan.saved.non_persistent)


def _index(ck: str) -> str:
    with open(os.path.join(ck, "latest")) as f:
        return os.path.join(ck, f.read().strip(), F.INDEX_NAME)


def test_a_checkpoint_saved_before_the_names_were_recorded_exports_as_then(tmp_path):
    """An index without the fields (a version 1 index: no seal to recompute) exports every
    buffer and every tied name, as exports did; a malformed field is one CheckpointError."""
    ck = str(tmp_path / "ck")
    save(ck, fnzero.shard(_model("llama"), config=CFG).init_state())
    with open(_index(ck), "rb") as f:
        ix = msgpack.unpackb(f.read(), raw=False)
    assert ix["non_persistent"] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert ix["pretrained_names"] == []  # an untied Llama: save_pretrained writes every state_dict name
    for field in ("index_crc32", "non_persistent", "pretrained_names"):
        ix.pop(field)
    with open(_index(ck), "wb") as f:
        f.write(msgpack.packb(dict(ix, version=1), use_bin_type=True))
    old = st.load_file(export(ck, tmp_path / "old", progress=False)[0])
    assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= old.keys()
    with open(_index(ck), "wb") as f:
        f.write(msgpack.packb(dict(ix, version=1, non_persistent="inv_freq"), use_bin_type=True))
    with pytest.raises(fnzero.CheckpointError, match="index.non_persistent: expected a list of buffer names"):
        export(ck, tmp_path / "bad", progress=False)


def test_a_pipelines_index_lists_every_stages_non_persistent_buffers():
    """Rank 0 commits a pipeline's index from its own stage's head: the other stages' buffers
    come from their parts, so `export` from the files leaves out every stage's."""
    from fnzero.checkpoint._pp import merge_pipelined

    parts = [{"pipeline_stage": stage, "rank": stage, "size": 0, "rng": {}, "tensors": {}, "stage_units": [],
              "stage_non_persistent": names} for stage, names in ((1, ["2.rope.inv_freq"]), (0, ["0.rope.inv_freq"]))]
    index = merge_pipelined(parts, {"non_persistent": ["0.rope.inv_freq"]})
    assert index["non_persistent"] == ["0.rope.inv_freq", "2.rope.inv_freq"]
