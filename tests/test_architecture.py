"""The layering of `specs/architecture.md`, read from the source: every import of a fnzero module,
at module level or inside a function, goes to its own layer or one below, except the exceptions
the spec lists; no import circle among fnzero's modules beyond those listed as being removed; no
function over 80 lines; and no module reads another's state through `sys.modules`."""

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
    "state": 6,
    "train": 7,
    "inference": 8,
    "memory": 9,
    "monitor": 10, "autotune": 10,
    "cli": 11,
    "testing": 12,
}
ROOT_API = 11  # `fnzero/__init__.py`: re-exports layers 0-9, so only cli and testing import it
# (importing module, imported module): the exceptions specs/architecture.md names (none today).
EXCEPTIONS: set[tuple[str, str]] = set()


def _modules(root=ROOT):
    for path in sorted((root / "fnzero").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        yield path, ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _absolute(node: ast.ImportFrom, mod: str, is_pkg: bool) -> str:
    """The absolute module name a `from ... import` reads from, `mod` being the importing module."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path, mod, is_pkg):
    """(line, absolute module name) of every fnzero import in the file, wherever it is."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(node, mod, is_pkg)
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


def test_no_module_below_the_root_imports_through_the_root_package():
    """`from fnzero import x` reads a name through `fnzero/__init__.py`, the top of the house (layer
    11): a module below it names the package or module the name lives in (`from ..optim import
    implementation`, `import fnzero._cext`), so every reading of the graph sees the real edge."""
    sources = {m.split(".")[1] for _, m, _ in _modules() if m.count(".") >= 1}
    bad = []
    for path, mod, is_pkg in _modules():
        if _layer(mod) >= ROOT_API or mod == "fnzero":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and _absolute(node, mod, is_pkg) == "fnzero":
                # `from .. import _ext` names a package of the tree; `from fnzero import shard` (or
                # the built `_cext`, no source file) takes a name from the root's namespace.
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names if a.name not in sources]
    assert not bad, "imports through the root package:\n" + "\n".join(bad)


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
        "fnzero/config/_probe.py:1 imports fnzero.train._step (layer 7 > 1)",
        "fnzero/config/_probe.py:4 imports fnzero.sharding (layer 3 > 1)",
    ]


# specs/architecture.md §Inside sharding: its sub-packages, bottom to top (tp and pp side by side).
SHARDING = {"comm": 0, "zero": 1, "tp": 2, "pp": 2, "ep": 2, "sp": 2, "construct": 3}


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


# specs/architecture.md §No import circles: the circles that remain, each being broken by the
# rework of its code (issue #41). Whoever breaks one removes it here: a listed circle that no
# longer exists fails `test_no_import_circles` as a new one does.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _import_graph(root=ROOT) -> dict[str, set[str]]:
    """Module -> the fnzero modules it imports, anywhere in the file (in functions and under
    TYPE_CHECKING too). `from X import name` is an edge to the module X.name where that file
    exists, else to X; a package's `__init__` is a module of its own, and importing `X.Y` is not
    counted as importing `X` (a package importing its own submodules closes no circle).
    `from fnzero import _cext` is the compiled C extension: no module of the graph."""
    modules = {mod: (path, is_pkg) for path, mod, is_pkg in _modules(root)}
    graph: dict[str, set[str]] = {mod: set() for mod in modules}
    for mod, (path, is_pkg) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[mod] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(node, mod, is_pkg)
                for a in node.names:
                    if f"{target}.{a.name}" in modules:
                        graph[mod].add(f"{target}.{a.name}")
                    elif target in modules and f"{target}.{a.name}" != "fnzero._cext":
                        graph[mod].add(target)
    return graph


def _import_circles(root=ROOT) -> set[frozenset[str]]:
    """The import circles: each strongly connected set of more than one module (Tarjan's algorithm)."""
    graph = _import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while v not in members:
                members.add(stack.pop())
            if len(members) > 1:
                circles.add(frozenset(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles():
    circles = _import_circles()
    new, gone = circles - KNOWN_CIRCLES, KNOWN_CIRCLES - circles
    assert not new, "import circles (specs/architecture.md §No import circles):\n" + "\n".join(
        " <-> ".join(sorted(c)) for c in new)
    assert not gone, "no longer circles, remove them from KNOWN_CIRCLES:\n" + "\n".join(
        " <-> ".join(sorted(c)) for c in gone)


def test_an_import_circle_is_caught(tmp_path):
    """The check can fail: a circle closed inside a function, and one under TYPE_CHECKING; not a
    package importing its own submodules, nor the C extension."""
    for sub in ("", "/a", "/b"):
        (tmp_path / f"fnzero{sub}").mkdir(parents=True)
    (tmp_path / "fnzero/__init__.py").write_text("from .a import f\nfrom .b import g\n")
    (tmp_path / "fnzero/a/__init__.py").write_text("from ._one import f\n")
    (tmp_path / "fnzero/a/_one.py").write_text(
        "from fnzero import _cext\nfrom . import _two\n\ndef f():\n    from ._three import h\n")
    (tmp_path / "fnzero/a/_two.py").write_text("X = 1\n")
    (tmp_path / "fnzero/a/_three.py").write_text("from ._one import f\n")
    (tmp_path / "fnzero/b/__init__.py").write_text("from ._x import g\n")
    (tmp_path / "fnzero/b/_x.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from fnzero.b._y import Y\n\ndef g(): ...\n")
    (tmp_path / "fnzero/b/_y.py").write_text("from ._x import g\n\nclass Y: ...\n")
    assert _import_circles(tmp_path) == {frozenset({"fnzero.a._one", "fnzero.a._three"}),
                                         frozenset({"fnzero.b._x", "fnzero.b._y"})}

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


MAX_FUNCTION_LINES = 80  # a def's lines, its docstring and comments included (specs/architecture.md §Sizes)


def _functions_over_the_limit(root=ROOT) -> list[str]:
    out = []
    for path, _, _ in _modules(root):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            lines = fn.end_lineno - fn.lineno + 1 if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else 0
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name}: {lines} lines")
    return out


def test_no_function_is_over_80_lines():
    """specs/architecture.md §Sizes: past 80 lines a function is cut into pieces with one job
    each, whatever its `# Long:` reason says."""
    bad = _functions_over_the_limit()
    assert not bad, bad


def test_a_long_function_is_caught(tmp_path):
    (tmp_path / "fnzero").mkdir()
    (tmp_path / "fnzero/__init__.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    (tmp_path / "fnzero/_m.py").write_text(f"def fits():\n{body}\n\ndef too_long():\n    'Doc.'\n{body}")
    assert _functions_over_the_limit(tmp_path) == ["fnzero/_m.py:83 too_long: 81 lines"]

def test_stage_numbers_are_compared_only_at_the_edges():
    """specs/sharding.md §Placements: the runtime reads placements; a stage number is compared
    only where a user's stage is read (config, CLI, the planner's input, the autotuner's
    candidates)."""
    import re

    edges = ("fnzero/config/", "fnzero/cli/", "fnzero/testing/", "fnzero/memory/_estimate.py", "fnzero/autotune/")
    compare = re.compile(r"\bstage\s*(==|!=|>=|<=|>|<)|(==|!=|>=|<=|>|<)\s*\w*\.?stage\b")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p, _, _ in _modules()
            if not str(p.relative_to(ROOT)).startswith(edges)
            for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line.split("#")[0])]
    assert not hits, hits


# specs/architecture.md §Package faces: another package's private modules are imported only here,
# each for the reason given; everything else goes through the package's `__init__`.
PRIVATE_IMPORTS = {
    # `fnzero plan` parses and prints without torch (a second, not seconds): the memory package's
    # face imports torch, so the planner's arithmetic and the expert counter are taken from their
    # modules on first use.
    ("fnzero.cli._plan", "fnzero.memory._estimate"): "torch-free `fnzero plan`",
    ("fnzero.cli._plan", "fnzero.memory._experts"): "torch-free `fnzero plan`",
}


def _private_imports(root=ROOT) -> set[tuple[str, str]]:
    """(importing module, imported private module) where the importer is outside the package whose
    face (`__init__`) it passes by: `from ..sharding.zero._plan import X` from `train/` (the face is
    `fnzero.sharding`), `from ..zero._plan import X` from `sharding/construct/` (`fnzero.sharding.zero`),
    and `from ..memory import _estimate` (a private module taken from the face is still private)."""
    graph = _import_graph(root)
    packages = {mod for _, mod, is_pkg in _modules(root) if is_pkg}
    found = set()
    for mod, targets in graph.items():
        own = mod if mod in packages else mod.rpartition(".")[0]
        for target in targets:
            parts = target.split(".")
            for i in range(2, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg not in packages or own == pkg or own.startswith(pkg + "."):
                    continue
                if any(p.startswith("_") for p in parts[i:]) and target not in packages:
                    found.add((mod, target))
                break
    return found


def test_packages_are_imported_through_their_faces():
    found = _private_imports()
    new, gone = found - set(PRIVATE_IMPORTS), set(PRIVATE_IMPORTS) - found  # (in-function imports too)
    assert not new, "import these through the package's __init__ (specs/architecture.md §Package faces):\n" + "\n".join(
        f"{m} -> {t}" for m, t in sorted(new))
    assert not gone, f"no longer imported, remove from PRIVATE_IMPORTS: {sorted(gone)}"
    assert len(PRIVATE_IMPORTS) <= 10


def test_a_private_import_is_caught(tmp_path):
    for sub in ("", "/a", "/b", "/b/c"):
        (tmp_path / f"fnzero{sub}").mkdir(parents=True)
        (tmp_path / f"fnzero{sub}/__init__.py").write_text("")
    (tmp_path / "fnzero/b/c/_x.py").write_text("X = 1\n")
    (tmp_path / "fnzero/b/_y.py").write_text("from .c._x import X\n")  # c is another package: caught
    (tmp_path / "fnzero/a/_z.py").write_text("from ..b import X\n\ndef f():\n    from ..b.c._x import X\n")
    (tmp_path / "fnzero/a/_w.py").write_text("from ..b.c import _x\n")  # a private module from a face
    assert _private_imports(tmp_path) == {("fnzero.b._y", "fnzero.b.c._x"), ("fnzero.a._z", "fnzero.b.c._x"),
                                          ("fnzero.a._w", "fnzero.b.c._x")}


def test_the_state_layer_hands_init_state_down_as_a_parameter():
    """`sm.init_state()` builds what layers above sharding define, so `fnzero.shard` (the state
    layer's) gives the module the builder; a module laid out by sharding alone says so."""
    import torch
    import fnzero
    from fnzero import sharding, state

    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})
    assert fnzero.shard is state.shard
    assert int(fnzero.shard(torch.nn.Linear(3, 2), stage=0, config=cfg).init_state().step) == 0
    bare = sharding.shard(torch.nn.Linear(3, 2), stage=0, config=cfg)
    with pytest.raises(fnzero.ShardingError, match="fnzero.shard"):
        bare.init_state()
