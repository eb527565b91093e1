"""`fnzero ssh`: one shell command on every host of a DeepSpeed hostfile, as DeepSpeed's `ds_ssh`
(which runs `pdsh -w HOSTS CMD`); `specs/cli.md` §fnzero ssh. The hosts and filters are
`fnzero launch --hostfile`'s (`launch/_hosts.py`), and so is the SSH command (`FNZERO_SSH` replaces ssh)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from ._common import fail
from .launch import DEFAULT_HOSTFILE, HostfileError, pump, read_hostfile, select, ssh_command

__all__ = ["register"]


def register(sub) -> None:
    p = sub.add_parser("ssh", help="run a shell command on every host of a hostfile (ds_ssh)",
                       description="Run CMD on every host of the hostfile at once over ssh; each output line "
                       "is prefixed 'HOST: '. The exit status is the worst host's.")
    p.add_argument("-H", "--hostfile", "-f", default=DEFAULT_HOSTFILE, metavar="FILE",
                   help=f"'HOST slots=N' lines (default {DEFAULT_HOSTFILE}, as DeepSpeed)")
    p.add_argument("-i", "--include", default="", metavar="SPEC", help="hosts to use: HOST[@HOST...]")
    p.add_argument("-e", "--exclude", default="", metavar="SPEC", help="hosts to leave out, same syntax")
    p.add_argument("--ssh_port", "--ssh-port", type=int, default=None, metavar="PORT", help="ssh port of the hosts")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ...", help="the command (a shell line)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not words:
        return fail("ssh", "give the command to run, e.g. `fnzero ssh -H hosts nvidia-smi`")
    try:
        hosts = list(select(read_hostfile(args.hostfile), args.include, args.exclude))
    except HostfileError as e:
        return fail("ssh", str(e))
    # One word is a shell line as typed (`fnzero ssh 'cd /x && ls'`); several are joined as pdsh does.
    line = words[0] if len(words) == 1 else " ".join(words)
    procs, pumps = {}, []
    for host in hosts:
        try:
            procs[host] = subprocess.Popen([*ssh_command(args.ssh_port), host, line], stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            return fail("ssh", f"cannot start {shlex.join(ssh_command(args.ssh_port))!r}: {e.strerror}")
        pumps.append(pump(procs[host], host))
    codes = {h: p.wait() for h, p in procs.items()}
    for t in pumps:
        t.join()
    for p in procs.values():
        p.stdout.close()
    failed = {h: c for h, c in codes.items() if c != 0}
    if failed:
        print("fnzero ssh: " + ", ".join(f"{h} exited with status {c}" for h, c in failed.items()), file=sys.stderr)
    return max(codes.values(), key=lambda c: (c != 0, abs(c)))
