"""The package's imports: no cycles, each module importable first and alone, and an import
inside a function says why it is there (start-up time, an optional extra).

The graph is read from the source (every ``import`` of a ``chimera`` module, at the top or
inside a function), so a cycle that a function-level import would hide is found too.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

from limits import limit
from sources import PACKAGE, SRC, package_files, tree


# Cycles allowed to stay: none (the last two went in issue 24). A cycle not listed here fails.
KNOWN_CYCLES: set[frozenset[str]] = set()
# Files whose function-level imports do not say why yet (same reason).
NOT_YET_COMMENTED = {"api.py", "cli/train_cmd.py", "train/__init__.py",
                     "train/equivalence.py", "train/faults.py",
                     "train/generate.py", "train/launch.py"}


# The layers, lowest first (docs/ARCHITECTURE.md draws the same list): a module imports only
# its own unit and units of lower layers, at the top of the file or inside a function alike.
# Units of one layer are independent of each other. No exceptions.
LAYERS = [
    {"errors"},
    {"ir", "collectives"},
    {"modelcfg"},
    {"schedules", "passes"},
    {"sim"},
    {"viz"},
    {"check", "theory"},
    {"plan"},
    {"data", "rng"},
    {"runtime"},
    {"tp"},
    {"byo"},
    {"models"},
    {"api"},
    {"hf"},
    {"train"},
    {"bench"},
    {"cli"},
    {"__main__"},
]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in package_files():
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node, known: dict) -> list[str]:
    """The chimera modules an import statement loads (``from m import name``: m.name if that
    is a module, else m)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                 for a in node.names]
    else:
        return []
    out = []
    for name in names:
        while name and name not in known:  # `import chimera.sim.cost` names a module
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}."""
    known = modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in known}
    for module, path in known.items():
        for node in ast.walk(tree(path)):
            for target in _imported(node, known):
                if target != module:
                    graph[module].setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, on_stack, found = [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def layer_of(module: str) -> int:
    """The index in LAYERS of a module's unit (``chimera.sim.cost`` -> sim)."""
    unit = module.split(".")[1]
    found = [i for i, layer in enumerate(LAYERS) if unit in layer]
    assert found, f"{module}: unit {unit!r} is in no layer of LAYERS"
    return found[0]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """'a (line n) imports b' for each import that does not go down the layers."""
    out = []
    for module, targets in graph.items():
        if module == "chimera":
            continue
        for target, line in targets.items():
            if target == "chimera":
                continue
            mine, theirs = layer_of(module), layer_of(target)
            same_unit = module.split(".")[1] == target.split(".")[1]
            if theirs > mine or (theirs == mine and not same_unit):
                out.append(f"{module} (line {line}) imports {target}")
    return out


def test_imports_go_down_the_layers():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layers (LAYERS):\n" + "\n".join(sorted(bad))


def test_the_layer_check_finds_an_upward_import():
    graph = {"chimera.sim.engine": {"chimera.viz.grid": 3}, "chimera.viz.grid": {"chimera.sim.timeline": 5},
             "chimera.sim.timeline": {}, "chimera.check.validate": {"chimera.theory.bounds": 7},
             "chimera.theory.bounds": {}}
    assert upward_imports(graph) == [
        "chimera.sim.engine (line 3) imports chimera.viz.grid",
        "chimera.check.validate (line 7) imports chimera.theory.bounds"]


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    graph = import_graph()
    new = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    lines = [" <-> ".join(f"{m} (line {graph[m][n]} imports {n})" for m in sorted(c)
                          for n in sorted(graph[m]) if n in c) for c in new]
    assert not new, "import cycles:\n" + "\n".join(lines)


@pytest.mark.slow
def test_every_module_imports_first_and_alone(cli_env):
    """Each module imported in a fresh interpreter with no other chimera module loaded
    before it: a cycle of top-level imports breaks there, depending on which module comes
    first. (Third-party modules such as torch stay loaded between them: they are not ours.)"""
    names = [m for m in modules() if m != "chimera.__main__"]  # that one runs the CLI
    script = (
        "import importlib, sys, traceback\n"
        f"names = {names!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for key in [k for k in sys.modules if k == 'chimera' or k.startswith('chimera.')]:\n"
        "        del sys.modules[key]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc().strip().splitlines()[-1])\n"
        "print('\\n'.join(failed))\n"
        "print('imported', len(names) - len(failed))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=cli_env, timeout=limit(300))
    assert proc.returncode == 0 and f"imported {len(names)}" in proc.stdout, proc.stdout + proc.stderr


def _function_imports(path: pathlib.Path):
    """(line, text) of each import inside a function with no comment saying why: on its line,
    on the line above it, or on or above an earlier import of the same function."""
    lines = path.read_text().splitlines()
    for fn in ast.walk(tree(path)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        said = False
        for node in sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))),
                           key=lambda n: n.lineno):
            said = said or any("#" in lines[k] for k in (node.lineno - 2, node.lineno - 1) if k >= 0)
            if not said:
                yield node.lineno, lines[node.lineno - 1].strip()


def test_imports_inside_functions_say_why():
    missing = [f"{path.relative_to(PACKAGE)}:{line}: {text}"
               for path in package_files()
               if str(path.relative_to(PACKAGE)) not in NOT_YET_COMMENTED
               for line, text in _function_imports(path)]
    assert not missing, "imports inside functions without a comment saying why:\n" + "\n".join(missing)


@pytest.mark.parametrize("text", ["def f():\n    import os\n    return os\n"])
def test_an_unexplained_function_import_is_found(tmp_path, text):
    path = tmp_path / "m.py"
    path.write_text(text)
    assert [line for line, _ in _function_imports(path)] == [2]
    path.write_text(text.replace("import os", "import os  # start-up time"))
    assert list(_function_imports(path)) == []


def _drawn_layers(text: str, after: str) -> list[str]:
    """The units a layer picture names, top to bottom: the first column of the first code
    block after ``after`` (``errors, rng`` names two; ``sim/`` is sim)."""
    block = text[text.index(after):].split("```")[1]
    units = []
    for line in block.splitlines():
        if line and not line[0].isspace():
            head = line.split("  ")[0]
            units += [u.strip().rstrip("/") for u in head.split(",")]
    return units


@pytest.mark.parametrize("doc, after", [("docs/ARCHITECTURE.md", "## The layer map"),
                                        ("README.md", "## How it is built")])
def test_the_docs_draw_the_layers_of_the_check(doc, after):
    """The layer pictures of docs/ARCHITECTURE.md and the README list the units of LAYERS,
    bottom layer first, in the order the check enforces (any order inside one layer)."""
    drawn = _drawn_layers((SRC.parent / doc).read_text(), after)
    declared = [layer & set(drawn) for layer in LAYERS if layer - {"__main__"}]
    unknown = set(drawn) - set().union(*LAYERS)
    assert not unknown, f"{doc} draws units that are in no layer: {sorted(unknown)}"
    order = [next(i for i, layer in enumerate(declared) if unit in layer) for unit in drawn]
    assert order == sorted(order), f"{doc} draws the layers out of order: {drawn}"
    missing = set().union(*LAYERS) - {"__main__"} - set(drawn)
    assert not missing, f"{doc} does not draw {sorted(missing)}"
