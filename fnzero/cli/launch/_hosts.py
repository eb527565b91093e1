"""DeepSpeed's hostfile, its filters and its `.deepspeed_env`, as `fnzero launch --hostfile` reads
them (`specs/cli.md` §`fnzero launch --hostfile FILE [filters] SCRIPT [ARGS...]`). Pure parsing: no
ssh, no torch.
"""

from __future__ import annotations

import os
import re

__all__ = ["DEFAULT_HOSTFILE", "LaunchError", "HostfileError", "read_hostfile", "parse_hostfile", "select", "read_env_file",
           "ENV_FILE_PATHS"]

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default (its runner, ds_ssh)


class LaunchError(ValueError):
    """A launch that cannot start as asked; the message says why (`fnzero launch` prints it, exit 2)."""


class HostfileError(LaunchError):
    """A hostfile, filter or environment file that cannot be used; the message says where."""


def parse_hostfile(text: str, where: str = "hostfile") -> dict[str, int]:
    """Host -> slot count, in file order."""
    hosts: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise HostfileError(f"{where}:{n}: expected 'HOST slots=N', got {line[:80]!r}")
        host, slots = m.group(1), int(m.group(2))
        if host in hosts:
            raise HostfileError(f"{where}:{n}: host {host!r} is listed twice")
        if slots < 1:
            raise HostfileError(f"{where}:{n}: host {host!r} has slots={slots}; at least 1")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"{where}: no 'HOST slots=N' lines")
    return hosts


def read_hostfile(path: str) -> dict[str, int]:
    try:
        with open(path) as f:
            return parse_hostfile(f.read(), path)
    except OSError as e:
        raise HostfileError(f"cannot read hostfile {path}: {e.strerror}") from None


def _specs(text: str, hosts: dict[str, int], flag: str) -> dict[str, list[int] | None]:
    """`HOST[:SLOT,...]@...` -> host -> slots (None: all), checked against the hostfile."""
    out: dict[str, list[int] | None] = {}
    for spec in text.split("@"):
        host, _, slots = spec.partition(":")
        if host not in hosts:
            raise HostfileError(f"{flag} {text!r}: host {host!r} is not in the hostfile (hosts: {list(hosts)})")
        if not slots:
            out[host] = None
            continue
        try:
            chosen = sorted({int(s) for s in slots.split(",")})
        except ValueError:
            raise HostfileError(f"{flag} {text!r}: slots of {host!r} must be integers, got {slots!r}") from None
        bad = [s for s in chosen if not 0 <= s < hosts[host]]
        if bad:
            raise HostfileError(f"{flag} {text!r}: host {host!r} has slots 0..{hosts[host] - 1}, not {bad}")
        if host in out and out[host] is None:  # already all of it
            continue
        out[host] = sorted(set(out.get(host) or []) | set(chosen))
    return out


def select(hosts: dict[str, int], include: str = "", exclude: str = "", num_nodes: int = -1,
           num_gpus: int = -1) -> dict[str, list[int]]:
    """The hosts and slot indices a job runs on, in hostfile order (DeepSpeed's semantics)."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise HostfileError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    active = {h: list(range(n)) for h, n in hosts.items()}
    if include:
        chosen = _specs(include, hosts, "--include")
        active = {h: (s if chosen[h] is None else chosen[h]) for h, s in active.items() if h in chosen}
    elif exclude:
        dropped = _specs(exclude, hosts, "--exclude")
        active = {h: ([] if dropped[h] is None else [x for x in s if x not in dropped[h]]) if h in dropped else s
                  for h, s in active.items()}
        active = {h: s for h, s in active.items() if s}
    if num_nodes > 0:
        if num_nodes > len(active):
            raise HostfileError(f"--num_nodes {num_nodes}: the hostfile has {len(active)} host(s)")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        short = {h: len(s) for h, s in active.items() if len(s) < num_gpus}
        if short:
            raise HostfileError(f"--num_gpus {num_gpus}: these hosts have fewer slots: {short}")
        active = {h: s[:num_gpus] for h, s in active.items()}
    if not active:
        raise HostfileError("the filters leave no host to run on")
    return active


# DeepSpeed reads `.deepspeed_env` (or $DS_ENV_FILE) from the home directory and the current one.
ENV_FILE_PATHS = (os.path.expanduser("~"), ".")


def read_env_file(name: str | None = None) -> dict[str, str]:
    """`KEY=VALUE` lines of every `.deepspeed_env` found (later files override earlier ones)."""
    name = name or os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    out: dict[str, str] = {}
    for folder in ENV_FILE_PATHS:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for n, raw in enumerate(f.read().splitlines(), 1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                key, sep, value = line.partition("=")
                if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                    raise HostfileError(f"{path}:{n}: expected KEY=VALUE, got {line[:80]!r}")
                out[key] = value
    return out
