"""`fnzero export`, `fnzero checkpoint info` and `fnzero checkpoint convert`: registered into the
`fnzero` command by `register`."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from .._errors import CheckpointError
from ._common import fail

__all__ = ["register"]


def _cmd_export(args: argparse.Namespace) -> int:
    from ..checkpoint import export

    try:
        paths = export(args.checkpoint, args.out, dtype=args.dtype, tag=args.tag, max_shard_size=args.max_shard_size,
                       exclude_frozen=args.exclude_frozen, format=args.format, tied=args.tied,
                       progress=None if not args.quiet else False, hf_config=args.hf_config)
    except (CheckpointError, OSError) as e:
        return fail("export", str(e), 1)
    for p in paths:
        print(p)
    return 0


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return str(n)


def _cmd_info(args: argparse.Namespace) -> int:
    from ..checkpoint import info

    try:
        rep = info(args.checkpoint, verify=args.verify)
    except (CheckpointError, OSError) as e:
        return fail("checkpoint info", str(e), 1)
    broken = [c for c in rep["checkpoints"] if not c["health"].startswith("ok")] or ("latest_health" in rep)
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
        return 1 if broken else 0
    universal = f", latest_universal: {rep['latest_universal']}" if rep.get("latest_universal") else ""
    print(f"{rep['path']}  (latest: {rep['latest']}{universal})")
    if not rep["checkpoints"]:
        print("  no committed checkpoints")
    for c in rep["checkpoints"]:
        mark = "*" if c["tag"] in (rep["latest"], rep.get("latest_universal")) else " "
        if "step" in c:
            prec = f"{c['param_dtype']} params" + (f" + {c['master_dtype']} master" if c["master_dtype"] else "")
            fmt = c["version"] if c.get("format") == "deepspeed" else f"format v{c['version']}"
            fmt += " universal" if c.get("deepspeed", {}).get("universal") else ""
            print(f"{mark} {c['tag']}: step {c['step']}, saved by {c['world_size']} rank(s) at ZeRO stage {c['stage']}, "
                  f"{c['num_params']:,} parameters ({prec}), {c['optimizer']}, {_human(c['bytes'])}, {fmt}: "
                  f"{c['health']}")
            if c.get("format") == "deepspeed":
                d = c["deepspeed"]
                print(f"    pipeline {d['pp_degree']} x tensor {d['tp_degree']}, {d['skipped_steps']} skipped step(s), "
                      f"lr scheduler {d['lr_scheduler']}" + (", BF16_Optimizer" if d["bf16_optimizer"] else ""))
            if args.config and c.get("config"):
                print("    config: " + c["config"].replace("\n", "\n    "))
        else:
            print(f"{mark} {c['tag']}: {c['health']}")
    if "latest_health" in rep:
        print(rep["latest_health"])
    return 1 if broken else 0


CONVERT_TARGETS = ("deepspeed-universal", "fnzero")


def _cmd_convert(args: argparse.Namespace) -> int:
    from ..checkpoint import is_deepspeed, to_deepspeed_universal
    from ..state import deepspeed_to_fnzero

    from_deepspeed = is_deepspeed(args.checkpoint)
    try:
        if args.to == "fnzero":
            if not from_deepspeed:
                raise CheckpointError(f"{args.checkpoint} is not a DeepSpeed checkpoint (no *model_states.pt under "
                                      "it): --to fnzero converts DeepSpeed's; fnzero's own loads as it is")
            print(deepspeed_to_fnzero(args.checkpoint, args.out, tag=args.tag, out_tag=args.out_tag,
                                      config=args.config))
        elif from_deepspeed:
            # DeepSpeed's own checkpoint to universal (what its ds_to_universal does): through fnzero's
            # format, written beside OUT and removed after.
            os.makedirs(args.out, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=args.out, prefix=".fnzero-convert-") as tmp:
                ckpt = deepspeed_to_fnzero(args.checkpoint, tmp, tag=args.tag, config=args.config)
                print(to_deepspeed_universal(ckpt, args.out, ds_tag=args.out_tag))
        else:
            print(to_deepspeed_universal(args.checkpoint, args.out, tag=args.tag, ds_tag=args.out_tag,
                                         config=args.config))
    except (CheckpointError, OSError) as e:
        return fail("checkpoint convert", str(e), 1)
    return 0


def register(sub) -> None:
    ep = sub.add_parser("export", help="consolidated weights (safetensors or torch) from a checkpoint",
                        description="Write a checkpoint's consolidated weights in model.state_dict() naming.")
    ep.add_argument("checkpoint", help="checkpoint root (uses 'latest') or one checkpoint directory; fnzero's or "
                                       "DeepSpeed's (a save directory, a global_stepN directory, a Trainer "
                                       "checkpoint-N, a universal checkpoint: 'latest_universal' where there is "
                                       "no 'latest')")
    ep.add_argument("out", help="output file, or a directory for model.safetensors / pytorch_model.bin")
    ep.add_argument("--dtype", default="fp32", help="fp32 (default), bf16, fp16 or fp64; integer buffers keep theirs")
    ep.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    ep.add_argument("--max-shard-size", default=None, help="split into files of at most this size, e.g. 5GB")
    ep.add_argument("--exclude-frozen", action="store_true", help="leave out requires_grad=False parameters")
    ep.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")
    ep.add_argument("--tied", choices=["auto", "copy", "first"], default="auto",
                    help="names: as the model's own save writes them (auto, the default: save_pretrained's for a "
                         "transformers model, one name per tied weight), every state_dict name (copy: tied weights "
                         "as copies), or each tensor once under its first name (first)")
    ep.add_argument("--hf-config", default=None, metavar="DIR",
                    help="a Hugging Face save_pretrained directory (or config.json) whose config.json, and "
                         "generation_config.json, are written beside the weights, for from_pretrained")
    ep.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ep.set_defaults(func=_cmd_export)

    cp = sub.add_parser("checkpoint", help="inspect and convert checkpoints")
    csub = cp.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    ip = csub.add_parser("info", help="tags, world size, stage, sizes, config and health")
    ip.add_argument("checkpoint", help="checkpoint root or one checkpoint directory (fnzero's or DeepSpeed's, "
                                       "universal ones too)")
    ip.add_argument("--verify", action="store_true", help="also read everything and check every checksum")
    ip.add_argument("--config", action="store_true", help="print each checkpoint's config JSON")
    ip.add_argument("--json", action="store_true", help="machine-readable output")
    ip.set_defaults(func=_cmd_info)
    cv = csub.add_parser("convert", help="write a checkpoint in another format (fnzero's, DeepSpeed universal)",
                         description="Write a DeepSpeed checkpoint as an fnzero one (--to fnzero), or an fnzero or "
                                     "DeepSpeed checkpoint as a DeepSpeed universal one, which DeepSpeed resumes with "
                                     '{"checkpoint": {"load_universal": true}} at ZeRO stage 1-3 and any world size '
                                     "(--to deepspeed-universal). DeepSpeed need not be installed.")
    cv.add_argument("checkpoint", help="checkpoint root (uses 'latest') or one checkpoint directory: fnzero's, or "
                                       "DeepSpeed's (a save directory, a global_stepN directory, a Trainer checkpoint-N)")
    cv.add_argument("out", help="the root to write: gets TAG/ and latest (fnzero) or latest_universal (DeepSpeed)")
    cv.add_argument("--to", required=True, choices=CONVERT_TARGETS, help="the format to write")
    cv.add_argument("--tag", default=None, help="the checkpoint's tag to read (default: latest)")
    cv.add_argument("--out-tag", "--ds-tag", dest="out_tag", default=None,
                    help="the tag directory to write (default: the DeepSpeed tag, or global_step<N> for universal)")
    cv.add_argument("--config", default=None, metavar="JSON",
                    help="the run's config, for a checkpoint saved without one (or to use instead of its own)")
    cv.set_defaults(func=_cmd_convert)
