"""`fnzero bench {comm,io}` (DeepSpeed's `ds_bench` and `ds_io`) and `fnzero nvme-tune`
(`ds_nvme_tune`); `specs/cli.md` §fnzero bench comm and §fnzero bench io."""

from __future__ import annotations

from . import _bench_comm, _nvme

__all__ = ["register"]


def register(sub) -> None:
    p = sub.add_parser("bench", help="communication and I/O micro-benchmarks (ds_bench, ds_io)",
                       description="Micro-benchmarks: `comm` (collectives) and `io` (the NVMe AIO engine).")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    _bench_comm.add_parser(bench_sub)
    _nvme.add_io_parser(bench_sub)
    _nvme.register(sub)
