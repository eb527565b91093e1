"""`fnzero plan --sp`: activation bytes per rank at each sequence-parallel size beside the
model-state rows, and the longest sequence fitting a device (`specs/cli.md` §plan,
`specs/mesh.md` §Sequence memory).

    fnzero plan --model ./llama_config_dir --world-size 8 --sp 1,2,4,8 --seq-len 32768 --memory-per-device 80GB
    fnzero plan --model ./llama_config_dir --world-size 8 --sp 1,8 --checkpointing --micro-batch 2
"""

from __future__ import annotations

import argparse

from ._common import arg_type, whole_numbers

__all__ = ["add_sequence_options", "check_sequence", "sequence_rows", "print_sequence"]

_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def add_sequence_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activations at sequence-parallel sizes (--sp; needs --model for the model's shape; "
                             "--seq-len and --micro-batch, below, give the step's tokens)")
    g.add_argument("--sp", type=arg_type(whole_numbers, too_small="give sequence-parallel sizes of at least 1"),
                   default=None, metavar="S[,S...]",
                   help="sequence-parallel (Ulysses) sizes: adds each one's activation bytes per rank and, with "
                   "--memory-per-device, the longest sequence that fits; each must divide the world size")
    g.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every layer (only each layer's input kept; one layer "
                   "recomputed at a time); implies --sp 1 when --sp is not given")


def check_sequence(args: argparse.Namespace) -> str | None:
    """An error message for activation options the run cannot take, or None (then `args.sp` is set
    when rows are asked for)."""
    if args.sp is None and not args.checkpointing:
        return None
    args.sp = args.sp or [1]
    if args.tp != [1] or args.pp != [1]:
        return "--sp plans data- and sequence-parallel runs only (with --tp or --pp the activations are not counted)"
    for sp in args.sp:
        if args.world_size % sp:
            return f"--sp {sp} does not divide --world-size {args.world_size}: sequence-parallel groups are runs of data-parallel ranks"
    if args.seq_len < 1 or args.micro_batch < 1:
        return f"--seq-len {args.seq_len} and --micro-batch {args.micro_batch} must be at least 1"
    if args.model is None:
        return ("--sp and --checkpointing need --model (a Hugging Face config.json): activation bytes depend on "
                "its hidden size, layers, heads and vocabulary")
    from ..memory import TransformerShape, activation_bytes, hf_config

    try:
        args._shape = TransformerShape.from_config(hf_config(args.model))
    except (OSError, ValueError) as e:
        return f"--model {args.model}: {e}"
    for sp in args.sp:
        try:
            activation_bytes(args._shape, seq_len=args.seq_len, micro_batch=args.micro_batch, sp=sp)
        except ValueError as e:
            return f"--sp {sp} with --seq-len {args.seq_len}: {e}"
    return None


def _state_row(rep: dict, precision: str) -> dict:
    """The model-state row the longest sequence shares the device with: the config's, else ZeRO-3
    without offload (the least a run without offload holds)."""
    mine = [r for r in rep["rows"] if r["from_config"] and r["precision"] == precision]
    return mine[0] if mine else next(r for r in rep["rows"] if r["precision"] == precision and r["stage"] == 3
                                     and (r["offload_optimizer"], r["offload_param"]) == ("none", "none"))


def sequence_rows(args: argparse.Namespace, rep: dict) -> list[dict]:
    """One row per (precision of the model-state tables, sp)."""
    from ..memory import activation_bytes, longest_sequence, ulysses_bytes

    rows = []
    for precision in dict.fromkeys(r["precision"] for r in rep["rows"]):
        dtype = _DTYPES[precision]
        state = _state_row(rep, precision)
        for sp in args.sp:
            a = activation_bytes(args._shape, seq_len=args.seq_len, micro_batch=args.micro_batch, sp=sp, dtype=dtype,
                                 checkpointing=args.checkpointing)
            # Forward and backward exchange the same bytes; a checkpointed layer's recomputation one forward more.
            passes = 3 if args.checkpointing else 2
            sent = args._shape.layers * passes * ulysses_bytes(args._shape, seq_len=args.seq_len,
                                                               micro_batch=args.micro_batch, sp=sp, dtype=dtype)
            row = {"precision": precision, "sp": sp, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                   "checkpointing": args.checkpointing, "tokens_per_rank": args.micro_batch * args.seq_len // sp,
                   "layer_bytes": a.layer, "saved_bytes": a.saved, "peak_bytes": a.peak, "all_to_all_bytes": sent,
                   "model_state_stage": state["stage"], "model_state_bytes": state["device_bytes"],
                   "fits": None, "longest_seq_len": None}
            if args.memory_per_device is not None:
                budget = args.memory_per_device - args.reserve - state["device_bytes"]
                row["fits"] = a.peak <= budget
                row["longest_seq_len"] = longest_sequence(
                    args._shape, budget, micro_batch=args.micro_batch, sp=sp, dtype=dtype,
                    checkpointing=args.checkpointing) if budget > 0 else 0
            rows.append(row)
    return rows


def print_sequence(args: argparse.Namespace, rows: list[dict], stream, fmt_bytes) -> None:
    s = args._shape
    print(f"\nactivations per rank (specs/mesh.md §Sequence memory): {args.micro_batch} x {args.seq_len} tokens per "
          f"micro-batch, {s.layers} layers, hidden {s.hidden}, {s.heads} heads ({s.kv_heads} kv), MLP "
          f"{s.intermediate}, vocabulary {s.vocab} ({s.family} layers); "
          + ("every layer checkpointed" if args.checkpointing else "no checkpointing"), file=stream)
    budget = args.memory_per_device is not None
    head = (f"  {'precision':<9} {'sp':>3} {'tokens/rank':>11} {'per layer':>12} {'saved':>12} {'peak':>12} "
            f"{'all-to-all':>12}")
    if budget:
        head += f"  {'fits':<4} {'longest seq':>11}"
    print(head, file=stream)
    for r in rows:
        line = (f"  {r['precision']:<9} {r['sp']:>3} {r['tokens_per_rank']:>11,} {fmt_bytes(r['layer_bytes']):>12} "
                f"{fmt_bytes(r['saved_bytes']):>12} {fmt_bytes(r['peak_bytes']):>12} "
                f"{fmt_bytes(r['all_to_all_bytes']) if r['sp'] > 1 else '-':>12}")
        if budget:
            line += f"  {'yes' if r['fits'] else 'no':<4} {r['longest_seq_len']:>11,}"
        print(line, file=stream)
    print("  saved: what autograd keeps for backward after the forward and loss; peak: saved + the layer being "
          "recomputed (checkpointing); gradients, the logits the caller holds and allocator slack are not counted. "
          "all-to-all: bytes each rank sends per micro-batch (forward, backward, recomputation).", file=stream)
    if budget:
        r = rows[0]
        print(f"  fits / longest seq: peak <= memory - reserve - model state (the config's row, else ZeRO-3 without "
              f"offload: stage {r['model_state_stage']}, {fmt_bytes(r['model_state_bytes'])} at {r['precision']}); "
              f"longest seq is a multiple of sp", file=stream)
