"""ZeRO stages against DDP and FSDP2 on the same GPT, in one invocation (CPU and gloo, or CUDA and NCCL).

    python benchmarks/bench_zero.py                       # 27.4M GPT, 2 ranks x 1 thread
    python benchmarks/bench_zero.py --model gpt100m --world 4 --configs z0,z3 --steps 2 --warmup 1
    python benchmarks/bench_zero.py --configs z3,z3_nvme,z3_nvme_params       # ZeRO-Infinity
    python benchmarks/bench_zero.py --configs ddp,z0,z3 --rounds 3           # medians of alternating rounds
    python benchmarks/bench_zero.py --configs ddp,z0,z0_jit,z3,z3_jit         # fnzero.jit on every rank
    python benchmarks/bench_zero.py --configs ddp,z0,z1,z2,z3 --rounds 3 --before a16ce74  # this tree vs a commit
    python benchmarks/bench_zero.py --device cuda --world 2                   # one GPU per rank, NCCL

For each configuration a fresh set of rank processes trains `warmup + steps` steps (micro-batch 4,
seq 128, fp32 AdamW, gradient norm clipped at `--clip` 1.0 in every configuration, so the final
losses agree within fp32 noise) and reports the slower rank's median step time, tokens/s, peak RSS above the
pre-model baseline (ru_maxrss), the model-state formula, and ring-equivalent bytes sent per rank
per step. Ratios are against DDP measured in the same run. The machine is shared: the "other
cores" column says how much CPU other processes used during the timed window.

`--before REF` measures every fnzero configuration a second time with the fnzero of git commit REF
(extracted to a scratch folder and its C extension built there), in the same rounds and alternating
order, and reports after/before ratios: a change's cost or gain measured side by side.

`--device cuda` puts rank r on accelerator r (NCCL); every framework's model, batches and step are
there, each timed step ends with a device synchronisation, and each row also reports the peak
device memory allocated (the RSS columns then count host memory only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import CpuMonitor, machine, median, rank_device  # noqa: E402

MODELS = {
    "gpt27m": dict(vocab_size=8192, seq_len=128, d_model=512, n_layer=6, n_head=8),
    "gpt100m": dict(vocab_size=8192, seq_len=128, d_model=768, n_layer=14, n_head=12),
    "gpt_tiny": dict(vocab_size=512, seq_len=32, d_model=64, n_layer=2, n_head=2),
}
LABELS = {
    "ddp": "DDP (torch AdamW default)",
    "ddp_fused": "DDP (torch AdamW fused)",
    "fsdp2": "FSDP2 fully_shard (AdamW default)",
    "z0": "fnzero ZeRO-0",
    "z1": "fnzero ZeRO-1",
    "z2": "fnzero ZeRO-2",
    "z3": "fnzero ZeRO-3",
    "z3_nvme": "fnzero ZeRO-3, optimizer on NVMe",
    "z3_nvme_params": "fnzero ZeRO-3, optimizer + params on NVMe",
    "z3_regather": "fnzero ZeRO-3, stage3_max_reuse_distance 0 (re-gathered for backward)",
    **{f"z{s}_jit": f"fnzero ZeRO-{s}, fnzero.jit (per unit)" for s in range(4)},
}
# Model-state bytes per rank *in memory* beside the ZeRO formula, for Ψ params, N ranks, fp32:
# NVMe holds the master and moments (12Ψ/N), and with offload_param the parameter shards as well.
# The store's staging buffers (4 x 3 x 2^20 x 4 bytes = 48 MiB) come on top.
IN_MEMORY = {"z3_nvme": 8, "z3_nvme_params": 4}


def _rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sync(device) -> None:
    # An accelerator runs the step asynchronously: a step's time ends when its kernels have.
    import torch

    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def worker(kind: str, model_kw: dict, micro: int, steps: int, warmup: int, malloc_threshold: int = 0,
           remat: bool = False, nvme_dir: str | None = None, device: str = "cpu", clip: float = 1.0):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fnzero
    from fnzero.testing import GPT

    torch.set_num_threads(1)
    if malloc_threshold:
        # The same allocator setting for every framework measured (what fnzero.init_distributed does).
        fnzero.memory.return_freed_memory(malloc_threshold)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device(device)
    pre_model = _current_rss_mib()
    torch.manual_seed(0)
    model = GPT(**model_kw).to(dev)
    psi = sum(p.numel() for p in model.parameters())
    if remat:  # activation checkpointing of every block, the same for every framework
        for block in model.blocks:
            block.forward = fnzero.remat(block.forward)
    g = torch.Generator().manual_seed(rank)
    seq, vocab = model_kw["seq_len"], model_kw["vocab_size"]
    batches = [torch.randint(0, vocab, (micro, seq + 1), generator=g).to(dev) for _ in range(4)]
    times, losses, sent = [], [], 0.0

    if kind.startswith("z"):
        stage = int(kind[1])
        zero = {"stage": stage, "overlap_comm": True}  # as the examples; DeepSpeed resolves null to stage == 3
        if "nvme" in kind:
            # The store's staging buffers: buffer_count x 3 kinds x sub_group_size x 4 bytes.
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 4}
            zero["sub_group_size"] = 1 << 20
        if kind.endswith("params"):
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
        if kind == "z3_regather":  # the least memory: only the last unit stays gathered for backward
            zero["stage3_max_reuse_distance"] = 0
        cfg = fnzero.load_config({
            "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "gradient_clipping": clip,  # written out: every row clips at the same norm (`--clip`)
            "zero_optimization": zero,
            "comms_logger": {"enabled": True},
        }, world_size=world)
        sm = fnzero.shard(model, config=cfg, device=dev)
        del model
        state = sm.init_state()

        def loss_fn(params, b):
            return F.cross_entropy(sm.apply(params, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())

        step = fnzero.train_step(loss_fn, cfg, donate=True)
        if kind.endswith("_jit"):
            step = fnzero.jit(step)  # compiled during the first warm-up step, which is not timed
        for i in range(warmup + steps):
            sm.comm.reset()
            dist.barrier()
            _sync(dev)
            t = time.perf_counter()
            state, m = step(state, batches[i % 4])
            _sync(dev)
            times.append(time.perf_counter() - t)
            losses.append(m["loss"])
            if i == warmup + steps - 1:
                sent = sm.comm.ring_bytes_sent()
    else:
        if kind.startswith("ddp"):
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model)
            sent = 4 * psi * 2 * (world - 1) / world  # one fp32 all-reduce of the gradients
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(dev.type, (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            net = model
            sent = float("nan")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01, fused=kind == "ddp_fused" or None)
        for i in range(warmup + steps):
            b = batches[i % 4]
            dist.barrier()
            _sync(dev)
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
            loss.backward()
            if clip > 0:  # as fnzero's rows: the global norm over all ranks' gradients (DTensor-aware for FSDP2)
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            _sync(dev)
            times.append(time.perf_counter() - t)
            mean = loss.detach().clone()  # the mean over ranks, as fnzero's metric (outside the timed window)
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
    peak_dev = torch.get_device_module(dev).max_memory_allocated(dev) / 2**20 if dev.type != "cpu" else float("nan")
    return {"step_s": median(times[warmup:]), "peak_rss_mib": _rss_mib(), "pre_model_mib": pre_model, "peak_dev_mib": peak_dev,
            "psi": psi, "sent": sent, "loss": losses[-1], "fnzero": os.path.dirname(os.path.dirname(fnzero.__file__))}


def measure(kind: str, args, env: dict) -> dict:
    """One configuration, one fresh world: the slower rank's step time and the row's figures."""
    from fnzero.memory import zero_formula
    from fnzero.testing import run_world

    with CpuMonitor() as mon:
        res = run_world(worker, args.world, kind, MODELS[args.model], args.micro, args.steps, args.warmup,
                        args.malloc_mmap_threshold, args.remat, args.nvme_dir, args.device, args.clip, timeout=3600,
                        env=env, backend="gloo" if args.device == "cpu" else "nccl")
    slow = max(res, key=lambda r: r["step_s"])
    psi = slow["psi"]
    stage = int(kind[1]) if kind.startswith("z") else (3 if kind == "fsdp2" else 0)
    return dict(
        step_s=slow["step_s"],
        tok_s=args.world * args.micro * MODELS[args.model]["seq_len"] / slow["step_s"],
        rss=max(r["peak_rss_mib"] for r in res),
        rss_above=max(r["peak_rss_mib"] - r["pre_model_mib"] for r in res),
        peak_dev_mib=max(r["peak_dev_mib"] for r in res),
        theory=(IN_MEMORY[kind] * psi / args.world if kind in IN_MEMORY
                else zero_formula(psi, stage, args.world, False)) / 2**20,
        sent_mb=slow["sent"] / 1e6,
        loss=res[0]["loss"],
        other=mon.other_cores,
        psi=psi,
        fnzero=slow["fnzero"],
    )


def checkout(ref: str) -> str:
    """Commit `ref` of this repository extracted to a scratch folder, its C extension built there."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sha = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", ref + "^{commit}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = os.path.join(tempfile.gettempdir(), f"fnzero-bench-{sha[:12]}")
    if not os.path.exists(os.path.join(tree, "fnzero", "__init__.py")):
        os.makedirs(tree, exist_ok=True)
        archive = subprocess.run(["git", "-C", repo, "archive", sha], check=True, capture_output=True).stdout
        subprocess.run(["tar", "xf", "-"], input=archive, cwd=tree, check=True)
        subprocess.run([sys.executable, "cext/_build.py"], cwd=tree, check=True, capture_output=True)
    return tree


def measure_at(tree: str, kind: str, args) -> dict:
    """`measure` in a child interpreter whose `import fnzero` finds the copy in `tree` first."""
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = ([sys.executable, os.path.abspath(__file__), "--one", kind, "--json", out.name,
               "--model", args.model, "--world", str(args.world), "--micro", str(args.micro),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--nvme-dir", args.nvme_dir,
               "--malloc-mmap-threshold", str(args.malloc_mmap_threshold), "--clip", str(args.clip)]
               + (["--remat"] if args.remat else []))
        if args.device != "cpu":
            cmd += ["--device", args.device]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        subprocess.run(cmd, env=env, check=True)
        with open(out.name) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt27m", choices=sorted(MODELS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--configs", default="ddp,ddp_fused,fsdp2,z0,z1,z2,z3")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations this many times, in alternating order, and report medians "
                         "(step-time ratios to DDP are the median of each round's own ratio)")
    ap.add_argument("--before", default=None, metavar="REF",
                    help="also run every fnzero configuration with the fnzero of this git commit, side by side")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # measure_at's child: one row to --json
    ap.add_argument("--nvme-dir", default=tempfile.gettempdir(),
                    help="where the z3_nvme* configurations keep their scratch files")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient-norm clip of every configuration: fnzero's gradient_clipping and "
                         "torch.nn.utils.clip_grad_norm_ for DDP and FSDP2 (0: none), so every row trains the same thing")
    ap.add_argument("--remat", action="store_true", help="activation checkpointing of every block, in every configuration")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=4 << 20,
                    help="glibc mmap threshold applied in every configuration's ranks, as fnzero.init_distributed "
                         "does (0: glibc's dynamic default)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where every framework's ranks train: the CPU (gloo) or one CUDA device per rank (NCCL)")
    args = ap.parse_args()

    from fnzero.memory import allocator_env

    # Every framework runs under the allocator settings `fnzero launch` uses (huge pages for
    # mmap-served blocks) unless --malloc-mmap-threshold 0 asks for glibc's defaults.
    env = {k: v for k, v in allocator_env({}).items()} if args.malloc_mmap_threshold else {}
    if args.one:
        with open(args.json, "w") as f:
            json.dump(measure(args.one, args, env), f)
        return

    print(f"machine: {machine()}")
    print(f"model {args.model} {MODELS[args.model]}, {args.world} ranks x 1 thread"
          f"{f' on {args.device}' if args.device != 'cpu' else ''}, micro-batch {args.micro}, "
          f"median of {args.steps} steps after {args.warmup} warm-up{', blocks rematerialised' if args.remat else ''}, "
          f"gradient norm clipped at {args.clip} in every configuration, "
          f"glibc mmap threshold "
          f"{args.malloc_mmap_threshold or 'dynamic (default)'} in every configuration"
          f"{' with transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)' if args.malloc_mmap_threshold else ''}\n")
    kinds = args.configs.split(",")
    runs = [(kind, None) for kind in kinds]
    if args.before:
        tree = checkout(args.before)
        print(f"before: {args.before} extracted to {tree}\n")
        runs += [(kind, tree) for kind in kinds if kind.startswith("z")]
    label = {(kind, None): LABELS[kind] for kind in kinds}
    label.update({(kind, t): f"{LABELS[kind]} @ {args.before}" for kind, t in runs if t})
    per_round: list[dict] = []
    for k in range(args.rounds):
        # Each round runs every configuration once, so each ratio to DDP comes from runs in the same
        # round; the order alternates so a slow spell does not always hit the same configuration.
        rows = {}
        for run in (runs if k % 2 == 0 else runs[::-1]):
            rows[run] = r = measure(run[0], args, env) if run[1] is None else measure_at(run[1], run[0], args)
            if run[1] and not os.path.samefile(r["fnzero"], run[1]):
                raise SystemExit(f"the 'before' ranks imported fnzero from {r['fnzero']}, not {run[1]}")
            dev_mem = f"  peak {args.device} memory {r['peak_dev_mib']:.0f} MiB" if args.device != "cpu" else ""
            print(f"  {f'[round {k}] ' if args.rounds > 1 else ''}{label[run]:34s} {r['step_s']:.3f} s/step  "
                  f"{r['rss_above']:.0f} MiB above baseline{dev_mem}  (other cores {r['other']:.2f})", flush=True)
        per_round.append(rows)
    rows = {run: {key: median([rr[run][key] for rr in per_round]) for key in per_round[0][run] if key != "fnzero"}
            for run in runs}
    if "ddp" in kinds:
        for run in runs:
            rows[run]["vs_ddp"] = median([rr[run]["step_s"] / rr[("ddp", None)]["step_s"] for rr in per_round])
            rows[run]["vs_ddp_each"] = [rr[run]["step_s"] / rr[("ddp", None)]["step_s"] for rr in per_round]
    base = rows.get(("ddp", None))
    psi = int(rows[runs[0]]["psi"])
    print(f"\nΨ = {psi:,} params; theory = ZeRO model-state bytes for fp32 Adam at N = {args.world} "
          "(for NVMe configurations, the part held in memory)\n")
    hdr = ("config", "s/step", "vs DDP", "tok/s", "peak RSS MiB", "RSS-baseline MiB", "vs DDP", "theory MiB",
           "ring MB sent/step/rank", "other cores", "final loss")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for run, r in rows.items():
        ratio = r.get("vs_ddp", float("nan"))
        mem_ratio = r["rss_above"] / base["rss_above"] if base else float("nan")
        print(f"| {label[run]} | {r['step_s']:.3f} | {ratio:.2f} | {r['tok_s']:.0f} | {r['rss']:.0f} | {r['rss_above']:.0f} | "
              f"{mem_ratio:.2f} | {r['theory']:.0f} | {r['sent_mb']:.1f} | {r['other']:.2f} | {r['loss']:.4f} |")
    if args.rounds > 1:
        print(f"\nmedians of {args.rounds} rounds; s/step ratios to DDP per round:")
        for run, r in rows.items():
            if "vs_ddp_each" in r:
                print(f"  {label[run]:34s} " + " ".join(f"{x:.2f}" for x in r["vs_ddp_each"]))
    if args.before:
        print(f"\nafter / before ({args.before}); step time: median of each round's own ratio")
        print("| config | s/step after/before | per round | RSS-baseline after/before |")
        print("|---|---|---|---|")
        for kind in kinds:
            if (kind, tree) in rows:
                each = [rr[(kind, None)]["step_s"] / rr[(kind, tree)]["step_s"] for rr in per_round]
                mem = rows[(kind, None)]["rss_above"] / rows[(kind, tree)]["rss_above"]
                print(f"| {LABELS[kind]} | {median(each):.2f} | {' '.join(f'{x:.2f}' for x in each)} | {mem:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(args),
                       "rows": {kind if t is None else f"{kind}@{args.before}": r for (kind, t), r in rows.items()}},
                      f, indent=2)


if __name__ == "__main__":
    main()
