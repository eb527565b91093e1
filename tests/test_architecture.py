"""The layering of `specs/architecture.md`, read from the source: every import of a fnzero module,
at module level or inside a function, goes to its own layer or one below, except the exceptions
the spec lists; and no module reads another's state through `sys.modules`."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "fnzero"

# specs/architecture.md §Layers, bottom to top.
LAYERS = {
    "_errors": 0, "_launch_env": 0,
    "_ext": 1, "config": 1, "_state": 1, "_cext": 1,
    "optim": 2, "schedules": 2,
    "sharding": 3,
    "offload": 4, "pipeline": 4, "moe": 4,
    "checkpoint": 5,
    "train": 6,
    "inference": 7,
    "memory": 8,
    "monitor": 9, "autotune": 9,
    "cli": 10,
    "testing": 11,
}
ROOT_API = 10  # `fnzero/__init__.py`: re-exports layers 0-8, so only cli and testing import it
# (importing module, imported module): the exceptions specs/architecture.md names.
EXCEPTIONS = {("fnzero.sharding.construct._module", "fnzero.train._init")}


def _modules(root=ROOT):
    for path in sorted((root / "fnzero").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        yield path, ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _imports(path, mod, is_pkg):
    """(line, absolute module name) of every fnzero import in the file, wherever it is."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "fnzero" or (node.module is None and node.level):
                # `from . import optim`: each name may be a module of its own layer
                for a in node.names:
                    yield node.lineno, f"{target}.{a.name}" if target != "fnzero" or a.name in LAYERS else target
            elif target.startswith("fnzero"):
                yield node.lineno, target
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fnzero"):
                    yield node.lineno, a.name


def _layer(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return ROOT_API
    return LAYERS[parts[1]]


def test_every_top_level_name_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert names <= set(LAYERS), f"add {sorted(names - set(LAYERS))} to specs/architecture.md and LAYERS"


def _violations(root=ROOT) -> list[str]:
    bad = []
    for path, mod, is_pkg in _modules(root):
        own = _layer(mod) if mod != "fnzero" else ROOT_API
        for line, target in _imports(path, mod, is_pkg):
            if target.split(".")[:2] == mod.split(".")[:2] or (mod, target) in EXCEPTIONS:
                continue
            if _layer(target) > own or (target == "fnzero" and own < ROOT_API):
                bad.append(f"{path.relative_to(root)}:{line} imports {target} (layer {_layer(target)} > {own})")
    return bad


def test_imports_go_down_the_layers():
    bad = _violations()
    assert not bad, "imports against specs/architecture.md:\n" + "\n".join(bad)


def test_the_exceptions_are_still_needed():
    found = {(mod, t) for path, mod, is_pkg in _modules() for _, t in _imports(path, mod, is_pkg)}
    assert EXCEPTIONS <= found, f"no longer imported, remove from the spec: {sorted(EXCEPTIONS - found)}"


@pytest.mark.parametrize("needle", ["sys.modules"])
def test_no_module_reads_another_through_sys_modules(needle):
    hits = [f"{p.relative_to(ROOT)}:{i}" for p, _, _ in _modules() if "testing" not in p.parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if needle in line and not line.lstrip().startswith("#")]
    assert not hits, hits


def test_a_layer_violation_is_caught(tmp_path):
    """The check can fail: a config module importing the step, at module level or in a function."""
    for sub in ("config", "train", "sharding"):
        (tmp_path / "fnzero" / sub).mkdir(parents=True)
        (tmp_path / "fnzero" / sub / "__init__.py").write_text("")
    (tmp_path / "fnzero" / "__init__.py").write_text("")
    (tmp_path / "fnzero" / "config" / "_probe.py").write_text(
        "from ..train._step import train_step\n\ndef f():\n    from fnzero.sharding import shard\n")
    (tmp_path / "fnzero" / "train" / "_ok.py").write_text("from ..config import _probe\n")
    assert _violations(tmp_path) == [
        "fnzero/config/_probe.py:1 imports fnzero.train._step (layer 6 > 1)",
        "fnzero/config/_probe.py:4 imports fnzero.sharding (layer 3 > 1)",
    ]


# specs/architecture.md §Inside sharding: its sub-packages, bottom to top (tp and pp side by side).
SHARDING = {"comm": 0, "zero": 1, "tp": 2, "pp": 2, "ep": 2, "construct": 3}


def _sharding_violations(root=ROOT) -> list[str]:
    bad = []
    for path, mod, is_pkg in _modules(root):
        parts = mod.split(".")
        if parts[:2] != ["fnzero", "sharding"] or len(parts) < 4:
            continue  # sharding/__init__.py re-exports them all
        for line, target in _imports(path, mod, is_pkg):
            sub = target.split(".")[2:3]
            if target.startswith("fnzero.sharding.") and sub and sub[0] in SHARDING and sub[0] != parts[2] \
                    and SHARDING[sub[0]] >= SHARDING[parts[2]]:
                bad.append(f"{path.relative_to(root)}:{line} imports {target} ({sub[0]} is not below {parts[2]})")
    return bad


def test_sharding_sub_packages_import_downwards():
    assert set(SHARDING) == {p.name for p in (PKG / "sharding").iterdir() if (p / "__init__.py").exists()}
    bad = _sharding_violations()
    assert not bad, "imports against specs/architecture.md §Inside sharding:\n" + "\n".join(bad)


def test_a_sharding_sub_package_violation_is_caught(tmp_path):
    for sub in ("", "/zero", "/tp", "/pp"):
        (tmp_path / f"fnzero/sharding{sub}").mkdir(parents=True)
        (tmp_path / f"fnzero/sharding{sub}/__init__.py").write_text("")
    (tmp_path / "fnzero/__init__.py").write_text("")
    (tmp_path / "fnzero/sharding/zero/_plan.py").write_text("def f():\n    from ..tp._ops import g\n")
    (tmp_path / "fnzero/sharding/tp/_ops.py").write_text("from ..pp._module import m\nfrom ..zero._plan import f\n")
    assert _sharding_violations(tmp_path) == [
        "fnzero/sharding/tp/_ops.py:1 imports fnzero.sharding.pp._module (pp is not below tp)",
        "fnzero/sharding/zero/_plan.py:2 imports fnzero.sharding.tp._ops (tp is not below zero)",
    ]


def test_the_config_layer_never_asks_torch_distributed():
    """specs/architecture.md: `load_config` is given the world size by whoever knows it (and the
    config layer needs no torch at all, so `fnzero config` could run without it)."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((PKG / "config").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if line.lstrip().startswith(("import torch", "from torch"))]
    assert not hits, hits


def _code_lines(fn: ast.FunctionDef) -> int:
    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)
    return fn.end_lineno - (body[0].end_lineno + 1 if doc else fn.lineno) + 1


def test_long_files_and_functions_say_why():
    """specs/architecture.md: no file over 400 lines and no function over 60 lines of code without
    the reason written at its top (a `[Note: why this file is long]` / a `# Long:` comment)."""
    bad = []
    for path, _, _ in _modules():
        src = path.read_text()
        lines = src.splitlines()
        if len(lines) > 400 and "[Note: why this file is long]" not in (ast.get_docstring(ast.parse(src)) or ""):
            bad.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
        for fn in ast.walk(ast.parse(src)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(fn) > 60:
                head = lines[fn.lineno - 1: fn.body[0].end_lineno + 2]
                if not any(line.strip().startswith("# Long:") for line in head):
                    bad.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {_code_lines(fn)} lines")
    assert not bad, bad


def test_stage_numbers_are_compared_only_at_the_edges():
    """specs/sharding.md §Placements: the runtime reads placements; a stage number is compared
    only where a user's stage is read (config, CLI, the planner's input, the preset table, the
    autotuner's candidates)."""
    import re

    edges = ("fnzero/config/", "fnzero/cli/", "fnzero/testing/", "fnzero/sharding/_placement.py",
             "fnzero/memory/_estimate.py", "fnzero/autotune/")
    compare = re.compile(r"\bstage\s*(==|!=|>=|<=|>|<)|(==|!=|>=|<=|>|<)\s*\w*\.?stage\b")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p, _, _ in _modules()
            if not str(p.relative_to(ROOT)).startswith(edges)
            for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line.split("#")[0])]
    assert not hits, hits
