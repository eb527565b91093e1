"""`fnzero bench comm`, `fnzero bench io`, `fnzero nvme-tune` and `fnzero ssh` (specs/cli.md
§fnzero bench comm, §fnzero bench io, §fnzero ssh), through the command's `main` in this process
(torch is imported already; bench comm forks its ranks, ssh starts one ssh process per host), and
ssh once for real, as a separate process between two network-namespace hosts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from test_launch_hostfile import two_hosts  # noqa: F401  (the fixture: two network-namespace hosts over sshd)

import fnzero
from fnzero.cli._main import main

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)


def test_bench_comm_on_two_ranks_prints_every_op_with_formula_bytes(capfd):
    """Two gloo ranks forked by the command itself (--world 2): each op's table, one row per size,
    the bytes each rank sends by the formula (all-reduce 2(n-1)/n, all-gather, reduce-scatter and
    all-to-all (n-1)/n, broadcast and pt2pt 1 of the size), busbw = those bytes / time."""
    code = main(["bench", "comm", "--world", "2", "--sizes", "4KiB,64KiB", "--trials", "2", "--warmups", "1"])
    r = capfd.readouterr()
    assert code == 0, r.err[-2000:]
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0,
              "pt2pt": 1.0}
    tables = re.split(r"\n---- Performance of (\w+) on 2 ranks \(gloo, float32, 2 trials\); bytes sent per rank = "
                      r"(\S+) x size ----\n", r.out)
    ops = tables[1::3]
    assert ops == list(factor)
    for op, formula, body in zip(tables[1::3], tables[2::3], tables[3::3]):
        assert formula == {1.0: "1", 0.5: "(n-1)/n"}[factor[op]] if op != "all_reduce" else formula == "2(n-1)/n"
        rows = [line.split() for line in body.strip().splitlines()[1:]]
        assert [(int(row[0]), row[1]) for row in rows] == [(4096, "1024x4"), (65536, "16384x4")], op
        for row in rows:
            size, seconds = int(row[0]), float(row[2]) * {"us": 1e-6, "ms": 1e-3}[row[3]]
            assert float(row[6]) == size * factor[op]  # formula bytes per rank
            assert float(row[5]) == pytest.approx(size * factor[op] * 8e-9 / seconds, rel=0.02, abs=2e-3)  # busbw


def test_bench_comm_bad_input_is_one_line(capsys):
    for args, words in ((["--ops", "all_reduce,allreduce"], "unknown collective 'allreduce'"),
                        (["--sizes", "12x"], "--sizes: size '12x'"),
                        (["--dtype", "float33"], "--dtype 'float33' is not a torch dtype"),
                        (["--scan", "--sizes", "1K"], "--scan and --sizes do not mix")):
        assert main(["bench", "comm", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("fnzero bench comm: ") and words in err, err


def test_bench_io_and_nvme_tune_write_an_aio_block_fnzero_accepts(tmp_path, capsys):
    """bench io reports GB/s for write and read; nvme-tune sweeps 2 x 2 x 2 combinations on a tmp
    folder, prints the table and writes the best one as an aio block that load_config takes
    without a warning, its values among those swept."""
    assert main(["bench", "io", "--folder", str(tmp_path), "--io-size", "256KiB", "--block-size", "64KiB",
                 "--loops", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["io_size"] == 262144 and r["write"] > 0 and r["read"] > 0
    out = tmp_path / "aio.json"
    assert main(["nvme-tune", "--nvme_dir", str(tmp_path), "--io_size", "256KiB", "--block_sizes", "64KiB,128KiB",
                 "--queue_depths", "2,8", "--intra_op_parallelism", "1,2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert len(re.findall(r"^\s+\d+\s+\d+\s+\d+\s+\d+\.\d+\s+\d+\.\d+$", text, re.M)) == 8
    block = json.loads(out.read_text())
    assert json.loads(text[text.index("{"):]) == block
    aio = block["aio"]
    assert aio["block_size"] in (65536, 131072) and aio["queue_depth"] in (2, 8)
    assert aio["intra_op_parallelism"] in (1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, **block})
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.thread_count) == (
        aio["block_size"], aio["queue_depth"], aio["intra_op_parallelism"])
    assert not any(f.name.startswith("fnzero-bench-io") for f in tmp_path.iterdir())  # cleaned up
    assert main(["nvme-tune", "--nvme_dir", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"fnzero nvme-tune: --nvme_dir {tmp_path / 'nope'}: no such directory"
    assert main(["bench", "io", "--queue-depth", "0"]) == 2
    assert "--queue-depth: '0': each value must be at least 1" in capsys.readouterr().err
    assert main(["nvme-tune", "--nvme_dir", "/proc"]) == 2  # a folder, but nothing can be made in it
    assert capsys.readouterr().err.strip() == "fnzero nvme-tune: /proc is not a writable directory"
    # ds_io's sizes: one letter is a power of 1024 (its refine_integer_value), `4M` = 4 MiB.
    assert main(["bench", "io", "--folder", str(tmp_path), "--io-size", "256K", "--block-size", "64K", "--loops", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["io_size"] == 262144
    # ds_nvme_tune's spellings: its sweep JSON, --no_read; several folders, one line.
    (tmp_path / "sweep.json").write_text('{"block_size": ["64K"], "queue_depth": [2, 4], "io_parallel": [1], '
                                         '"single_submit": [false, true]}')
    assert main(["nvme-tune", "--nvme_dir", str(tmp_path), "--sweep_config", str(tmp_path / "sweep.json"),
                 "--io_size", "256K", "--no_read", "--no_sudo"]) == 0
    out, err = capsys.readouterr()
    assert len(re.findall(r"^\s+65536\s+[24]\s+1\s+\d+\.\d+\s+-$", out, re.M)) == 2
    assert "single_submit other than false has no effect" in err
    assert main(["nvme-tune", "--nvme_dir", str(tmp_path), str(tmp_path)]) == 2
    assert "give one folder" in capsys.readouterr().err


FAKE_SSH = """#!/bin/sh
# ssh stand-in: drop ssh's options, then run the command line here with HOST set to the host named
while [ $# -gt 0 ]; do case "$1" in -o|-p) shift 2;; *) break;; esac; done
host=$1; shift
HOST=$host exec sh -c "$1"
"""


def test_ssh_runs_on_every_host_with_prefixes_and_the_worst_status(tmp_path, capfd, monkeypatch):
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("alpha slots=1\nbeta slots=2\ngamma slots=1\n")
    monkeypatch.setenv("FNZERO_SSH", str(ssh))
    assert main(["ssh", "-H", str(hosts), "-e", "gamma", "echo", "on", "$HOST"]) == 0
    out = capfd.readouterr().out
    assert sorted(out.splitlines()) == ["alpha: on alpha", "beta: on beta"], out
    assert main(["ssh", "-H", str(hosts), "case $HOST in alpha) exit 3;; beta) exit 7;; esac"]) == 7
    assert capfd.readouterr().err.strip() == "fnzero ssh: alpha exited with status 3, beta exited with status 7"
    assert main(["ssh", "-H", str(hosts), "-i", "alpha@delta", "true"]) == 2
    assert capfd.readouterr().err.strip() == ("fnzero ssh: --include 'alpha@delta': host 'delta' is not in the "
                                              "hostfile (hosts: ['alpha', 'beta', 'gamma'])")
    assert main(["ssh", "-H", str(tmp_path / "none"), "true"]) == 2
    assert capfd.readouterr().err.strip() == (
        f"fnzero ssh: cannot read hostfile {tmp_path / 'none'}: No such file or directory")


def test_ssh_on_two_real_hosts(two_hosts):
    """Over real ssh between the two namespace hosts: each host answers with its own address."""
    hostfile, env, ns = two_hosts
    with open(hostfile) as f:
        ips = [line.split()[0] for line in f.read().splitlines()]
    r = subprocess.run(["ip", "netns", "exec", ns[0], sys.executable, "-m", "fnzero.cli", "ssh", "-H", hostfile,
                        "--ssh_port", "2222", "hostname", "-I"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    got = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert {h: v.split()[0] for h, v in got.items()} == {ip: ip for ip in ips}


def test_bench_comm_takes_ds_benchs_op_switches(capsys):
    # ds_bench's --all-gather, --broadcast ...: only the ops named, beside those --ops names.
    assert main(["bench", "comm", "--all-gather", "--broadcast", "--ops", "all_reduce", "--sizes", "4KiB",
                 "--trials", "1", "--warmups", "0", "--json"]) == 0
    assert [r["op"] for r in json.loads(capsys.readouterr().out)] == ["all_gather", "broadcast", "all_reduce"]


def test_bench_comm_raw_prints_microseconds_without_the_unit(capsys):
    # ds_bench's --raw: every duration in µs, a bare number, and the header says the unit.
    assert main(["bench", "comm", "--ops", "all_reduce", "--sizes", "4KiB", "--trials", "1", "--warmups", "0",
                 "--raw"]) == 0
    header, row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("Size", "4096"))]
    assert "Duration (us)" in header
    float(row.split()[2])  # a number: no "us"/"ms" after it
    assert row.split()[3] != "us" and row.split()[3] != "ms"
