"""`fnzero report`: what fnzero runs on here (the `ds_report` analogue)."""

from __future__ import annotations

import platform
import sys

__all__ = ["register", "report_lines"]


def register(sub) -> None:
    p = sub.add_parser("report", help="environment, devices, backends and native-extension status")
    p.set_defaults(func=_run)


def _run(args) -> int:
    print("\n".join(report_lines()))
    return 0


def _gloo_direct_note() -> str:
    import os

    if os.environ.get("FNZERO_GLOO_DIRECT", "1") == "0":
        return "  (all-gather/reduce-scatter: gloo's own, FNZERO_GLOO_DIRECT=0)"
    return "  (all-gather/reduce-scatter: direct point-to-point exchanges; FNZERO_GLOO_DIRECT=0 for gloo's own)"


def report_lines() -> list[str]:
    import torch
    import torch.distributed as dist

    import fnzero

    lines = [
        f"fnzero            {fnzero.__version__}  ({fnzero.__file__})",
        f"python            {sys.version.split()[0]}  {platform.platform()}",
        f"torch             {torch.__version__}  (CPU capability {torch.backends.cpu.get_cpu_capability()})",
        f"threads           {torch.get_num_threads()}",
        f"cuda              {'available, ' + str(torch.cuda.device_count()) + ' device(s)' if torch.cuda.is_available() else 'not available'}",
        f"distributed       {'available' if dist.is_available() else 'not available'}",
        f"  gloo            {'yes' if dist.is_available() and dist.is_gloo_available() else 'no'}"
        f"{_gloo_direct_note() if dist.is_available() and dist.is_gloo_available() else ''}",
        f"  nccl            {'yes' if dist.is_available() and dist.is_nccl_available() else 'no'}",
    ]
    from .. import _ext

    lines += _ext.report_lines()
    return lines
