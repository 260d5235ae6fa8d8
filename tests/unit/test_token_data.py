"""Issue 43, first part: the token file -- packed from .npy, .jsonl and text, read by partial
reads in a seeded order, and read as untrusted input (a one-line refusal, before libhdf5 or
a training step sees anything)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcml.data import DataError, TokenDataset, pack
from hpcml.errors import ConfigError

SELF = MPI.COMM_SELF


def _docs(tmp_path, n=40, vocab=300):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab - 1, rng.integers(5, 400)) for _ in range(n)]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for d in docs[: n // 2]:
            f.write(json.dumps({"tokens": d.tolist()}) + "\n")
    for k, d in enumerate(docs[n // 2:]):
        np.save(tmp_path / f"doc_{k:03d}.npy", d.astype(np.int32))
    return docs, [tmp_path / "docs.jsonl", *sorted(tmp_path.glob("doc_*.npy"))]


def test_packed_tokens_are_the_documents_end_to_end_each_ended(tmp_path):
    docs, sources = _docs(tmp_path)
    m = pack(tmp_path / "c.h5", sources, vocab_size=300, eod=299, comm=SELF)
    want = np.concatenate([np.append(d, 299) for d in docs])
    ds = TokenDataset(tmp_path / "c.h5", seq_len=32)
    assert (m.n_docs, m.n_tokens, m.dtype.name) == (40, want.size, "uint16")
    assert np.array_equal(ds.tokens(0, m.n_tokens), want)
    with h5py.File(tmp_path / "c.h5") as f:  # any HDF5 tool reads it
        assert np.array_equal(f["tokens"][:], want) and f["doc_offsets"][-1] == want.size
        assert np.array_equal(np.diff(f["doc_offsets"][:]), [d.size + 1 for d in docs])
        assert f.attrs["format"] == "hpcml-tokens/1" and f.attrs["vocab_size"] == 300
    assert not list(tmp_path.glob(".c.h5*"))  # no temporary left


def test_text_with_the_bytes_tokenizer_and_a_large_vocabulary_in_uint32(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\n")
    m = pack(tmp_path / "t.h5", [tmp_path / "a.txt"], tokenizer="bytes", comm=SELF)
    assert list(TokenDataset(tmp_path / "t.h5", seq_len=2).tokens(0, m.n_tokens)) == [*"héllo\n".encode(), 256]
    np.save(tmp_path / "big.npy", np.array([70000, 3, 5]))
    m = pack(tmp_path / "u.h5", [tmp_path / "big.npy"], vocab_size=100_000, eod=0, comm=SELF)
    assert m.dtype.name == "uint32" \
        and list(TokenDataset(tmp_path / "u.h5", seq_len=2).tokens(0, 4)) == [70000, 3, 5, 0]


def test_each_epoch_visits_every_sequence_once_in_a_seeded_order(tmp_path):
    _, sources = _docs(tmp_path)
    pack(tmp_path / "c.h5", sources, vocab_size=300, eod=299, comm=SELF)
    ds = TokenDataset(tmp_path / "c.h5", seq_len=16, seed=5)
    w = ds.windows
    per_step = 7
    ids = [i for s in range(-(-2 * w // per_step)) for i in ds.sample_ids(s, per_step)][:2 * w]
    assert sorted(k for e, k in ids if e == 0) == list(range(w)) == sorted(k for e, k in ids if e == 1)
    assert [k for e, k in ids if e == 0] != [k for e, k in ids if e == 1]  # a new order each epoch
    assert ds.sample_ids(3, 8) == TokenDataset(tmp_path / "c.h5", seq_len=16, seed=5).sample_ids(3, 8)
    assert ds.sample_ids(3, 8) != TokenDataset(tmp_path / "c.h5", seq_len=16, seed=6).sample_ids(3, 8)
    assert ds.sample_ids(3, 8, 2, 5) == ds.sample_ids(3, 8)[2:5]  # a dp slice is part of the global batch
    b = ds.global_batch(3, 8)
    (e, k), = ds.sample_ids(3, 8, 1, 2)
    assert b.shape == (8, 17) and b.dtype.is_floating_point is False
    assert np.array_equal(b[1].numpy(), ds.tokens(k * 16, 17))  # a window and its next-token targets


@pytest.fixture
def packed(tmp_path):
    _, sources = _docs(tmp_path)
    pack(tmp_path / "c.h5", sources, vocab_size=300, eod=299, comm=SELF)
    return tmp_path / "c.h5"


def _edit_manifest(path, **kw):
    mpath = path.with_name(path.name + ".json")
    rec = json.loads(mpath.read_text())
    rec.update(kw)
    mpath.write_text(json.dumps(rec))


@pytest.mark.parametrize("edit, msg", [
    (dict(format="other/9"), r"format 'other/9', expected 'hpcml-tokens/1'"),
    (dict(file="../c.h5"), r"file '\.\./c\.h5': expected a file name beside the manifest"),
    (dict(file="/etc/passwd"), r"file '/etc/passwd': expected a file name beside the manifest"),
    (dict(n_tokens=10**12), r"/tokens at bytes \d+ to \d+ passes the file's size"),
    (dict(tokens_offset=-1), r"tokens_offset=-1: expected an int >= 0"),
    (dict(dtype="float32"), r"dtype 'float32': expected one of \['uint16', 'uint32'\]"),
    (dict(eod=300), r"eod 300 is not a token id of the vocabulary \(300\)"),
    (dict(size=5), r"/tokens at bytes \d+ to \d+ passes the file's size 5"),
])
def test_a_manifest_that_lies_is_refused_in_one_line(packed, edit, msg):
    _edit_manifest(packed, **edit)
    with pytest.raises(DataError, match=r"^token manifest .*c\.h5\.json: " + msg):
        TokenDataset(packed, seq_len=16)


def test_what_is_not_the_packed_file_is_refused_in_one_line(packed, tmp_path):
    ds = TokenDataset(packed, seq_len=16)
    with open(packed, "r+b") as f:  # one byte of the tokens flipped: its block's CRC says so
        f.seek(ds.m.tokens_offset + 10)
        b = f.read(1)
        f.seek(ds.m.tokens_offset + 10)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(DataError, match=r"block 0 \(tokens 0 to \d+\) does not match its CRC-32: the file is "
                                        r"corrupted; pack it again or restore it$"):
        TokenDataset(packed, seq_len=16).tokens(0, 5)
    with open(packed, "ab") as f:
        f.write(b"x")
    with pytest.raises(DataError, match=r"has \d+ bytes, its manifest says \d+: not the file that was packed"):
        TokenDataset(packed, seq_len=16)
    os.replace(packed, tmp_path / "elsewhere.h5")
    os.symlink(tmp_path / "elsewhere.h5", packed)
    with pytest.raises(DataError, match=r"^token file .*c\.h5: is a symbolic link; expected a regular file"):
        TokenDataset(packed, seq_len=16)
    packed.unlink()
    os.mkfifo(packed)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(DataError, TokenDataset, packed, seq_len=16)))
    t.start()
    t.join(10)
    assert done, "a FIFO under the token file's name blocked the reader"
    packed.unlink()
    with pytest.raises(DataError, match=r"c\.h5: no such file \(named by its manifest\)"):
        TokenDataset(packed, seq_len=16)
    with pytest.raises(DataError) as e:  # a newcomer's mistakes: named as given, with the command that makes one
        TokenDataset(tmp_path / "nope.h5", seq_len=16)
    assert str(e.value) == (f"token data {tmp_path / 'nope.h5'}: no such file; expected a token file written by "
                            f"'hpcml data pack OUT.h5 SOURCES...' (OUT.h5 with OUT.h5.json beside it; text sources "
                            f"with --tokenizer bytes or a Hugging Face tokenizer directory)")
    (tmp_path / "corpus.txt").write_text("plain text\n")
    with pytest.raises(DataError, match=r"corpus\.txt: no manifest corpus\.txt\.json beside it: not a packed token "
                                        r"file; expected a token file written by 'hpcml data pack"):
        TokenDataset(tmp_path / "corpus.txt", seq_len=16)
    with pytest.raises(DataError, match=r": a directory; expected a token file written by"):
        TokenDataset(tmp_path, seq_len=16)


def test_a_token_id_outside_the_vocabulary_is_named_with_its_position(packed):
    _edit_manifest(packed, vocab_size=100, eod=99)  # ids up to 298 were packed
    ds = TokenDataset(packed, seq_len=16)
    first = int(np.argmax(np.asarray(h5py.File(packed)["tokens"][:]) >= 100))
    with pytest.raises(DataError, match=rf"token id \d+ at position {first} is outside the vocabulary of 100$"):
        ds.tokens(0, first + 1)
    with pytest.raises(DataError, match=r"hold no sequence of 100000 \+ 1 tokens"):
        TokenDataset(packed, seq_len=100_000)


@pytest.mark.parametrize("make, kw, msg", [
    (lambda d: np.save(d / "x.npy", np.zeros((2, 2), np.int64)), {}, r"x\.npy: a 2-D int64 array; expected a 1-D"),
    (lambda d: np.save(d / "x.npy", np.array([1, 2, 400])), {},
     r"x\.npy: token id 400 is outside the vocabulary of 300"),
    (lambda d: (d / "x.jsonl").write_text('{"tokens": [1, 2]}\n{"tokens": [1.5]}\n'), {},
     r"x\.jsonl line 2: tokens must be integers"),
    (lambda d: (d / "x.jsonl").write_text('{"text": "hi"}\n'), {}, r'x\.jsonl line 1: expected \{"tokens": \[ids\]\} '
                                                                   r'\(or \{"text": \.\.\.\} with --tokenizer\)'),
    (lambda d: (d / "x.txt").write_text("hi"), {}, r"x\.txt: text needs a tokenizer \(--tokenizer bytes"),
    (lambda d: (d / "x.txt").write_text("hi"), {"vocab_size": None, "eod": None},  # a newcomer's first pack: the
     r"x\.txt: text needs a tokenizer \(--tokenizer bytes"),  # tokenizer is what is missing, not a vocabulary
    (lambda d: np.save(d / "x.npy", np.array([1])), {"vocab_size": None}, r"token ids need their vocabulary: give "
                                                                          r"--vocab-size N and --eod ID"),
    (lambda d: np.save(d / "x.npy", np.array([1])), {"eod": 300}, r"eod 300: expected a token id of the vocabulary"),
])
def test_bad_sources_are_refused_in_one_line_and_nothing_is_written(tmp_path, make, kw, msg):
    make(tmp_path)
    src = next(p for p in tmp_path.iterdir() if p.name.startswith("x."))
    args = {"vocab_size": 300, "eod": 299} | kw
    with pytest.raises(ConfigError, match=msg):
        pack(tmp_path / "out.h5", [src], comm=SELF, **args)
    assert not list(tmp_path.glob("*out.h5*"))


def test_gzip_compressed_jsonl_shards_pack_as_their_inflated_lines(tmp_path, monkeypatch):
    """Corpora ship as ``*.jsonl.gz`` shards: the same tokens as the .jsonl they inflate to;
    a truncated shard, one that inflates past the bounds, or a line too long is one line."""
    import gzip

    from hpcml.data import pack as pack_mod

    docs, sources = _docs(tmp_path)
    raw = sources[0].read_bytes()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    one = pack(tmp_path / "plain.h5", [sources[0]], vocab_size=300, eod=299, comm=SELF)
    two = pack(tmp_path / "gz.h5", [tmp_path / "a.jsonl.gz"], vocab_size=300, eod=299, comm=SELF)
    assert two.n_docs == one.n_docs == 20 and two.n_tokens == one.n_tokens
    a, b = TokenDataset(one.path, seq_len=8), TokenDataset(two.path, seq_len=8)
    assert np.array_equal(a.tokens(0, one.n_tokens), b.tokens(0, two.n_tokens))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(raw)[:-40])
    with pytest.raises(ConfigError, match=r"cut\.jsonl\.gz: not a whole gzip file \(.*\); expected a \.jsonl\.gz$"):
        pack(tmp_path / "o.h5", [tmp_path / "cut.jsonl.gz"], vocab_size=300, eod=299, comm=SELF)
    (tmp_path / "bomb.jsonl.gz").write_bytes(gzip.compress(b"\n" * (1 << 20)))  # 1 MiB from ~1 KiB
    monkeypatch.setattr(pack_mod, "MAX_SOURCE_BYTES", 1 << 19)
    with pytest.raises(ConfigError, match=r"bomb\.jsonl\.gz: more than 524288 bytes inflated; split it into smaller"):
        pack(tmp_path / "o.h5", [tmp_path / "bomb.jsonl.gz"], vocab_size=300, eod=299, comm=SELF)
    monkeypatch.setattr(pack_mod, "MAX_LINE_BYTES", 100)
    with pytest.raises(ConfigError, match=r"a\.jsonl\.gz: a line past 100 bytes; split it"):
        pack(tmp_path / "o.h5", [tmp_path / "a.jsonl.gz"], vocab_size=300, eod=299, comm=SELF)
    assert not list(tmp_path.glob("*o.h5*"))


def test_hpcml_data_pack_and_info_from_the_command_line(tmp_path):
    (tmp_path / "a.txt").write_text("one document\n")
    (tmp_path / "b.txt").write_text("and another\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "hpcml.cli", "data", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    out = run("pack", str(tmp_path / "c.h5"), str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--tokenizer", "bytes")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{tmp_path / 'c.h5'}: 2 documents, 27 tokens " \
                                 "(uint16, vocabulary 257, end of document 256)"
    info = run("info", str(tmp_path / "c.h5"), "--verify", "--json")
    assert json.loads(info.stdout) == {"file": str(tmp_path / "c.h5"), "documents": 2, "tokens": 27, "dtype": "uint16",
                                       "vocab_size": 257, "eod": 256, "bytes": (tmp_path / "c.h5").stat().st_size,
                                       "verified": True}
    bad = run("pack", str(tmp_path / "c.txt"), str(tmp_path / "a.txt"))
    assert bad.returncode == 2 and bad.stderr.strip() == f"hpcml: error: output {tmp_path / 'c.txt'}: " \
                                                         f"expected a name ending in .h5"


def test_a_mixture_serves_each_file_its_exact_share_in_a_layout_free_order(tmp_path):
    from hpcml.data import Mixture

    _, sources = _docs(tmp_path)
    pack(tmp_path / "a.h5", sources[:5], vocab_size=300, eod=299, comm=SELF)
    pack(tmp_path / "b.h5", sources[5:], vocab_size=300, eod=299, comm=SELF)
    a, b = TokenDataset(tmp_path / "a.h5", seq_len=16, seed=1), TokenDataset(tmp_path / "b.h5", seq_len=16, seed=2)
    mix = Mixture([(a, 0.7), (b, 0.3)], seed=4, block=10)
    ids = mix.sample_ids(0, 1000)
    assert [k for k, _, _ in ids].count(0) == 700  # exact per block of 10: 7 and 3
    assert all(sum(k == 0 for k, _, _ in ids[j:j + 10]) == 7 for j in range(0, 1000, 10))
    # each file's own samples in its own order: the i-th from a is a's global sample i
    assert [(e, w) for k, e, w in ids if k == 0] == [a.window_of(i) for i in range(700)]
    assert [(e, w) for k, e, w in ids if k == 1] == [b.window_of(i) for i in range(300)]
    assert mix.sample_ids(7, 16, 4, 9) == mix.sample_ids(7, 16)[4:9]  # a dp slice of the batch: no state
    k, e, w = mix.sample_ids(3, 8)[5]
    assert np.array_equal(mix.rows(3, 8, 5, 6)[0].numpy(), (a, b)[k].tokens(w * 16, 17))
    for bad, msg in ((dict(parts=[(a, 0.7), (b, -1)]), r"mixture weights \[0\.7, -1\]: expected positive numbers"),
                     (dict(parts=[(a, 1.0), (b, 1e-6)]), r"dataset\(s\) \[1\] get no place in a block of 1000"),
                     (dict(parts=[(a, 1), (TokenDataset(tmp_path / "b.h5", seq_len=8), 1)]),
                      r"sequence lengths \[8, 16\]: expected one")):
        with pytest.raises(ConfigError, match=msg):
            Mixture(**bad)


def test_llm_pretrain_data_flags_open_one_file_or_a_weighted_mixture(packed, tmp_path):
    from hpcml.data import Mixture, end_of_document, open_tokens

    one = open_tokens([str(packed)], seq_len=16)
    assert isinstance(one, TokenDataset) and one.seq_len == 16 and end_of_document(one) == one.m.eod
    mix = open_tokens([f"{packed}:3", str(packed)], seq_len=16)
    assert isinstance(mix, Mixture) and list(mix.counts) == [750, 250] and end_of_document(mix) == one.m.eod
    with pytest.raises(DataError, match=r"token data .*nope\.h5: no such file; expected a token file written by"):
        open_tokens([f"{tmp_path / 'nope.h5'}:0.5"], seq_len=16)
    with pytest.raises(ConfigError, match="no token file given"):
        open_tokens([], seq_len=16)

    class Two:
        eods = {3, 7}

    with pytest.raises(ConfigError, match=r"end their documents with different tokens \[3, 7\]: pack them with one"):
        end_of_document(Two())


def test_text_with_a_hugging_face_tokenizer_directory(tmp_path):
    """A tokenizer directory as `save_pretrained` writes it (built here: nothing downloaded)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path / "tk")
    (tmp_path / "a.txt").write_text("hello world hello")
    (tmp_path / "b.jsonl").write_text('{"text": "world mars"}\n')
    m = pack(tmp_path / "c.h5", [tmp_path / "a.txt", tmp_path / "b.jsonl"], tokenizer=str(tmp_path / "tk"), comm=SELF)
    assert (m.vocab_size, m.eod, m.n_docs) == (4, 1, 2)
    assert list(TokenDataset(tmp_path / "c.h5", seq_len=2).tokens(0, m.n_tokens)) == [2, 3, 2, 1, 3, 0, 1]
    with pytest.raises(ConfigError, match=r"tokenizer '.*nowhere': .*expected a tokenizer directory \(or a name "
                                          r"already in the Hugging Face cache: this reads no network\)"):
        pack(tmp_path / "d.h5", [tmp_path / "a.txt"], tokenizer=str(tmp_path / "nowhere"), comm=SELF)
