"""Run by a DeepSpeed interpreter (not fnzero's): DeepSpeed 0.19.8's own Ulysses sequence
parallelism on a tiny Llama over gloo, for `test_sequence_parallel_deepspeed.py` to compare with
fnzero. `python _ds_ulysses_runner.py SPEC.json`; SPEC names the `world` and its `jobs`, run one
after another in one process group (each DeepSpeed start costs seconds):

* `{"level": "module", "kv", "sp", "rows", "samples", "out"}`: the model registered with
  `UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size=rows)`, fed
  by `UlyssesSPDataLoaderAdapter` over a DataLoader of this rank's samples; each micro-batch's
  forward, the loss of transformers' `deepspeed_sp_compute_loss` and a backward. Rank r writes to
  `out.r` per micro-batch: its shard, logits, loss, local share and local gradients.
* `{"level": "engine", "kv", "sp", "config", "samples", "out"}`: the same through
  `deepspeed.initialize(..., mpu=parallel_state_sp)` and transformers' own
  `deepspeed_sp_compute_loss`, `gradient_accumulation_steps` micro-batches per step; rank 0 writes
  {"losses", "params"} to `out`.

`samples` is a torch file {"input_ids", "labels"}, each (micro-batches, data-parallel groups, rows,
tokens): micro-batch m of data-parallel group d is what sequence-parallel group d processes m-th.
The adapter gives the group's ranks each other's samples in turn (its `refill` all-gathers one
batch from every rank and serves them in rank order; `__len__` is the loader's times sp), so rank
j of group d loads micro-batches j, j + sp, j + 2 sp, ... of its group (`rank_samples`).

The ranks meet through a file store, as `_ds_universal_runner.py`'s do (a fresh file per launch,
no TCP port to race for). The test imports `build_llama` and `rank_samples` from here, so both
sides build the same model and agree on the order; nothing here imports fnzero or, at import
time, DeepSpeed.
"""

from __future__ import annotations

import types

import torch

from _ds_gloo import init_deepspeed_gloo, run_ranks

V, S = 51, 16  # vocabulary; tokens per sample


def build_llama(kv: int, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A tiny Llama (4 heads, `kv` kv heads), seed 0, sdpa; built from its config, nothing downloaded."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=22, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)


def rank_samples(samples: dict, rank: int, sp: int) -> list[dict]:
    """The rows rank `rank`'s DataLoader yields, in order: micro-batches j, j + sp, ... of its
    data-parallel group d (rank = d·sp + j), each with position ids 0, 1, ... (the adapter requires them)."""
    d, j = divmod(rank, sp)
    ids, labels = samples["input_ids"], samples["labels"]
    rows = []
    for m in range(j, ids.shape[0], sp):
        for r in range(ids.shape[2]):
            rows.append({"input_ids": ids[m, d, r], "labels": labels[m, d, r],
                         "position_ids": torch.arange(ids.shape[3])})
    return rows


def _worker(rank: int, spec: dict, store: str) -> None:
    world = spec["world"]
    deepspeed = init_deepspeed_gloo(rank, world, store)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    for job in spec["jobs"]:
        # register_with_transformers overwrites the "sdpa" entry with its wrapper and builds the sp
        # groups once per process: put the plain function back and let it build them again, so
        # each job (its own kv heads, micro-batch) wraps plain sdpa once.
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

        mpu._release_sequence_parallel_groups()
        {"module": _module_job, "engine": _engine_job}[job["level"]](deepspeed, job, rank)
        torch.distributed.barrier()


def _registered(job: dict, model: torch.nn.Module, rows: int):
    """DeepSpeed's Ulysses installed for `model` and its adapter over this rank's samples; (mpu, loader)."""
    from torch.utils.data import DataLoader

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", job["sp"], micro_batch_size=rows)
    groups.mpu = mpu  # what deepspeed.initialize(mpu=) records; transformers' loss reads the sp group there
    dl = DataLoader(rank_samples(torch.load(job["samples"]), torch.distributed.get_rank(), job["sp"]),
                    batch_size=rows)
    loader = UlyssesSPDataLoaderAdapter(dl, sp_rank=mpu.get_sequence_parallel_rank(),
                                        sp_group=mpu.get_sequence_parallel_group(),
                                        sp_world_size=mpu.get_sequence_parallel_world_size(), device="cpu")
    assert len(loader) == len(dl) * job["sp"]
    return mpu, loader


def _sp_loss(call, inputs: dict, sp: int) -> torch.Tensor:
    """transformers' `deepspeed_sp_compute_loss` (integrations/deepspeed.py, 5.25) on `call`."""
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    pc = types.SimpleNamespace(sp_backend="deepspeed", sp_size=sp)
    return deepspeed_sp_compute_loss(None, call, dict(inputs), False, pc)


def _module_job(deepspeed, job: dict, rank: int) -> None:
    """Forward and backward of each micro-batch on the plain module (no engine): what the ranks hold.

    The loss is `deepspeed_sp_compute_loss`'s formula written out in the model's dtype: transformers'
    function casts the loss to float32 (`loss.float()`, and its model loss casts the logits), which
    would leave float32 rounding in float64 gradients. Its value is checked against the function's
    own (`tf_loss`, float32)."""
    model = build_llama(job["kv"])
    mpu, loader = _registered(job, model, job["rows"])
    group = mpu.get_sequence_parallel_group()
    results = []
    for batch in loader:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        labels = batch["shift_labels"]
        mean = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        good = (labels != -100).sum()
        local_sum = torch.where(good > 0, mean, 0.0) * good
        totals = torch.stack((local_sum.detach(), good.to(local_sum.dtype)))
        torch.distributed.all_reduce(totals, group=group)
        loss = (local_sum + (totals[0] - local_sum.detach())) / totals[1].clamp(min=1)
        loss.backward()
        tf_loss = _sp_loss(lambda **kw: types.SimpleNamespace(loss=mean.detach().float()),
                           {**batch, "shift_labels": labels}, job["sp"])
        results.append({"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
                        "shift_labels": labels, "logits": out.logits.detach(), "loss": loss.detach(),
                        "share": (local_sum / totals[1]).detach(), "tf_loss": tf_loss.detach(),
                        "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    torch.save(results, f"{job['out']}.{rank}")


def _engine_job(deepspeed, job: dict, rank: int) -> None:
    """`steps` optimizer steps of an engine at the job's ZeRO stage, transformers' SP loss."""
    cfg = job["config"]
    model = build_llama(job["kv"], torch.float32)
    mpu, loader = _registered(job, model, cfg["train_micro_batch_size_per_gpu"])
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg, mpu=mpu)
    zero3 = None
    if cfg["zero_optimization"]["stage"] == 3:
        # transformers multiplies each rank's share by sp where DeepSpeed < 0.20.2's ZeRO-3
        # averages gradients over the sp ranks: it asks `is_deepspeed_zero3_enabled()`, which a live
        # HfDeepSpeedConfig answers (created after the model, so that from_config built it whole).
        from transformers.integrations import HfDeepSpeedConfig

        zero3 = HfDeepSpeedConfig(cfg)
    losses, micro = [], eng.gradient_accumulation_steps()
    for i, batch in enumerate(loader):
        # The adapter cuts each tensor `[:, a:b].cpu()`: a copy from a GPU, but on CPU a strided view,
        # whose rows > 1 transformers' loss cannot take ("view size is not compatible with input
        # tensor's size and stride", `shift_labels.view(-1)` in ForCausalLMLoss). Made contiguous
        # here, as the copy from a GPU makes them.
        batch = {k: v.contiguous() if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = _sp_loss(eng, batch, job["sp"])
        eng.backward(loss)
        eng.step()
        if i % micro == 0:
            losses.append(0.0)
        losses[-1] += float(loss.detach()) / micro
    del zero3
    params = {}
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):  # a no-op below ZeRO-3
            params[name] = p.detach().clone()
    # Each step's loss is its sp group's (the engine does not average it over data-parallel groups).
    total = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(total)
    if rank == 0:
        torch.save({"losses": (total / torch.distributed.get_world_size()).tolist(), "params": params}, job["out"])


if __name__ == "__main__":
    run_ranks(_worker)
