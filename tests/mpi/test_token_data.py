"""Issue 43: a real text corpus packed on every rank of the launch, trained on under dp, tp,
pp and cp like one process (fp64, 1e-10), with and without document masking, and resumed
mid-epoch on another layout reading exactly the sequences the uninterrupted run reads next
(by sample id).

The corpus ships in tests/data/corpus: 4,017 paragraphs of CPython's standard library (PSF
licence) in 8 ``.jsonl.gz`` shards, tokenized as UTF-8 bytes."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
import tempfile
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcml.data import TokenDataset, pack
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.checkpointing import load_trainer, save_trainer
from hpcml.train.recipe import build_llm_trainer
from tests.reference import reference_run

WORLD = MPI.COMM_WORLD.Get_size()
MODEL = TransformerConfig(vocab_size=257, dim=32, n_layers=4, n_heads=4, max_seq_len=16, tie_embeddings=False)
TRAIN = TrainConfig(steps=4, global_batch=8, micro_batch=2, seq_len=16, progress=False, seed=3)
TOL = 1e-10
LAYOUTS = {2: [("dp2", {"dp": 2}, {}), ("tp2", {"tp": 2}, {}), ("pp2", {"pp": 2}, {})],
           4: [("fsdp4", {"dp": 4}, {"fsdp": True}), ("tp2xdp2", {"tp": 2}, {}), ("pp2xdp2", {"pp": 2}, {})]}
RESUME = {2: (("dp2", {"dp": 2}), ("tp2", {"tp": 2})), 4: (("tp2xdp2", {"tp": 2}), ("pp2xdp2", {"pp": 2}))}

pytestmark = pytest.mark.usefixtures("fp64_default")


SHARDS = sorted((Path(__file__).resolve().parent.parent / "data" / "corpus").glob("*.jsonl.gz"))


def _texts() -> list[str]:
    """The shipped corpus's documents, read without hpcml (tests/data/corpus/README.md)."""
    return [json.loads(line)["text"] for shard in SHARDS for line in gzip.open(shard, "rt")]


@pytest.fixture(scope="module")
def corpus(comm) -> Path:
    d = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-data-") if comm.rank == 0 else None))
    pack(d / "corpus.h5", SHARDS, tokenizer="bytes", comm=comm)
    return d / "corpus.h5"


class Recorder(TokenDataset):
    """A TokenDataset that notes which sample ids this rank read, step by step."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.read: dict[int, list] = {}

    def rows(self, step, n, lo, hi):
        self.read.setdefault(step, []).extend(self.sample_ids(step, n, lo, hi))
        return super().rows(step, n, lo, hi)


def _read_by_step(comm, data: Recorder) -> dict[int, list]:
    """Every sample id read for each step, over the ranks (each id once per dp slice)."""
    out: dict[int, set] = {}
    for part in comm.allgather(data.read):
        for step, ids in part.items():
            out.setdefault(step, set()).update(map(tuple, ids))
    return {k: sorted(v) for k, v in out.items()}


def test_a_corpus_packed_on_every_rank_is_the_one_packed_on_one(comm, corpus):
    ds = TokenDataset(corpus, seq_len=16)
    texts = _texts()
    assert len(SHARDS) == 8 and ds.m.n_docs == len(texts) == 4017  # thousands of documents
    assert ds.m.vocab_size == 257 and ds.m.eod == 256
    assert ds.m.n_tokens == sum(len(t.encode()) + 1 for t in texts)
    if comm.rank == 0:
        alone = pack(corpus.with_name("alone.h5"), SHARDS, tokenizer="bytes", comm=MPI.COMM_SELF)
        one = TokenDataset(alone.path, seq_len=16)
        assert torch.equal(torch.from_numpy(one.tokens(0, one.m.n_tokens)),
                           torch.from_numpy(ds.tokens(0, ds.m.n_tokens)))
        first = texts[0].encode()
        assert bytes(ds.tokens(0, len(first)).astype("uint8")) == first  # the text itself, byte for byte
        assert ds.tokens(len(first), 1)[0] == 256  # then the end of the document
        last = texts[-1].encode()
        assert bytes(ds.tokens(ds.m.n_tokens - 1 - len(last), len(last)).astype("uint8")) == last
    comm.Barrier()


@pytest.mark.parametrize("name,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_training_on_the_corpus_equals_one_process(comm, corpus, name, degrees, pkw):
    ref_losses, ref_norms, _ = reference_run(MODEL, TRAIN, TokenDataset(corpus, seq_len=16, seed=3))
    data = Recorder(corpus, seq_len=16, seed=3)
    history = build_llm_trainer(MODEL, TRAIN, ParallelConfig(**pkw), data=data, **degrees).fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=TOL)
    assert [m["grad_norm"] for m in history] == pytest.approx(ref_norms, rel=TOL)
    read = _read_by_step(comm, data)
    assert read == {s: sorted(TokenDataset(corpus, seq_len=16, seed=3).sample_ids(s, 8)) for s in range(4)}
    assert ref_losses[0] > ref_losses[-1]  # it learns the text's bytes


@pytest.mark.skipif(WORLD not in RESUME, reason="2 or 4 ranks")
def test_resumed_mid_epoch_on_another_layout_it_reads_and_trains_as_the_uninterrupted_run(comm, corpus):
    (a, adeg), (b, bdeg) = RESUME[WORLD]
    ref_losses, _, _ = reference_run(MODEL, TRAIN, TokenDataset(corpus, seq_len=16, seed=3))
    half = TrainConfig(**{**TRAIN.__dict__, "steps": 2})
    first = build_llm_trainer(MODEL, half, data=Recorder(corpus, seq_len=16, seed=3), **adeg)
    history = first.fit()
    path = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-data-ck-") if comm.rank == 0 else None))
    result = save_trainer(first, path / "ck")
    data = Recorder(corpus, seq_len=16, seed=3)
    second = build_llm_trainer(MODEL, TRAIN, data=data, **bdeg)
    load_trainer(second, result.path)
    assert second.step == 2
    history += second.fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=TOL), (a, b)
    want = TokenDataset(corpus, seq_len=16, seed=3)
    assert _read_by_step(comm, data) == {s: sorted(want.sample_ids(s, 8)) for s in (2, 3)}  # no sample twice or skipped


def test_a_corpus_with_more_ids_than_the_model_embeds_is_refused_on_every_rank_before_step_one(comm, corpus):
    from hpcml.errors import ConfigError

    small = TransformerConfig(vocab_size=200, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    with pytest.raises(ConfigError, match=r"token file .*corpus\.h5 was packed for a vocabulary of 257 ids, the model "
                                          r"embeds 200: .* give a model with vocab_size >= 257"):
        build_llm_trainer(small, TRAIN, data=TokenDataset(corpus, seq_len=16), dp=WORLD)


def test_a_mixture_of_two_corpora_trains_as_one_process(comm, corpus):
    """Two token files by weight (hpcml.data.Mixture): the first layout of this rank count equals
    one process, and every rank read exactly its rows' (dataset, epoch, window)."""
    from hpcml.data import Mixture

    other = corpus.with_name("other.h5")
    pack(other, sorted(Path(json.__file__).resolve().parent.parent.glob("*.py"))[120:200], tokenizer="bytes",
         comm=comm)

    class Recorded(Mixture):
        read: dict

        def rows(self, step, n, lo, hi):
            self.read.setdefault(step, []).extend(self.sample_ids(step, n, lo, hi))
            return super().rows(step, n, lo, hi)

    def mix(cls=Mixture):
        m = cls([(TokenDataset(corpus, seq_len=16, seed=3), 0.75), (TokenDataset(other, seq_len=16, seed=4), 0.25)],
                seed=3, block=8)
        m.read = {}
        return m

    ref_losses, _, _ = reference_run(MODEL, TRAIN, mix())
    name, degrees, pkw = LAYOUTS[WORLD][0] if WORLD in LAYOUTS else ("dp", {"dp": WORLD}, {})
    data = mix(Recorded)
    history = build_llm_trainer(MODEL, TRAIN, ParallelConfig(**pkw), data=data, **degrees).fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=TOL), name
    read = _read_by_step(comm, data)
    assert read == {s: sorted(mix().sample_ids(s, 8)) for s in range(4)}
    assert sum(k == 1 for ids in read.values() for k, _, _ in ids) == 8  # 2 of each 8: 25%


@pytest.mark.parametrize("name,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_validation_loss_on_held_out_data_equals_one_process(comm, corpus, name, degrees, pkw):
    """Issue 43: ``val_loss`` in the metrics (every 2 steps and after the last), forward only on
    every layout: after the last step it equals one process's loss of the same weights on the
    same held-out batches (fp64, 1e-10), and training is unchanged by it."""
    from hpcml.models.transformer import Transformer, cross_entropy

    ref_losses, _, ref_params = reference_run(MODEL, TRAIN, TokenDataset(corpus, seq_len=16, seed=3))
    held_out = TokenDataset(corpus, seq_len=16, seed=77)  # other batches than training's first ones: the check is
    # that every layout computes what one process does
    trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(**pkw), data=TokenDataset(corpus, seq_len=16, seed=3),
                                **degrees)
    trainer.validate_on(held_out, every=2, batches=3)
    history = trainer.fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=TOL)  # evaluating changed nothing
    assert [("val_loss" in m) for m in history] == [False, True, False, True]
    model = Transformer(MODEL)
    model.load_state_dict(ref_params, strict=False)
    with torch.no_grad():
        want = sum(float(cross_entropy(model(b[:, :-1]), b[:, 1:])) for b in
                   (held_out.global_batch(k, 8) for k in range(3))) / 3
    assert history[-1]["val_loss"] == pytest.approx(want, rel=TOL), name


MASKED = TrainConfig(**{**TRAIN.__dict__, "doc_mask_eod": 256, "seed": 142})  # seed 142: every step's batch crosses
# a document's end (documents are ~250 tokens, sequences 16)
DOC_MASK = {2: [("dp2", {"dp": 2}, {}), ("tp2", {"tp": 2}, {}), ("pp2", {"pp": 2}, {}),
                ("cp2-ulysses", {"cp": 2}, {}), ("cp2-allgather", {"cp": 2}, {"cp_kind": "allgather"})],
            4: [("fsdp4", {"dp": 4}, {"fsdp": True}), ("tp2xcp2", {"tp": 2, "cp": 2}, {}),
                ("pp2xcp2-allgather", {"pp": 2, "cp": 2}, {"cp_kind": "allgather"})]}


@pytest.mark.parametrize("name,degrees,pkw", DOC_MASK.get(WORLD, []), ids=[x[0] for x in DOC_MASK.get(WORLD, [])])
def test_document_masked_training_equals_one_process_running_each_document_alone(comm, corpus, name, degrees, pkw):
    """Issue 43: with document masking the packed sequences train, on every layout (cp
    included: each rank's query rows of the whole sequence's mask), as one process that runs
    every document through the model alone, with no mask (fp64, 1e-10)."""
    data = TokenDataset(corpus, seq_len=16, seed=142)
    assert all((data.global_batch(s, 8)[:, :-1] == 256).any() for s in range(TRAIN.steps))  # batches cross documents
    ref_losses, ref_norms, _ = reference_run(MODEL, MASKED, data)
    plain, _, _ = reference_run(MODEL, replace(MASKED, doc_mask_eod=None), data)
    assert abs(ref_losses[-1] - plain[-1]) > 1e-6  # the mask changes what is learned
    history = build_llm_trainer(MODEL, MASKED, ParallelConfig(**pkw), data=data, **degrees).fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=TOL), name
    assert [m["grad_norm"] for m in history] == pytest.approx(ref_norms, rel=TOL), name
