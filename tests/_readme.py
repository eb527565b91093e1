"""What README.md names, read so the tests can check it (tests/test_readme.py) and run it
(tests/test_examples.py): its shell commands and the repository paths and spec sections it cites.

Commands are the lines of its ```bash blocks (split at `&&`, `;` and `|`, comments dropped) and the
inline `code` spans that read as one: starting with `fnzero `, `python` or a repository script.
A `[a|b|c]` in a command is a choice: each alternative is checked, and the command without it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

REPO_DIRS = ("examples", "benchmarks", "specs", "tests", "fnzero", "cext", ".ci")
_PATH = re.compile(r"(?<![\w./-])(?:" + "|".join(re.escape(d) for d in REPO_DIRS) + r")/[\w./-]*")
_SECTION = re.compile(r"`(specs/[\w.-]+\.md)` §([^).,;:(`\n]+)")
_SPAN = re.compile(r"`([^`]+)`")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_CHOICE = re.compile(r"\[([^\[\]]*\|[^\[\]]*)\]")
# Scripts the README names for the reader's own, never the repository's.
PLACEHOLDER_SCRIPTS = {"train.py"}
# Setup steps (a virtual environment, its activation): nothing of the repository's to check.
_SETUP = {"python3 -m venv", ". ", "source "}


@dataclasses.dataclass(frozen=True)
class Command:
    line: int  # in README.md, 1-based
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"README.md:{self.line}: `{shlex.join(self.argv)}`"


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _alternatives(cmd: str) -> list[str]:
    """`cmd` with its first `[a|b]` choice expanded (each alternative, and none), recursively."""
    m = _CHOICE.search(cmd)
    if m is None:
        return [cmd]
    out = []
    for alt in [*m.group(1).split("|"), ""]:
        out += _alternatives(cmd[: m.start()] + alt.strip() + cmd[m.end():])
    return out


def _split(line: int, cmd: str) -> list[Command]:
    """The commands of one shell line: its comment dropped, its choices expanded, split at `&&`,
    `;` and `|`."""
    out = []
    for alt in _alternatives(cmd.split(" #")[0]):
        out += [Command(line, tuple(shlex.split(part))) for part in re.split(r"&&|;|\|", alt) if part.strip()]
    return out


def _is_command(span: str) -> bool:
    """`fnzero ...`, `python ...`, or a repository script with arguments (alone, it is a path)."""
    words = span.split()
    script = words[0].endswith(".py") and _PATH.fullmatch(words[0]) is not None
    return words[0] in ("fnzero", "python", "python3") or (script and len(words) > 1)


def commands(text: str) -> list[Command]:
    """Every shell command of the text: each line of its bash blocks, each command-like inline span."""
    out = []
    for m in _FENCE.finditer(text):
        if m.group(1) in ("bash", "sh", "shell", "console"):
            first = _line_of(text, m.start(2))
            for i, raw in enumerate(m.group(2).splitlines()):
                if raw.strip() and not raw.lstrip().startswith("#"):
                    out += _split(first + i, raw)
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep line numbers
    for m in _SPAN.finditer(prose):
        span = " ".join(m.group(1).split())
        if _is_command(span):
            out += _split(_line_of(prose, m.start()), span)
    return sorted(out, key=lambda c: c.line)


def paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of every repository path the text names."""
    return [(_line_of(text, m.start()), m.group(0).rstrip(".,:;")) for m in _PATH.finditer(text)]


def sections(text: str) -> list[tuple[int, str, str]]:
    """(line, spec file, section) of every "`specs/x.md` §Section" reference."""
    return [(_line_of(text, m.start()), m.group(1), m.group(2).strip()) for m in _SECTION.finditer(text)]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _heading_has(spec: str, section: str) -> bool:
    heads = [ln.lstrip("#").replace("§", "").replace("`", "").strip().lower()
             for ln in _read(spec).splitlines() if ln.startswith("#")]
    return any(section.lower() in h for h in heads)


def static_problems(text: str, root: str = ROOT) -> list[str]:
    """What in `text` names something that does not exist: paths, spec sections, `fnzero`
    subcommands and their options, launched scripts, `python -m` modules, pip extras. Script
    invocations are checked against their own parsers by `script_problems`."""
    bad = [f"README.md:{ln}: {p} does not exist" for ln, p in paths(text) if not os.path.exists(os.path.join(root, p))]
    refs = sections(text)
    bad += [f"README.md:{ln}: {spec} has no section {sec!r}" for ln, spec, sec in refs
            if os.path.exists(os.path.join(root, spec)) and not _heading_has(os.path.join(root, spec), sec)]
    cited = len(re.findall("§", _FENCE.sub("", text)))
    if cited != len(refs):
        bad.append(f"README.md: {cited - len(refs)} § section(s) not written as `specs/x.md` §Section: not checkable")
    for cmd in commands(text):
        bad += [f"{cmd}: {why}" for why in _command_problems(cmd, root)]
    return bad


def _command_problems(cmd: Command, root: str) -> list[str]:
    argv = list(cmd.argv)
    line = " ".join(argv)
    if argv == ["fnzero"] or any(line.startswith(s) for s in _SETUP):  # (naming the command)
        return []
    if argv[0] in ("pip", "pip3"):
        return _pip_problems(argv, root)
    if argv[0] == "fnzero":
        return _fnzero_problems(argv[1:], root)
    if argv[0] in ("python", "python3"):
        if argv[1:2] == ["-m"]:
            import importlib.util

            return [] if importlib.util.find_spec(argv[2]) is not None else [f"no module {argv[2]}"]
        return _script_exists(argv[1], root)
    if argv[0].endswith(".py"):
        return _script_exists(argv[0], root)
    return [f"no check knows the command {argv[0]!r} (add one to tests/_readme.py)"]


def _script_exists(script: str, root: str) -> list[str]:
    if script in PLACEHOLDER_SCRIPTS or os.path.isfile(os.path.join(root, script)):
        return []
    return [f"script {script} does not exist"]


def dependency_ranges(root: str = ROOT, *, build: bool = True) -> dict[str, SpecifierSet]:
    """Every requirement pyproject.toml names (the build system's too unless `build=False`: pip
    installs those in an isolated environment of the build's own), by package."""
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        toml = tomllib.load(f)
    project = toml["project"]
    reqs = [*(toml["build-system"]["requires"] if build else ()), *project["dependencies"],
            *(r for extra in project.get("optional-dependencies", {}).values() for r in extra)]
    ranges: dict[str, SpecifierSet] = {}
    for r in map(Requirement, reqs):
        name = r.name.lower().replace("_", "-")
        if ranges.setdefault(name, r.specifier) != r.specifier:
            raise AssertionError(f"pyproject.toml gives {name} two ranges: {ranges[name]} and {r.specifier}")
    return ranges


# pip install options that take the next word as their value.
_PIP_VALUED = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-r",
               "--requirement", "-t", "--target", "--prefix", "--root", "--python-version", "--platform"}


def _pip_problems(argv: list[str], root: str) -> list[str]:
    """The extras a `pip install` names exist, and a package it names is one pyproject.toml
    lists, at a version its range admits (the README installs torch by hand, first)."""
    import tomllib

    from packaging.requirements import InvalidRequirement, Requirement

    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extras = sorted(tomllib.load(f)["project"].get("optional-dependencies", {}))
    ranges = dependency_ranges(root)
    bad = []
    words = iter(argv[2:])
    for arg in words:
        if arg in _PIP_VALUED:
            next(words, None)  # (its value: an index, a folder, a requirements file)
        if arg.startswith("-"):
            continue
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
        if m:
            bad += [f"pyproject.toml has no extra {e!r} (it has {extras})"
                    for e in (m.group(1) or "").split(",") if e and e not in extras]
            continue
        try:
            req = Requirement(arg)
        except InvalidRequirement:
            bad.append(f"{arg!r} is neither the project nor a requirement")
            continue
        admitted = ranges.get(req.name.lower().replace("_", "-"))
        if admitted is None:
            bad.append(f"pyproject.toml does not list {req.name}")
        else:
            pins = [s.version for s in req.specifier if s.operator == "=="]
            bad += [f"{req.name}=={v} is outside pyproject.toml's range {req.name}{admitted}"
                    for v in pins if not admitted.contains(v, prereleases=True)]
    return bad


def _fnzero_problems(argv: list[str], root: str) -> list[str]:
    """The `fnzero` command line parses, its subcommand has `--help`, a launched script exists."""
    from fnzero.cli._main import build_parser, split_launch_args

    rest: list[str] = []
    if argv[:1] == ["launch"]:
        head, rest = split_launch_args(argv[1:])
        argv = ["launch", *head]
    # `fnzero plan` alone names the command: only its --help must work.
    checks = [(argv, None)] if len(argv) > 1 or rest else []
    checks.append(([argv[0], "--help"], 0))
    bad = [why for why in (_parse_error(build_parser(), a, code) for a, code in checks) if why]
    return bad + (_script_exists(rest[0], root) if rest else [])


def _parse_error(parser, argv: list[str], expect: int | None = None) -> str | None:
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code != expect:
            return f"`fnzero {' '.join(argv)}` exits {e.code}: {err.getvalue().strip().splitlines()[-1:]}"
        return None
    return None if expect is None else f"`fnzero {' '.join(argv)}` did not exit"


def script_calls(text: str) -> list[tuple[Command, str, list[str]]]:
    """(command, script, its arguments) of every command that runs a repository script."""
    from fnzero.cli._main import split_launch_args

    out = []
    for cmd in commands(text):
        argv = list(cmd.argv)
        if argv[:2] == ["fnzero", "launch"]:
            argv = split_launch_args(argv[2:])[1]
        elif argv[0] in ("python", "python3") and argv[1:2] != ["-m"]:
            argv = argv[1:]
        if argv and argv[0].endswith(".py") and argv[0] not in PLACEHOLDER_SCRIPTS:
            out.append((cmd, argv[0], argv[1:]))
    return out


class _Parsed(BaseException):
    """Raised by the patched `parse_args`: the script got as far as parsing; stop it there."""


def _run_to_parse(path: str, argv: list[str]):
    """Run the script at `path` up to its `parse_args()` and stop there, in this process: its own
    parser judges `argv`, and nothing after the parse (processes, training) runs. Before the parse
    the examples and benchmarks only import (torch, fnzero and transformers are imported by the
    suite's collection already) and define. (the parser or None, why it refused `argv` or None)."""
    import argparse
    import contextlib
    import io
    import runpy
    from unittest import mock

    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                real(self, args, namespace)
        except SystemExit as e:
            raise _Parsed(self, f"its parser refused them (exit {e.code}): {err.getvalue().strip().splitlines()[-1:]}")
        raise _Parsed(self, None)

    here = os.path.dirname(path)
    saved_path, saved_argv, before = list(sys.path), sys.argv, set(sys.modules)
    sys.path.insert(0, here)  # as `python script` does
    sys.argv = [path, *argv]
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
            runpy.run_path(path, run_name="__main__")
        return None, "it ended without parsing its arguments"
    except _Parsed as p:
        return p.args
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
        for name in set(sys.modules) - before:  # the script's sibling helpers (benchmarks/_common.py)
            if os.path.dirname(getattr(sys.modules[name], "__file__", None) or "") == here:
                del sys.modules[name]


def script_problems(calls: list[tuple[Command, str, list[str]]], root: str = ROOT) -> list[str]:
    """Each script's own argparse parser run on its arguments (a missing script is a static problem)."""
    out = []
    for cmd, script, argv in calls:
        path = os.path.join(root, script)
        why = _run_to_parse(path, argv)[1] if os.path.isfile(path) else None
        if why:
            out.append(f"{cmd}: {script} {shlex.join(argv)}: {why}")
    return out


def option_problems(text: str, root: str = ROOT) -> list[str]:
    """Inline spans of options alone (`--remat`, `--nnodes/--node-rank`): each option belongs to a
    command the text names: `fnzero`'s, torchrun's (which `fnzero launch` runs), or a script's."""
    from torch.distributed.run import get_args_parser

    from fnzero.cli._main import build_parser

    parsers = [get_args_parser(), build_parser()]
    parsers += [a.choices[c] for a in build_parser()._actions if a.choices and isinstance(a.choices, dict)
                for c in a.choices]  # the subcommands
    for _, p in paths(text):
        full = os.path.join(root, p)
        if p.endswith(".py") and os.path.isfile(full) and "ArgumentParser" in _read(full):
            parsers.append(_run_to_parse(full, [])[0])
    known = {o for p in parsers if p is not None for a in p._actions for o in a.option_strings}
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    bad = []
    for m in _SPAN.finditer(prose):
        if m.group(1).startswith("--"):
            for opt in re.findall(r"--[\w-]+", m.group(1)):
                if opt not in known:
                    bad.append(f"README.md:{_line_of(prose, m.start())}: {opt} is an option of no command it names")
    return bad


def example_runs(text: str) -> list[tuple[Command, str, str | None]]:
    """(command, script, its --config or None) of every command that runs an example (`fnzero
    launch` or `python`; a script named with options alone is not a run)."""
    return [(cmd, script, _config_of(argv)) for cmd, script, argv in script_calls(text)
            if script.startswith("examples/") and cmd.argv[0] in ("fnzero", "python", "python3")]


def readme_argv(script: str, config: str | None = None, *, nproc: int | None = None, extra=()) -> list[str]:
    """The README's one command that runs `script` (with `--config config`, or none), as an argv
    for a subprocess: `fnzero` as `python -m fnzero.cli`, `--nproc-per-node` set to `nproc` when
    given (the suite's 2 cores), and `extra` appended (argparse: a later option wins, so
    `--steps 30` shortens the run)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    found = [list(cmd.argv) for cmd, s, c in example_runs(text) if (s, c) == (script, config)]
    assert len(found) == 1, f"README.md runs {script} --config {config} {len(found)} times, expected once: {found}"
    argv = found[0]
    argv = [sys.executable, "-m", "fnzero.cli", *argv[1:]] if argv[0] == "fnzero" else [sys.executable, *argv[1:]]
    if nproc is not None:
        argv[argv.index("--nproc-per-node") + 1] = str(nproc)
    return argv + list(extra)


def _config_of(argv: list[str]) -> str | None:
    return argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
