"""Run by a DeepSpeed interpreter (not fnzero's): resume a checkpoint (universal, or DeepSpeed's own)
with DeepSpeed and take the given steps. `python _ds_universal_runner.py SPEC.json`; SPEC names the
checkpoint root, the world size, the batches file (a list of global (x, y)) and `runs`, each a
config (one engine after another in the same process group) and where to write {"losses",
"params", "global_steps"}. An optional `train` ({"config", "batches", "save"}) first trains a fresh
engine on its batches and saves it with `save_checkpoint` (the checkpoint the runs then resume);
with `"universal": true` rank 0 then converts it with DeepSpeed's own `ds_to_universal` into the tag
`<tag>_universal` beside it (and `latest_universal`), as its command line does.
Each global step is `gradient_accumulation_steps` micro-batches of this rank's rows. The test imports `build_model` from here too, so both
sides train the same module; nothing here imports fnzero or, at import time, DeepSpeed.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch

IN, HIDDEN, OUT = 8, 6, 4


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _worker(rank: int, spec: dict, port: int) -> None:
    world = spec["world"]
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    # On CPU, DeepSpeed's TorchBackend JIT-builds a shared-memory op on init (a minute, or a hang on
    # a stale build lock); gloo needs none of it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if "train" in spec:
        t = spec["train"]
        model = build_model()
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=t["config"])
        for x, y in torch.load(t["batches"]):
            _global_step(eng, x, y, rank, world)
        eng.save_checkpoint(t["save"])
        if t.get("universal") and rank == 0:
            _to_universal(t["save"])
        torch.distributed.barrier()
    batches = torch.load(spec["batches"])
    for run in spec["runs"]:
        result = _resume_and_step(deepspeed, run["config"], spec["load"], batches, rank, world)
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


def _resume_and_step(deepspeed, config: dict, load: str, batches, rank: int, world: int) -> dict:
    """A fresh engine loads `load` and takes one step per global batch on this rank's rows."""
    model = build_model()
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    eng.load_checkpoint(load)
    losses, lrs = [], []
    for x, y in batches:
        lrs.append(eng.get_lr()[0])  # the lr the step applies
        losses.append(_global_step(eng, x, y, rank, world))
    params, masters = {}, {}
    for name, p in eng.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):  # a no-op below ZeRO-3
            params[name] = p.detach().clone().float()
        master = deepspeed.utils.safe_get_full_fp32_param(p)  # collective; None below ZeRO (stage 0)
        assert master is not None or eng.zero_optimization_stage() == 0, (name, eng.zero_optimization_stage())
        masters[name] = (master if master is not None else params[name]).detach().clone()
    return {"losses": losses, "params": params, "global_steps": eng.global_steps, "skipped_steps": eng.skipped_steps,
            "lrs": lrs, "masters": masters, "loss_scale": float(getattr(eng.optimizer, "loss_scale", 1.0))}


def _global_step(eng, x, y, rank: int, world: int) -> float:
    """One optimizer step on this rank's rows of global batch (x, y), in micro-batches; the loss
    averaged over them and the ranks."""
    rows = x.shape[0] // world
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    gas = eng.gradient_accumulation_steps()
    micro, total = rows // gas, torch.zeros(())
    xs = xs.to(next(eng.module.parameters()).dtype)  # an fp16 engine's module is half; the loss stays float32
    for k in range(gas):
        out = eng(xs[k * micro:(k + 1) * micro]).float()
        loss = torch.nn.functional.mse_loss(out, ys[k * micro:(k + 1) * micro])
        eng.backward(loss)
        eng.step()
        total += loss.detach() / gas
    torch.distributed.all_reduce(total)
    return float(total) / world


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    if spec["world"] == 1:
        _worker(0, spec, port)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(spec, port), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main()
