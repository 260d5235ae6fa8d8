"""The packages of hpcml are layers: each imports only layers below it (docs/how-it-fits.md
draws them). Every import counts -- module level or inside a function, where the lazy ones
live -- so an upward import (the old ``ckpt.tools`` -> ``models.transformer.hf`` cycle)
fails here, naming the module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hpcml"

#: Lowest first; packages in one row import none of each other.
LAYERS = [
    ["errors", "stop", "lazy", "numeric"],
    ["safeio"],  # the one file layer: every file hpcml reads or writes for a user
    ["idset"],  # simulation ids as runs, and records written a chunk at a time
    ["env", "net", "contract", "waiting"],
    ["log", "info", "outcome"],
    ["grid", "stream", "lifeline", "data"],
    ["parallel", "ckpt"],
    ["models"],
    ["interop"],
    ["train"],
    ["ensemble"],
    ["plan"],  # reads model shapes, the grid's rules and site facts; runs nothing
    ["cli", "hpcml"],  # hpcml: the package's __init__ (lazy names of everything)
    ["__main__"],  # python -m hpcml: the command
]
RANK = {name: i for i, row in enumerate(LAYERS) for name in row}


def imports() -> list[tuple[str, str, str]]:
    """(package, imported package, module file) for every import of another hpcml package:
    absolute and relative ones, and the ``importlib.import_module("hpcml.x...")`` of the lazy
    name tables (an f-string counts by its constant start)."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        pkg = "hpcml" if rel.parts == ("__init__",) else rel.parts[0]
        here = ["hpcml", *rel.parts[:-1]]  # the package this file is in
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:  # from . import x, from ..grid import y
                base = here[:len(here) - (node.level - 1)]
                node = ast.ImportFrom(module=".".join(base + ([node.module] if node.module else [])),
                                      names=node.names, level=0)
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "hpcml":  # from hpcml import stop, env: submodules (or the version)
                    targets = [a.name for a in node.names if a.name != "__version__"]
                else:
                    targets = [node.module.split(".")[1]] if node.module.startswith("hpcml.") else []
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1] for a in node.names if a.name.startswith("hpcml.")]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
                arg = node.args[0]
                first = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
                text = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
                name = text.split(".")[1] if text.startswith("hpcml.") else ""
                targets = [name] if name and name in RANK else []  # "hpcml.{name}": the root's own lazy table
            else:
                continue
            out += [(pkg, t, str(path.relative_to(ROOT.parent))) for t in targets if t != pkg]
    return out


def test_every_package_has_a_layer():
    packages = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert packages - set(RANK) == set(), "a new package: put it in LAYERS (and docs/how-it-fits.md)"


def test_no_import_points_up_or_sideways():
    found = imports()
    assert len(found) > 50  # the walk sees the imports (a broken walk would pass vacuously)
    bad = sorted({f"{f}: {a} (layer {RANK[a]}) imports {b} (layer {RANK[b]})" for a, b, f in found
                  if RANK[b] >= RANK[a]})
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("lower, upper", [("ckpt", "models"), ("models", "interop"), ("ckpt", "interop"),
                                          ("parallel", "models"), ("stream", "train")])
def test_the_layers_that_matter_are_in_order(lower, upper):
    assert RANK[lower] < RANK[upper]
    assert any(a == upper and b == lower for a, b, _ in imports())  # the edge is real, not only allowed


def private_imports() -> list[str]:
    """``file: module.name`` for every ``from hpcml.x import _name`` (absolute or relative) of
    another module's private name, and every ``module._name`` read through an imported hpcml
    module: a private name is its module's own business (issue 44)."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        here = ["hpcml", *path.relative_to(ROOT).with_suffix("").parts[:-1]]
        tree = ast.parse(path.read_text(), str(path))
        aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    module = ".".join(here[:len(here) - (node.level - 1)] + ([module] if module else []))
                if not module.startswith("hpcml"):
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"{rel}: from {module} import {a.name}")
                    aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                aliases.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("hpcml"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                out.append(f"{rel}: {node.value.id}.{node.attr}")
    return sorted(set(out))


def test_no_module_imports_another_modules_private_name():
    assert private_imports() == []


def test_numbers_are_checked_by_one_definition():
    """'An int, not a bool' is hpcml.numeric.is_int (is_real for reals), not written again by
    hand (issue 44: it was written 79 times in 39 files, five private helpers among them)."""
    import re

    hand = re.compile(r"isinstance\(([^,()]+(?:\([^()]*\))?), bool\)[^\n]*isinstance\(\1, \(?(int|float|Real)"
                      r"|isinstance\(([^,()]+(?:\([^()]*\))?), \(?(int|float|Real)[^\n]*isinstance\(\3, bool\)")
    found = [f"{p.relative_to(ROOT.parent)}:{i + 1}" for p in sorted(ROOT.rglob("*.py")) if p.name != "numeric.py"
             for i, line in enumerate(p.read_text().splitlines()) if hand.search(line)]
    assert found == []
    assert hand.search("if isinstance(n, bool) or not isinstance(n, int) or n < 0:")  # the check sees one


def test_files_are_read_and_written_by_one_layer():
    """A bounded read of a regular file, a JSON record and an atomic replacement are
    :mod:`hpcml.safeio`'s, each with the caller's error class (``error=``), never written again
    (issue 44: two bounded readers with two error classes, three ``read_json``, three atomic
    writers). A rename outside it is allowed only where the file is not small and not ours to
    write whole: a checkpoint's directory committed, a file HDF5 or MPI ranks wrote in place."""
    import re

    again = re.compile(r"^\s*def (read_json|write_json|write_text|read_bounded|read_bytes|read_text)\(")
    renames = re.compile(r"os\.replace\(|os\.rename\(|\.rename\(")
    allowed = {"hpcml/ckpt/index.py": "a checkpoint's step directory committed by renaming it",
               "hpcml/ckpt/tools.py": "a consolidated HDF5 file h5py wrote, renamed once whole",
               "hpcml/ckpt/linking.py": "a step directory of hard links to another root's, committed by renaming it",
               "hpcml/data/pack.py": "a token file the MPI ranks wrote in parallel, renamed once whole",
               "hpcml/ensemble/driver_lease.py": "a stale lease moved aside (of two drivers, one wins)",
               "hpcml/train/run_record.py": "an earlier run's record moved aside whole into previous-N/"}
    found = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = str(p.relative_to(ROOT.parent))
        if rel.startswith("hpcml/safeio/"):
            continue
        for i, line in enumerate(p.read_text().splitlines()):
            code = line.split("#", 1)[0]
            if again.search(code) or (renames.search(code) and rel not in allowed):
                found.append(f"{rel}:{i + 1}: {line.strip()}")
    assert found == []
    assert again.search("def read_json(path):") and renames.search("tmp.rename(final)")  # the checks see one


def test_every_package_hands_out_its_lazy_names_one_way():
    """One public-surface mechanism (issue 44): a package's ``__getattr__`` is
    :func:`hpcml.lazy.lazy_names`, never written by hand."""
    hand = [str(p.relative_to(ROOT.parent)) for p in sorted(ROOT.rglob("*.py")) if p.name != "lazy.py"
            and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(p.read_text()).body)]
    assert hand == []
    import hpcml
    import hpcml.ckpt
    import hpcml.grid

    assert hpcml.ckpt.CheckpointError is hpcml.errors.CheckpointError
    assert hpcml.ckpt.pipeline.__name__ == "hpcml.ckpt.pipeline"
    assert hpcml.grid.interface_address is hpcml.net.interface_address \
        and hpcml.train_online is hpcml.train.train_online
    with pytest.raises(AttributeError, match="module 'hpcml' has no attribute 'nope'"):
        hpcml.nope  # noqa: B018


def module_imports(file_level: bool = True) -> dict[str, set[str]]:
    """Module -> the hpcml modules it imports, each as a dotted name: with ``file_level``, those
    imported when it is imported (not a function's, which run on use); else every import.
    ``if TYPE_CHECKING:`` imports never count."""
    modules = {".".join(("hpcml", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        top = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
        for node in (n for stmt in top if not (file_level and isinstance(stmt, (ast.FunctionDef, ast.ClassDef)))
                     for n in ast.walk(stmt)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:  # from pkg import module, or from module import name
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        out[name] = {m for m in found if m in modules and m != name}
    return out


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """The import loops among the modules of each package (a package's ``__init__`` left out:
    it re-exports its modules' names), each as ``a -> b -> a``."""
    inits = {m for m in graph if (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()}
    graph = {m: deps - inits for m, deps in graph.items() if m not in inits}
    found, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d.rpartition(".")[0] != m.rpartition(".")[0]:
                continue  # across packages: test_no_import_points_up_or_sideways
            if state.get(d) == 1:
                found.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


#: Loops closed only by an import inside a function (run on use): design debt, to shrink (issue 44).
LAZY_CYCLES = {
    "hpcml.ckpt.chunkmac -> hpcml.ckpt.keys -> hpcml.ckpt.shard -> hpcml.ckpt.chunkmac",
    "hpcml.ensemble.site -> hpcml.ensemble.parsl_build -> hpcml.ensemble.site",
    "hpcml.grid.mpi -> hpcml.grid.torch_dist -> hpcml.grid.mpi",
    "hpcml.models.transformer.config -> hpcml.models.transformer.presets -> hpcml.models.transformer.config",
    "hpcml.models.transformer.model -> hpcml.models.transformer.moe -> hpcml.models.transformer.model",
    "hpcml.models.transformer.model -> hpcml.models.transformer.parallelize -> hpcml.models.transformer.model",
}


def test_no_import_cycle_between_the_modules_of_a_package():
    """Issue 44: within a package no two modules import each other at file level, directly or
    round a longer loop; the loops that a function's import closes are only those known."""
    graph = module_imports()
    assert "hpcml.ckpt.pipeline" in graph["hpcml.ckpt.writer"]  # the walk sees the imports
    assert cycles(graph) == []
    assert set(cycles(module_imports(file_level=False))) <= LAZY_CYCLES
    assert cycles({"hpcml.x.a": {"hpcml.x.b"}, "hpcml.x.b": {"hpcml.x.a"}}) == ["hpcml.x.a -> hpcml.x.b -> hpcml.x.a"]
