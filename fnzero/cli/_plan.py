"""`fnzero plan`: per-rank model-state memory for every ZeRO stage and offload choice, and the
largest model that fits a device. The arithmetic is `fnzero.memory._estimate`; this module only parses and prints.

    fnzero plan --params 7B --world-size 64 --gpus-per-node 8 --memory-per-device 80GB
    fnzero plan --params 350M --world-size 8 --config ds_config.json --json
    fnzero plan --params 70B --world-size 64 --tp 1,2,4,8 --memory-per-device 80GB   # dp x tp meshes
    fnzero plan --model ./mixtral_config_dir --world-size 64 --ep 1,8                 # experts over ep ranks
    fnzero plan --params 7B --world-size 64 --mics 8                                  # MiCS: shard groups of 8
    fnzero plan --model ./llama_config_dir --world-size 8 --sp 1,2,4,8 --seq-len 32768  # activations per sp
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from fractions import Fraction

from ._common import arg_type, fail, load_config_or_report
from ._plan_predict import add_predict_options, predict_rows, print_predictions
from ._plan_sequence import add_sequence_options, check_sequence, print_sequence, sequence_rows

__all__ = ["register", "plan_report"]

_PRECISION_TITLE = {
    "fp32": "fp32 weights, gradients and Adam state (16 bytes/param before sharding)",
    "bf16": "16-bit (bf16/fp16) weights and gradients + fp32 master and Adam state (16 bytes/param before sharding)",
    "fp16": "fp16 weights and gradients + fp32 master and Adam state (16 bytes/param before sharding)",
}


class _Estimator:
    """`fnzero.memory._estimate`, imported on first use: it imports torch (seconds), and building
    the parser for `fnzero --help` or `fnzero config` must not."""

    def __getattr__(self, name: str):
        from ..memory import _estimate

        return getattr(_estimate, name)


_plan = _Estimator()


def _arg(parse: str, **kw):
    return arg_type(lambda text: getattr(_plan, parse)(text, **kw))


def _pos_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _tp_sizes(text: str) -> list[int]:
    return [_pos_int(t.strip()) for t in text.split(",") if t.strip()] or [1]


def _rows(args, config_choice):
    """(precision, stage, offload_optimizer, offload_param, ratio, from_config) for every row."""
    if args.precision is not None:
        precisions = [args.precision]
    elif config_choice is not None:
        precisions = [config_choice[0]]
    else:
        precisions = ["fp32", "bf16"]  # fp16 has bf16's bytes
    rows = []
    for prec in precisions:
        seen = False
        for stage, opt, par in _plan.OFFLOAD_CHOICES:
            mine = config_choice is not None and config_choice[1:] == (stage, opt, par, 1.0)
            seen |= mine
            rows.append((prec, stage, opt, par, 1.0, mine))
        if config_choice is not None and not seen:  # e.g. a partial ratio or parameter-only offload
            rows.append((prec, *config_choice[1:], True))
    return rows


def plan_report(args) -> dict:
    """Everything `fnzero plan` prints, as JSON-ready data (bytes are whole numbers)."""
    nodes = math.ceil(args.world_size / args.gpus_per_node)
    out = {
        "num_params": args.params, "world_size": args.world_size, "gpus_per_node": args.gpus_per_node, "nodes": nodes,
        "memory_per_device": args.memory_per_device, "reserve": args.reserve,
        "host_memory_per_node": args.host_memory_per_node, "config": args.config, "rows": [],
    }
    out["tp"], out["pp"], out["ep"], out["mics"] = list(args.tp), list(args.pp), list(args.ep), args.mics
    out["expert_params"], out["dense_params"] = args.expert_params, args.params - args.expert_params
    out["experts_per_layer"], out["model"] = args._experts_per_layer, args.model
    meshes = [(t, p, e) for p in args.pp for t in args.tp for e in args.ep]
    for (tp, pp, ep), (prec, stage, opt, par, ratio, mine) in ((m, r) for m in meshes for r in _rows(args, args._config_choice)):
        if (pp > 1 and stage >= 2) or (args.mics and (opt, par) != ("none", "none")):
            continue  # ZeRO-2/3 are refused with a pipeline (specs/mesh.md §Pipeline), offload with MiCS (§MiCS)
        # specs/mesh.md §Memory: each rank holds 1/(tp pp) of the parameters (Ψ_r ≈ Ψ / (tp pp); norms
        # and biases, which stay whole, and uneven stages are neglected), and ZeRO shards that over
        # the world / (tp pp) data-parallel ranks; §Expert parallelism memory: of it, the experts
        # are split over ep of those ranks and sharded over the dp / ep holding the same ones.
        dp, psi_r = args.world_size // (tp * pp), -(-args.params // (tp * pp))
        dp = args.mics if args.mics and stage >= 1 else dp  # MiCS: ZeRO shards over its shard group (specs/mesh.md §MiCS memory)
        share = Fraction(args.expert_params, args.params)
        e = _plan.estimate(psi_r, stage=stage, world_size=dp, precision=prec, offload_optimizer=opt,
                           offload_param=par, ratio=ratio, expert_params=share * psi_r, ep=ep)
        row = {
            "tp": tp, "pp": pp, "ep": ep, "dp": dp, "precision": prec, "stage": stage, "offload_optimizer": opt,
            "offload_param": par, "ratio": ratio,
            "from_config": mine and (tp, pp, ep) == (args._config_tp, args._config_pp, args._config_ep),
            "device_bytes": e.device_bytes, "host_bytes": e.host_bytes, "nvme_bytes": e.nvme_bytes,
            "host_bytes_per_node": round(e.host.total * args.gpus_per_node),
            "nvme_bytes_per_node": round(e.nvme.total * args.gpus_per_node),
            "device": e.device.as_ints(), "host": e.host.as_ints(), "nvme": e.nvme.as_ints(),
            "device_bytes_per_param": float(_plan.bytes_per_param(e, "device")),
            "fits": None, "max_params": None,
        }
        if args.memory_per_device is not None:
            budget = args.memory_per_device - args.reserve
            row["fits"] = e.device_bytes <= budget and (
                args.host_memory_per_node is None or row["host_bytes_per_node"] <= args.host_memory_per_node)
            largest = _plan.largest_model(
                args.memory_per_device, stage=stage, world_size=dp, precision=prec,
                offload_optimizer=opt, offload_param=par, ratio=ratio, reserve=args.reserve,
                host_memory_per_node=args.host_memory_per_node, gpus_per_node=args.gpus_per_node, expert_share=share,
                ep=ep)
            row["max_params"] = largest * tp * pp if largest is not None else None
        out["rows"].append(row)
    return out


def _fmt(n: int) -> str:
    return _plan.format_bytes(n) if n else "-"


def _print_table(rep: dict, stream) -> None:
    w = rep["world_size"]
    print(f"fnzero plan: {_plan.format_count(rep['num_params'])} parameters ({rep['num_params']:,}), {w} rank(s) "
          f"= {rep['nodes']} node(s) x {rep['gpus_per_node']} per node, Adam", file=stream)
    if rep["expert_params"]:
        per_layer = f", {rep['experts_per_layer']} per MoE layer" if rep["experts_per_layer"] else ""
        print(f"  experts: {_plan.format_count(rep['expert_params'])} parameters ({rep['expert_params']:,}{per_layer}), "
              f"dense {_plan.format_count(rep['dense_params'])} ({rep['dense_params']:,})"
              + (f"; from {rep['model']}" if rep["model"] else ""), file=stream)
    print("  model states only: activations, gathered stage-3 working sets, buffers and padding are not "
          "counted (set them aside with --reserve)", file=stream)
    if rep["mics"]:
        print(f"  MiCS: stages 1-3 shard within groups of {rep['mics']} ranks, replicated across the "
              f"{w // rep['mics']} groups", file=stream)
    budget = rep["memory_per_device"]
    if budget is not None:
        line = (f"  memory per device {budget / 1e9:g} GB = {_plan.format_bytes(budget)}, reserve "
                f"{_plan.format_bytes(rep['reserve']) if rep['reserve'] else '0'}")
        if rep["host_memory_per_node"] is not None:
            line += f", host memory per node {_plan.format_bytes(rep['host_memory_per_node'])}"
        print(line, file=stream)
    mesh = rep["tp"] != [1] or rep["pp"] != [1] or rep["ep"] != [1]
    head = f"  {'tp':>2} {'pp':>2} {'ep':>2} {'dp':>4} " * mesh + f"  {'stage':>5}  {'offload':<20} {'device/rank':>12} {'host/rank':>12} {'host/node':>12} {'nvme/rank':>12}"
    if budget is not None:
        head += f"  {'fits':<4} {'largest model':>13}"
    prec = None
    for r in rep["rows"]:
        if r["precision"] != prec:
            prec = r["precision"]
            print(f"\n{_PRECISION_TITLE[prec]}", file=stream)
            print(head, file=stream)
        e = _plan.Estimate(0, r["stage"], w, prec, r["offload_optimizer"], r["offload_param"], r["ratio"],
                           *(_plan.Breakdown(),) * 3)
        mark = "*" if r["from_config"] else " "
        line = (f"{mark}" + f" {r['tp']:>2} {r['pp']:>2} {r['ep']:>2} {r['dp']:>4}  " * mesh + f" {r['stage']:>5}  {e.label:<20} {_plan.format_bytes(r['device_bytes']):>12} "
                f"{_fmt(r['host_bytes']):>12} {_fmt(r['host_bytes_per_node']):>12} {_fmt(r['nvme_bytes']):>12}")
        if budget is not None:
            mx = r["max_params"]
            line += f"  {'yes' if r['fits'] else 'no':<4} {_plan.format_count(mx) if mx is not None else 'unbounded':>13}"
        print(line, file=stream)
    print("\noffload: opt=cpu moves the fp32 master, Adam moments and gradient shard (16 bytes/param over the ranks) "
          "to host memory; opt=nvme puts the master and moments (12) on NVMe and the gradient shard (4) in host "
          "memory; param=X moves the parameter shard to X (stage 3).", file=stream)
    if budget is not None:
        print("largest model: the most parameters whose model state fits (memory - reserve) on each device "
              "(and the host memory per node, when given); 'unbounded': no model state stays on the device.",
              file=stream)
    if mesh:
        print("tp: tensor-parallel ranks per layer (each holds 1/tp of the parameters; norms and biases, which stay "
              "whole, are neglected); pp: pipeline stages (each holds 1/pp of the layers, balanced by parameters; "
              "ZeRO-2/3 are not offered with a pipeline); ep: expert-parallel ranks (each holds 1/ep of every MoE "
              "layer's experts, sharded over the dp/ep ranks holding the same ones); dp: the ranks ZeRO shards "
              "dense parameters over (world / (tp pp)).", file=stream)
    if any(r["from_config"] for r in rep["rows"]):
        print(f"*: your config ({rep['config']})", file=stream)


def _config_ep(cfg) -> int:
    """The config's expert-parallel size: `expert_parallel.autoep_size` when the block is enabled, else 1."""
    block = getattr(cfg, "expert_parallel", None)
    return int(getattr(block, "autoep_size", 1)) if block is not None and getattr(block, "enabled", False) else 1


def _count_model(args: argparse.Namespace) -> str | None:
    """--model: its parameter counts into --params and --expert-params (unless given); an error message or None."""
    args._experts_per_layer = None
    if args.model is not None:
        try:
            dense, expert, per_layer, _ = _plan_experts().hf_expert_param_counts(args.model)
        except (OSError, ValueError, KeyError) as e:
            return f"--model {args.model}: not a Hugging Face model config ({type(e).__name__}: {e})"
        args._experts_per_layer = per_layer
        args.params = args.params if args.params is not None else dense + expert
        args.expert_params = args.expert_params if args.expert_params is not None else expert
    if args.params is None:
        return "one of --params or --model is required"
    args.expert_params = args.expert_params or 0
    if args.expert_params > args.params:
        return f"--expert-params {args.expert_params:,} exceeds --params {args.params:,}"
    return None


def _check_ep(args: argparse.Namespace) -> str | None:
    """An error message for an ep size the meshes or the model cannot take, or None."""
    for tp, pp, ep in ((t, p, e) for p in args.pp for t in args.tp for e in args.ep):
        dp = args.world_size // (tp * pp)
        if dp % ep:
            return (f"--ep {ep} does not divide the {dp} data-parallel ranks (--world-size {args.world_size} / "
                    f"tp {tp} / pp {pp}): the expert-parallel ranks are a division of the data-parallel ones")
    split = [e for e in args.ep if e > 1]
    if split and not args.expert_params:
        return f"--ep {split[0]} but the model has no expert parameters: give --expert-params N or a MoE --model"
    per_layer = args._experts_per_layer
    uneven = [e for e in split if per_layer and per_layer % e]
    if uneven:
        return f"--ep {uneven[0]} does not divide the model's {per_layer} experts per MoE layer"
    return None


def _check_mics(args: argparse.Namespace) -> str | None:
    """An error message for a MiCS shard size the run cannot take, or None."""
    if not args.mics:
        return None
    if args.world_size % args.mics:
        return f"--mics {args.mics} does not divide --world-size {args.world_size}"
    if args.tp != [1] or args.pp != [1] or args.ep != [1]:
        return "--mics plans data-parallel runs only (MiCS with tensor, pipeline or expert parallelism is refused)"
    return None


def _plan_experts():
    from ..memory import _experts  # imports torch: only when a model is counted

    return _experts


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.gpus_per_node is None:
        args.gpus_per_node = min(8, args.world_size)
    args._config_choice, args._config_tp, args._config_pp, args._config_ep = None, 1, 1, 1
    problem = _count_model(args)
    if problem is not None:
        return fail("plan", problem)
    if args.memory_per_device is not None and args.reserve >= args.memory_per_device:
        return fail("plan", f"--reserve ({args.reserve:,} bytes) must be below --memory-per-device "
                            f"({args.memory_per_device:,} bytes)")
    if args.config is not None:
        cfg = load_config_or_report(args.config, args.world_size, prefix="fnzero plan: ")
        if cfg is None:
            return 2
        z = cfg.zero_optimization
        opt = z.offload_optimizer.device if z.offload_optimizer is not None else "none"
        par = z.offload_param.device if z.offload_param is not None else "none"
        ratio = z.offload_optimizer.ratio if opt != "none" else 1.0
        args._config_choice = (cfg.precision, z.stage, opt, par, float(ratio))
        args._config_tp = cfg.tensor_parallel.size
        args._config_pp = cfg.pipeline.size or 1
        args._config_ep = _config_ep(cfg)
        if args.mics is None and z.mics_shard_size > 0:
            args.mics = z.mics_shard_size
        for axis in ("tp", "pp", "ep"):  # not given: the config's
            if getattr(args, axis) is None:
                setattr(args, axis, [getattr(args, f"_config_{axis}")])
    args.tp, args.pp, args.ep = args.tp or [1], args.pp or [1], args.ep or [1]
    bad = [(t, p) for p in args.pp for t in args.tp if args.world_size % (t * p)]
    if bad:
        t, p = bad[0]
        what = f"--tp {t} x --pp {p} = {t * p}" if p > 1 else f"--tp {t}"
        return fail("plan", f"{what} does not divide --world-size {args.world_size}: a mesh is pipeline stages x "
                            f"data-parallel x tensor-parallel ranks")
    problem = _check_ep(args) or _check_mics(args) or check_sequence(args)
    if problem is not None:
        return fail("plan", problem)
    rep = plan_report(args)
    if args.sp is not None:
        rep["sequence"] = sequence_rows(args, rep)
    if args.predict:
        rep["predict"] = predict_rows(args)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        _print_table(rep, sys.stdout)
        if args.sp is not None:
            print_sequence(args, rep["sequence"], sys.stdout, _plan.format_bytes)
        if args.predict:
            print_predictions(args, rep["predict"], sys.stdout)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="model-state memory per rank for ZeRO stages 0-3 and offload, and the largest model that fits",
        description="Per-rank model-state memory (parameters, gradients, fp32 master weights, Adam state) for "
        "every ZeRO stage and offload choice, from the ZeRO formulas (fnzero.memory.zero_formula), and with "
        "--memory-per-device the largest model each choice fits. Sizes: KB/MB/GB/TB are powers of 1000, "
        "KiB/MiB/GiB/TiB powers of 1024. Exit status 0, or 2 for bad arguments or an invalid --config.",
        epilog="example: fnzero plan --params 7B --world-size 64 --gpus-per-node 8 --memory-per-device 80GB",
    )
    p.add_argument("--params", default=None, type=_arg("parse_count"), metavar="N",
                   help="number of model parameters: 7e9, 7B, 350M, 1.3b (or give --model)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a Hugging Face model's config.json (or its folder): its parameters are counted, experts apart "
                   "(built on the meta device; nothing else is read)")
    p.add_argument("--expert-params", default=None, type=_arg("parse_count"), metavar="N",
                   help="how many of --params are MoE experts (split over --ep ranks)")
    p.add_argument("--world-size", required=True, type=_pos_int, metavar="N", help="data-parallel ranks (GPUs) in all")
    p.add_argument("--gpus-per-node", type=_pos_int, default=None, metavar="N",
                   help="ranks per node, for the per-node host figures (default: 8, or the world size if smaller)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a DeepSpeed/fnzero JSON config: its precision and its stage/offload row is marked with *")
    p.add_argument("--memory-per-device", type=_arg("parse_bytes"), default=None, metavar="SIZE",
                   help="device memory, e.g. 80GB: adds 'fits' and 'largest model' columns")
    p.add_argument("--reserve", type=_arg("parse_bytes", allow_zero=True), default=0, metavar="SIZE",
                   help="device memory set aside for activations and working buffers (default 0)")
    p.add_argument("--host-memory-per-node", type=_arg("parse_bytes"), default=None, metavar="SIZE",
                   help="host memory per node: also bounds the largest model for offloaded rows")
    p.add_argument("--precision", choices=list(_PRECISION_TITLE), default=None,
                   help="fp32, or bf16/fp16 with fp32 master weights (default: the config's, else both fp32 and 16-bit)")
    p.add_argument("--tp", type=_tp_sizes, default=None, metavar="T[,T...]",
                   help="tensor-parallel sizes to plan for, e.g. 1,2,4,8 (default: the config's autotp_size, else 1); "
                   "each must divide the world size")
    p.add_argument("--pp", type=_tp_sizes, default=None, metavar="P[,P...]",
                   help="pipeline stage counts to plan for, e.g. 1,2,4 (default: the config's pipeline.stages, else 1); "
                   "with --tp, every combination whose product divides the world size")
    p.add_argument("--ep", type=_tp_sizes, default=None, metavar="E[,E...]",
                   help="expert-parallel sizes to plan for (default: the config's expert_parallel.autoep_size when "
                   "enabled, else 1); each must divide the data-parallel ranks")
    p.add_argument("--mics", type=_pos_int, default=None, metavar="S",
                   help="MiCS shard size: stages 1-3 shard over groups of S ranks, replicated across them (default: "
                   "the config's zero_optimization.mics_shard_size when on); must divide the world size")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (bytes as whole numbers)")
    add_sequence_options(p)
    add_predict_options(p)
    p.set_defaults(func=_cmd_plan)
