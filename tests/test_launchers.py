"""`fnzero launch --launcher ...` (specs/cli.md §Launchers): the command line each launcher tool gets
equals DeepSpeed 0.19.8's (`multinode_runner.py` `get_cmd`) for the same hostfile, filters, flags and
variables, except where fnzero must differ (specs/cli.md §Where fnzero's commands differ), which is
tested exactly; the MPI ranks' variables as `init_distributed` reads them; core binding; the bad
input (a missing tool, an unknown host, a bad core list) as one line and exit 2.

`tests/data/deepspeed_0_19_8_launcher_commands.json` holds DeepSpeed's commands, written by
`tests/scripts/deepspeed_launcher_table.py`; the last test regenerates it where DeepSpeed is
importable (run with /tmp/dsvenv/bin/python) and compares."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from fnzero.cli.launch._binding import bind_command, core_ranges, parse_core_list, physical_cores
from fnzero.cli.launch._hosts import LaunchError, select
from fnzero.cli.launch._launchers import (MVAPICH_HOSTFILE, LaunchJob, default_exports, encode_world_info,
                                          launcher_command, pdsh_kill_command)
from fnzero.cli._main import split_launch_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from deepspeed_launcher_table import CWD, HOSTFILE, LAUNCH_CASES, PYTHON  # noqa: E402

TABLE_PATH = ROOT / "tests" / "data" / "deepspeed_0_19_8_launcher_commands.json"
TABLE = json.loads(TABLE_PATH.read_text())
CASES = {c["name"]: c for c in TABLE["cases"]}
ADDR, PORT = TABLE["master_addr"], TABLE["master_port"]


def fnzero_command(case: dict) -> tuple[list[str], dict[str, str]]:
    active = select(case["pool"], case.get("include", ""), case.get("exclude", ""), case.get("num_nodes", -1),
                    case.get("num_gpus", -1))
    exports = {**default_exports(case["launcher"], cuda=False), **dict(case.get("exports", []))}
    job = LaunchJob(launcher=case["launcher"], hostfile=HOSTFILE, active=active,
                    exports={k: v.strip() for k, v in exports.items()}, master_addr=ADDR, master_port=PORT,
                    python=PYTHON, cwd=CWD, script="train.py", script_args=tuple(case.get("user_args", [])),
                    launcher_args=case.get("launcher_args", ""), module=case.get("module", False),
                    no_python=case.get("no_python", False), ssh_port=case.get("ssh_port"),
                    narrowed=bool(case.get("include") or case.get("exclude")), num_nodes=case.get("num_nodes", -1),
                    num_gpus=case.get("num_gpus", -1))
    return launcher_command(job, {})


def _program_start(cmd: list[str]) -> int:
    return cmd.index(PYTHON) if PYTHON in cmd else cmd.index("train.py")


def deepspeed_in_fnzero(case: dict) -> list[str]:
    """DeepSpeed's command with fnzero's specified differences applied (specs/cli.md §Where
    fnzero's commands differ): variables' values reach mpirun and srun without shell quotes; each
    MPI rank and srun task is told the rendezvous; MPICH ranks run the script directly (fnzero
    reads PMI_RANK itself, no helper); pdsh hosts run `fnzero launch`."""
    cmd = list(case["deepspeed"]["cmd"])
    at = _program_start(cmd)
    launcher = case["launcher"]
    if launcher != "pdsh":  # a value is one word of mpirun's or srun's command: no shell quotes in it
        cmd[:at] = [w.replace('"', "") for w in cmd[:at]]
    if launcher == "openmpi":
        cmd[at:at] = ["-x", f"MASTER_ADDR={ADDR}", "-x", f"MASTER_PORT={PORT}"]
    elif launcher == "mvapich":
        cmd[at:at] = ["-env", f"MASTER_ADDR={ADDR}", "-env", f"MASTER_PORT={PORT}"]
    elif launcher == "slurm":
        cmd[at - 1] += f",MASTER_ADDR={ADDR},MASTER_PORT={PORT}"
    elif launcher == "mpich":
        helper = next(i for i, w in enumerate(cmd) if w.endswith("launcher_helper.py"))
        del cmd[helper:helper + 3]  # the helper and its `--launcher mpich`
        cmd = [w for i, w in enumerate(cmd) if not (i >= helper and w in ("--module", "--no_python"))]
    elif launcher == "pdsh":
        at = cmd.index("deepspeed.launcher.launch")
        cmd[at:at + 1] = ["fnzero.cli", "launch"]
        cmd.remove("--enable_each_rank_log=None")  # a DeepSpeed-only option (fnzero's ranks log to the launcher)
    return cmd


@pytest.mark.parametrize("name", [c["name"] for c in LAUNCH_CASES])
def test_each_launcher_command_is_deepspeeds(name):
    case = CASES[name]
    ds = case["deepspeed"]
    if "refused" in ds and name != "openmpi-include":
        with pytest.raises(LaunchError):  # DeepSpeed refuses: so does fnzero
            fnzero_command(case)
        return
    cmd, env = fnzero_command(case)
    if name == "openmpi-include":  # DeepSpeed refuses filters with Open MPI; fnzero gives mpirun the hosts kept
        assert cmd[:5] == ["mpirun", "-n", "2", "-hostfile", HOSTFILE], cmd
        return
    assert cmd == deepspeed_in_fnzero(case)
    if case["launcher"] == "pdsh":  # the environment pdsh runs in: its ssh, and the port
        assert {k: v.split() for k, v in env.items()} == {k: v.split() for k, v in ds["env"].items()}
        assert f"--world_info={ds['world_info']}" in cmd  # the same hosts and slots, the same encoding


def test_fnzero_commands_exactly():
    """The differences, spelled out: what fnzero runs, word for word, for a 2 x 2 hostfile."""
    def cmd(launcher, **kw):
        case = {"launcher": launcher, "pool": {"w0": 2, "w1": 2}, **kw}
        return fnzero_command(case)[0]

    tail = ["-x", f"MASTER_ADDR={ADDR}", "-x", f"MASTER_PORT={PORT}", PYTHON, "-u", "train.py"]
    assert cmd("openmpi") == ["mpirun", "-n", "4", "-hostfile", HOSTFILE, "--mca", "btl", "^openib", "--mca",
                              "btl_tcp_if_include", "eth0", "-x", "UCX_TLS=tcp", *tail]
    assert cmd("mpich", module=True)[-6:] == ["-hosts", "w0,w1", PYTHON, "-u", "-m", "train.py"]
    assert cmd("slurm", no_python=True) == ["srun", "-n", "4", f"--export=ALL,MASTER_ADDR={ADDR},MASTER_PORT={PORT}",
                                            "train.py"]
    assert cmd("mvapich")[:7] == ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", MVAPICH_HOSTFILE]
    world = encode_world_info({"w0": [0, 1], "w1": [0, 1]})
    assert cmd("pdsh", module=True, user_args=["a b"]) == [
        "pdsh", "-S", "-f", "1024", "-w", "w0,w1", "", f"cd {CWD};", PYTHON, "-u", "-m", "fnzero.cli", "launch",
        f"--world_info={world}", "--node_rank=%n", f"--master_addr={ADDR}", f"--master_port={PORT}", "--module",
        "train.py", '"a b"']
    # Ctrl-C: pdsh does not pass it on, so each host's launcher of this job is ended by its line.
    job = LaunchJob(launcher="pdsh", hostfile=HOSTFILE, active={"w0": [0, 1], "w1": [0, 1]}, exports={},
                    master_addr=ADDR, master_port=PORT, python=PYTHON, cwd=CWD, script="train.py")
    assert pdsh_kill_command(job) == [
        "pdsh", "-S", "-f", "1024", "-w", "w0,w1",
        f"pkill -f 'fnzero.cli launch --world_info={world} --node_rank=[0-9]* --master_addr={ADDR} "
        f"--master_port={PORT}'"]


def test_bound_ranks_run_behind_the_binding_step():
    """--bind_cores_to_rank with a tool: each rank starts fnzero's binding step, which reads its
    local rank from the tool's variables; Intel MPI's command binds each rank itself (DeepSpeed)."""
    job = dict(hostfile=HOSTFILE, active={"w0": [0, 1], "w1": [0, 1]}, exports={}, master_addr=ADDR,
               master_port=PORT, python=PYTHON, cwd=CWD, script="train.py", bind_cores_to_rank=True,
               bind_core_list="0-3")
    cmd, _ = launcher_command(LaunchJob(launcher="openmpi", **job), {})
    assert cmd[-7:] == [PYTHON, "-u", "-m", "fnzero.cli._rank_front", "--bind_cores_to_rank", "--bind_core_list=0-3",
                         "train.py"]
    impi, _ = launcher_command(LaunchJob(launcher="impi", **job), {})
    assert impi[impi.index("OMP_NUM_THREADS") + 1] == "2"
    bound = [impi[i - 2:i + 3] for i, w in enumerate(impi) if w == "-C" or w == "-c"]
    assert [b[-2:] for b in bound] == [["0-1", PYTHON], ["2-3", PYTHON]] * 2  # local ranks 0 and 1 of each host


def test_core_binding_shares_the_cores_out_as_deepspeed():
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7] and core_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert bind_command("0-7", 2, 1, numactl="numactl", numa=nodes) == (4, ["numactl", "-m", "1", "-C", "4-7"])
    assert bind_command("2-5", 2, 0, numactl="numactl", numa=nodes) == (2, ["numactl", "-m", "0", "-C", "2-3"])
    assert bind_command("3-4", 1, 0, numactl="numactl", numa=nodes) == (2, ["numactl", "-C", "3-4"])  # spans nodes
    assert bind_command("0,2,4", 3, 2, numactl="", numa=nodes) == (1, ["taskset", "-c", "4"])  # no numactl
    with pytest.raises(LaunchError, match=r"2 core\(s\) for 3 local ranks"):
        bind_command("0-1", 3, 0, numactl="", numa=nodes)
    with pytest.raises(LaunchError, match="--bind_core_list '0-x'"):
        bind_command("0-x", 1, 0, numactl="", numa=nodes)


@pytest.mark.parametrize("env, want", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0"}, (3, 4, 1, 2)),  # mpirun inside an allocation
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (2, 4, 0, 2)),
    ({"PMIX_RANK": "1", "WORLD_SIZE": "2", "PALS_LOCAL_RANKID": "1", "LOCAL_SIZE": "2"}, (1, 2, 1, 2)),
    ({"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "6", "MV2_COMM_WORLD_LOCAL_RANK": "2"}, (5, 6, 2, None)),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, (1, 2, 0, None)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "PMI_RANK": "0"}, (1, 2, 1, 2)),
])
def test_ranks_are_read_from_each_launchers_variables(env, want, monkeypatch):
    from fnzero._launch_env import RANK_VARIABLES, launcher_ranks

    for family in RANK_VARIABLES:
        for names in family[1:]:
            for n in names:
                monkeypatch.delenv(n, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launcher_ranks() == want


def test_switches_take_no_value():
    head, rest = split_launch_args(["--hostfile", "h", "--module", "--save_pid", "-q", "--launcher", "pdsh",
                                    "--bind_cores_to_rank", "pkg.train", "--lr", "1"])
    assert rest == ["pkg.train", "--lr", "1"] and head[-1] == "--bind_cores_to_rank"


def _launch(capsys, *argv) -> tuple[int, list[str]]:
    from fnzero.cli._main import main

    code = main(["launch", *argv])
    return code, capsys.readouterr().err.strip().splitlines()


def test_bad_launches_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as m:
        m.setenv("PATH", str(tmp_path))  # no mpirun, pdsh or srun here
        for launcher, tool in (("openmpi", "mpirun"), ("pdsh", "pdsh"), ("slurm", "srun")):
            assert _launch(capsys, "--hostfile", "hosts", "--launcher", launcher, "t.py") == (2, [
                f"fnzero launch: --launcher {launcher}: `{tool}` is not on PATH; install it, or use --launcher ssh "
                "(the default)"])
    assert _launch(capsys, "--hostfile", "hosts", "--launcher", "openmpi", "--include", "w9", "t.py") == (2, [
        "fnzero launch: --include 'w9': host 'w9' is not in the hostfile (hosts: ['w0', 'w1'])"])
    assert _launch(capsys, "--hostfile", "hosts", "--no_ssh", "--node_rank", "2", "t.py") == (2, [
        "fnzero launch: --node_rank 2: give this node's rank, 0..1 (hosts: ['w0', 'w1'])"])
    assert _launch(capsys, "--launcher", "openmpi", "t.py") == (2, [
        "fnzero launch: --include/--exclude/--num_nodes/--no_ssh/--launcher select and start hosts of a --hostfile"])
    assert _launch(capsys, "--module", "--no_python", "t.py") == (2, [
        "fnzero launch: --module and --no_python cannot be used together"])
    # Checked before torchrun starts, not by each rank: one line each.
    (tmp_path / "t.py").write_text("")
    assert _launch(capsys, "missing.py") == (2, [f"fnzero launch: script 'missing.py' not found (from {tmp_path})"])
    assert _launch(capsys, "--num_gpus", "0", "t.py") == (2, ["fnzero launch: --num_gpus must be at least 1, got 0"])
    assert _launch(capsys, "--master_port", "99999", "t.py") == (2, [
        "fnzero launch: --master_port 99999: a TCP port is 1-65535"])
    assert _launch(capsys, "--bind_cores_to_rank", "--bind_core_list", "0", "--nproc-per-node", "2", "t.py") == (2, [
        "fnzero launch: --bind_cores_to_rank: 1 core(s) for 2 local ranks; each rank needs at least one"])
    assert _launch(capsys, "--bind_cores_to_rank", "--bind_core_list", "100000", "t.py")[1][0].startswith(
        "fnzero launch: --bind_core_list '100000': core(s) 100000 are not this machine's (it may run on ")
    assert _launch(capsys, "--hostfile", "hosts", "--launcher", "pdsh", "--launcher_args", 'a"', "t.py") == (2, [
        "fnzero launch: --launcher_args 'a\"': No closing quotation"])
    # No hostfile: --include picks among this machine's slots (DeepSpeed's localhost pool; one per
    # CUDA device, else one per NUMA node), e.g. `--include localhost:1,2` on GPUs 1 and 2.
    import torch

    from fnzero.cli.launch._binding import numa_nodes
    n = torch.cuda.device_count() if torch.cuda.is_available() else sum(1 for c in numa_nodes().values() if c) or 1
    assert _launch(capsys, "--include", f"localhost:{n}", "t.py") == (2, [
        f"fnzero launch: --include 'localhost:{n}': host 'localhost' has slots 0..{n - 1}, not [{n}]"])
    # Flags where one would silently win over the other: one line each, nothing started.
    assert _launch(capsys, "--hostfile", "hosts", "--nproc-per-node", "4", "--nnodes", "3", "t.py") == (2, [
        "fnzero launch: --nproc-per-node cannot be used with --hostfile: each host runs the hostfile's slots "
        "(--num_gpus, --include and --exclude select among them)",
        "fnzero launch: --nnodes cannot be used with --hostfile: the hosts are the hostfile's (--num_nodes selects "
        "among them)"])
    assert _launch(capsys, "--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "--launcher", "pdsh", "t.py")[1] == [
        "fnzero launch: --launcher pdsh cannot be used with --no_ssh: each node is then started by hand"]
    # An option launch does not know is named, and takes no value (a typo, or another launcher's flag).
    assert _launch(capsys, "--hostfile_path", "--hostfile", "hosts", "t.py") == (2, [
        "fnzero launch: unknown option --hostfile_path: `fnzero launch --help` lists the options, DeepSpeed's runner "
        "flags among them (specs/cli.md §Launcher flags)"])


def test_no_ssh_node_rank_is_that_hosts_share(tmp_path, monkeypatch):
    """`--no_ssh --node_rank 1` (each node started by hand): torchrun gets host 1's slots as node 1
    of the hosts kept, the rendezvous at the first host unless --master_addr says."""
    from fnzero.cli._main import build_parser
    from fnzero.cli.launch import plan_launch

    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=4\nw2 slots=1\n")
    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["launch", "--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "--exclude",
                                      "w2@w1:0", "--master_port", "29531"])
    parsed = dict(vars(args))
    plan = plan_launch(args, ["t.py"])
    assert plan.kind == "torchrun" and plan.command == (
        "--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr", "w0", "--master-port", "29531",
        "--monitor-interval", "1", "t.py")
    assert plan.setenv == {"CUDA_VISIBLE_DEVICES": "1,2,3"}  # the slots kept of w1, set for its ranks at the start
    assert vars(args) == parsed  # the plan is built from the flags, which stay as parsed


def test_no_ssh_runs_this_nodes_ranks_with_its_pid_saved(tmp_path):
    """A real `--no_ssh --node_rank 0` of a one-host hostfile: its two ranks, the script run as a
    module, each bound to its own core of 0-1 with OMP_NUM_THREADS=1 (--bind_cores_to_rank), and
    --save_pid's /tmp/<launcher pid>.deepspeed there while the job runs (named after the launcher,
    which the binding step became the rank of, so the rank's parent), gone after."""
    (tmp_path / "hosts").write_text("127.0.0.1 slots=2\n")
    (tmp_path / "job.py").write_text(
        "import os\n"
        "cpus = open('/proc/self/status').read().split('Cpus_allowed_list:')[1].split()[0]\n"
        "saved = open(f'/tmp/{os.getppid()}.deepspeed').read() == str(os.getppid())\n"
        "line = ' '.join(map(str, ('RANK', os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['GROUP_RANK'], cpus,\n"
        "                          os.environ['OMP_NUM_THREADS'], saved)))\n"
        "os.write(1, (line + '\\n').encode())  # one write: the two ranks share the pipe, and print's parts interleave\n")
    r = subprocess.run([sys.executable, "-m", "fnzero.cli", "launch", "--hostfile", "hosts", "--no_ssh", "--node_rank",
                        "0", "--master_port", "29531", "--save_pid", "--module", "--bind_cores_to_rank",
                        "--bind_core_list", "0-1", "job"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("RANK")) == [
        "RANK 0 2 0 0 1 True", "RANK 1 2 0 1 1 True"], r.stdout
    pid = r.stdout.split("launcher pid: ")[1].split()[0]
    assert not os.path.exists(f"/tmp/{pid}.deepspeed")  # removed when the launcher ended


def test_a_hostfile_selection_of_one_host_runs_here_as_deepspeeds_runner(tmp_path):
    """DeepSpeed's runner starts one selected host's ranks locally, without ssh or the launcher tool,
    unless --force_multi: host w1 (not reachable from here) of two, its two slots."""
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=2\n")
    (tmp_path / "job.py").write_text("import os\nos.write(1, f\"RANK {os.environ['RANK']} {os.environ['WORLD_SIZE']}\\n\".encode())\n")
    r = subprocess.run([sys.executable, "-m", "fnzero.cli", "launch", "--hostfile", "hosts", "--include", "w1",
                        "--launcher", "pdsh", "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("RANK")) == ["RANK 0 2", "RANK 1 2"]
    assert "one host selected (w1): its 2 rank(s) run here" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not importable here")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # DeepSpeed's numactl probe's pipes
def test_the_table_is_deepspeed_0_19_8s_own(tmp_path):
    import deepspeed

    assert deepspeed.__version__ == "0.19.8"
    out = tmp_path / "table.json"
    subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "deepspeed_launcher_table.py"), str(out)],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert json.loads(out.read_text()) == TABLE
    if shutil.which("numactl"):  # DeepSpeed's binding needs numactl; on this machine's cores and nodes
        from deepspeed.utils.numa import get_numactl_cmd

        n = physical_cores()
        for cores, size, rank in ((None, 1, 0), (None, n, n - 1), (f"0-{n - 1}", n, 0), ("0", 1, 0)):
            assert bind_command(cores, size, rank) == tuple(get_numactl_cmd(cores, size, rank))


def test_ssh_launcher_passes_the_flags_to_each_hosts_launch(monkeypatch):
    """The default launcher (ssh): --launcher_args are ssh's options, and each host's `fnzero
    launch` gets the front's --module/--no_python/--save_pid/--bind_cores_to_rank/-q."""
    from fnzero.cli._main import build_parser
    from fnzero.cli.launch._multinode import _remote_command
    from fnzero.cli.launch._ssh import launch_ssh

    monkeypatch.delenv("FNZERO_SSH", raising=False)
    args = build_parser().parse_args(["launch", "--hostfile", "h", "--launcher_args", "-o ConnectTimeout=5",
                                      "--ssh_port", "22", "--module", "--save_pid", "--bind_cores_to_rank",
                                      "--bind_core_list", "0-3", "-q"])
    assert launch_ssh(args) == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-p", "22"]
    line = _remote_command(args, [0, 1], 2, 2, 1, "10.0.0.1", {}, ["pkg.train", "--lr", "1"])
    assert line.endswith(f"--master-port 29500 --module --save_pid={os.getpid()} --bind_cores_to_rank "
                         "--bind_core_list=0-3 -q pkg.train --lr 1"), line


def test_launch_reads_deepspeeds_default_hostfile_where_it_exists(tmp_path):
    # DeepSpeed's runner reads /job/hostfile without --hostfile; not a node's own launch (which
    # would start the hosts again), nor beside --nproc-per-node, nor where the file is missing.
    from fnzero.cli._main import build_parser
    from fnzero.cli.launch._checks import launch_hostfile

    path = tmp_path / "hostfile"
    path.write_text("w0 slots=2\n")
    for flags, taken in (([], True), (["--hostfile", "mine"], False), (["--nnodes", "2", "--node-rank", "1"], False),
                         (["--world_info", "e30="], False), (["--nproc-per-node", "2"], False)):
        args = build_parser().parse_args(["launch", *flags])
        assert launch_hostfile(args, str(path)) == (str(path) if taken else args.hostfile), flags
    args = build_parser().parse_args(["launch"])
    assert launch_hostfile(args, str(tmp_path / "missing")) is None


def test_a_bare_launch_runs_every_device_of_this_machine_as_deepspeed(tmp_path, monkeypatch, capsys):
    # `deepspeed train.py` with no hostfile runs one rank per device (its CPU accelerator: per NUMA
    # node); --nproc-per-node or --num_gpus still say how many.
    import fnzero.cli._main as cli_main
    import fnzero.cli.launch._launch as launching
    from fnzero.cli.launch import _node, _torchrun

    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launching, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))
    monkeypatch.setattr(_node, "machine_slots", lambda: 3)
    started = []
    monkeypatch.setattr(_torchrun, "run_torchrun", lambda argv: started.append(argv) or 0)
    for flags, ranks in (([], "3"), (["--nproc-per-node", "1"], "1"), (["--num_gpus", "2"], "2"),
                         (["--num_accelerators", "2"], "2")):
        assert cli_main.main(["launch", *flags, "t.py"]) == 0, capsys.readouterr().err
        assert started.pop()[:2] == ["--nproc-per-node", ranks], flags
    # "given" is now `is not None`: --nproc-per-node 1 beside a hostfile is refused too.
    (tmp_path / "hosts").write_text("w0 slots=2\n")
    assert _launch(capsys, "--hostfile", "hosts", "--nproc-per-node", "1", "t.py")[0] == 2


FAKE_SSH = """#!/bin/sh
# ssh stand-in: logs the host; host w1 is down, the others run the command here
while [ $# -gt 0 ]; do case "$1" in -o|-p) shift 2;; *) break;; esac; done
echo "$1" >> "$SSH_LOG"
[ "$1" = w1 ] && { echo "ssh: connect to host w1 port 22: Connection refused" >&2; exit 255; }
shift; exec sh -c "$*"
"""


def test_each_host_is_checked_over_ssh_before_anything_starts(tmp_path, monkeypatch, capsys):
    # DeepSpeed's runner checks passwordless ssh before a multi-node launch (--no_ssh_check skips
    # it); fnzero asks every selected host at once, and names each that does not answer.
    from fnzero.cli._main import build_parser
    from fnzero.cli.launch._ssh import check_ssh

    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("FNZERO_SSH", str(ssh))
    monkeypatch.setenv("SSH_LOG", str(log))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=1\nw2 slots=1\n")
    (tmp_path / "t.py").write_text("")
    assert _launch(capsys, "--hostfile", "hosts", "--master_addr", "10.0.0.1", "t.py") == (2, [
        "fnzero launch: host 'w1' does not answer over passwordless ssh (ssh: connect to host w1 port 22: Connection "
        "refused): set up passwordless ssh to every host, or give --no_ssh_check if --launcher ssh reaches them "
        "another way"])
    assert sorted(log.read_text().split()) == ["w0", "w1", "w2"]
    log.unlink()
    for flags in (["--no_ssh_check"], ["--launcher", "slurm"]):  # skipped: asked to, or srun needs no ssh
        check_ssh(build_parser().parse_args(["launch", "--hostfile", "hosts", *flags]), ["w0", "w1"])
        assert not log.exists(), flags
    check_ssh(build_parser().parse_args(["launch", "--hostfile", "hosts", "--launcher", "pdsh"]), ["w0", "w2"])
    assert sorted(log.read_text().split()) == ["w0", "w2"]


def test_slurm_takes_deepspeeds_comment_and_account_and_other_launches_warn(tmp_path, monkeypatch, capsys):
    job = LaunchJob(launcher="slurm", hostfile="h", active={"w0": [0], "w1": [0]}, exports={}, master_addr="a",
                    master_port=1, python="PY", cwd="/", script="t.py", slurm_comment="run 7", slurm_account="proj")
    cmd, _ = launcher_command(job, {})
    assert cmd[:7] == ["srun", "-n", "2", "--comment", "run 7", "--account", "proj"], cmd
    import fnzero.cli.launch._launch as launching
    from fnzero.cli.launch import _torchrun

    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_torchrun, "run_torchrun", lambda argv: 0)
    monkeypatch.setattr(launching, "DEFAULT_HOSTFILE", str(tmp_path / "no-hostfile"))
    assert _launch(capsys, "--comment", "x", "--nproc-per-node", "1", "t.py") == (0, [
        "fnzero launch: warning: --comment has no effect without --hostfile and --launcher slurm (it is srun's "
        "--comment)"])


def test_each_rank_logs_to_its_own_file_as_deepspeed(tmp_path, monkeypatch, capsys):
    # --enable_each_rank_log FOLDER: rank R's stdout and stderr go to FOLDER/<launch time>_rank<R>.log
    # (DeepSpeed's launch.py's names), not to the terminal.
    import re

    (tmp_path / "job.py").write_text("import os, sys\nprint('out', os.environ['RANK'])\n"
                                     "print('err', os.environ['RANK'], file=sys.stderr)\n")
    temp = tmp_path / "temp"  # the launch's temporary directory, to see what it leaves there
    temp.mkdir()
    r = subprocess.run([sys.executable, "-m", "fnzero.cli", "launch", "--nproc-per-node", "2", "--enable_each_rank_log",
                        "logs", "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TMPDIR": str(temp)})
    assert r.returncode == 0, r.stderr
    # Not even torchrun's empty `torchelastic_*` log folder, once per launch (torch's compile cache,
    # `torchinductor_<user>`, is kept on purpose: it is shared by every run).
    assert [f for f in os.listdir(temp) if not f.startswith("torchinductor_")] == []
    assert "out " not in r.stdout and "err " not in r.stderr, (r.stdout, r.stderr)
    assert "Warning" not in r.stderr, r.stderr  # the front runs fresh: nothing imported it before `-m`
    files = sorted(os.listdir(tmp_path / "logs"))
    assert [re.fullmatch(r"\d{14}_rank(\d)\.log", f).group(1) for f in files] == ["0", "1"], files
    for f, rank in zip(files, "01"):
        assert sorted((tmp_path / "logs" / f).read_text().split("\n")[:2]) == [f"err {rank}", f"out {rank}"]
    # A file where the folder should be: one line, nothing started.
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)
    assert _launch(capsys, "--enable_each_rank_log", "afile", "job.py") == (2, [
        "fnzero launch: --enable_each_rank_log 'afile': a file, not a folder"])
    # With a tool: MPI ranks start behind the front, which opens the file; pdsh's per-host launches
    # are given the folder and name their ranks' files by their own launch time.
    job = dict(hostfile=HOSTFILE, active={"w0": [0], "w1": [0]}, exports={}, master_addr=ADDR, master_port=PORT,
               python=PYTHON, cwd=CWD, script="train.py", rank_log="/logs/20261203080000")
    cmd, _ = launcher_command(LaunchJob(launcher="openmpi", **job), {})
    assert cmd[-6:] == [PYTHON, "-u", "-m", "fnzero.cli._rank_front", "--rank_log=/logs/20261203080000", "train.py"]
    cmd, _ = launcher_command(LaunchJob(launcher="pdsh", **job), {})
    assert "--enable_each_rank_log=/logs" in cmd and "_rank_front" not in " ".join(cmd)
    cmd, _ = launcher_command(LaunchJob(launcher="impi", **job), {})  # Intel MPI: one section per rank
    assert cmd.count("--rank_log=/logs/20261203080000") == 2 and cmd.count("fnzero.cli._rank_front") == 2
