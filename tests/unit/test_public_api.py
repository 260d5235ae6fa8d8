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
