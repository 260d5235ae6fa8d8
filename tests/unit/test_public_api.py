"""``import hpcml`` gives the main names lazily: nothing heavy at import, every name real."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hpcml


def test_import_hpcml_loads_neither_torch_nor_mpi_nor_parsl():
    code = ("import sys, hpcml; heavy = [m for m in ('torch', 'mpi4py', 'parsl', 'h5py', 'zmq') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("name", [n for n in hpcml.__all__ if n != "__version__"])
def test_every_public_name_is_the_library_object(name):
    obj = getattr(hpcml, name)
    assert obj.__module__.startswith("hpcml."), (name, obj.__module__)
    assert obj.__name__ == name
    assert name in dir(hpcml)


def test_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="module 'hpcml' has no attribute 'nope'"):
        hpcml.nope  # noqa: B018


PACKAGES = ("hpcml.ckpt", "hpcml.ensemble", "hpcml.grid", "hpcml.stream")


def test_internals_are_not_exported():
    import hpcml.ensemble
    import hpcml.ensemble.campaign
    import hpcml.grid
    import hpcml.stream

    assert "announce_done" not in hpcml.stream.__all__ and not hasattr(hpcml.stream, "announce_done")
    assert hpcml.ensemble.campaign.__all__ == ["Campaign", "CampaignResult", "SimSpec", "TrainingJob"]
    assert "CORE_AXES" not in hpcml.grid.__all__
    assert not {"CANCEL_FILE", "RESULT_MARKER", "SIMS_DONE_FILE"} & set(hpcml.ensemble.__all__)


def _library_imports(path) -> list[tuple[str, str]]:
    """(module, name) of every ``from hpcml.X... import name`` in a file."""
    import ast

    return [(node.module, a.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hpcml.")
            for a in node.names]


def test_every_name_the_workflows_import_is_exported_by_its_package():
    """A workflow is what a user writes: what it needs from ckpt, ensemble, grid and stream
    (even through a submodule) is in that package's ``__all__``."""
    import importlib
    from pathlib import Path

    workflows = sorted((Path(__file__).resolve().parents[2] / "workflows").glob("*.py"))
    assert workflows
    missing = []
    for path in workflows:
        for module, name in _library_imports(path):
            package = ".".join(module.split(".")[:2])
            if package not in PACKAGES:
                continue
            pkg = importlib.import_module(package)
            if name not in pkg.__all__ or getattr(pkg, name) is not getattr(importlib.import_module(module), name):
                missing.append(f"{path.name}: {module}.{name} is not {package}.{name} in its __all__")
    assert missing == []


def _doc_imports() -> list[tuple[str, int, str, list[str]]]:
    """(file, line, module, names) of every ``from hpcml... import ...`` line of the docs and README."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = []
    for md in [*sorted((root / "docs").glob("*.md")), root / "README.md"]:
        for k, line in enumerate(md.read_text().splitlines()):
            m = re.match(r"\s*from (hpcml(?:\.\w+)*) import ([\w, ]+?)\s*(#.*)?$", line)
            if m:
                out.append((md.name, k + 1, m.group(1), [n.strip() for n in m.group(2).split(",") if n.strip()]))
    return out


def _wrong_paths(found: list[tuple[str, int, str, list[str]]]) -> list[str]:
    import importlib

    wrong = []
    for md, line, module, names in found:
        mod = importlib.import_module(module)
        package = importlib.import_module(".".join(module.split(".")[:2]))
        for name in names:
            if not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                wrong.append(f"{md}:{line}: {module} has no {name}")
            elif package is not mod and name in package.__all__ and getattr(package, name) is getattr(mod, name, None):
                wrong.append(f"{md}:{line}: {module}.{name} is {package.__name__}.{name}: import it from there")
    return wrong


def test_the_docs_import_every_name_from_one_path_that_exists():
    """Issue 44: a name a package exports is imported, in the docs, from that package, never
    from the module inside it that defines it (one path per name); and every import resolves."""
    found = _doc_imports()
    assert len(found) > 30  # the walk sees the docs' imports
    assert _wrong_paths(found) == []
    assert _wrong_paths([("x.md", 1, "hpcml.ensemble.breed", ["Breed"]), ("x.md", 2, "hpcml.stream", ["Nope"])]) == [
        "x.md:1: hpcml.ensemble.breed.Breed is hpcml.ensemble.Breed: import it from there",
        "x.md:2: hpcml.stream has no Nope"]


def test_the_readme_names_every_root_name():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [n for n in hpcml.__all__ if n != "__version__" and not re.search(rf"`{n}`", readme)] == []
