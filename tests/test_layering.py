"""The import graph goes one way: scripts -> packages; training/ -> evaluation/ -> rollouts/ -> model/, data/, rlhf/,
utils/; rlhf/ -> torch only; utils/ -> none of the project's other packages; model/ and data/ -> nothing of utils/
(model/ may use rlhf/'s pure math); no script imports a script, no test file imports another; and no module imports
itself back, however long the way round (module granularity, imports inside functions included)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"sft", "reward_model", "dpo", "grpo", "eval_preferences", "demo", "sample", "verdict"}
PACKAGES = {"model", "data", "rlhf", "rollouts", "evaluation", "training", "experiments", "utils", "bench", "tests"}


def project_imports(file: Path) -> set[str]:
    """Top-level project modules or packages that `file` imports (anywhere in it, functions included)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & (SCRIPTS | PACKAGES)
    return found


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).glob("*.py"))


def test_packages_import_one_way():
    allowed = {
        "rlhf": {"rlhf"},
        "utils": {"utils"},
        "model": {"model", "data", "rlhf"},  # rlhf: pure math, e.g. the sampler's logit processing
        "data": {"data"},
        "rollouts": {"rollouts", "model", "data", "rlhf", "utils"},
        "evaluation": {"evaluation", "rollouts", "model", "data", "rlhf", "utils"},
        "training": {"training", "evaluation", "rollouts", "model", "data", "rlhf", "utils"},
        "experiments": {"experiments", "evaluation", "rollouts", "model", "data", "rlhf", "utils"},
    }
    bad = []
    for package, ok in allowed.items():
        for file in package_files(package):
            extra = project_imports(file) - ok
            if extra:
                bad.append(f"{file.relative_to(ROOT)} imports {sorted(extra)}")
    assert not bad, bad


def test_rlhf_imports_nothing_but_torch_and_the_standard_library():
    import sys

    stdlib = set(sys.stdlib_module_names)
    for file in package_files("rlhf"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                top = node.module.split(".")[0]
            elif isinstance(node, ast.Import):
                top = node.names[0].name.split(".")[0]
            else:
                continue
            assert top in stdlib or top in ("torch", "rlhf"), f"{file.name} imports {top}"


def test_scripts_import_packages_never_scripts():
    for name in SCRIPTS:
        imported = project_imports(ROOT / f"{name}.py")
        assert not imported & SCRIPTS, f"{name}.py imports scripts {sorted(imported & SCRIPTS)}"
    for package in ("model", "data", "rlhf", "rollouts", "evaluation", "training", "experiments", "utils"):
        for file in package_files(package):
            assert not project_imports(file) & SCRIPTS, f"{file.relative_to(ROOT)} imports a script"


def test_no_test_file_imports_another():
    for file in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.split(".")[-1].startswith("test_"), (
                    f"{file.relative_to(ROOT)} imports {node.module}"
                )


@pytest.mark.parametrize("package", ["rollouts", "training"])
def test_package_docstring_names_every_module_and_every_importer(package):
    # the package docstring says what each module holds and who imports the package: a new module or importer
    # (outside tests/ and bench/, which it names as a whole) fails here until the docstring says so
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    modules = [f.name for f in package_files(package) if f.name != "__init__.py"]
    importers = [
        str(f.relative_to(ROOT))
        for f in [
            *(ROOT / f"{s}.py" for s in SCRIPTS),
            *(g for p in PACKAGES - {"tests", "bench"} for g in package_files(p)),
        ]
        if f.parent.name != package and package in project_imports(f)
    ]
    assert modules and importers
    missing = [name for name in modules + importers if name not in doc]
    assert not missing, missing


def test_no_function_of_grpo_its_step_or_the_math_takes_more_than_eight_positional_parameters():
    # a function with a long positional signature wants a dataclass of its options (rlhf/policy_gradient.py Objective)
    # or keyword-only parameters: every function and method written in grpo.py, its step (rollouts/step.py) and
    # rlhf/ (a dataclass's generated __init__ is not written there) takes at most 8 positional parameters besides self
    import importlib
    import inspect

    modules = ["grpo", "rollouts.step"] + [f"rlhf.{f.stem}" for f in package_files("rlhf")]
    too_long, seen = [], 0
    for name in modules:
        module = importlib.import_module(name)
        functions = [f for f in vars(module).values() if inspect.isfunction(f) and f.__module__ == name]
        for cls in [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == name]:
            functions += [f for f in vars(cls).values() if inspect.isfunction(f)]
        for f in functions:
            if f.__code__.co_filename != module.__file__:
                continue  # generated (a dataclass's __init__)
            seen += 1
            kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            params = inspect.signature(f).parameters.values()
            positional = [p.name for p in params if p.kind in kinds and p.name not in ("self", "cls")]
            if len(positional) > 8:
                too_long.append(f"{name}.{f.__qualname__}: {len(positional)} ({', '.join(positional)})")
    assert seen > 50
    assert not too_long, too_long


def module_file(name: str) -> Path | None:
    """The project file that module `name` is (a package is its __init__.py), or None outside the project."""
    path = ROOT / Path(*name.split("."))
    for file in (path.with_suffix(".py"), path / "__init__.py"):
        if file.is_file():
            return file
    return None


def imported_files(file: Path) -> set[Path]:
    """Project files that `file` imports, anywhere in it (functions included), one per module: `from a.b import c` is
    a/b/c.py when c is a module, else a/b.py; `import a.b` is a/b.py (the package a/__init__.py that Python runs
    first is not counted)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found |= {module_file(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{file.relative_to(ROOT)}: a relative import (this graph reads absolute ones)"
            found |= {module_file(f"{node.module}.{a.name}") or module_file(node.module) for a in node.names}
    return found - {None}


def import_cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """One cycle (first file repeated at its end) for each edge that closes one in a depth-first walk of `graph`."""
    cycles, done, stack = [], set(), []

    def visit(file):
        stack.append(file)
        for target in sorted(graph.get(file, ())):
            if target in stack:
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in done:
                visit(target)
        stack.pop()
        done.add(file)

    for file in sorted(graph):
        if file not in done:
            visit(file)
    return cycles


def test_import_cycles_are_found_and_named_as_a_chain_of_files():
    a, b, c, d = (ROOT / f"{n}.py" for n in "abcd")
    assert import_cycles({a: {b}, b: {c}, c: set(), d: {a}}) == []
    assert import_cycles({a: {b}, b: {c}, c: {a}, d: {a}}) == [[a, b, c, a]]
    assert import_cycles({a: {a}}) == [[a, a]]
    assert module_file("evaluation") == ROOT / "evaluation" / "__init__.py" and module_file("torch") is None
    common, step, compare = (ROOT / f for f in ("bench/common.py", "rollouts/step.py", "evaluation/compare.py"))
    assert compare in imported_files(ROOT / "evaluation/frontier.py")  # inside main()
    profile = imported_files(ROOT / "bench/decode_profile.py")
    assert common in profile and ROOT / "bench/__init__.py" not in profile  # `from bench import common`
    assert {step, common} <= imported_files(ROOT / "bench/grpo_step.py")  # `import rollouts.step`, `from bench.common`


def test_no_module_imports_itself_back():
    # module granularity: `from evaluation.compare import x` (even inside a function) is an edge from the importing file
    # to evaluation/compare.py, `from evaluation import compare` too; a package's __init__.py is a module of its own
    files = sorted(ROOT.glob("*.py")) + [f for p in sorted(PACKAGES - {"tests"}) for f in package_files(p)]
    graph = {file: imported_files(file) for file in files}
    assert sum(map(len, graph.values())) > 200
    cycles = [" -> ".join(str(f.relative_to(ROOT)) for f in cycle) for cycle in import_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
