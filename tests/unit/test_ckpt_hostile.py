"""A checkpoint is untrusted input: a corpus of crafted and bit-flipped checkpoints, each
refused with one line by verify, by resume (load) and by export -- never silent wrong
values, never a native crash or a traceback, never a read outside the checkpoint directory."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcml import ckpt
from hpcml.ckpt import format as fmt, tools
from hpcml.ckpt.pipeline import index_and_commit, local_pieces, plan_pending, write_local
from hpcml.errors import CheckpointError

STATE = {0: {"model/tok_embeddings.weight": torch.randn(64, 16, generator=torch.Generator().manual_seed(1)),
             "model/layers.0.w": torch.randn(16, 48, generator=torch.Generator().manual_seed(2)),
             "optim/step": torch.tensor(6.0)},
         1: {"model/layers.1.w": torch.randn(48, 16, generator=torch.Generator().manual_seed(3)),
             "model/output.weight": torch.randn(64, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)}}
EXTRA = {"step": 6, "param_groups": [{"lr": 3e-4}]}


def _save(root: Path, step: int = 6, scale: float = 1.0) -> Path:
    """Two ranks' real save steps (plan, shards, index, manifest, commit) with the two MPI
    collectives done by hand: a checkpoint with two shard files."""
    stages = [{n: t * scale if t.is_floating_point() else t for n, t in STATE[r].items()} for r in (0, 1)]
    pieces = [local_pieces(t) for t in stages]
    parts = [(p[0], {n for n, t in ts.items() if t.dim() == 0}, "%032x" % step) for p, ts in zip(pieces, stages)]
    pending = [plan_pending(r, 2, None, root, step, pieces[r], parts, extra={**EXTRA, "step": step}, layout={"pp": 2},
                        keep=None, tensor_attrs=None, snapshot=True, t0=0.0) for r in range(2)]
    statuses = [write_local(p) for p in pending]
    gathered = [(s, {n: p.placements[n] for n in {c.name for c in p.mine}}) for s, p in zip(statuses, pending)]
    assert index_and_commit(pending[0], gathered) is None
    return root / fmt.step_dir(step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ref")
    _save(root, 5, scale=2.0)  # an older step, for stale and swapped files
    _save(root, 6)
    return root


def _copy(reference: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ck"
    shutil.copytree(reference, root, symlinks=True)
    return root, root / "step_00000006"


def _want() -> dict[str, torch.Tensor]:
    return {n: t.clone() for r in (0, 1) for n, t in STATE[r].items()}


def _outcomes(root: Path, tmp_path: Path) -> dict[str, str | None]:
    """Each of verify, load and export: None when it gave the reference values (or found
    nothing wrong), else its one-line refusal. Any other exception fails the test."""
    out: dict[str, str | None] = {}
    problems = tools.verify(root)
    out["verify"] = "; ".join(problems) or None
    dst = {n: torch.zeros_like(t) for n, t in _want().items()}
    try:
        report = ckpt.load(root, dst)
        assert all(torch.equal(dst[n], t) for n, t in _want().items()), "load gave wrong values silently"
        assert report.extra == EXTRA and report.step == 6, f"load gave wrong extra silently: {report.extra}"
        out["load"] = None
    except CheckpointError as e:
        out["load"] = str(e)
    try:
        weights = tools.model_weights(root)
        assert all(torch.equal(weights[n[len("model/"):]], t) for n, t in _want().items() if n.startswith("model/"))
        out["export"] = None
    except CheckpointError as e:
        out["export"] = str(e)
    for what, why in out.items():
        assert why is None or "\n" not in why, (what, why)
    return out


def _refused(root: Path, tmp_path: Path, *, every: bool = True) -> dict:
    out = _outcomes(root, tmp_path)
    assert out["verify"] is not None, out
    if every:
        assert out["load"] is not None and out["export"] is not None, out
    return out


def test_the_reference_is_sound(reference, tmp_path):
    root, _ = _copy(reference, tmp_path)
    assert _outcomes(root, tmp_path) == {"verify": None, "load": None, "export": None}
    with h5py.File(root / "step_00000006" / "index.h5") as f:  # any HDF5 tool reads the whole tensors
        assert np.array_equal(f["model/layers.1.w"][()], STATE[1]["model/layers.1.w"].numpy())


class Tripwire:
    """A FIFO that must never be opened: a thread waits to write into it and records
    whether any reader (HDF5 or Python) ever opened it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        self.opened = self._checking = False
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        with open(self.path, "wb"):  # blocks until somebody opens the FIFO for reading
            self.opened = not self._checking

    def check(self) -> None:
        self._checking = True
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # release the writer
        self._thread.join(5)
        os.close(fd)
        assert not self.opened, f"{self.path} outside the checkpoint was opened"


def _rewrite_dataset(shard: Path, dataset: str, **create) -> None:
    """The corpus's (benchmarks/ckpt_corpus.py) rewrite: the dataset again, with ``create``'s storage."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckpt_corpus", Path(__file__).resolve().parents[2] / "benchmarks"
                                                  / "ckpt_corpus.py")
    corpus = sys.modules.get("ckpt_corpus") or importlib.util.module_from_spec(spec)
    if "ckpt_corpus" not in sys.modules:
        sys.modules["ckpt_corpus"] = corpus
        spec.loader.exec_module(corpus)
    corpus._rewrite_dataset(shard, dataset, **create)


def _manifest(step: Path) -> dict:
    m = json.loads((step / "manifest.json").read_text())
    m.pop("manifest_sha256")
    return m


def _write_manifest(step: Path, m: dict) -> None:
    from hpcml.ckpt import manifest

    manifest.write(step / "manifest.json", m)  # a consistent digest: only the checks below the digest can refuse


def test_external_storage_and_links_never_read_outside(reference, tmp_path):
    root, step = _copy(reference, tmp_path)
    wire = Tripwire(tmp_path / "environ")
    shard = step / "rank_00000.h5"
    _rewrite_dataset(shard, "model/layers.0.w/@0_0", external=[(str(wire.path), 0, h5py.h5f.UNLIMITED)])
    _refused(root, tmp_path)
    # an external link and a VDS source outside the directory in index.h5
    root2, step2 = _copy(reference, tmp_path / "b")
    with h5py.File(step2 / "index.h5", "a") as f:
        del f["model/layers.1.w"]
        f["model/layers.1.w"] = h5py.ExternalLink(str(wire.path), "/x")
        layout = h5py.VirtualLayout(shape=(64, 16), dtype=np.float32)
        layout[:] = h5py.VirtualSource("../../outside.h5", "x", shape=(64, 16))
        del f["model/tok_embeddings.weight"]
        f.create_virtual_dataset("model/tok_embeddings.weight", layout)
    out = _refused(root2, tmp_path)
    assert "index.h5" in out["load"]
    wire.check()


def test_symlinks_and_latest_leading_out(reference, tmp_path):
    root, step = _copy(reference, tmp_path)
    outside = tmp_path / "elsewhere.h5"
    shutil.copy(step / "rank_00001.h5", outside)
    (step / "rank_00001.h5").unlink()
    (step / "rank_00001.h5").symlink_to(outside)
    out = _refused(root, tmp_path)
    assert "symlink" in out["load"]
    for name in ("../ck/step_00000006", "/etc", "step_6", "step_00000006/../step_00000005", "x" * 300):
        root, _ = _copy(reference, tmp_path / f"l{len(name)}")
        (root / "latest").write_text(name + "\n")
        with pytest.raises(CheckpointError, match=r"latest (names|is)|latest: \d+ bytes, larger than 256 bytes, "
                                                  r"expected a step name"):
            ckpt.load(root, _want())
    root, step = _copy(reference, tmp_path / "d")  # a step directory that is a symlink
    shutil.move(step, tmp_path / "moved")
    step.symlink_to(tmp_path / "moved")
    with pytest.raises(CheckpointError, match="symlink"):
        ckpt.load(root, _want())


def test_stale_swapped_and_edited_files(reference, tmp_path):
    # a shard of the same size from another step
    root, step = _copy(reference, tmp_path / "a")
    shutil.copy(reference / "step_00000005" / "rank_00000.h5", step / "rank_00000.h5")
    assert (step / "rank_00000.h5").stat().st_size == (reference / "step_00000006" / "rank_00000.h5").stat().st_size
    _refused(root, tmp_path)
    # a stale index, a stale manifest (rolls the step back), another save's manifest and index together
    for files in (["index.h5"], ["manifest.json"], ["manifest.json", "index.h5"]):
        root, step = _copy(reference, tmp_path / "-".join(files))
        for f in files:
            shutil.copy(reference / "step_00000005" / f, step / f)
        out = _refused(root, tmp_path)
        assert "another step" in out["load"] or "index.h5" in out["load"], out
    # digits edited in the JSON state: lr and step
    for old, new in (('"lr":0.0003', '"lr":0.0009'), ('"step":6', '"step":1')):
        root, step = _copy(reference, tmp_path / new)
        text = (step / "manifest.json").read_text()
        assert old in text
        (step / "manifest.json").write_text(text.replace(old, new, 1))
        assert "edited or corrupted" in _refused(root, tmp_path)["load"]


def test_a_consistent_manifest_cannot_reach_past_the_disk(reference, tmp_path):
    """Edits below a recomputed manifest digest: the field checks still refuse what the
    writer never makes, before anything is allocated or read."""
    edits = {
        "8 GiB declared": lambda m: m["tensors"]["model/layers.0.w"].update(shape=[1 << 20, 2048]),
        "piece larger than the file": lambda m: m["tensors"]["model/layers.0.w"]["pieces"][0].update(
            shape=[1 << 20, 48], chunk=[1 << 20, 48]),
        "chunk beyond the file": lambda m: m["tensors"]["model/layers.0.w"]["pieces"][0]["at"].__setitem__(0, 1 << 40),
        "overlapping chunks": lambda m: m["tensors"]["model/layers.0.w"]["pieces"][0]["at"].__setitem__(
            1, m["tensors"]["model/layers.0.w"]["pieces"][0]["at"][0]),
        "file outside": lambda m: m["tensors"]["model/layers.0.w"]["pieces"][0].update(file="../rank_00000.h5"),
        "unlisted file": lambda m: m["tensors"]["model/layers.0.w"]["pieces"][0].update(file="rank_00007.h5"),
        "absolute tensor name": lambda m: m["tensors"].update({"/etc/x": m["tensors"].pop("optim/step")}),
        "format 1": lambda m: m.update(format_version="1.1"),
        "negative step": lambda m: m.update(step=-1),
        "bool as int": lambda m: m["tensors"]["optim/step"].update(shape=[True]),
        "unknown dtype": lambda m: m["tensors"]["optim/step"].update(dtype="object"),
        "no index": lambda m: m["files"].pop("index.h5"),
    }
    for what, edit in edits.items():
        root, step = _copy(reference, tmp_path / what.replace(" ", "_"))
        m = _manifest(step)
        edit(m)
        _write_manifest(step, m)
        out = _refused(root, tmp_path)
        assert out["load"].startswith(f"{step / 'manifest.json'}: "), (what, out)


def test_lone_index_and_missing_shards(reference, tmp_path):
    root, step = _copy(reference, tmp_path)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(step / "index.h5", alone / "index.h5")
    with pytest.raises(CheckpointError, match=r"has index.h5 but no manifest.json: a lone index"):
        ckpt.load(alone, _want())
    with h5py.File(alone / "index.h5") as f:  # what plain HDF5 tools do: fill values, no error (docs/checkpoints.md)
        assert not f["model/layers.0.w"][()].any()
    (step / "rank_00001.h5").unlink()
    out = _refused(root, tmp_path)
    assert "rank_00001.h5" in out["load"] and "rank_00001.h5: missing" in out["verify"]


FLIPS = {"rank_00000.h5": 70, "rank_00001.h5": 50, "index.h5": 50, "manifest.json": 50}


def test_random_bit_flips_in_every_kind_of_file(reference, tmp_path):
    """220 single-bit flips anywhere in shards (data and HDF5 metadata), index and manifest:
    each is refused by verify; load and export refuse it or return exactly the saved values
    (a flip in index.h5 leaves them intact but is still refused, since index.h5 is checked)."""
    rng = random.Random(11)
    root, step = _copy(reference, tmp_path)
    pristine = {f: (step / f).read_bytes() for f in FLIPS}
    refused = {"verify": 0, "load": 0, "export": 0}
    for file, n in FLIPS.items():
        for _ in range(n):
            data = bytearray(pristine[file])
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
            (step / file).write_bytes(bytes(data))
            out = _outcomes(root, tmp_path)
            assert out["verify"] is not None, (file, pos)
            for k, v in out.items():
                refused[k] += v is not None
        (step / file).write_bytes(pristine[file])
    total = sum(FLIPS.values())
    assert refused == {"verify": total, "load": total, "export": total}


def test_cli_verify_one_line_and_exit_code(reference, tmp_path):
    root, step = _copy(reference, tmp_path)
    data = bytearray((step / "rank_00001.h5").read_bytes())
    data[_manifest(step)["tensors"]["model/layers.1.w"]["pieces"][0]["at"][0] + 5] ^= 0xFF  # in a data chunk
    (step / "rank_00001.h5").write_bytes(bytes(data))
    hpcml = str(Path(sys.executable).parent / "hpcml")
    r = subprocess.run([hpcml, "ckpt", "verify", str(root)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert "fails its CRC-32" in r.stdout + r.stderr
    r = subprocess.run([hpcml, "ckpt", "export", str(root), str(tmp_path / "m.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "m.safetensors").exists()
