"""The layering docs/design.md states ("Code layout"), checked on every import in the package:
commands on top (they may use anything), then tui, server and trace, each over engine, over
model, over the leaves. An arrow only ever points down."""

from __future__ import annotations

import ast
from pathlib import Path

import kimitui

PACKAGE = Path(kimitui.__file__).parent
COMMANDS = {"kimitui.cli", "kimitui.__main__", "kimitui.doctor", "kimitui.serve_cmd"}
LEAVES = {"kimitui", "kimitui.config", "kimitui.units", "kimitui.errors", "kimitui.history", "kimitui.startup"}
# room -> rooms it may import (besides itself and the leaves)
MAY_IMPORT = {
    "tui": {"engine", "model"},  # handed its server client and trace; never imports them
    "server": {"engine", "model"},
    "trace": {"engine", "model"},
    "engine": {"model"},
    "model": set(),
    "leaf": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    if module in COMMANDS or module.startswith("kimitui.benchmarks"):
        return "command"
    if module in LEAVES:
        return "leaf"
    return module.split(".")[1]


def imports(path: Path, module: str) -> list[str]:
    """Every module ``module`` (at ``path``) imports, relative imports resolved; ``from kimitui
    import tui`` counts as importing kimitui.tui."""
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.append(base)
            if base == "kimitui" or (PACKAGE.parent / base.replace(".", "/")).is_dir():
                out += [f"{base}.{alias.name}" for alias in node.names
                        if (PACKAGE.parent / base.replace(".", "/") / alias.name).exists()
                        or (PACKAGE.parent / base.replace(".", "/") / f"{alias.name}.py").exists()]
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
    return out


def modules():
    return sorted((module_name(p), p) for p in PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_known_room():
    rooms = {room(name) for name, _ in modules()}
    assert rooms <= set(MAY_IMPORT) | {"command"}, rooms


def upward_imports(pairs) -> list[str]:
    """The imports among ``pairs`` of (module, path) that point up or sideways."""
    wrong = []
    for name, path in pairs:
        here = room(name)
        if here == "command":
            continue
        for target in imports(path, name):
            if not target.startswith("kimitui"):
                continue
            there = room(target)
            if there not in (here, "leaf") and there not in MAY_IMPORT[here]:
                wrong.append(f"{name} imports {target} ({here} -> {there})")
    return wrong


def test_imports_point_down_only():
    wrong = upward_imports(modules())
    assert not wrong, "\n".join(wrong)


def test_no_textual_below_the_tui_and_no_terminal_rendering_in_engine_or_model():
    wrong = []
    for name, path in modules():
        banned = {"command": (), "tui": ()}.get(room(name), ("textual",))
        if room(name) in ("engine", "model", "server"):
            banned = ("textual", "rich")  # a trace command may print tables; these never draw
        wrong += [f"{name} imports {t}" for t in imports(path, name) if t.split(".")[0] in banned]
    assert not wrong, "\n".join(wrong)


def test_the_rule_catches_wrong_imports_in_every_spelling(tmp_path):
    bad = tmp_path / "bad.py"
    for line in ("from kimitui.tui.app import KimituiApp", "from kimitui import tui", "from ..server import app", "import kimitui.trace"):
        bad.write_text(line + "\n")
        assert upward_imports([("kimitui.engine.bad", bad)]), line
    bad.write_text("from kimitui.model.gguf_map import load_model_map\nfrom . import budget\n")
    assert upward_imports([("kimitui.engine.bad", bad)]) == []


def test_the_server_and_the_tui_take_the_engine_through_its_interface():
    """Neither imports the concrete Engine (engine/session.py): the server is typed with
    interface.ServingEngine, the UI with interface.ChatEngine; commands build the engine."""
    wrong = [
        f"{name} imports {target}"
        for name, path in modules() if room(name) in ("server", "tui")
        for target in imports(path, name) if target == "kimitui.engine.session"
    ]
    assert not wrong, "\n".join(wrong)


def import_cycles(pairs) -> list[list[str]]:
    """The strongly connected sets of more than one module among ``pairs`` of (module, path):
    imports inside functions count, as a module that waits to import another still needs it."""
    names = {name for name, _ in pairs}
    graph = {name: sorted({t for t in imports(path, name) if t in names and t != name}) for name, path in pairs}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):  # Tarjan's, iterative: a deep chain would pass Python's recursion limit
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.append(sorted(members))
    return sorted(cycles)


def test_no_import_cycles():
    cycles = import_cycles(modules())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_a_cycle_is_found_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("import kimitui.engine.b\n")
    (tmp_path / "b.py").write_text("def late():\n    import kimitui.engine.c\n")
    (tmp_path / "c.py").write_text("import kimitui.engine.a\n")
    (tmp_path / "d.py").write_text("import kimitui.engine.a\n")  # into the cycle, not in it
    pairs = [(f"kimitui.engine.{name}", tmp_path / f"{name}.py") for name in "abcd"]
    assert import_cycles(pairs) == [["kimitui.engine.a", "kimitui.engine.b", "kimitui.engine.c"]]
