"""`fnzero launch --hostfile`, DeepSpeed-style (specs/cli.md §launch --hostfile): the hostfile and
its filters, and, for real, a 2-host x 2-rank ZeRO-3 job over SSH between two network namespaces
(each with its own sshd, joined by a veth link) that trains, saves a checkpoint on each host's own
directory (checkpoint.use_node_local_storage), and ends on every host when one host is killed;
the same job first counts the bytes crossing the link for plain ZeRO-3, hpZ and MiCS (specs/mesh.md §hpZ).

The same two hosts then run a job started by `--launcher openmpi` (mpirun) and by `--launcher pdsh`
(specs/cli.md §Launchers).

The real part needs root, iproute2 and Debian's openssh-server (`.ci/run` installs it), and
openmpi-bin and pdsh for the launchers; without them it is skipped, saying why."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from fnzero.cli.launch._hosts import HostfileError, parse_hostfile, read_env_file, select

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(HERE, "scripts", "train_launched.py")

# -- the hostfile and its filters (no ssh) -----------------------------------------------------------

HOSTS = parse_hostfile("# a comment\nworker-0 slots=4\n\nworker-1 slots=4\nworker-2 slots=2\n")


def test_hostfile_lines_in_order():
    assert HOSTS == {"worker-0": 4, "worker-1": 4, "worker-2": 2}


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\nworker-0 slots=2", "hostfile:2: host 'worker-0' is listed twice"),
    ("worker-0 slots=four", "hostfile:1: expected 'HOST slots=N'"),
    ("worker-0 slots=0", "slots=0; at least 1"),
    ("# nothing\n", "no 'HOST slots=N' lines"),
])
def test_a_bad_hostfile_names_the_line(text, message):
    with pytest.raises(HostfileError, match=re.escape(message)):
        parse_hostfile(text)


@pytest.mark.parametrize("kw, want", [
    ({}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
    ({"include": "worker-1@worker-0:0,2"}, {"worker-0": [0, 2], "worker-1": [0, 1, 2, 3]}),  # hostfile order
    ({"exclude": "worker-1@worker-0:3"}, {"worker-0": [0, 1, 2], "worker-2": [0, 1]}),
    ({"num_nodes": 2}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ({"num_nodes": 2, "num_gpus": 1}, {"worker-0": [0], "worker-1": [0]}),
])
def test_filters_select_hosts_and_slots_as_deepspeed_does(kw, want):
    assert select(HOSTS, **kw) == want


@pytest.mark.parametrize("kw, message", [
    ({"include": "worker-9"}, "host 'worker-9' is not in the hostfile"),
    ({"include": "worker-2:2"}, "host 'worker-2' has slots 0..1, not [2]"),
    ({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive"),
    ({"include": "worker-0", "num_nodes": 1}, "cannot be combined"),
    ({"num_nodes": 4}, "the hostfile has 3 host(s)"),
    ({"num_gpus": 3}, "fewer slots: {'worker-2': 2}"),
    ({"exclude": "worker-0@worker-1@worker-2"}, "leave no host"),
])
def test_bad_filters_say_what_is_wrong(kw, message):
    with pytest.raises(HostfileError, match=re.escape(message)):
        select(HOSTS, **kw)


def test_deepspeed_env_files_are_read_from_home_and_here(tmp_path, monkeypatch):
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir(), here.mkdir()
    (home / ".deepspeed_env").write_text("A=1\nB=from home\n")
    (here / ".deepspeed_env").write_text("# comment\nB=from here=with equals\n")
    monkeypatch.setattr("fnzero.cli.launch._hosts.ENV_FILE_PATHS", (str(home), str(here)))
    assert read_env_file() == {"A": "1", "B": "from here=with equals"}
    (here / ".deepspeed_env").write_text("not a pair\n")
    with pytest.raises(HostfileError, match=r"\.deepspeed_env:1: expected KEY=VALUE"):
        read_env_file()


# -- two hosts for real ------------------------------------------------------------------------------

def _why_no_hosts() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces)"
    for tool in ("ip", "ssh", "ssh-keygen", "/usr/sbin/sshd"):
        if shutil.which(tool) is None:
            return f"needs {tool} (openssh-server, iproute2; .ci/run installs them)"
    probe = f"fnzprobe{uuid.uuid4().hex[:6]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "network namespaces are not permitted here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd, ns: str | None = None, check=True):
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Two network namespaces, 10.77.x.1 and 10.77.x.2 on a veth link named `fnz0` in both, each
    running sshd on port 2222 that accepts one generated key. Yields (hostfile, env, namespaces)."""
    why = _why_no_hosts()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("hosts")
    tag = uuid.uuid4().hex[:6]
    ns = [f"fnzA{tag}", f"fnzB{tag}"]
    net = f"10.77.{int(tag[:2], 16) % 250}"
    ips = [f"{net}.1", f"{net}.2"]
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id"))
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key"))
    shutil.copy(d / "id.pub", d / "authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True)
    sshd = []
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
        _sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for n, end, ip in zip(ns, (f"va{tag}", f"vb{tag}"), ips):
            _sh("ip", "link", "set", end, "netns", n)
            _sh("ip", "link", "set", end, "name", "fnz0", ns=n)
            _sh("ip", "addr", "add", f"{ip}/24", "dev", "fnz0", ns=n)
            _sh("ip", "link", "set", "fnz0", "up", ns=n)
            _sh("ip", "link", "set", "lo", "up", ns=n)
            conf = d / f"sshd_{n}"
            conf.write_text(
                f"Port 2222\nListenAddress {ip}\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
                f"PermitRootLogin yes\nPasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile {d / n}.pid\n"
                "AcceptEnv *\n"
            )
            sshd.append(subprocess.Popen(["ip", "netns", "exec", n, "/usr/sbin/sshd", "-D", "-e", "-f", str(conf)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ssh = f"ssh -i {d / 'id'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
        deadline = time.monotonic() + 20
        for ip in ips:  # sshd takes a moment to listen
            while _sh(*ssh.split(), "-p", "2222", ip, "true", ns=ns[0], check=False).returncode != 0:
                assert time.monotonic() < deadline, f"sshd on {ip} did not come up"
                time.sleep(0.2)
        (d / "hostfile").write_text(f"{ips[0]} slots=2\n{ips[1]} slots=2\n")
        home = d / "home"  # the launcher's home: DeepSpeed's `.deepspeed_env` is read from ~ (and .)
        home.mkdir()
        (home / ".deepspeed_env").write_text("FNZ_HOSTFILE_TEST=forwarded\n")
        env = {**os.environ, "HOME": str(home), "FNZERO_SSH": ssh, "GLOO_SOCKET_IFNAME": "fnz0",
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        yield str(d / "hostfile"), env, ns
    finally:
        for p in sshd:
            p.kill()
            p.wait()
        for n in ns:
            subprocess.run(["ip", "netns", "pids", n], capture_output=True)
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _launch(two_hosts, *script_args, **popen):
    hostfile, env, ns = two_hosts
    cmd = ["ip", "netns", "exec", ns[0], sys.executable, "-m", "fnzero.cli", "launch", "--hostfile", hostfile,
           "--ssh_port", "2222", "--master_port", "29533", os.path.join(HERE, "scripts", "train_on_hosts.py"),
           *script_args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


# -- the same two hosts, started by mpirun and by pdsh (before the test below kills the second) ------

def _start_launcher(two_hosts, launcher: str, launcher_args: str, extra_env: dict, *flags) -> subprocess.Popen:
    """`fnzero launch --launcher L` from the first host (flags, then the script and its arguments)."""
    hostfile, env, ns = two_hosts
    cmd = ["ip", "netns", "exec", ns[0], sys.executable, "-m", "fnzero.cli", "launch", "--hostfile", hostfile,
           "--launcher", launcher, "--launcher_args", launcher_args, "--ssh_port", "2222", "--master_port", "29535",
           "--num_gpus", "1", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _results(out: str) -> list[tuple[str, ...]]:
    found = re.findall(r"RESULT rank=(\d) world=(\d) local=(\d) net=(\S+) by=(\w+) var=(\w+) cpus=(\S+) omp=(\w+) "
                       r"loss=(\S+)", out)
    return sorted(found)


def _check_two_hosts(found, by: str, out: str) -> str:
    """Two ranks, one per host (`--num_gpus 1` of the hostfile's two slots), one job: its loss."""
    assert [(r, w, loc, b, v) for r, w, loc, _, b, v, *_ in found] == [("0", "2", "0", by, "forwarded"),
                                                                       ("1", "2", "0", by, "forwarded")], out
    assert found[0][3] != found[1][3], out  # each rank in its own host's network namespace
    assert len({loss for *_, loss in found}) == 1, out
    return found[0][-1]


# Two more 2-host jobs, 25-30 s on the 2-core CI machine: the real mpirun and pdsh where CI installs them
# (the other launchers' command lines, and their table against DeepSpeed's: tests/test_launchers.py).
def test_openmpi_and_pdsh_launch_the_same_job_across_two_hosts(two_hosts):
    """`--launcher openmpi`: one mpirun starts the ranks (each reads its rank from Open MPI's
    variables; `--num_gpus 1` gives mpirun a hostfile of one slot per host); `--launcher pdsh`:
    pdsh starts one `fnzero launch` per host (`%n` its node rank), which starts the host's rank.
    ZeRO-3 across the two hosts, the same job either way: the same loss. Ctrl-C then ends the pdsh
    job on both hosts."""
    missing = [t for t in ("mpirun", "pdsh") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (openmpi-bin, pdsh; .ci/run installs them)")
    ssh_opts = two_hosts[1]["FNZERO_SSH"].split(None, 1)[1]
    # --bind_cores_to_rank under mpirun: each rank (its host's only one) is bound to cores 0-1 by
    # fnzero's binding step, reading Open MPI's local rank and size, with OMP_NUM_THREADS=2.
    proc = _start_launcher(two_hosts, "openmpi", "--allow-run-as-root --bind-to none --mca btl_tcp_if_include fnz0 "
                           "--mca oob_tcp_if_include fnz0", {"OMPI_MCA_plm_rsh_args": f"{ssh_opts} -p 2222"},
                           "--bind_cores_to_rank", "--bind_core_list", "0-1", TRAIN)
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    found = _results(out)
    assert [(cpus, omp) for *_, cpus, omp, _ in found] == [("0-1", "2"), ("0-1", "2")], out
    mpi_loss = _check_two_hosts(found, "openmpi", out)
    # pdsh: the ranks train, then wait; Ctrl-C to this launcher ends them on both hosts (pdsh does
    # not pass it on: the per-host launchers are ended by pdsh's kill command).
    proc = _start_launcher(two_hosts, "pdsh", "", {"PDSH_SSH_ARGS_APPEND": ssh_opts}, TRAIN, "wait")
    out, t0 = "", time.monotonic()
    while out.count("RESULT rank=") < 2:
        line = proc.stdout.readline()
        assert line and time.monotonic() - t0 < 150, out
        out += line
    assert _check_two_hosts(_results(out), "torchrun", out) == mpi_loss
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + rest
    for n in two_hosts[2]:  # each host's launcher stops its ranks (SIGTERM, then its grace): seconds under load
        deadline, left = time.monotonic() + 20, ["?"]
        while left and time.monotonic() < deadline:
            left = [p for p in _sh("ip", "netns", "pids", n).stdout.split() if "train_launched" in _cmdline(p)]
            time.sleep(0.5 if left else 0)
        assert not left, f"a rank outlived the job on {n} by 20 s: {left}"


@pytest.fixture(scope="module")
def hosts_job(two_hosts, tmp_path_factory):
    """One 2-host job (starting one costs ~12 s, more on a loaded machine): it measures the bytes
    crossing between the hosts (cross_host_bytes.py), trains, saves node-locally, prints its results,
    then trains on until it is ended. Yields (the running launcher, its output so far, the measured bytes)."""
    d = tmp_path_factory.mktemp("job")
    proc = _launch(two_hosts, "3", str(d / "ck"), "forever", f"bytes={d / 'bytes.json'}")
    t0, out = time.monotonic(), ""
    try:
        while len(re.findall(r"RESULT rank=", out)) < 4:
            line = proc.stdout.readline()
            assert line and time.monotonic() - t0 < 150, out
            out += line
        with open(d / "bytes.json") as f:
            yield proc, out, json.load(f)
    finally:
        if proc.poll() is None:  # the killed-host test did not end it: the launcher ends every host's ranks
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def test_hpz_and_mics_keep_gathers_off_the_link_between_hosts(hosts_job):
    """specs/mesh.md §hpZ (Measured across two hosts): the bytes crossing the veth link while the
    same float64 MLP trains 3 stage-3 steps (backward re-gathering) as plain ZeRO-3, with
    `zero_hpz_partition_size: 2` and with `mics_shard_size: 2`, hosts of 2 ranks each.

    Expected (both directions, per step): on gloo, all-gathers and reduce-scatters are direct
    exchanges (fnzero/sharding/comm/_direct.py): each of the 4 ranks sends P/4 elements to each of
    the 2 ranks on the other host, 2P elements across per collective over all 4 ranks. Plain: forward
    gather, backward re-gathers (Ψ_r) and reduce-scatter, 2(2P + Ψ_r) b. hpZ: the re-gathers stay in
    the node, 2·2P b. MiCS: every gather and reduce-scatter stays in the node; the replica all-reduce
    of each P/2 shard between the two hosts' paired ranks sends it once each way per pair, 2P a.
    The link also carries Ethernet/IP/TCP headers and ACKs, gloo's message headers and the barriers:
    without segmentation offload 66 header bytes per 1448 payload bytes (4.6 %) plus an ACK per two
    frames (2.3 %), so measured ≤ 1.08 x expected + the empty phase's bytes (measured: about 1 %,
    veth sends 64 KiB segments); and at least the expected payload."""
    *_, rows = hosts_job
    b = 8  # float64 parameters and gradients
    p = rows["zero3"]["padded"]
    assert p == rows["params"] == rows["mics2"]["padded"]  # the widths divide by 4: no padding
    regathered = rows["zero3"]["gathered_per_step"] - p
    assert 0 < regathered < p and rows["hpz2"]["gathered_per_step"] == p  # hpZ gathers once over the 4 ranks
    expected = {name: rows["steps"] * per_step * b for name, per_step in
                (("zero3", 2 * (2 * p + regathered)), ("hpz2", 2 * 2 * p), ("mics2", 2 * p))}
    crossed = {name: rows[name]["crossed"] for name in expected}
    for name in expected:
        assert expected[name] <= crossed[name] <= 1.08 * expected[name] + rows["empty"]["crossed"], (name, rows)
    saved = crossed["zero3"] - crossed["hpz2"]  # the re-gathers, 2 Ψ_r b a step, up to the headers' share
    assert abs(saved - (expected["zero3"] - expected["hpz2"])) <= 0.08 * expected["zero3"], rows
    assert crossed["mics2"] < crossed["hpz2"] < crossed["zero3"]
    assert rows["hpz2"]["loss"] == rows["zero3"]["loss"]  # the same gathered values, the same sums
    assert rows["mics2"]["loss"] == pytest.approx(rows["zero3"]["loss"], rel=1e-12)  # sums in another order


def test_two_hosts_train_from_a_hostfile_and_a_killed_host_ends_the_job(two_hosts, hosts_job):
    # The job trains, saves node-locally, prints its results, then trains on until the second host
    # is killed, which must end it on the first.
    _, _, ns = two_hosts
    proc, out, _ = hosts_job
    killed = time.monotonic()
    for pid in _sh("ip", "netns", "pids", ns[1]).stdout.split():  # the second host goes down, all of it
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - killed < 30, out + rest  # well within the watchdog's 15 s plus its grace
    assert "ending the job on every host" in rest, out + rest
    time.sleep(1)  # no rank of the first host is left behind
    assert not [p for p in _sh("ip", "netns", "pids", ns[0]).stdout.split() if "train_on_hosts" in _cmdline(p)], \
        "a rank outlived the job"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""

