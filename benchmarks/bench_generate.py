"""Generation throughput and memory: fnzero.generate against transformers' generate(), in one invocation.

    python benchmarks/bench_generate.py                                  # ~150M Llama, every row
    python benchmarks/bench_generate.py --hidden 512 --layers 8 --vocab 8000 --rows hf,z3_2,tp2
    python benchmarks/bench_generate.py --rows hf,z3_cpu,z3_nvme --nvme-dir /mnt/nvme --json gen.json

One Llama-shaped model (random fp32 weights, written once as a save_pretrained directory), one
left-padded batch of prompts, greedy decoding of `--new-tokens` tokens. Each row runs in fresh
processes (forked by fnzero.testing.run_world from a server that only imported torch and fnzero;
gloo on loopback, 1 thread per process, glibc's mmap threshold fixed at 1 MiB so freed buffers
leave the process):

  hf       transformers' model.generate() in one process: from_pretrained(dir) (the baseline)
  hf_2     the same in two processes at once, each the whole model and batch: what two readers of the
           weights per token cost on this machine's shared memory bus (tensor parallelism's ceiling
           is twice hf_2's tokens/s: each rank reads half the weights while the other reads the rest)
  z3_2     fnzero.generate at ZeRO-3 on 2 ranks    z3_4  the same on 4 ranks (the default
           max_live_parameters, DeepSpeed's 1e9: the whole model fits, gathered once per call)
  z3_2_serve  z3_2 with the warm-up and the timed call inside one sm.holding(): a serving loop,
           whose units are gathered once for all its calls (the timed call gathers nothing)
  z3_2_q   z3_2 with max_live_parameters a quarter of the model: the units that fit held, the others
           gathered for every token; its floor is the larger of hf's time per token (compute: each
           rank decodes the whole batch) and the time of bare all-gathers of the streamed units'
           shards, timed on the same ranks after the call (transfer)
  z3_2_stream  z3_2 with max_live_parameters 0: every unit gathered for every token
  z3_2_root  z3_2 with the embeddings and the LM head in the root unit, gathered for the whole of
           each forward (shard(wrap=) with the decoder layers only: the default before they
           became units of their own)
  tp2      tensor parallelism 2 (AutoTP, ZeRO-0) on 2 ranks
  z3_cpu   ZeRO-3, offload_param cpu, 2 ranks      z3_nvme  ZeRO-3, offload_param nvme, 2 ranks

fnzero's rows build the model on the meta device and load it with init_state(pretrained=dir)
(plain SGD: no optimizer state, so the state is the parameters; z3_nvme's AdamW state lies on
NVMe). One warm-up call, then the timed call, both the same: tokens/s = new tokens x batch / its
wall time (the slower rank), and its ratio to `hf`. Per rank: the timed call's peak RSS above the
process's RSS after its imports (VmHWM, reset through /proc/self/clear_refs before the call),
beside the formula

  this rank's share of the model (state bytes in memory, fnzero.memory.model_state_bytes)
  + two of the largest unit, gathered (ZeRO-3 rows)
  + the KV cache: 2 x layers x batch x kv_heads x head_dim x (prompt + new) x 4 bytes / tp

with what was resident before the call (the share plus first-call costs that stay, such as
kernels' caches), what the call added to it, and the peak while building; and whether each row's
tokens equal transformers'. "other cores" is the CPU the rest of the machine used during the row
(0 = the benchmark had it to itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import CpuMonitor, machine, proc_status as _status  # noqa: E402

ROWS = {  # row: (processes, label)
    "hf": (1, "transformers generate(), 1 process"),
    "hf_2": (2, "transformers generate() in 2 processes at once (the memory bus shared)"),
    "z3_2": (2, "fnzero ZeRO-3, 2 ranks"),
    "z3_4": (4, "fnzero ZeRO-3, 4 ranks"),
    "z3_2_serve": (2, "fnzero ZeRO-3, 2 ranks, both calls inside one sm.holding() (a serving loop)"),
    "z3_2_q": (2, "fnzero ZeRO-3, 2 ranks, max_live_parameters a quarter of the model"),
    "z3_2_stream": (2, "fnzero ZeRO-3, 2 ranks, max_live_parameters 0 (every unit gathered per token)"),
    "z3_2_root": (2, "fnzero ZeRO-3, 2 ranks, embeddings and LM head in the root unit (wrap=)"),
    "tp2": (2, "fnzero tensor parallel 2 (ZeRO-0)"),
    "z3_cpu": (2, "fnzero ZeRO-3, offload_param cpu, 2 ranks"),
    "z3_nvme": (2, "fnzero ZeRO-3, offload_param nvme, 2 ranks"),
}
MIB = 2**20


def llama_config(hidden: int, layers: int, vocab: int, heads: int, kv_heads: int):
    import transformers

    # No end-of-sequence token: every row generates exactly --new-tokens tokens.
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=False,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=None, pad_token_id=0)


def prompts(batch: int, length: int, vocab: int):
    """A left-padded batch: row i has i * length // (2 * batch) pad tokens (id 0) in front."""
    import torch

    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for i in range(batch):
        pad = i * length // (2 * batch)
        ids[i, :pad], mask[i, :pad] = 0, 0
    return ids, mask


def row_config(row: str, world: int, nvme_dir: str | None) -> dict:
    zero: dict = {"stage": 0 if row == "tp2" else 3}
    if row == "z3_cpu":
        zero["offload_param"] = {"device": "cpu"}
    if row == "z3_nvme":  # fnzero reads parameter shards from the NVMe store of an offloaded optimizer
        nvme = {"device": "nvme", "nvme_path": nvme_dir}
        zero.update(offload_param=nvme, offload_optimizer=nvme)
    # Plain SGD keeps no optimizer state; an NVMe-offloaded optimizer runs fnzero's host kernels
    # (no SGD among them), and AdamW's state then lies on NVMe, not in memory.
    opt = "AdamW" if row == "z3_nvme" else "SGD"
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": opt, "params": {"lr": 0.0}},
            "zero_optimization": zero, **({"tensor_parallel": {"autotp_size": 2}} if row == "tp2" else {})}


def layers_only(path: str, module) -> bool:
    """Units: each decoder layer, the rest (embeddings, final norm, LM head) in the root unit, which
    stays gathered for the whole of each forward (the default keeps the embeddings and the LM head
    in units of their own, gathered for their own forward only)."""
    return type(module).__name__ == "LlamaDecoderLayer"


def _reset_peak() -> int:
    """VmHWM := VmRSS; returns VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def rank_main(row: str, pretrained: str, hf_dict: dict, ids, mask, new_tokens: int, nvme_dir: str | None) -> dict:
    """One rank of one row: build, warm up, time one generate call; the tokens and the memory."""
    import torch
    import torch.distributed as dist
    import transformers

    import fnzero

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # glibc's mmap threshold fixed at 1 MiB (what MALLOC_MMAP_THRESHOLD_=1048576 sets at process
    # start): freed buffers leave the process, so RSS shows what is alive, not what once was.
    fnzero.memory.return_freed_memory(1 << 20)
    hf = transformers.LlamaConfig(**hf_dict)
    with torch.device("meta"):  # import the modeling code (lazy in transformers) before the baseline
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**hf_dict, "num_hidden_layers": 1}))
    import transformers.generation.utils  # noqa: F401

    import fnzero.inference  # noqa: F401
    dist.barrier()
    base, t0 = _reset_peak(), time.perf_counter()
    out: dict = {}
    if row in ("hf", "hf_2"):
        model = transformers.LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()
        out.update(share=sum(p.numel() * p.element_size() for p in model.parameters()), largest_unit=0, root_unit=0,
                   largest_layer=0, held=0, streamed_unit=0)

        def gen(n):
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    else:
        cfg = fnzero.load_config(row_config(row, dist.get_world_size(), nvme_dir), world_size=dist.get_world_size())
        wrap = layers_only if row == "z3_2_root" else None
        sm = fnzero.shard(lambda: transformers.LlamaForCausalLM(hf), config=cfg, wrap=wrap)
        state = sm.init_state(pretrained=pretrained)
        held = fnzero.memory.model_state_bytes(state)
        gathered = row != "tp2"  # ZeRO-3: units are gathered for their forward
        out.update(share=held.params + held.master + held.optimizer, units=len(sm.plan.units),
                   largest_unit=max(u.numel for u in sm.plan.units) * 4 if gathered else 0,
                   root_unit=sum(u.numel for u in sm.plan.units if u.module == "") * 4 if gathered else 0,
                   largest_layer=max((u.numel for u in sm.plan.units if u.module), default=0) * 4 if gathered else 0)

        budget = row_budget(row, sm)
        out.update(held=held_bytes(sm, budget), streamed_unit=4 * max(_held_and_streamed(sm, budget)[1], default=0)
                   if gathered else 0)

        def gen(n):
            return fnzero.generate(sm, state, ids, mask, max_new_tokens=n, do_sample=False,
                                   max_live_parameters=budget)
    out.update(build_s=time.perf_counter() - t0, build_peak=_status("VmHWM") - base, built=_status("VmRSS") - base)
    serving = contextlib.ExitStack()
    if row == "z3_2_serve":
        serving.enter_context(sm.holding())
    gen(new_tokens)  # warm-up: first-call costs (kernels' caches, lazy imports) stay resident after it
    dist.barrier()
    out["resident"] = _reset_peak() - base
    t = time.perf_counter()
    tokens = gen(new_tokens)
    out.update(wall=time.perf_counter() - t, peak=_status("VmHWM") - base, tokens=tokens)
    serving.close()
    dist.barrier()
    if row == "z3_2_q":
        out["transfer_s"] = streamed_gather_s(sm, budget)
    cpu = os.times()
    out["cpu_s"] = cpu.user + cpu.system  # this process's, since it was forked
    return out


def row_budget(row: str, sm) -> int | None:
    """The row's max_live_parameters: a quarter of the gathered elements, 0, or the config's (None)."""
    from fnzero.sharding.zero import residency_sizes

    if row == "z3_2_q":
        return sum(n for _, n in residency_sizes(sm.plan)) // 4
    return 0 if row == "z3_2_stream" else None


def _held_and_streamed(sm, budget: int | None) -> tuple[list, list]:
    from fnzero.sharding.zero import plan_residency, residency_sizes

    if budget is None:
        budget = sm.config.zero_optimization.stage3_max_live_parameters
    sizes = residency_sizes(sm.plan)
    held = plan_residency(sizes, budget)
    return [n for k, n in sizes if k in held], [n for k, n in sizes if k not in held]


def held_bytes(sm, budget: int | None) -> int:
    """Bytes of the units a generate call holds gathered (fp32), from the residency plan."""
    return 4 * sum(_held_and_streamed(sm, budget)[0]) if sm.plan.any_sharded_params else 0


def streamed_gather_s(sm, budget: int | None, repeats: int = 3) -> float:
    """Seconds of one token's transfers alone: a bare all-gather of each streamed unit's shard (the
    fastest of `repeats`), on this row's ranks and collectives."""
    import torch

    shards = [torch.zeros(n // sm.comm.world_size) for n in _held_and_streamed(sm, budget)[1]]
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for s in shards:
            sm.comm.all_gather_async(s).wait()
        best = min(best, time.perf_counter() - t)
    return best


def _nothing() -> None:
    pass


def kv_cache_bytes(cfg, batch: int, total_len: int, tp: int) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * head_dim * total_len * 4 // tp


def run_row(row: str, pretrained: str, cfg, ids, mask, args) -> dict:
    from fnzero.testing import run_world

    nvme_dir = tempfile.mkdtemp(prefix="bench-generate-", dir=args.nvme_dir) if row == "z3_nvme" else None
    try:
        with CpuMonitor() as mon:
            ranks = run_world(rank_main, ROWS[row][0], row, pretrained, cfg.to_dict(), ids, mask, args.new_tokens,
                              nvme_dir, timeout=3600)
        mon.add_own(sum(r["cpu_s"] for r in ranks))
    finally:
        if nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    batch, total = ids.shape[0], ids.shape[1] + args.new_tokens
    kv = kv_cache_bytes(cfg, batch, total, 2 if row == "tp2" else 1)
    wall = max(r["wall"] for r in ranks)
    return {"row": row, "label": ROWS[row][1], "ranks": ranks, "wall": wall, "kv": kv, "other_cores": mon.other_cores,
            "tokens_per_s": args.new_tokens * batch / wall}


def same_tokens(r: dict, hf: dict | None) -> bool | None:
    """Whether every rank of row `r` returned the hf row's tokens (None without an hf row)."""
    if hf is None:
        return None
    want = hf["ranks"][0]["tokens"]
    return all(x["tokens"].shape == want.shape and bool((x["tokens"] == want).all()) for x in r["ranks"])


def print_table(results: dict) -> None:
    hf = results.get("hf")
    print("\n| row | tokens/s | vs hf | tokens == hf | other cores | rank | peak RSS | formula | within | share "
          "| held | 2 streamed units | root unit | largest other unit | KV cache | resident - share | peak - resident "
          "| call within held + 2 units + KV | peak building |")
    print("|" + "---|" * 19)
    for row, r in results.items():
        same = {None: "n/a", True: "yes", False: "NO"}[same_tokens(r, hf)] if row != "hf" else "baseline"
        head = [row, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}" if hf else "n/a",
                same, f"{r['other_cores']:.2f}"]
        for k, x in enumerate(r["ranks"]):
            units, call = 2 * x["streamed_unit"], x["peak"] - x["resident"]
            formula = x["share"] + x["held"] + units + r["kv"]
            cells = (head if k == 0 else [""] * len(head)) + [str(k), f"{x['peak'] / MIB:.0f}", f"{formula / MIB:.0f}",
                                                              "ok" if x["peak"] <= formula else "OVER"]
            cells += [f"{v / MIB:.1f}" for v in (x["share"], x["held"], units, x["root_unit"], x["largest_layer"],
                                                 r["kv"], x["resident"] - x["share"], call)]
            gathered = x["held"] + units
            check = ("ok" if call <= gathered + r["kv"] else "OVER") if gathered else "-"  # ZeRO-3 rows only
            cells += [check, f"{x['build_peak'] / MIB:.0f}"]
            print("| " + " | ".join(cells) + " |")
    print("\nMiB. peak RSS: of the timed call, above the process's RSS after its imports. formula = share + held "
          "+ 2 streamed units + KV cache: share, the model state this rank holds in memory (hf: the whole model); "
          "held, the units the call keeps gathered (max_live_parameters; ZeRO-3 rows); 2 streamed units, twice the "
          "largest unit gathered per token (the root unit holds the final norm, and the embeddings and LM head in "
          "z3_2_root); KV cache / tp. resident: after building and "
          "the warm-up call (resident - share: first-call costs that stay, such as kernels' caches; hf's row shows "
          "them too). peak building: from_pretrained, or shard + init_state(pretrained=).")


def print_floors(results: dict, new_tokens: int) -> None:
    """Streaming rows: seconds per token against the larger of compute (hf's per token) and transfer."""
    hf, hf_2 = results.get("hf"), results.get("hf_2")
    if hf is not None and hf_2 is not None:
        print(f"two processes reading the whole model at once: {hf_2['tokens_per_s']:.1f} tokens/s each against "
              f"{hf['tokens_per_s']:.1f} alone ({hf_2['tokens_per_s'] / hf['tokens_per_s']:.2f}x): tensor parallel 2's "
              f"ceiling here is {2 * hf_2['tokens_per_s'] / hf['tokens_per_s']:.2f}x hf")
    for row, r in results.items():
        xfer = [x.get("transfer_s") for x in r["ranks"] if x.get("transfer_s") is not None]
        if not xfer or hf is None:
            continue
        compute, transfer, tok = hf["wall"] / new_tokens, max(xfer), r["wall"] / new_tokens
        floor = max(compute, transfer)
        print(f"{row}: {tok * 1e3:.1f} ms per token; compute (hf) {compute * 1e3:.1f} ms, transfer (bare all-gathers "
              f"of the streamed shards) {transfer * 1e3:.1f} ms: {tok / floor:.2f}x their larger")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden // 64)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default heads // 3, at least 2)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32, help="prompt length, padding included")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rows", default="hf,hf_2,z3_2,z3_4,z3_2_serve,z3_2_q,z3_2_stream,z3_2_root,tp2,z3_cpu,z3_nvme")
    p.add_argument("--dir", default=None, help="where the weight files go (default: a temp dir, removed)")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="where z3_nvme keeps its scratch files")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown --rows {unknown}: {', '.join(ROWS)}")
    heads = args.heads or max(1, args.hidden // 64)
    kv_heads = args.kv_heads or max(min(2, heads), heads // 3)

    from bench_init import write_pretrained

    print(machine())
    cfg = llama_config(args.hidden, args.layers, args.vocab, heads, kv_heads)
    ids, mask = prompts(args.batch, args.prompt, args.vocab)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        psi = write_pretrained(cfg, d)
        print(f"Llama-shaped model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {heads} heads "
              f"({kv_heads} kv): {psi / 1e6:.1f}M params, {4 * psi / MIB:.0f} MiB fp32; batch {args.batch} "
              f"left-padded prompts of {args.prompt}, {args.new_tokens} new tokens, greedy; 1 thread per process")
        from fnzero.testing import run_world

        run_world(_nothing, 1)  # the ranks' fork server starts (imports torch, fnzero) outside any row
        results = {}
        for row in rows:
            results[row] = r = run_row(row, d, cfg, ids, mask, args)
            print(f"  {row:8s} {r['tokens_per_s']:8.1f} tokens/s  peak RSS generating "
                  f"{' / '.join(str(round(x['peak'] / MIB)) for x in r['ranks'])} MiB  "
                  f"(other cores {r['other_cores']:.2f})", flush=True)
    print_table(results)
    print_floors(results, args.new_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "psi": psi, "rows": {
                row: {**{k: v for k, v in r.items() if k != "ranks"},
                      "tokens_equal_hf": same_tokens(r, results.get("hf")),
                      "ranks": [{k: v for k, v in x.items() if k != "tokens"} for x in r["ranks"]]}
                for row, r in results.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
