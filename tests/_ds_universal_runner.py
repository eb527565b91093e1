"""Run by a DeepSpeed interpreter (not fnzero's): resume a checkpoint (universal, or DeepSpeed's own)
with DeepSpeed and take the given steps. `python _ds_universal_runner.py SPEC.json`; SPEC names the
world size and `jobs`, each (or SPEC itself, as one job) naming the checkpoint root `load`, the
batches file (a list of global (x, y)), the `model` ("mlp", the default, or "llama") and `runs`, each
a config (one engine after another in the same process group) and where to write {"losses",
"params", "masters", "global_steps", ...}. An optional `train` ({"config", "batches", "save", "out"?,
"universal"?}) first trains a fresh engine on its batches and saves it with `save_checkpoint` (the
checkpoint the runs then resume), writing to `out` what the engine held when it saved ({name:
{"param", "master", "exp_avg", "exp_avg_sq"}}, whole); with `"universal": true` rank 0 then converts
it with DeepSpeed's own `ds_to_universal` into the tag `<tag>_universal` beside it (and
`latest_universal`), as its command line does. Each global step is `gradient_accumulation_steps`
micro-batches of this rank's rows. The test imports `build_model` and `loss_of` from here too, so
both sides train the same module on the same loss; nothing here imports fnzero or, at import time,
DeepSpeed.

The ranks meet through a file store (`init_method="file://..."`, a fresh file in a fresh directory
per launch), not a TCP port: a port picked free by binding port 0 and closing it can be taken by
another process before rank 0 binds it again ("address already in use"); gloo's own connections
then bind ports the kernel assigns, which cannot race.
"""

from __future__ import annotations

import os
import sys

import torch

from _ds_gloo import init_deepspeed_gloo, run_ranks

IN, HIDDEN, OUT = 8, 6, 4
VOCAB, SEQ = 64, 8  # the Llama's


def build_model(kind: str = "mlp") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":  # tiny, built from its config: nothing is downloaded
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                          tie_word_embeddings=True)
        return LlamaForCausalLM(cfg)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def loss_of(kind: str, call, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss both sides compute, in float32, `call` running the model. The Llama's is next-token
    cross-entropy computed here, not by transformers (`labels=`), so that both sides compute it the
    same way whatever the model's dtype."""
    if kind == "llama":
        logits = call(input_ids=x).logits.float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return torch.nn.functional.mse_loss(call(x).float(), y)


def _worker(rank: int, spec: dict, store: str) -> None:
    world = spec["world"]
    deepspeed = init_deepspeed_gloo(rank, world, store)
    for job in spec.get("jobs") or [spec]:
        _job(deepspeed, job, rank, world)


def _job(deepspeed, job: dict, rank: int, world: int) -> None:
    kind = job.get("model", "mlp")
    if "train" in job:
        t = job["train"]
        model = build_model(kind)
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=t["config"])
        for x, y in torch.load(t["batches"]):
            _global_step(eng, kind, x, y, rank, world)
        eng.save_checkpoint(t["save"])
        held = _held(deepspeed, eng)
        if rank == 0 and "out" in t:
            torch.save(held, t["out"])
        if t.get("universal") and rank == 0:
            _to_universal(t["save"])
        torch.distributed.barrier()
    batches = torch.load(job["batches"])
    for run in job["runs"]:
        result = _resume_and_step(deepspeed, kind, run["config"], job["load"], batches, rank, world)
        if rank == 0:
            torch.save(result, run["out"])


def _to_universal(root: str) -> None:
    """`python -m deepspeed.checkpoint.ds_to_universal --input_folder ROOT/TAG --output_folder
    ROOT/TAG_universal --inject_missing_state` (a plain model records no `universal_checkpoint_info`,
    which the converter asks for at ZeRO-1/2 unless told to inject it), in this process."""
    from deepspeed.checkpoint import ds_to_universal

    with open(os.path.join(root, "latest")) as f:
        tag = f.read().strip()
    argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", os.path.join(root, tag), "--output_folder",
                os.path.join(root, f"{tag}_universal"), "--num_extract_workers", "1", "--num_merge_workers", "1",
                "--inject_missing_state"]
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv


def _resume_and_step(deepspeed, kind: str, config: dict, load: str, batches, rank: int, world: int) -> dict:
    """A fresh engine loads `load` and takes one step per global batch on this rank's rows."""
    model = build_model(kind)
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    eng.load_checkpoint(load)
    losses, lrs = [], []
    for x, y in batches:
        lrs.append(eng.get_lr()[0])  # the lr the step applies
        losses.append(_global_step(eng, kind, x, y, rank, world))
    held = _held(deepspeed, eng)
    return {"losses": losses, "global_steps": eng.global_steps, "skipped_steps": eng.skipped_steps, "lrs": lrs,
            "params": {n: h["param"].float() for n, h in held.items()},
            "masters": {n: h["master"] for n, h in held.items()}, "loss_scale": float(getattr(eng.optimizer, "loss_scale", 1.0)), "optimizer": type(eng.optimizer).__name__}


def _held(deepspeed, eng) -> dict:
    """{name: {"param", "master", "exp_avg", "exp_avg_sq"}}: what the engine holds for each
    parameter, whole: the parameter in its own dtype, the rest in fp32 (collectives at ZeRO-1..3:
    every rank calls it)."""
    out = {}
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):  # a no-op below ZeRO-3
            param = p.detach().clone()
        master = deepspeed.utils.safe_get_full_fp32_param(p)
        if master is not None:  # ZeRO-1..3 and BF16_Optimizer
            out[name] = {"param": param, "master": master.detach().clone(),
                         **{k: deepspeed.utils.safe_get_full_optimizer_state(p, k).detach().clone()
                            for k in ("exp_avg", "exp_avg_sq")}}
            continue
        # Stage 0: a 16-bit run's unfused optimizer steps an fp32 copy of each parameter
        # (`fp32_groups`); an fp32 run's optimizer is torch's own, stepping the parameter itself.
        assert eng.zero_optimization_stage() == 0, (eng.zero_optimization_stage(), type(eng.optimizer).__name__)
        opt = eng.optimizer
        hp, base = p, opt
        for lp_group, hp_group in zip(getattr(opt, "fp16_groups", ()), getattr(opt, "fp32_groups", ())):
            for lp, fp32 in zip(lp_group, hp_group):
                if lp is p:
                    hp, base = fp32, opt.optimizer
        assert hp.dtype == torch.float32, hp.dtype
        out[name] = {"param": param, "master": hp.detach().clone(),
                     **{k: base.state[hp][k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}}
    return out


def _global_step(eng, kind: str, x, y, rank: int, world: int) -> float:
    """One optimizer step on this rank's rows of global batch (x, y), in micro-batches; the loss
    averaged over them and the ranks."""
    rows = x.shape[0] // world
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    gas = eng.gradient_accumulation_steps()
    micro, total = rows // gas, torch.zeros(())
    if xs.is_floating_point():  # a 16-bit engine's module is 16-bit; the loss stays float32
        xs = xs.to(next(eng.module.parameters()).dtype)
    for k in range(gas):
        loss = loss_of(kind, eng, xs[k * micro:(k + 1) * micro], ys[k * micro:(k + 1) * micro])
        eng.backward(loss)
        eng.step()
        total += loss.detach() / gas
    torch.distributed.all_reduce(total)
    return float(total) / world


if __name__ == "__main__":
    run_ranks(_worker)
