"""The `fnzero` command, run as a user runs it (specs/cli.md).

Starting Python and importing torch costs seconds of CPU, so only a few checks start a fresh
`python -m fnzero.cli`; the rest go through `run_cli`, which forks a real child process per
command from one warm interpreter: each gets its own exit status, stdout and stderr.
"""

import atexit
import json
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny fork server: import the CLI once, then fork one child per request. Requests and replies
# are JSON lines; a child's stdout/stderr go to files the parent reads back.
_SERVER = r"""
import json, os, sys, time
import fnzero.cli._main as cli
cli.build_parser()
import fnzero.memory._estimate, fnzero.checkpoint  # what the commands import (torch): children start warm
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        try:
            code = cli.main(req["argv"])
        except SystemExit as e:  # argparse errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc(); code = 99
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code or 0)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9); os.waitpid(pid, 0); status = 124 << 8
            break
        time.sleep(0.01)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""

_server = None


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}


def _stop():
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        _server.wait(timeout=30)
        _server.stdout.close()


def run_cli(*argv):
    """(returncode, stdout, stderr) of `fnzero ARGV...` in a freshly forked process."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, env=_env(), text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        atexit.register(_stop)
    with tempfile.TemporaryDirectory(prefix="fnzero_cli_test_") as tmp:  # the child's stdout and stderr
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        _server.stdin.write(json.dumps({"argv": [str(a) for a in argv], "out": out, "err": err}) + "\n")
        _server.stdin.flush()
        reply = _server.stdout.readline()
        assert reply, "the CLI fork server died"
        with open(out) as fo, open(err) as fe:
            return json.loads(reply)["rc"], fo.read(), fe.read()


def run_fresh(*argv):
    """(returncode, stdout, stderr) of a brand-new `python -m fnzero.cli ARGV...`."""
    p = subprocess.run([sys.executable, "-m", "fnzero.cli", *map(str, argv)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=180)
    return p.returncode, p.stdout, p.stderr


# -- help -------------------------------------------------------------------------------------------

def test_top_level_help_lists_every_subcommand():
    rc, out, err = run_fresh("--help")
    assert rc == 0 and err == ""
    assert out.startswith("usage: fnzero")
    for cmd in ("launch", "report", "config", "export", "checkpoint", "plan"):
        assert f"    {cmd}" in out, out


@pytest.mark.parametrize("argv, must_mention", [
    (["launch"], ["--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--max-restarts"]),
    (["report"], ["usage: fnzero report"]),
    (["config"], ["show", "validate", "--world-size", "--auto"]),
    (["export"], ["checkpoint", "out", "--dtype", "--max-shard-size", "--format", "--hf-config"]),
    (["checkpoint"], ["info"]),
    (["checkpoint", "info"], ["--verify", "--json"]),
    (["checkpoint", "convert"], ["--to", "deepspeed-universal", "--tag", "--ds-tag", "--config"]),
    (["plan"], ["--params", "--world-size", "--gpus-per-node", "--config", "--memory-per-device", "--reserve",
                "--precision", "--json"]),
])
def test_help_for_each_subcommand(argv, must_mention):
    rc, out, err = run_cli(*argv, "--help")
    assert rc == 0, err
    assert err == ""
    assert out.startswith(f"usage: fnzero {' '.join(argv)}"), out
    for word in must_mention:
        assert word in out, (word, out)
    # Every option has a help text: no bare option lines left unexplained.
    assert "options:" in out


def test_no_subcommand_prints_help():
    rc, out, _ = run_cli()
    assert rc == 0 and "usage: fnzero" in out


def test_unknown_subcommand_fails():
    rc, out, err = run_fresh("frobnicate")
    assert rc != 0
    assert "invalid choice" in err and "frobnicate" in err
    assert out == ""


# -- config -------------------------------------------------------------------------------------------

def test_config_validate_good_file():
    rc, out, err = run_cli("config", "validate", "examples/configs/zero3.json", "--world-size", "4")
    assert rc == 0, err
    assert "valid" in out and "stage 3" in out and "world size 4" in out


def test_config_validate_bad_file_lists_every_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimisation": {"stage": 2},'
                   ' "gradient_clipping": -1, "optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}')
    rc, out, err = run_cli("config", "validate", str(bad))
    assert rc == 1
    assert out == ""
    assert "3 error(s)" in err, err
    assert "zero_optimization" in err  # the typo names the nearest valid key
    assert "gradient_clipping" in err and "lr" in err
    assert err.count("\n  - ") == 3


def test_config_validate_reports_cross_field_errors_beside_field_errors(tmp_path):
    # fp16 + bf16 both on used to show only once the other errors were fixed.
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true},'
                   ' "zero_optimization": {"stage": 7}, "optimizer": {"type": "AdamW", "params": {"lr": "x"}},'
                   ' "gradient_clipping": -1}')
    rc, out, err = run_cli("config", "validate", str(bad))
    assert rc == 1 and "4 error(s)" in err, err
    assert "`fp16.enabled` and `bf16.enabled` are both true" in err and "`zero_optimization.stage`" in err
    # A rule about a section that has an error of its own is not also judged on its default.
    bad.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": "x", "offload_param": {"device": "cpu"}}}')
    rc, _, err = run_cli("config", "validate", str(bad))
    assert rc == 1 and "1 error(s)" in err and "needs stage 3" not in err, err


def test_help_and_config_commands_do_not_import_torch(tmp_path):
    # torch takes seconds to import; `--help` and `config` need none of it.
    good = tmp_path / "ok.json"
    good.write_text('{"train_batch_size": 8}')
    code = ("import sys, io, contextlib\nfrom fnzero.cli import main\n"
            "for argv in (['--help'], ['config', 'validate', sys.argv[1]], ['config', 'show', sys.argv[1]], ['plan', '--help'],\n"
            "             ['config', 'validate', sys.argv[1], '--auto', 'lr=1e-3,micro_batch_size=2']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try: main(argv)\n"
            "        except SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code, str(good)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)


def test_output_into_a_closed_pipe_ends_quietly():
    # `fnzero config show f | head -1`: no BrokenPipeError traceback, the SIGPIPE exit status. The
    # reader here (`true`) is gone long before Python has started, so the write always fails.
    p = subprocess.run(f"{sys.executable} -m fnzero.cli config show examples/configs/zero3.json | true; "
                       "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.stdout == "" and p.stderr == "" and p.returncode == 141, (p.returncode, p.stderr)


# A Hugging Face-style config: "auto" where transformers' DeepSpeed docs put it, DeepSpeed's unprefixed
# ZeRO-3 spellings, and two keys fnzero accepts without acting on them.
HF_CONFIG = {
    "fp16": {"enabled": "auto", "auto_cast": True}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "cpu_offload": False, "reduce_bucket_size": "auto",
                          "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"},
    "compile": {"deepcompile": False},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
AUTO = "lr=3e-4,micro_batch_size=4,gradient_accumulation_steps=2,betas=[0.9,0.95],bf16=true,warmup_steps=0.1," \
       "total_steps=1_000,hidden_size=64"


def test_config_validate_fills_auto_as_hf_auto_values(tmp_path):
    import fnzero

    path = tmp_path / "hf.json"
    path.write_text(json.dumps(HF_CONFIG))
    rc, out, err = run_cli("config", "validate", path, "--auto", AUTO, "--world-size", "2")
    assert rc == 0 and out.startswith(f"{path}: valid (ZeRO stage 3, world size 2)"), (out, err)
    rc, out, _ = run_cli("config", "show", path, "--auto", AUTO, "--world-size", "2")
    assert rc == 0
    with pytest.warns(fnzero.config.ConfigWarning):  # auto_cast and cpu_offload: as the CLI lists them
        want = fnzero.config.load_config(HF_CONFIG, world_size=2, auto=fnzero.config.hf_auto_values(
            lr=3e-4, micro_batch_size=4, gradient_accumulation_steps=2, betas=(0.9, 0.95), bf16=True,
            warmup_steps=0.1, total_steps=1000, hidden_size=64, world_size=2))
    shown = json.loads(out)
    assert shown == want.to_dict()
    assert (shown["train_batch_size"], shown["optimizer"]["params"]["betas"]) == (16, [0.9, 0.95])
    assert shown["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert shown["scheduler"]["params"]["warmup_num_steps"] == 100 and shown["bf16"]["enabled"] is True


def test_config_validate_without_auto_says_how_to_give_it(tmp_path):
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(HF_CONFIG))
    rc, out, err = run_cli("config", "validate", path)
    assert rc == 1 and out == "" and '17 keys are "auto"' in err and "--auto lr=" in err, err


@pytest.mark.parametrize("auto,needle", [
    ("lrr=3e-4,micro_batch_size=4", "`lrr` is not an argument of hf_auto_values; did you mean `lr`?"),
    ("lr=fast,micro_batch_size=4", "`lr` must be a finite number >= 0, got \"fast\""),
    ("lr=3e-4,micro_batch_size=0", "`micro_batch_size` must be a positive integer, got 0"),
    ("lr=3e-4", "micro_batch_size must be given"),
    ("lr", "'lr' is not NAME=VALUE"),
])
def test_config_auto_argument_errors_are_usage_errors(tmp_path, auto, needle):
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(HF_CONFIG))
    rc, out, err = run_cli("config", "validate", path, "--auto", auto)
    assert rc == 2 and out == "" and err.startswith("fnzero config: --auto: ") and needle in err, err


def test_config_validate_lists_keys_without_effect_as_warnings(tmp_path):
    path = tmp_path / "warn.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabled": True, "auto_cast": True},
                                "dump_state": True, "zero_optimization": {"stage": 1, "cpu_offload": False}}))
    rc, out, err = run_cli("config", "validate", path)
    assert rc == 0 and out == f"{path}: valid (ZeRO stage 1, world size 1), 3 warning(s)\n", (out, err)
    lines = err.splitlines()
    assert len(lines) == 3 and all(line.startswith("  - warning: `") for line in lines), err
    assert "`fp16.auto_cast` is true, which has no effect in fnzero" in err and "`dump_state`" in err
    assert "`zero_optimization.cpu_offload: false` is deprecated" in err
    rc, out, err = run_cli("config", "validate", "examples/configs/zero3.json")
    assert rc == 0 and "warning" not in out + err, (out, err)


def test_config_validate_missing_file():
    rc, out, err = run_cli("config", "validate", "no/such/file.json")
    assert rc == 1 and out == "" and "error" in err


def test_config_show_round_trips():
    import fnzero

    rc, out, err = run_cli("config", "show", "examples/configs/bf16.json", "--world-size", "2")
    assert rc == 0, err
    shown = json.loads(out)
    again = fnzero.load_config(out, world_size=2)
    assert again.to_dict() == shown
    assert again == fnzero.load_config("examples/configs/bf16.json", world_size=2)


# -- report, launch -----------------------------------------------------------------------------------

def test_report_mentions_torch_and_cext():
    rc, out, err = run_cli("report")
    assert rc == 0, err
    assert "torch" in out and "cext" in out and "fnzero" in out
    assert "direct point-to-point exchanges" in out  # which gloo collectives run (specs/collectives.md)


def test_launch_without_script_is_a_usage_error():
    rc, out, err = run_cli("launch", "--nproc-per-node", "2")
    assert rc == 2
    assert "name the training script" in err
    assert out == ""


def test_launch_multinode_needs_master_addr():
    rc, _, err = run_cli("launch", "--nnodes", "2", "train.py")
    assert rc == 2 and "--master-addr" in err
