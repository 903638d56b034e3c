"""The package's shape, as the seams issue set it: small files and functions, a loop that names no
algorithm, no import cycles. A new feature that grows the loop instead of adding a module behind
a seam (docs/design.md, "Next") fails here, with the offending file or function named."""

from __future__ import annotations

import ast
from pathlib import Path

import posttrain
from posttrain.algos.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

PACKAGE = Path(posttrain.__file__).parent
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_LOOP_LINES = 500, 60, 400


def modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }


def test_no_file_and_no_function_is_too_long():
    long_files, long_functions = [], []
    for path in modules().values():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            long_files.append((str(path), len(source.splitlines())))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append((f"{path}:{node.lineno} {node.name}", length))
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
    assert len((PACKAGE / "train" / "rl.py").read_text().splitlines()) <= MAX_LOOP_LINES


def test_the_rl_loop_names_no_algorithm():
    """The loop reads what an estimator or loss needs from its registry entry; an algorithm's name
    in train/rl*.py is a branch that the next algorithm would have to extend. Only a config
    field's default may name one (``advantage: str = "grpo"``): that is a choice, not a branch."""
    names = set(ADVANTAGE_ESTIMATORS) | set(POLICY_LOSSES)
    assert {"grpo", "gae", "remax", "gdpo", "ppo_clip"} <= names  # the check below is not vacuous
    found = []
    for path in sorted((PACKAGE / "train").glob("rl*.py")):
        tree = ast.parse(path.read_text())
        defaults = {
            id(statement.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            for statement in node.body
            if isinstance(statement, ast.AnnAssign) and statement.value is not None
        }
        found += [
            f"{path.name}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in defaults
        ]
    assert not found, found


def top_level_imports(path: Path, package: str) -> set[str]:
    """posttrain modules imported when this module is imported: module-level statements only (an
    import inside a function or under ``if TYPE_CHECKING`` runs later or never)."""
    imported: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            imported.add(base)
            imported |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in imported if name.startswith("posttrain")}


def test_no_import_cycle():
    found = modules()
    graph = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        # importing a.b.c runs a and a.b first: a module naming its own package (``from a.b import
        # c``) finds it already being imported, so that edge starts nothing and closes no cycle
        graph[name] = {
            m for m in top_level_imports(path, package) if m in found and m != name and not name.startswith(m + ".")
        }
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_one_sft_loop():
    defined = [
        f"{path}:{node.lineno}"
        for path in modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "train_sft"
    ]
    assert not defined, defined


# The floors of the package, lowest first: a folder (or top-level module) imports only from its own
# floor or below, counting every import — deferred into a function, or under ``if TYPE_CHECKING``
# — since a deferred import still ties the two folders together (docs/design.md, "Package layout").
FLOORS = [
    {"errors", "config", "hub", "user_code", "memory", "devices", "distributed", "telemetry"},
    {"algos"},
    {"models"},
    {"data"},
    {"rollout"},
    {"rewards"},
    {"envs"},
    {"evaluate"},
    {"run"},
    {"sources"},
    {"view"},
    {"train"},
    {"plan"},
    {"demo", "launch", "cli", "run_commands", "eval_command", "__main__", "presets", "posttrain"},
]


def folder_of(module: str) -> str:
    """``posttrain.sources.single_turn`` → ``sources``; ``posttrain.cli`` → ``cli``; ``posttrain`` → itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def every_import(path: Path) -> set[str]:
    """Every posttrain module a file names in an import statement, wherever the statement is."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
    return {name for name in named if name == "posttrain" or name.startswith("posttrain.")}


def test_imports_go_down_the_floors():
    floor = {name: level for level, names in enumerate(FLOORS) for name in names}
    unplaced = sorted({folder_of(module) for module in modules()} - set(floor))
    assert not unplaced, f"place these in FLOORS: {unplaced}"
    upward = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for module, path in modules().items()
        for name in sorted(every_import(path))
        if floor[folder_of(name)] > floor[folder_of(module)]
    ]
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_the_sources_import_nothing_from_the_loop():
    """The acceptance line of the imports issue, spelled out: not even lazily or for types."""
    found = [
        f"{path.name}: {name}"
        for path in (PACKAGE / "sources").rglob("*.py")
        for name in every_import(path)
        if folder_of(name) == "train"
    ]
    assert not found, found


def imported_modules(path: Path, found: dict[str, Path]) -> set[str]:
    """The package's modules a file imports anywhere in it (deferred, or for types): ``from a.b
    import c`` names ``a.b.c`` where that is a module, else ``a.b``."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                named.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in found else node.module)
    return {name for name in named if name in found}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# Folders whose files import each other one way only, counting deferred imports too: the planner
# reads the config and its own formulas, never itself back; run keeping is a floor others build on.
NO_CIRCLE_INSIDE = {"plan", "run"}


def test_no_circle_between_folders_nor_inside_the_planner():
    """The floors keep folders of different floors apart; this also catches a circle between two
    folders of one floor (the ground's modules) and between files of ``NO_CIRCLE_INSIDE``."""
    found = modules()
    graph = {
        name: {m for m in imported_modules(path, found) if m != name and not name.startswith(m + ".")}
        for name, path in found.items()
    }
    bad = [
        part
        for part in circles(graph)
        if len({folder_of(module) for module in part}) > 1 or folder_of(part[0]) in NO_CIRCLE_INSIDE
    ]
    assert not bad, "\n".join(" <-> ".join(part) for part in bad)
