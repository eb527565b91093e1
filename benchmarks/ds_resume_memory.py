"""Peak resident memory of one rank resuming a DeepSpeed ZeRO-3 checkpoint
(specs/checkpoint-format.md §DeepSpeed, "Memory and files").

Writes a float32 AdamW ZeRO-3 checkpoint of LAYERS Linear(H, H) layers as DeepSpeed 0.19.8 lays
it out at world 2 (per-parameter slices in `fp32_flat_groups` and both moments, one optimizer file
per rank), then, each in a fresh process, resumes it into a ZeRO-3 state at world 1 and into rank 1
of 2 (a simulated world: only rank 1 loads) and reports the rise of the process's peak RSS
(`ru_maxrss`) over its RSS just before `load`, next to the bytes the rank's share holds.

    python benchmarks/ds_resume_memory.py [LAYERS] [H]
"""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections import OrderedDict

import torch

TAG = "global_step3"


def _model(layers: int, h: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(h, h) for _ in range(layers)])


def write(root: str, layers: int, h: int, world: int = 2) -> None:
    shapes = OrderedDict((n, p.shape) for n, p in _model(layers, h).named_parameters())
    d = os.path.join(root, TAG)
    os.makedirs(d)
    g = torch.Generator().manual_seed(0)
    fields = {f: {n: torch.randn(s, generator=g) for n, s in shapes.items()} for f in ("fp32", "exp_avg", "exp_avg_sq")}
    meta = {"buffer_names": [], "optimizer": None, "param_shapes": [shapes], "frozen_param_shapes": None,
            "shared_params": {}, "lr_scheduler": None, "skipped_steps": 0, "global_steps": 3, "global_samples": 6,
            "dp_world_size": world, "mp_world_size": 1, "ds_version": "0.19.8",
            "ds_config": {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}}
    for r in range(world):
        flat = {}
        for f, ts in fields.items():
            parts = []
            for t in ts.values():
                ps = -(-t.numel() // world)
                parts.append(torch.nn.functional.pad(t.reshape(-1), (0, ps * world - t.numel()))[r * ps:(r + 1) * ps])
            flat[f] = torch.cat(parts)
        osd = {"zero_stage": 3, "partition_count": world, "fp32_flat_groups": [flat["fp32"]],
               "optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": flat["exp_avg"],
                                                      "exp_avg_sq": flat["exp_avg_sq"]}},
                                        "param_groups": [{"lr": 1e-3, "params": [0]}]}}
        torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"},
                   os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        module = OrderedDict((n, torch.empty(0)) for n in shapes)
        torch.save({"module": module, **meta}, os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(TAG)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def measure(root: str, layers: int, h: int, world: int) -> dict:
    import fnzero
    from fnzero.checkpoint import load
    from fnzero.testing._threads import simulated_world

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    out, model = {}, _model(layers, h)

    def fn(comm):
        like = fnzero.shard(copy.deepcopy(model), config=fnzero.load_config(cfg, world_size=world), comm=comm).init_state()
        comm.barrier()  # (every rank's state allocated before the last one measures)
        if comm.rank == world - 1:
            before = _rss_kib()
            state, _ = load(root, like=like)
            share = sum(t.numel() * t.element_size() for t in (*state.params.values(),
                                                                *state.opt_state.exp_avg.values(),
                                                                *state.opt_state.exp_avg_sq.values()))
            out.update(before_mib=before / 1024, peak_rise_mib=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                - before) / 1024, share_mib=share / 2**20)
        comm.barrier()  # (the other ranks keep their states, so none is freed while the last one loads)
        return None

    simulated_world(world).run(fn)
    return out


def main() -> None:
    layers, h = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (8, 1024)))
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ds")
        subprocess.run([sys.executable, __file__, "--write", root, str(layers), str(h)], check=True)
        files = sorted(os.listdir(os.path.join(root, TAG)))
        sizes = {f: os.path.getsize(os.path.join(root, TAG, f)) / 2**20 for f in files if "optim" in f}
        print(f"{layers} x Linear({h}, {h}): optimizer files {', '.join(f'{v:.0f} MiB' for v in sizes.values())}")
        for world in (1, 2):
            run = subprocess.run([sys.executable, __file__, "--measure", root, str(layers), str(h), str(world)],
                                 capture_output=True, text=True)
            if run.returncode:
                sys.exit(run.stderr[-3000:])
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"world {world} (rank {world - 1}): share {r['share_mib']:.0f} MiB, peak RSS rises "
                  f"{r['peak_rise_mib']:.0f} MiB over {r['before_mib']:.0f} MiB while loading")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["--measure"]:
        torch.set_num_threads(1)
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
    else:
        main()
