"""Run by a DeepSpeed interpreter (not fnzero's): train a two-stage DeepSpeed PipelineModule, save it,
resume it in a fresh engine and take more steps. `python _ds_pipe_runner.py SPEC.json`; SPEC names
the world size, the config, the batches to train (`first`) and to continue with (`more`), each a
list of global (x, y), the checkpoint directory (`save`) and where to write {"losses", "params",
"global_steps"} of the continued run (`out`). Each global step is `train_batch` over the config's
`gradient_accumulation_steps` micro-batches of the batch's rows. The test imports `build_layers`
from here too, so both sides train the same layers; nothing here imports fnzero or, at import
time, DeepSpeed.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch

from _ds_gloo import init_deepspeed_gloo

STAGES = 2


def build_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)]


def _engine(deepspeed, config: dict):
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(layers=build_layers(), num_stages=STAGES, loss_fn=torch.nn.MSELoss(),
                            partition_method="uniform")
    eng, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    return eng


def _step(eng, x: torch.Tensor, y: torch.Tensor) -> float:
    gas = eng.gradient_accumulation_steps()
    micro = x.shape[0] // gas
    batches = [(x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]) for k in range(gas)]
    return float(eng.train_batch(data_iter=iter(batches)))


def _worker(rank: int, spec: dict, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed = init_deepspeed_gloo(rank, spec["world"])
    eng = _engine(deepspeed, spec["config"])
    for x, y in torch.load(spec["first"]):
        _step(eng, x, y)
    eng.save_checkpoint(spec["save"])
    eng = _engine(deepspeed, spec["config"])
    eng.load_checkpoint(spec["save"])
    losses = [_step(eng, x, y) for x, y in torch.load(spec["more"])]
    mine = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    every = [None] * spec["world"]
    torch.distributed.all_gather_object(every, mine)  # (each stage holds its own layers)
    if rank == 0:
        params = {n: t for part in every for n, t in part.items()}
        torch.save({"losses": losses, "params": params, "global_steps": eng.global_steps}, spec["out"])


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(spec, port), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main()
