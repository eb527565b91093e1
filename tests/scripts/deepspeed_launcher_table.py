"""Writes tests/data/deepspeed_0_19_8_launcher_commands.json: for each case of LAUNCH_CASES (a
hostfile's hosts, filters, flags, forwarded variables), the command line DeepSpeed 0.19.8's
multi-node runner builds (`get_cmd`), or its refusal. Run where DeepSpeed is importable:

    PYTHONPATH=. /tmp/dsvenv/bin/python tests/scripts/deepspeed_launcher_table.py [OUT]

`tests/test_launchers.py` compares fnzero's command lines with it (and regenerates it live)."""

from __future__ import annotations

import json
import os
import sys

# The program and directory a command names are written as these words (DeepSpeed's own package
# directory as DEEPSPEED).
PYTHON, CWD, HOSTFILE = "PYTHON", "CWD", "HOSTFILE"

_EXPORTS = [["PYTHONPATH", "CWD"], ["NCCL_DEBUG", "INFO"], ["MLFLOW_RUN", "a b"]]
LAUNCH_CASES = [
    {"name": "openmpi", "launcher": "openmpi", "pool": {"w0": 2, "w1": 2}},
    {"name": "openmpi-args", "launcher": "openmpi", "pool": {"w0": 2, "w1": 2}, "exports": _EXPORTS,
     "launcher_args": "--mca btl_tcp_if_include ib0 --allow-run-as-root", "module": True, "user_args": ["--lr", "1"]},
    {"name": "openmpi-no-python", "launcher": "openmpi", "pool": {"w0": 1, "w1": 3}, "no_python": True},
    {"name": "openmpi-include", "launcher": "openmpi", "pool": {"w0": 2, "w1": 2}, "include": "w1"},
    {"name": "mpich", "launcher": "mpich", "pool": {"w0": 2, "w1": 2}, "exports": _EXPORTS,
     "launcher_args": "-bind-to none", "user_args": ["--x", "y z"]},
    {"name": "mpich-uneven", "launcher": "mpich", "pool": {"w0": 2, "w1": 1}},
    {"name": "impi", "launcher": "impi", "pool": {"w0": 2, "w1": 2}, "exports": _EXPORTS, "user_args": ["--a"]},
    {"name": "impi-module", "launcher": "impi", "pool": {"w0": 1, "w1": 1, "w2": 1}, "module": True},
    {"name": "mvapich", "launcher": "mvapich", "pool": {"w0": 2, "w1": 2}, "exports": _EXPORTS,
     "launcher_args": "-verbose"},
    {"name": "slurm", "launcher": "slurm", "pool": {"w0": 2, "w1": 2}, "exports": _EXPORTS,
     "launcher_args": "--partition dbg", "user_args": ["--a", "1"]},
    {"name": "slurm-include", "launcher": "slurm", "pool": {"w0": 2, "w1": 2, "w2": 2}, "include": "w0@w2"},
    {"name": "slurm-num", "launcher": "slurm", "pool": {"w0": 4, "w1": 4, "w2": 4}, "num_nodes": 2, "num_gpus": 2},
    {"name": "slurm-slots", "launcher": "slurm", "pool": {"w0": 4, "w1": 4}, "include": "w0:1,2@w1"},
    {"name": "pdsh", "launcher": "pdsh", "pool": {"w0": 2, "w1": 2}, "exports": _EXPORTS,
     "user_args": ["--msg", 'say "hi"', "-n"]},
    {"name": "pdsh-port-module", "launcher": "pdsh", "pool": {"w0": 2, "w1": 1, "w2": 2}, "exclude": "w2:1",
     "ssh_port": 2222, "launcher_args": "-u 30", "module": True},
    {"name": "pdsh-no-python", "launcher": "pdsh", "pool": {"w0": 1, "w1": 1}, "no_python": True},
]
MASTER_ADDR, MASTER_PORT = "10.0.0.1", 29511


def deepspeed_command(case: dict) -> dict:
    from deepspeed.launcher import runner as ds

    argv = ["--hostfile", HOSTFILE, "--launcher", case["launcher"], "--master_addr", MASTER_ADDR,
            "--master_port", str(MASTER_PORT)]
    for flag in ("include", "exclude", "launcher_args"):
        if case.get(flag):
            argv.append(f"--{flag}={case[flag]}")
    for flag in ("num_nodes", "num_gpus", "ssh_port"):
        if case.get(flag) is not None:
            argv += [f"--{flag}", str(case[flag])]
    argv += ["--module"] * bool(case.get("module")) + ["--no_python"] * bool(case.get("no_python"))
    args = ds.parse_args(argv + ["train.py", *case.get("user_args", [])])
    pool = dict(case["pool"])
    active = ds.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = ds.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    env: dict = {}
    try:
        cls = ds.LAUNCHER_CLASSES[case["launcher"]]
        cls.validate_active_resources(active)
        world = ds.encode_world_info(active)
        runner = cls(args, world) if case["launcher"] == "pdsh" else cls(args, world, pool)
        for k, v in case.get("exports", []):
            runner.add_export(k, v)
        out = runner.get_cmd(env, active)
    except (ValueError, AssertionError) as e:
        return {"refused": str(e)}
    cmd = out[0] if case["launcher"] == "pdsh" else out
    package = os.path.dirname(os.path.dirname(os.path.realpath(ds.__file__)))  # where DeepSpeed is installed
    return {"cmd": [w.replace(package, "DEEPSPEED").replace(os.getcwd(), CWD) for w in cmd], "env": env,
            "world_info": world}


def main(out: str) -> None:
    sys.executable = PYTHON  # the commands name the interpreter as PYTHON
    import deepspeed

    table = {"deepspeed": deepspeed.__version__, "master_addr": MASTER_ADDR, "master_port": MASTER_PORT,
             "cases": [{**c, "deepspeed": deepspeed_command(c)} for c in LAUNCH_CASES]}
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data",
                                                           "deepspeed_0_19_8_launcher_commands.json"))
