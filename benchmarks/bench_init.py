"""Building a model bigger than one rank: meta construction + pretrained load + init_state, against
building the model eagerly on every rank first, at ZeRO-3 (fp32, AdamW); and construction from the
meta device with no weight files, against FSDP2's, in the same run.

A Llama-shaped model (default ~500M parameters) is written first as a save_pretrained-style
directory of safetensors shards with its index (random weights, streamed tensor by tensor, so the
writer never holds the model). Then, in fresh processes, N gloo ranks each:

  meta:      fnzero.shard(factory on the meta device) -> init_state(pretrained=dir)
  eager:     model = LlamaForCausalLM(config) on the host -> fnzero.shard -> init_state(pretrained=dir)
  fsdp2:     LlamaForCausalLM on the meta device -> fully_shard(each decoder layer), fully_shard(model)
             -> to_empty(device="cpu") -> model.init_weights() (the model's _init_weights over its modules)
  meta_init: fnzero.shard(factory on the meta device), no weight files (timed: the sharded parameters
             built), then init_state() (timed apart: the optimizer state)

For meta and eager, per rank, printed beside the formula: peak RSS above the process's baseline
(VmHWM, reset through /proc/self/clear_refs after the imports), this rank's model state (16Psi/N),
the largest unit, and the bytes it read from the weight files (rchar in /proc/self/io; fnzero's own
count beside it) against its share (4Psi/N, fp32 files). For fsdp2 and meta_init: each rank's
seconds and peak RSS, and fnzero's time over FSDP2's (the slower rank of each; with --rounds, the
median of each round's ratio, the modes run in alternating order).

Usage: python benchmarks/bench_init.py [--world 4] [--hidden 1536] [--layers 16] [--dir /tmp/...]
       python benchmarks/bench_init.py --modes fsdp2,meta_init --world 2 --hidden 256 --layers 2 --vocab 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, proc_status as _status  # noqa: E402


def llama_config(hidden: int, layers: int, vocab: int):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 384), vocab_size=vocab,
        tie_word_embeddings=False, max_position_embeddings=2048)


def write_pretrained(cfg, out: str, shard_bytes: int = 512 << 20) -> int:
    """A save_pretrained-style directory of random fp32 weights, one tensor in memory at a time."""
    import torch
    import transformers
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    groups, cur, size = [], [], 0
    for n, s in shapes.items():
        b = math.prod(s) * 4
        if cur and size + b > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    groups.append(cur)
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: torch.randn(shapes[n], generator=g) * 0.02 for n in names}, os.path.join(out, fname))
        weight_map.update({n: fname for n in names})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg.save_pretrained(out)
    return sum(math.prod(s) for s in shapes.values())


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def rank_main(mode: str, pretrained: str | None, stage: int, hf_dict: dict):
    import torch
    import transformers

    import fnzero

    transformers.logging.set_verbosity_error()
    dist = fnzero.init_distributed()
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": stage}}, world_size=dist.world_size)
    hf = transformers.LlamaConfig(**hf_dict)
    # Import the modeling code (lazy in transformers) before the baseline: it is not the model.
    with torch.device("meta"):
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**hf_dict, "num_hidden_layers": 1}))
    mesh = None
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.world_size,))  # the process group's setup, as fnzero's
    torch.distributed.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    base, read0, t0 = _status("VmRSS"), _rchar(), time.perf_counter()
    out = {}
    if mode == "fsdp2":
        out["kept"] = fsdp2_construct(hf, mesh)
    elif mode == "meta_init":
        sm = fnzero.shard(lambda: transformers.LlamaForCausalLM(hf), config=cfg)
        out["shard_s"], out["shard_peak"] = time.perf_counter() - t0, _status("VmHWM") - base
        state = sm.init_state()
        out["kept"] = sum(t.numel() * t.element_size() for t in state.params.values())
    else:
        if mode == "meta":
            sm = fnzero.shard(lambda: transformers.LlamaForCausalLM(hf), config=cfg)
        else:
            torch.manual_seed(0)
            sm = fnzero.shard(transformers.LlamaForCausalLM(hf), config=cfg)
        state = sm.init_state(pretrained=pretrained)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    out.update(peak=peak, seconds=seconds)
    if mode in ("meta", "eager", "meta_init"):
        out.update(largest_unit=max(u.numel for u in sm.plan.units) * 4, num_params=sm.plan.num_params,
                   state_bytes=fnzero.memory.model_state_bytes(state).total, units=len(sm.plan.units))
    if mode in ("meta", "eager"):
        out.update(read=_rchar() - read0, fnzero_read=sm.pretrained_report.bytes_read)
    torch.distributed.barrier()
    return out


def fsdp2_construct(hf, mesh) -> int:
    """FSDP2's construction of a model bigger than one rank, as its documentation gives it: build
    on the meta device, fully_shard each decoder layer and the root, allocate this rank's shards
    (to_empty), run the model's own init over them. The bytes of parameters this rank keeps."""
    import torch
    import transformers
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with warnings.catch_warnings():
        # "DTensor random operators may not have complete support on cpu device mesh": each rank
        # draws its own shard's values, which is what is timed.
        warnings.simplefilter("ignore", UserWarning)
        model.init_weights()
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None, help="where the weight files go (default: a temp dir, removed)")
    p.add_argument("--modes", default="fsdp2,meta_init,meta,eager")
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, in alternating order")
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - {"meta", "eager", "fsdp2", "meta_init"}
    if unknown:
        raise SystemExit(f"unknown --modes {sorted(unknown)}: meta, eager, fsdp2, meta_init")

    print(machine())
    cfg = llama_config(args.hidden, args.layers, args.vocab)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        if {"meta", "eager"} & set(modes):
            t = time.perf_counter()
            psi = write_pretrained(cfg, d)
            files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
            written = f"; {len(files)} safetensors shards written in {time.perf_counter() - t:.1f}s"
        else:
            psi, written = param_count(cfg), ""
        print(f"Llama-shaped model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
              f"Psi = {psi / 1e6:.1f}M{written}")
        rounds = []
        for k in range(args.rounds):
            rounds.append({})
            for mode in modes if k % 2 == 0 else modes[::-1]:
                rounds[-1][mode] = res = run_mode(mode, d, cfg, args)
                print_mode(mode, res, psi, args, f"[round {k}] " if args.rounds > 1 else "")
        if {"fsdp2", "meta_init"} <= set(modes):
            print_versus(rounds, args)


def param_count(cfg) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        return sum(p.numel() for p in transformers.LlamaForCausalLM(cfg).parameters())


def run_mode(mode: str, d: str, cfg, args) -> list[dict]:
    from fnzero.testing import run_world

    env = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return run_world(rank_main, args.world, mode, d, args.stage, cfg.to_dict(), timeout=1800, env=env)


def print_mode(mode: str, res: list[dict], psi: int, args, label: str) -> None:
    n, mib = args.world, 2**20
    share = 16 * psi / n
    if mode in ("fsdp2", "meta_init"):
        what = ("FSDP2: meta construction + fully_shard (each layer, root) + to_empty + init_weights" if mode == "fsdp2"
                else f"fnzero: shard(factory on the meta device), ZeRO-{args.stage}, no weight files; then init_state()")
        print(f"\n{label}{mode}: {n} ranks; {what}")
        print("  rank | seconds | peak RSS above baseline | parameters kept"
              + (" | init_state seconds | peak RSS with init_state" if mode == "meta_init" else ""))
        for r, x in enumerate(res):
            extra = (f" | {x['seconds'] - x['shard_s']:.2f} | {x['peak'] / mib:.0f} MiB" if mode == "meta_init" else "")
            print(f"  {r:4d} | {x.get('shard_s', x['seconds']):7.2f} | {x.get('shard_peak', x['peak']) / mib:8.0f} MiB | "
                  f"{x['kept'] / mib:6.0f} MiB{extra}")
        return
    largest = res[0]["largest_unit"]
    limit = 1.25 * share + 2 * largest
    read_limit = 1.1 * 4 * psi / n + largest
    print(f"\n{label}{mode}: {n} ranks, ZeRO-{args.stage}, fp32 AdamW, {res[0]['units']} units, largest unit "
          f"{largest / mib:.0f} MiB")
    print("  rank | peak RSS above baseline | 16Psi/N | limit 1.25*16Psi/N + 2 units | state bytes | "
          "read from files (fnzero's count) | 4Psi/N | read limit | seconds")
    for r, x in enumerate(res):
        print(f"  {r:4d} | {x['peak'] / mib:8.0f} MiB ({x['peak'] / share:.2f}x) | {share / mib:6.0f} MiB | "
              f"{limit / mib:6.0f} MiB {'ok' if x['peak'] <= limit else 'OVER'} | {x['state_bytes'] / mib:6.0f} MiB | "
              f"{x['read'] / mib:6.0f} MiB ({x['fnzero_read'] / mib:.0f}) | {4 * psi / n / mib:6.0f} MiB | "
              f"{read_limit / mib:6.0f} MiB {'ok' if x['read'] <= read_limit else 'OVER'} | {x['seconds']:.1f}")


def print_versus(rounds: list[dict], args) -> None:
    """fnzero's meta construction against FSDP2's: the slower rank of each, per round."""
    import statistics

    ours = [max(x["shard_s"] for x in r["meta_init"]) for r in rounds]
    theirs = [max(x["seconds"] for x in r["fsdp2"]) for r in rounds]
    ratios = [a / b for a, b in zip(ours, theirs)]
    peak = [max(x["shard_peak"] for x in r["meta_init"]) / max(x["peak"] for x in r["fsdp2"]) for r in rounds]
    print(f"\nconstruction from the meta device, {args.world} ranks, slower rank: "
          "| fnzero shard s | FSDP2 s | fnzero / FSDP2 | peak RSS fnzero shard / FSDP2 |")
    for a, b, r, m in zip(ours, theirs, ratios, peak):
        print(f"  | {a:.2f} | {b:.2f} | {r:.2f} | {m:.2f} |")
    if len(rounds) > 1:
        print(f"  median ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
