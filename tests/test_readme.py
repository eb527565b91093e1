"""README.md is executable: every repository path and spec section it names exists, every command
it shows parses with the real parsers (`fnzero`'s, each script's own), and each command that runs
an example is run, shortened, by tests/test_examples.py (specs: README; a README once named an
example that did not exist)."""

import ast
import os

import _readme

with open(_readme.README, encoding="utf-8") as f:
    TEXT = f.read()


def test_every_path_section_and_command_the_readme_names_exists():
    assert _readme.static_problems(TEXT) == []


def test_every_script_the_readme_runs_accepts_its_arguments():
    calls = _readme.script_calls(TEXT)
    assert {s for _, s, _ in calls} >= {"examples/train_gpt.py", "examples/finetune_hf.py", "benchmarks/bench_jit.py"}
    assert _readme.script_problems(calls) == []


def test_every_option_the_readme_names_alone_belongs_to_a_command_it_names():
    assert _readme.option_problems(TEXT) == []


def _runs_in_test_examples() -> set[tuple[str, str | None]]:
    """(script, config) of every `readme_argv(...)` call in tests/test_examples.py."""
    with open(os.path.join(_readme.ROOT, "tests", "test_examples.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "readme_argv"]
    return {(ast.literal_eval(c.args[0]), ast.literal_eval(c.args[1]) if len(c.args) > 1 else None) for c in calls}


def test_each_readme_command_that_runs_an_example_is_run_by_test_examples():
    readme = {(script, config) for _, script, config in _readme.example_runs(TEXT)}
    # The headline run, the fine-tune, LoRA with generation, tensor, pipeline and sequence parallelism.
    assert readme == {("examples/train_gpt.py", "examples/configs/zero3.json"), ("examples/finetune_hf.py", None),
                      ("examples/lora_generate.py", None),
                      ("examples/train_gpt.py", "examples/configs/tp2_zero1.json"),
                      ("examples/train_gpt.py", "examples/configs/pp2_zero1.json"),
                      ("examples/train_gpt.py", "examples/configs/sp2_zero3.json")}
    assert _runs_in_test_examples() == readme


def test_every_dependency_has_the_range_the_suite_passed_with_and_this_environment_is_in_it():
    # specs: README (pyproject.toml's comment): a lower and an upper bound on every requirement, so
    # a fresh install (CI's too) gets the newest release the suite has passed with, never a newer one.
    from importlib.metadata import PackageNotFoundError, version

    ranges = _readme.dependency_ranges()
    assert {"torch", "transformers", "peft", "pydantic", "optree"} <= set(ranges)
    unbounded = [f"{n}{s}" for n, s in ranges.items()
                 if not any(x.operator in ("<", "==", "~=") for x in s) or not any(x.operator in (">=", "==", "~=") for x in s)]
    assert unbounded == [], f"requirements without a lower and an upper bound: {unbounded}"
    outside = []
    for name, spec in _readme.dependency_ranges(build=False).items():
        try:
            have = version(name).split("+")[0]  # (torch's CPU wheel is 2.13.0+cpu)
        except PackageNotFoundError:
            continue  # an extra this environment did not install
        if not spec.contains(have, prereleases=True):
            outside.append(f"{name} {have} (pyproject.toml: {spec})")
    assert outside == [], f"this environment runs versions pyproject.toml does not admit: {outside}"


def test_the_readme_installs_only_what_pyproject_admits():
    # The README's commands install torch by hand before the project; that pin is checked against
    # pyproject.toml's range by static_problems, as is any package a README command installs.
    installs = [c for c in _readme.commands(TEXT) if c.argv[:2] == ("pip", "install")]
    assert any("torch==" in " ".join(c.argv) for c in installs)
    assert [p for c in installs for p in _readme._pip_problems(list(c.argv), _readme.ROOT)] == []
    drifted = "pip install torch==2.99.0 && pip install somepkg && pip install -e '.[hf,gpu]'"
    assert _readme._pip_problems(drifted.split(" && ")[0].split(), _readme.ROOT) == [
        f"torch==2.99.0 is outside pyproject.toml's range torch{_readme.dependency_ranges()['torch']}"]
    assert _readme._pip_problems(["pip", "install", "somepkg"], _readme.ROOT) == ["pyproject.toml does not list somepkg"]
    assert _readme._pip_problems(["pip", "install", "--index-url", "https://x/simple", "torch==2.13.0"], _readme.ROOT) == []
    assert _readme._pip_problems(["pip", "install", "-e", ".[hf,gpu]"], _readme.ROOT) == [
        "pyproject.toml has no extra 'gpu' (it has ['hf', 'plot', 'test'])"]


BAD = """\
Run `fnzero launch --nproc-per-node 2 examples/train_gpt_pipeline.py --config examples/configs/pp2_zero1.json`,
read `specs/mesh.md` §Pipelines galore, and `specs/nothing.md`, then:

```bash
pip install -e '.[hf,gpu]' && fnzero frobnicate
fnzero plan --paramz 7B --world-size 8   # a typo
make all
```
and `fnzero launch --nproc-per-node 2 examples/train_gpt.py --stepz 3 --jit [units|fast]`, with `--remat` (of nothing).
"""


def test_the_checks_fail_on_a_readme_that_names_what_does_not_exist():
    problems = _readme.static_problems(BAD)
    expected = [  # (argparse words its messages differently across Python versions: fragments)
        "README.md:1: examples/train_gpt_pipeline.py does not exist",
        "README.md:2: specs/nothing.md does not exist",
        "README.md:2: specs/mesh.md has no section 'Pipelines galore'",
        "README.md:1: `fnzero launch --nproc-per-node 2 examples/train_gpt_pipeline.py --config "
        "examples/configs/pp2_zero1.json`: script examples/train_gpt_pipeline.py does not exist",
        "README.md:5: `pip install -e '.[hf,gpu]'`: pyproject.toml has no extra 'gpu' (it has ['hf', 'plot', 'test'])",
        "README.md:5: `fnzero frobnicate`: `fnzero frobnicate --help` exits 2: ",
        "README.md:6: `fnzero plan --paramz 7B --world-size 8`: `fnzero plan --paramz 7B --world-size 8` exits 2: "
        "['fnzero: error: unrecognized arguments: --paramz 7B']",
        "README.md:7: `make all`: no check knows the command 'make' (add one to tests/_readme.py)",
    ]
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected)), problems
    assert "invalid choice: 'frobnicate'" in problems[5]
    scripts = _readme.script_problems(_readme.script_calls(BAD))
    # `[units|fast]` is checked as each choice and as none.
    assert [p.split(": ")[1] for p in scripts] == [f"`fnzero launch --nproc-per-node 2 examples/train_gpt.py --stepz 3 "
                                                   f"--jit{c}`" for c in (" units", " fast", "")], scripts
    assert "unrecognized arguments: --stepz 3" in scripts[0] and "invalid choice: 'fast'" in scripts[1], scripts
    assert _readme.option_problems(BAD) == ["README.md:9: --remat is an option of no command it names"]
    assert _readme.example_runs(BAD)[0][1:] == ("examples/train_gpt_pipeline.py", "examples/configs/pp2_zero1.json")
