"""Issue 24: checkpoints you can trust -- keys, bounded time and memory on every path, the
loaded step proven, one owner per directory. Every refusal is one line naming the value."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcml import ckpt, stop
from hpcml.ckpt import keys, lock, manifest, tools
from hpcml.ckpt.tiling import coverage
from hpcml.errors import CheckpointError, ConfigError

KEY = b"k" * 32
OTHER = b"o" * 32


def _tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"model/a": torch.randn(32, 8, generator=g) * scale, "model/b": torch.randn(8, 32, generator=g) * scale,
            "optim/c": torch.arange(12, dtype=torch.float32) * scale}


def _save(root: Path, step: int = 3, key=False, scale: float = 1.0) -> Path:
    res = ckpt.save(root, step, _tensors(scale), comm=MPI.COMM_SELF, extra={"step": step}, key=key)
    return res.path


def _load(path, key=None) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros_like(t) for n, t in _tensors().items()}
    ckpt.load(path, out, key=key)
    return out


def _rewrite(step: Path, edit) -> None:
    """Edit the manifest and recompute its own digest, keeping any signature: a consistent forger."""
    import hashlib

    m = json.loads((step / "manifest.json").read_text())
    m.pop("manifest_sha256")
    edit(m)
    m["manifest_sha256"] = hashlib.sha256(manifest._canonical(m)).hexdigest()
    (step / "manifest.json").write_bytes(manifest._canonical(m))


@contextmanager
def _deadline(seconds: int):
    def boom(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv(keys.ENV_KEY, raising=False)
    monkeypatch.delenv(keys.ENV_KEY_FILE, raising=False)


# -- keys -----------------------------------------------------------------------------------
def test_signed_checkpoint_verifies_only_with_its_key(tmp_path, monkeypatch):
    step = _save(tmp_path / "ck", key=KEY)
    assert torch.equal(_load(step, key=KEY)["model/a"], _tensors()["model/a"])
    assert tools.verify(step, key=KEY) == []
    with pytest.raises(CheckpointError, match="signed by key .* not among the keys configured"):
        _load(step, key=OTHER)
    monkeypatch.setenv(keys.ENV_KEY, OTHER.decode())  # the environment is the default for every reader
    problems = tools.verify(step)
    assert len(problems) == 1 and "not among the keys" in problems[0]
    monkeypatch.setenv(keys.ENV_KEY, f"{OTHER.decode()} {KEY.decode()}")  # rotation: the old key still verifies
    assert tools.verify(step) == []
    assert "checked" in tools.signature_note(step)
    monkeypatch.delenv(keys.ENV_KEY)
    assert "not checked: no key configured" in tools.signature_note(step)


def test_unsigned_refused_while_a_key_is_configured_and_sign_fixes_it(tmp_path, monkeypatch):
    step = _save(tmp_path / "ck")
    assert tools.signature_note(step) == "unsigned"
    monkeypatch.setenv(keys.ENV_KEY, KEY.decode())
    with pytest.raises(CheckpointError, match="is not signed, and a checkpoint key is configured"):
        _load(step)
    kid = tools.sign(step)
    assert kid == keys.key_id(keys.derive(KEY, "t"))
    assert torch.equal(_load(step)["optim/c"], _tensors()["optim/c"])


def test_consistent_forger_refused_with_a_key(tmp_path):
    """A changed dtype (digests recomputed) loads wrong values unsigned; a key refuses it."""
    plain = _save(tmp_path / "plain")
    signed = _save(tmp_path / "signed", key=KEY)

    _rewrite(plain, lambda m: m["tensors"]["optim/c"].update(dtype="int32"))
    # unsigned, recomputed digests are no defence; this one is refused all the same, since a float
    # tensor never takes an integer checkpoint's values (once loaded as wrong values)
    with pytest.raises(CheckpointError, match=r"of another kind .*'optim/c: checkpoint int32, model float32'"):
        _load(plain)
    _rewrite(signed, lambda m: m["tensors"]["optim/c"].update(dtype="int32"))
    with pytest.raises(CheckpointError, match="signature does not match"):
        _load(signed, key=KEY)
    signed2 = _save(tmp_path / "signed2", key=KEY)
    _rewrite(signed2, lambda m: m.pop("signature"))  # stripping the signature does not help
    with pytest.raises(CheckpointError, match="is not signed"):
        _load(signed2, key=KEY)


def test_bad_keys_one_line(tmp_path, monkeypatch):
    kf = tmp_path / "key"
    kf.write_text("short\n")
    kf.chmod(0o600)
    with pytest.raises(ConfigError, match="has 5 characters: expected at least 16"):
        keys.keyring(kf)
    kf.write_text("x" * 40 + "\n")
    kf.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 644: expected no access for group and others"):
        keys.keyring(kf)
    monkeypatch.setenv(keys.ENV_KEY_FILE, str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="checkpoint key file .*missing: no such file"):
        _save(tmp_path / "ck", key=None)
    assert not (tmp_path / "ck" / "step_00000003").exists()


def test_a_signed_step_rolled_back_or_of_another_run_is_refused(tmp_path):
    """Issue 40: with a key, an older signed step behind `latest`, or another run's signed step
    under the same key, passed before; each directory now has a signed id and newest step."""
    from hpcml.ckpt import rollback

    root, other = tmp_path / "ck", tmp_path / "other"
    _save(root, step=3, key=KEY)
    _save(root, step=5, key=KEY, scale=2.0)
    state = json.loads((root / rollback.STATE).read_text())
    assert state["step"] == 5 and len(state["root"]) == 32
    assert ckpt.Checkpoint(root, key=KEY).step == 5
    (root / "latest").write_text("step_00000003\n")  # pointed back by someone who can write the directory
    with pytest.raises(CheckpointError, match=r"latest names step 3, but step 5 was saved and signed here "
                                              r"\(signed_state\.json\): rolled back, refused"):
        ckpt.Checkpoint(root, key=KEY)
    assert ckpt.Checkpoint(root / "step_00000003", key=KEY).step == 3  # named explicitly: an earlier one, on purpose
    _save(other, step=7, key=KEY, scale=3.0)  # another run, the same key
    subprocess.run(["cp", "-r", str(other / "step_00000007"), str(root)], check=True)
    (root / "latest").write_text("step_00000007\n")
    for path in (root, root / "step_00000007"):
        with pytest.raises(CheckpointError, match=r"step_00000007 was saved in checkpoint directory [0-9a-f]{32}, "
                                                  r"not in this one .*: a step of another run copied in: refused"):
            ckpt.Checkpoint(path, key=KEY)
    assert ckpt.Checkpoint(root, key=False).step == 7  # without a key nothing is known: what the key buys
    state["step"] = 9  # the state itself edited: its signature says so
    (root / rollback.STATE).write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"signed_state\.json: the signature does not match its content"):
        ckpt.Checkpoint(root / "step_00000005", key=KEY)
    _save(root, step=11, key=KEY)  # a save goes on: a new signed state, with a warning
    assert json.loads((root / rollback.STATE).read_text())["step"] == 11 and ckpt.Checkpoint(root, key=KEY).step == 11


def _forge_first_chunk(step: Path, name: str) -> None:
    """The first chunk of ``name``: its first value 1000.0, its CRC-32 kept (benchmarks/ckpt_corpus.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckpt_corpus", Path(__file__).parents[2] / "benchmarks" /
                                                  "ckpt_corpus.py")
    corpus = sys.modules.get("ckpt_corpus") or importlib.util.module_from_spec(spec)
    if "ckpt_corpus" not in sys.modules:
        sys.modules["ckpt_corpus"] = corpus
        spec.loader.exec_module(corpus)
    corpus.forge_chunk(step, name)


def test_data_forged_under_its_crc_is_refused_with_a_key(tmp_path):
    """Issue 40: a signed checkpoint's chunks had only CRC-32s, which anyone who can write a
    shard can fit -- the forgery verified and loaded wrong values. Under a key each chunk has a
    keyed digest (AES-GMAC) too."""
    plain, signed = _save(tmp_path / "plain"), _save(tmp_path / "signed", key=KEY)
    m = json.loads((signed / "manifest.json").read_text())
    assert m["data_mac"]["alg"] == "aes256-gmac/v1" and len(m["data_mac"]["salt"]) == 32
    assert all(len(p["mac"]) == 32 * len(p["at"]) for t in m["tensors"].values() for p in t["pieces"])
    assert "data_mac" not in json.loads((plain / "manifest.json").read_text())
    for step in (plain, signed):
        _forge_first_chunk(step, "model/a")
    got = _load(plain)["model/a"]  # documented: without a key a CRC-32 is no defence against a writer
    assert got[0, 0].item() == 1000.0 and tools.verify(plain) == []
    with pytest.raises(CheckpointError, match=r"rank_00000\.h5 model/a\S*: chunk 0 at byte \d+ fails its keyed digest "
                                              r"\(aes256-gmac/v1\): changed after the save"):
        _load(signed, key=KEY)
    problems = tools.verify(signed, key=KEY)
    assert len(problems) == 1 and "model/a piece 0: chunk 0" in problems[0] and "keyed digest" in problems[0]
    assert tools.verify(signed, key=False) == []  # the CRCs still pass: the forgery is one they cannot see
    with ckpt.Checkpoint(signed, key=KEY) as ck:  # what was not touched still reads, checked
        assert np.array_equal(ck.read("model/b")[0], _tensors()["model/b"].numpy())


def test_a_keyed_reader_needs_chunk_digests_and_sign_adds_them(tmp_path):
    """A signed manifest without chunk MACs (an older hpcml's) is refused under a key, with the
    command that fixes it; `hpcml ckpt sign` tags every chunk (checking its CRC first) under a new salt."""
    step = _save(tmp_path / "ck", key=KEY)
    salt = json.loads((step / "manifest.json").read_text())["data_mac"]["salt"]

    def strip(m):
        m.pop("data_mac")
        for t in m["tensors"].values():
            for p in t["pieces"]:
                p.pop("mac")
        m["signature"] = keys.Keyring((keys.derive(KEY, "t"),), "t").sign(manifest._body(m))
    _rewrite(step, strip)
    with pytest.raises(CheckpointError, match=r"is signed, but its data chunks carry only CRC-32s.*"
                                              r"re-sign it: hpcml ckpt sign .*step_00000003"):
        _load(step, key=KEY)
    assert torch.equal(_load(step, key=False)["model/a"], _tensors()["model/a"])
    os.environ[keys.ENV_KEY] = KEY.decode()
    try:
        tools.sign(step)
    finally:
        del os.environ[keys.ENV_KEY]
    m = json.loads((step / "manifest.json").read_text())
    assert m["data_mac"]["salt"] != salt and len(m["data_mac"]["salt"]) == 32
    assert torch.equal(_load(step, key=KEY)["model/a"], _tensors()["model/a"])
    _forge_first_chunk(step, "optim/c")
    with pytest.raises(CheckpointError, match="fails its keyed digest"):
        _load(step, key=KEY)


def test_malformed_chunk_macs_refused_in_one_line(tmp_path):
    import shutil

    step = _save(tmp_path / "ck", key=KEY)
    for k, (edit, msg) in enumerate([(lambda m: m["tensors"]["model/a"]["pieces"][0].update(mac="zz"),
                                      "mac is 'zz': expected 32"),
                      (lambda m: m["data_mac"].update(alg="crc32"), "data_mac is .*: expected"),
                      (lambda m: m.pop("data_mac"), "a piece has chunk MACs, but the manifest names no data_mac")]):
        copy = tmp_path / f"c{k}" / step.name
        shutil.copytree(step, copy)
        _rewrite(copy, edit)
        with pytest.raises(CheckpointError, match=msg):
            ckpt.Checkpoint(copy, key=False)


def test_the_stream_secret_never_signs_checkpoints(tmp_path, monkeypatch):
    """Keys have roles (issue 40): every simulation holds the campaign's stream secret, so a
    checkpoint key that is it -- its file, its text, its bytes, a piece of it -- is refused."""
    from hpcml.stream import new_secret

    run = tmp_path / "run"
    run.mkdir()
    (run / "campaign_id.json").write_text("{}")
    secret = new_secret(run / "stream.key")
    text = (run / "stream.key").read_text().strip()
    with pytest.raises(ConfigError, match=r"checkpoint key from key file .*stream\.key "
                                          r"is the campaign's stream secret: "
                                          r"every simulation holds that secret, so it cannot sign checkpoints"):
        keys.keyring(run / "stream.key")  # beside campaign_id.json: a campaign's, even outside its jobs
    monkeypatch.setenv("HPCML_STREAM_SECRET_FILE", str(run / "stream.key"))
    own = tmp_path / "copy.key"
    for key_text in (text, text.upper(), "prefix-" + text, text[8:40]):
        own.write_text(key_text + "\n")
        own.chmod(0o600)
        with pytest.raises(ConfigError, match=r"is the campaign's stream secret \(or holds it\)"):
            keys.keyring(own)
    with pytest.raises(ConfigError, match=r"key= is the campaign's stream secret"):
        keys.keyring(secret)  # the bytes themselves
    monkeypatch.setenv(keys.ENV_KEY, "x" * 8 + text)
    with pytest.raises(ConfigError, match=r"HPCML_CKPT_KEY is the campaign's stream secret"):
        keys.keyring(None)
    monkeypatch.delenv(keys.ENV_KEY)
    own.write_text("a key of its own, 0123456789abcdef\n")
    assert keys.keyring(own).source == f"key file {own}"  # another key is taken


@pytest.mark.parametrize("edge", [b" ", b"\t", b"\n", b"\x0b", b"\x0c", b"\r"])
def test_stream_secret_bytes_with_whitespace_edges_are_still_refused(tmp_path, monkeypatch, edge):
    """A random 32-byte secret begins or ends with a whitespace byte about once in 20: those
    bytes given as key= are still the secret (CI caught a strip() that let them through)."""
    secret = edge + bytes(range(60, 92)) + edge  # holds A-Z, which lower() changes
    path = tmp_path / "stream.key"
    path.write_text(secret.hex())
    monkeypatch.setenv("HPCML_STREAM_SECRET_FILE", str(path))
    with pytest.raises(ConfigError, match=r"key= is the campaign's stream secret"):
        keys.keyring(secret)


# -- bounded before parsing -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["rank_00000.h5", "index.h5", "manifest.json", "latest"])
def test_fifo_under_a_checkpoint_name_is_refused_at_once(tmp_path, name):
    step = _save(tmp_path / "ck")
    target = (tmp_path / "ck" / name) if name == "latest" else step / name
    target.unlink()
    os.mkfifo(target)
    with _deadline(10):
        problems = tools.verify(tmp_path / "ck")
        with pytest.raises(CheckpointError) as e:
            _load(tmp_path / "ck")
    said = " ".join(problems)
    assert "FIFO" in said or ("latest" in said and name == "latest"), said
    assert "\n" not in str(e.value)


def test_a_kill_stops_a_long_read(tmp_path):
    step = _save(tmp_path / "ck")
    stop.request("SIGTERM")
    try:
        with pytest.raises(CheckpointError, match="stopped: SIGTERM arrived"):
            _load(step)
    finally:
        stop.clear()
    stop.request("SIGUSR1")  # the walltime warning lets reads go on (a save's read-back, a resume)
    try:
        assert torch.equal(_load(step)["model/a"], _tensors()["model/a"])
    finally:
        stop.clear()


def test_coverage_is_fast_and_exact():
    # the attack: 65,536 one-element pieces of a 32-dimensional tensor
    shape = (2,) * 16 + (1,) * 16
    boxes = [(list(np.unravel_index(i, shape)), [1] * 32) for i in range(1 << 16)]
    boxes = [([int(x) for x in o], s) for o, s in boxes]
    t = time.perf_counter()
    assert coverage(shape, boxes) is None
    assert time.perf_counter() - t < 5
    dup = boxes[:-1] + [boxes[0]]  # same volume, one element twice and one never
    assert "overlap" in coverage(shape, dup)
    assert "not covered" in coverage(shape, boxes[:-1])
    assert "overlap" in coverage((4, 4), [([0, 0], [2, 4]), ([1, 0], [2, 4])])
    # a pinwheel: disjoint, exact, not slabs -- small enough to be tested pairwise
    wheel = [([0, 0], [2, 1]), ([2, 0], [1, 2]), ([1, 2], [2, 1]), ([0, 1], [1, 2]), ([1, 1], [1, 1])]
    assert coverage((3, 3), wheel) is None
    # fused sub-parameters sharded over tp, times a dp split of the columns: nested slabs
    rows = [0, 3, 6, 8, 10, 12, 14]
    nested = [([a, c], [b - a, 4]) for a, b in zip(rows, rows[1:]) for c in (0, 4)]
    assert coverage((14, 8), nested) is None


def test_manifest_bounded_by_the_files_beside_it(tmp_path):
    step = _save(tmp_path / "ck")
    (step / "manifest.json").write_bytes(b" " * (manifest.FREE_MANIFEST_BYTES + 1))
    with pytest.raises(CheckpointError, match="larger than .* expected a manifest of this checkpoint"):
        _load(step)
    shard = next(p for p in step.iterdir() if manifest.FILE_RE.match(p.name))
    os.truncate(shard, 1 << 30)  # a shard made sparse: a GiB it does not hold makes no room (issue 40)
    (step / "manifest.json").write_bytes(b" " * (manifest.FREE_MANIFEST_BYTES + 1))
    with pytest.raises(CheckpointError, match=rf"{manifest.FREE_MANIFEST_BYTES + 1} bytes, larger than "
                                              rf"{manifest.FREE_MANIFEST_BYTES} bytes, expected a manifest of this "
                                              rf"checkpoint"):
        _load(step)


def test_huge_integers_refused(tmp_path):
    step = _save(tmp_path / "ck")
    _rewrite(step, lambda m: m["tensors"]["model/a"].update(shape=[10 ** 30, 8]))
    with pytest.raises(CheckpointError, match="expected an integer >= 0 and <= 4611686018427387904"):
        _load(step)


# -- the step is proven ---------------------------------------------------------------------
def test_old_copy_of_another_step_is_refused(tmp_path):
    root = tmp_path / "ck"
    s2 = _save(root, step=2)
    s2.rename(root / "step_00000006.old")
    (root / "latest").write_text("step_00000006\n")
    with pytest.raises(CheckpointError, match="step 2 saved in a directory named step_00000006.old"):
        _load(root)
    assert "step 2 saved in a directory named" in tools.verify(root)[0]


def test_extra_step_must_be_the_saved_step(tmp_path):
    step = _save(tmp_path / "ck", step=4)
    for bad in (-5, 999, 10 ** 30, "abc"):
        _rewrite(step, lambda m, bad=bad: m["extra"].update(step=bad))
        with pytest.raises(CheckpointError, match="extra step .* differs from the saved step 4"):
            _load(step)


def test_loop_extra_schema():
    from hpcml.train.resume_schema import check_loop_extra

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    for g in opt.param_groups:
        g["initial_lr"] = 1e-3
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    good = {"step": 5, "scheduler": sched.state_dict(), "schedule": {"steps": 10, "anchor": None},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}
    good = json.loads(json.dumps(good))
    check_loop_extra(good, 5, "ck", sched.state_dict(), opt.param_groups)
    cases = {"step": ({**good, "step": "abc"}, "extra\\['step'\\] is 'abc': expected the saved step 5"),
             "scheduler": ({k: v for k, v in good.items() if k != "scheduler"}, "extra\\['scheduler'\\] is None"),
             "groups": ({**good, "param_groups": []}, "extra\\['param_groups'\\] is \\[\\]"),
             "lambda": ({**good, "scheduler": {**good["scheduler"], "lr_lambdas": [{"x": 1}]}}, "scheduler"),
             "key": ({**good, "scheduler": {**good["scheduler"], "evil": 1}}, "keys among"),
             "schedule": ({**good, "schedule": {"steps": -1}}, "schedule"),
             "warmup": ({**good, "schedule": {"steps": 10, "anchor": None, "warmup": -3}}, "'warmup' \\(if set\\)"),
             "warmup-type": ({**good, "schedule": {"steps": 10, "anchor": None, "warmup": 2.5}}, "schedule")}
    check_loop_extra({**good, "schedule": {"steps": 10, "anchor": None, "warmup": 3}}, 5, "ck", sched.state_dict(),
                     opt.param_groups)  # a warmup PBT set is kept
    for what, (extra, msg) in cases.items():
        with pytest.raises(CheckpointError, match=msg):
            check_loop_extra(extra, 5, "ck", sched.state_dict(), opt.param_groups)


# -- one owner per directory ----------------------------------------------------------------
_HOLDER = """
import sys, time
from hpcml.ckpt import lock
lock.hold(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def test_second_job_refused_naming_the_owner_then_stale_lock_recovered(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "SLURM_JOB_ID": "4242"})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"being saved to by another job \\(pid {holder.pid} on .*job 4242"):
            _save(root)
        assert not (root / "step_00000003").exists()
    finally:
        holder.kill()
        holder.wait()
    assert torch.equal(_load(_save(root))["model/a"], _tensors()["model/a"])  # the owner is gone: taken over
    owner = json.loads((root / lock.LOCK).read_text())
    assert owner["pid"] == os.getpid()
    lock.release(root)


# -- model configs bounded by the files -----------------------------------------------------
def test_hf_config_bounded_by_its_safetensors(tmp_path):
    from safetensors.torch import save_file

    from hpcml.interop.hf import config_from_hf

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(8, 8)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 65536, "num_hidden_layers": 64,
                                               "num_attention_heads": 64, "intermediate_size": 4,
                                               "vocab_size": 32, "max_position_embeddings": 16}))
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match="describes .* parameters .* its safetensors hold"):
        config_from_hf(d)
    assert time.perf_counter() - t < 2


def test_export_hf_config_bounded_by_the_checkpoint(tmp_path):
    from hpcml.models.transformer import TransformerConfig
    from hpcml.interop.hf import config_from_checkpoint

    cfg = TransformerConfig.preset("tiny")
    for fields in ({"n_layers": 10 ** 6}, {"dim": 1 << 20, "n_heads": 1, "n_kv_heads": 1}):
        bad = {**cfg.to_dict(), **fields}
        root = tmp_path / f"ck{len(str(fields))}"
        ckpt.save(root, 1, _tensors(), comm=MPI.COMM_SELF, extra={"model": {"type": "transformer", "config": bad}})
        t = time.perf_counter()
        with pytest.raises((CheckpointError, ConfigError)) as e:
            config_from_checkpoint(root)
        assert time.perf_counter() - t < 2 and "\n" not in str(e.value)


def test_a_lock_file_nested_deep_is_no_owner_not_a_crash(tmp_path):
    """The lock names its owner in JSON another job may have written: 4,000 nested brackets (a
    RecursionError out of ``json.loads`` before) are read as no owner, and the save goes on."""
    root = tmp_path / "ck"
    root.mkdir()
    (root / lock.LOCK).write_text("[" * 4000)
    assert torch.equal(_load(_save(root))["model/a"], _tensors()["model/a"])
    assert json.loads((root / lock.LOCK).read_text())["pid"] == os.getpid()
    lock.release(root)


def test_sign_never_leaves_a_checkpoint_its_reader_refuses(tmp_path, monkeypatch):
    """A signature and the chunks' digests add bytes to the manifest: a checkpoint whose manifest
    is just under what a reader takes (a large ``extra``) is refused signing in one line, its
    manifest unchanged and still loadable -- it was once replaced by one no load could open."""
    probe = ckpt.save(tmp_path / "probe", 3, _tensors(), comm=MPI.COMM_SELF, extra={"step": 3, "note": ""}).path
    room = manifest.FREE_MANIFEST_BYTES - (probe / "manifest.json").stat().st_size
    step = ckpt.save(tmp_path / "ck", 3, _tensors(), comm=MPI.COMM_SELF,
                     extra={"step": 3, "note": "x" * (room - 40)}).path
    before = (step / "manifest.json").read_bytes()
    assert manifest.FREE_MANIFEST_BYTES - len(before) in range(1, 100)  # under the limit by < 100 bytes
    monkeypatch.setenv(keys.ENV_KEY, KEY.decode())
    with pytest.raises(CheckpointError, match=r"not signing .*manifest would be \d+ bytes, more than a reader takes "
                                              r".*\(8388608\).*it stays as it was$"):
        tools.sign(step)
    assert (step / "manifest.json").read_bytes() == before
    monkeypatch.delenv(keys.ENV_KEY)
    assert torch.equal(_load(step)["model/a"], _tensors()["model/a"])
    assert tools.verify(step) == []
