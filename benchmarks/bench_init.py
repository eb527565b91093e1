"""Building a model bigger than one rank: meta construction + pretrained load + init_state, against
building the model eagerly on every rank first, at ZeRO-3 (fp32, AdamW).

A Llama-shaped model (default ~500M parameters) is written first as a save_pretrained-style
directory of safetensors shards with its index (random weights, streamed tensor by tensor, so the
writer never holds the model). Then, in fresh processes, N gloo ranks each:

  meta:  fnzero.shard(factory on the meta device) -> init_state(pretrained=dir)
  eager: model = LlamaForCausalLM(config) on the host -> fnzero.shard -> init_state(pretrained=dir)

Per rank, printed beside the formula: peak RSS above the process's baseline (VmHWM, reset through
/proc/self/clear_refs after the imports), this rank's model state (16Psi/N), the largest unit, and the
bytes it read from the weight files (rchar in /proc/self/io; fnzero's own count beside it) against
its share (4Psi/N, fp32 files).

Usage: python benchmarks/bench_init.py [--world 4] [--hidden 1536] [--layers 16] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine  # noqa: E402


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


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def rank_main(mode: str, pretrained: str, stage: int):
    import torch
    import transformers

    import fnzero

    transformers.logging.set_verbosity_error()
    dist = fnzero.init_distributed()
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": stage}}, world_size=dist.world_size)
    hf = transformers.AutoConfig.from_pretrained(pretrained)
    # Import the modeling code (lazy in transformers) before the baseline: it is not the model.
    with torch.device("meta"):
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**hf.to_dict(), "num_hidden_layers": 1}))
    torch.distributed.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    base, read0, t0 = _status("VmRSS"), _rchar(), time.perf_counter()
    if mode == "meta":
        sm = fnzero.shard(lambda: transformers.LlamaForCausalLM(hf), config=cfg)
    else:
        torch.manual_seed(0)
        sm = fnzero.shard(transformers.LlamaForCausalLM(hf), config=cfg)
    state = sm.init_state(pretrained=pretrained)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    largest = max(u.numel for u in sm.plan.units) * 4
    state_bytes = fnzero.memory.model_state_bytes(state).total
    out = {"peak": peak, "seconds": seconds, "read": _rchar() - read0, "fnzero_read": sm.pretrained_report.bytes_read,
           "largest_unit": largest, "num_params": sm.plan.num_params, "state_bytes": state_bytes,
           "units": len(sm.plan.units)}
    torch.distributed.barrier()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None, help="where the weight files go (default: a temp dir, removed)")
    p.add_argument("--modes", default="meta,eager")
    args = p.parse_args()

    from fnzero.testing import run_world

    print(machine())
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        cfg = llama_config(args.hidden, args.layers, args.vocab)
        t = time.perf_counter()
        psi = write_pretrained(cfg, d)
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        print(f"Llama-shaped model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
              f"Psi = {psi / 1e6:.1f}M; {len(files)} safetensors shards written in {time.perf_counter() - t:.1f}s")
        n, mib = args.world, 2**20
        share = 16 * psi / n
        for mode in args.modes.split(","):
            env = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
            res = run_world(rank_main, n, mode, d, args.stage, timeout=1800, env=env)
            largest = res[0]["largest_unit"]
            limit = 1.25 * share + 2 * largest
            read_limit = 1.1 * 4 * psi / n + largest
            print(f"\n{mode}: {n} ranks, ZeRO-{args.stage}, fp32 AdamW, {res[0]['units']} units, largest unit "
                  f"{largest / mib:.0f} MiB")
            print("  rank | peak RSS above baseline | 16Psi/N | limit 1.25*16Psi/N + 2 units | state bytes | "
                  "read from files (fnzero's count) | 4Psi/N | read limit | seconds")
            for r, x in enumerate(res):
                print(f"  {r:4d} | {x['peak'] / mib:8.0f} MiB ({x['peak'] / share:.2f}x) | {share / mib:6.0f} MiB | "
                      f"{limit / mib:6.0f} MiB {'ok' if x['peak'] <= limit else 'OVER'} | {x['state_bytes'] / mib:6.0f} MiB | "
                      f"{x['read'] / mib:6.0f} MiB ({x['fnzero_read'] / mib:.0f}) | {4 * psi / n / mib:6.0f} MiB | "
                      f"{read_limit / mib:6.0f} MiB {'ok' if x['read'] <= read_limit else 'OVER'} | {x['seconds']:.1f}")


if __name__ == "__main__":
    main()
