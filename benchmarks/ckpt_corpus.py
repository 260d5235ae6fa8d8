#!/usr/bin/env python
"""Issue 24: a corpus of crafted checkpoints through every entry point, each operation in a
worker process under a 10 s and 512 MB limit.

    python benchmarks/ckpt_corpus.py                          # the whole matrix (>= 300 cases), no key and keyed
    python benchmarks/ckpt_corpus.py --jobs 2 --json corpus.json --markdown table.md
    python benchmarks/ckpt_corpus.py --classes nonregular,forger --cases 40
    python benchmarks/ckpt_corpus.py --list                   # the classes and their case counts

A reference run (a tiny Transformer trained 2 steps, saved at steps 1 and 2, single process),
another run of the same shape (its step 2: foreign files), the reference exported as a Hugging
Face directory and converted to a torchtitan DCP directory are built once under --workdir.
Every case is a copy of one of them, crafted (seeded), then handed to every entry point that
takes its kind:

    hpcml checkpoint: verify, inspect, resume (load_trainer), export (safetensors),
                      export-hf (export --format hf), convert (--to dcp), consolidate
    Hugging Face dir: init-from (workflows/llm_pretrain.py --init-from, training stubbed out)
    DCP dir:          convert-in (convert --to hpcml)

The CLI entry points run in-process through ``hpcml.cli.main(argv)`` with stdout and stderr
captured at the file-descriptor level (native writes included); resume and init-from call the
library / the workflow's ``main``. Each operation runs in a long-lived worker process that the
parent watches: over 10 s it is SIGKILLed (``hang``), its RSS polled and killed at baseline +
512 MiB (``memory``; also when VmHWM, reset through /proc/self/clear_refs before the operation,
grew by more), a signal death is ``crash``; a killed worker is restarted and the case goes on
with its next entry point.

Outcomes per (case, entry point):

    refused       CLI: non-zero exit, one ``hpcml: error: ...`` line on stderr (verify: exit 1 and
                  only ``hpcml ckpt verify: ...`` lines), no traceback; library/workflow: an
                  hpcml error class (CheckpointError, ConfigError, ...) with a one-line message
    ok-correct    it succeeded and its output equals what it gives on the pristine reference
    silent-wrong  it succeeded with another output (verify: said "ok" of a crafted checkpoint)
    accepted      it succeeded with the reference's output where the case demands a refusal
                  (a symlinked file, `latest` sent to another step, an unsigned manifest under a key)
    traceback     any other exception (the last line is kept); ``untidy``: a non-zero exit whose
                  stderr is not one hpcml line (a traceback, extra lines, native messages)
    hang, memory, crash, outside (a file outside the case's checkpoint -- a tripwire FIFO -- was opened)

``silent-wrong`` is expected (not a failure) only for the documented limit of digests without a
key: a consistent forger who rewrites the manifest and recomputes every digest -- the
``forger`` and ``many-pieces`` rows everywhere, the other classes that rewrite the manifest in
verify and inspect only (they report what a consistent manifest says; every entry point that
loads values must still refuse or give the reference's). With a key (HPCML_CKPT_KEY, the
reference saved with ``ckpt.save(..., key=)``) every class that rewrites the manifest, an
unsigned checkpoint and one signed with another key must be refused everywhere.
Exit status 1 when any failure occurred (0 otherwise; 2 bad arguments).

Outputs compared: verify (ok/not), inspect (its JSON but the path, the save id and the JSON
``extra``, which it shows as stored), resume (every state tensor, step, scheduler, param groups, schedule),
export (the safetensors tensors), export-hf (config.json, file list, tensors), convert (every
DCP entry but ``hpcml.extra``, the carried JSON), consolidate (every dataset, its attributes
and ``step``), init-from (every parameter), convert-in (every tensor and the JSON state).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import queue
import random
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LIMIT_S = 10.0
LIMIT_MB = 512
KEY_TEXT = "hpcml-corpus-key-4f1c2a9e"
OTHER_KEY_TEXT = "not-the-corpus-key-77d0"
STEP, OLD = 2, 1
STEP_DIR, OLD_DIR = f"step_{STEP:08d}", f"step_{OLD:08d}"
CK_EPS = ("verify", "inspect", "resume", "export", "export-hf", "convert", "consolidate")
HF_EPS = ("init-from",)
DCP_EPS = ("convert-in",)
ALL_EPS = CK_EPS + HF_EPS + DCP_EPS
FATAL = ("traceback", "untidy", "hang", "memory", "crash", "outside", "accepted", "gen-error", "skipped")
OUTCOMES = ("refused", "ok-correct", "silent-wrong", "accepted", "traceback", "untidy", "hang", "memory", "crash",
            "outside", "gen-error", "skipped")
SHORT = {"refused": "R", "ok-correct": "OK", "silent-wrong": "SW", "accepted": "ACC", "traceback": "TB",
         "untidy": "UT", "hang": "H", "memory": "M", "crash": "C", "outside": "OUT", "gen-error": "GEN",
         "skipped": "SKIP"}
READ_ALL = tuple(e for e in CK_EPS if e != "inspect")  # every entry point that opens the shards
READS_INDEX = ("verify", "resume", "export", "export-hf", "consolidate")  # and checks index.h5 (convert does not)
REPORTS = ("verify", "inspect")
"""They report what the manifest says: a forger's consistent manifest fools them without a key."""

# the reference model: small enough that a case is ~0.4 MB and an operation tens of ms
MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
TRAIN = dict(steps=8, global_batch=2, seq_len=16, warmup_steps=2, progress=False)


# ------------------------------------------------------------------------------------------
# the cases: pure Python (the parent imports none of torch, h5py, hpcml)
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    cls: str
    index: int
    variant: str
    kind: str = "ck"
    benign: bool = False
    """The crafted checkpoint is sound: every entry point must give the reference's output."""
    rewrites: bool = False
    """manifest.json rewritten with every digest recomputed (a forger without the key)."""
    forger_eps: tuple[str, ...] = ()
    """Entry points where silent-wrong is the documented no-key limit of digests."""
    must_refuse: tuple[str, ...] = ()
    """Entry points where succeeding with the reference's output is still a failure (accepted)."""
    isolate: bool = False
    """Hang-, crash- or memory-prone: the unit test runs it in the worker, not in-process."""
    keyed_only: bool = False

    @property
    def id(self) -> str:
        return f"{self.cls}/{self.index:03d}-{self.variant}"

    @property
    def seed(self) -> int:
        return int.from_bytes(hashlib.sha256(self.id.encode()).digest()[:4], "little")

    @property
    def eps(self) -> tuple[str, ...]:
        return {"ck": CK_EPS, "hf": HF_EPS, "dcp": DCP_EPS}[self.kind]


@dataclasses.dataclass(frozen=True)
class Cls:
    name: str
    kind: str
    what: str
    variants: tuple[str, ...] = ()
    """Named variants (one case each); empty: ``count`` random ones (seeded)."""
    count: int = 0
    policy: dict = dataclasses.field(default_factory=dict)
    per_variant: dict = dataclasses.field(default_factory=dict)
    """variant -> policy overrides."""


def _c(name, kind, what, variants=(), count=0, per_variant=None, **policy) -> Cls:
    return Cls(name, kind, what, tuple(variants), count, policy, per_variant or {})


_SYM_FILES = ("rank_00000.h5", "index.h5", "manifest.json")
_NONREG_TARGETS = ("rank_00000.h5", "index.h5", "manifest.json", "latest", "stepdir")
_NONREG_KINDS = ("fifo", "socket", "devzero", "chardev", "dir")
_EXTRA_TRAINER = ("step=-5", "step=999", "step=1e30", "step=abc", "step=null", "step=2.5", "step=true",
                  "no-step", "no-scheduler", "scheduler=str", "scheduler.last_epoch=abc", "param_groups=[]",
                  "param_groups=[{}]", "param_groups=str", "param_groups.lr=abc", "no-schedule-no-train_config",
                  "schedule.steps=-1", "data=list")
_EXTRA_MODEL = ("n_layers=1e6", "dim=2**20", "n_layers=1e6,dim=2**20", "n_heads=0", "vocab_size=-1",
                "config=str", "type=other", "unknown-key")
_FIELDS = ("8GiB-declared", "piece-larger-than-file", "chunk-beyond-file", "overlapping-chunks", "file-outside",
           "unlisted-file", "absolute-name", "format-1", "negative-step", "bool-as-int", "unknown-dtype", "no-index",
           "deep-nesting", "huge-int-literal", "float-1e400", "nul-in-name", "world_size-0", "layout-list",
           "files-dotdot", "scalar-wrong", "crc-negative", "at-float", "pieces-dict", "attrs-list",
           "partition-int", "fused-widths-bogus", "tensor-null")
_HUGE = ("shape-2^40x2^20", "shape-32dims-2^31", "piece-2^40", "chunk-2^40", "at-2^62", "bytes-2^62",
         "zero-by-2^62-no-pieces", "logical-shape-2^40", "offset-2^63", "fused-widths-2^62")
_FORGER = ("swap-wq-layers", "swap-exp_avg-exp_avg_sq", "dtype-float32-int32", "dtype-of-optim-int32",
           "logical-shape-shrunk", "swap-pieces-via-at")

CLASSES: tuple[Cls, ...] = (
    # -- hpcml checkpoints ---------------------------------------------------------------------
    _c("pristine", "ck", "the reference itself (by its root and by its step directory)", ("root", "stepdir"),
       benign=True),
    _c("stray-nonregular", "ck", "a FIFO, socket, /dev/zero link beside the files, not in the manifest",
       ("fifo", "socket", "devzero"), benign=True, isolate=True),
    _c("old-fallback", "ck", "latest names step_2, step_2 missing, step_2.old this run's step 2 (a killed re-save)",
       ("this-run",), benign=True),
    _c("flip-manifest", "ck", "one bit flipped in manifest.json", count=14),
    _c("flip-index", "ck", "one bit flipped in index.h5", count=14),
    _c("flip-shard-meta", "ck", "one bit flipped in the shard's HDF5 metadata (outside data chunks)", count=14),
    _c("flip-shard-model", "ck", "one bit flipped in a data chunk of a model/ tensor", count=14),
    _c("flip-shard-optim", "ck", "one bit flipped in a data chunk of an optim/ tensor", count=14),
    _c("flip-latest", "ck", "one bit flipped in the step name `latest` holds", count=4),
    _c("trunc-shard", "ck", "the shard truncated", count=8),
    _c("trunc-index", "ck", "index.h5 truncated", count=4),
    _c("trunc-manifest", "ck", "manifest.json truncated", count=4),
    _c("grow-shard", "ck", "bytes appended to the shard", count=3),
    _c("stale", "ck", "files of this run's step 1 in step 2", ("shard", "index", "manifest", "manifest+index")),
    _c("foreign", "ck", "files of another run's step 2", ("shard", "index", "manifest", "manifest+index",
                                                           "index+shard")),
    _c("latest-old", "ck", "latest names step_6, missing; step_6.old holds another run's / this run's step 2 ...",
       ("foreign-step2", "this-step2", "old-symlink", "step-is-fifo", "old-manifest-fifo"),
       must_refuse=CK_EPS, isolate=True),
    _c("latest-bad", "ck", "latest naming what is not a step beside it",
       ("missing-step", "dotdot", "absolute", "300-bytes", "empty", "binary", "symlink", "step_2-dir-symlink")),
    _c("symlink", "ck", "a file (or the step) a symlink to an identical copy outside", _SYM_FILES + ("stepdir",),
       must_refuse=READ_ALL, per_variant={"manifest.json": {"must_refuse": CK_EPS},
                                          "stepdir": {"must_refuse": CK_EPS},
                                          "index.h5": {"must_refuse": READS_INDEX}}),
    _c("external-storage", "ck", "a shard dataset moved to HDF5 external storage (a tripwire FIFO, /dev/zero)",
       ("fifo", "devzero", "fifo-recomputed", "devzero-recomputed"), isolate=True,
       per_variant={v: {"rewrites": True, "forger_eps": ("verify",)} for v in ("fifo-recomputed",
                                                                                 "devzero-recomputed")}),
    _c("index-outside", "ck", "index.h5 with an external link / a VDS source outside the directory",
       ("extlink", "vds", "extlink-recomputed", "vds-recomputed"), isolate=True,
       per_variant={v: {"rewrites": True, "forger_eps": ("verify",)} for v in ("extlink-recomputed",
                                                                                 "vds-recomputed")}),
    _c("huge-shape", "ck", "shapes, chunks, offsets and sizes far beyond the file (digests recomputed)", _HUGE,
       rewrites=True, isolate=True),
    _c("many-pieces", "ck", "65,536 single-element pieces of one tensor (digests recomputed)",
       ("uint8-32dims", "uint8-32dims-20MB-shard", "f32-1dim", "65537-pieces"), rewrites=True, forger_eps=CK_EPS,
       isolate=True),
    _c("nonregular", "ck", "a FIFO, socket, /dev/zero symlink, char device or directory under a checkpoint name",
       tuple(f"{t}:{k}" for t in _NONREG_TARGETS for k in _NONREG_KINDS if not (t == "stepdir" and k == "dir")),
       isolate=True),
    _c("extra-trainer", "ck", "the trainer's JSON state crafted (digests recomputed)", _EXTRA_TRAINER,
       rewrites=True, forger_eps=("verify",), isolate=True),
    _c("extra-edited", "ck", "the trainer's JSON state edited, digest not recomputed",
       ("step=-5", "param_groups=[]", "n_layers=1e6")),
    _c("extra-model", "ck", "extra['model'] crafted: what export --format hf rebuilds (digests recomputed)",
       _EXTRA_MODEL, rewrites=True, forger_eps=("verify",), isolate=True),
    _c("step-disagree", "ck", "the manifest's step and extra['step'] disagree (digests recomputed)",
       ("extra-step-1", "dir-step-1"), rewrites=True, must_refuse=CK_EPS),
    _c("manifest-field", "ck", "a manifest field the writer never makes (digests recomputed)", _FIELDS,
       rewrites=True, isolate=True),
    _c("forger", "ck", "a consistent forger: pieces swapped, a dtype changed, every digest recomputed", _FORGER,
       rewrites=True, forger_eps=CK_EPS),
    # -- keyed only: a reader with a key ----------------------------------------------------------
    _c("unsigned", "ck", "the unsigned reference read with a key", ("unsigned",), keyed_only=True,
       must_refuse=CK_EPS, rewrites=True),
    _c("wrong-key", "ck", "the reference signed with another key", ("other-key",), keyed_only=True,
       must_refuse=CK_EPS, rewrites=True),
    _c("crc-fit", "ck", "a data chunk's values changed, 4 bytes fitted so its CRC-32 still matches (no file but "
       "the shard touched)", ("model-first-value", "optim-first-value", "model-last-chunk"), keyed_only=True,
       must_refuse=READ_ALL,  # the exports read model/ tensors only: an optimizer chunk is not theirs to refuse
       per_variant={"optim-first-value": {"must_refuse": ("verify", "resume", "convert", "consolidate")}}),
    _c("rollback", "ck", "latest pointed back at the older signed step 1 of this run (signed_state.json kept)",
       ("latest-to-step1", "step2-removed"), keyed_only=True, must_refuse=CK_EPS),
    _c("other-run", "ck", "another run's signed step (same key) copied in (signed_state.json kept)",
       ("replaces-step2", "as-step3-latest"), keyed_only=True, must_refuse=CK_EPS),
    # -- Hugging Face directories (--init-from) ---------------------------------------------------
    _c("hf-pristine", "hf", "the reference's Hugging Face export", ("as-exported",), benign=True),
    _c("hf-config-huge", "hf", "config.json far larger than the safetensors",
       ("hidden-65536x64-layers", "layers-1e6", "vocab-1e9", "intermediate-1e9", "positions-1e12"), isolate=True),
    _c("hf-config-bad", "hf", "config.json malformed or unsupported",
       ("not-json", "list", "model_type", "rope_scaling", "head_dim", "2MiB", "vocab-str", "kv-heads-3",
        "eps-negative", "tie-str"), isolate=True),
    _c("hf-flip-header", "hf", "one bit flipped in model.safetensors' header", count=8, isolate=True),
    _c("hf-trunc", "hf", "model.safetensors truncated", count=4, isolate=True),
    _c("hf-header", "hf", "a crafted safetensors header",
       ("length-2^63", "length-64MiB+1", "offsets-outside", "offsets-overlap", "dtype-F64", "shape-wrong",
        "extra-tensor", "not-object"), isolate=True),
    _c("hf-nonregular", "hf", "config.json / model.safetensors / the index a FIFO, socket or /dev/zero link",
       tuple(f"{t}:{k}" for t in ("config.json", "model.safetensors", "index") for k in ("fifo", "socket", "devzero")),
       isolate=True),
    _c("hf-links", "hf", "links and index entries leading out of the directory",
       ("safetensors-symlink-out", "config-symlink-passwd", "index-dotdot", "index-absolute", "index-missing-file"),
       isolate=True),
    # -- torchtitan DCP directories (convert --to hpcml) ---------------------------------------------
    _c("dcp-pristine", "dcp", "the reference converted to DCP", ("as-converted",), benign=True),
    _c("dcp-flip-metadata", "dcp", "one bit flipped in .metadata (the pickle)", count=6, isolate=True),
    _c("dcp-flip-data", "dcp", "one bit flipped in __0_0.distcp", count=6, isolate=True),
    _c("dcp-trunc", "dcp", "a DCP file truncated", count=4, isolate=True),
    _c("dcp-nonregular", "dcp", ".metadata / __0_0.distcp a FIFO, socket or /dev/zero link",
       tuple(f"{t}:{k}" for t in (".metadata", "__0_0.distcp") for k in ("fifo", "socket", "devzero")),
       isolate=True),
    _c("dcp-links", "dcp", "a DCP file a symlink out of the directory", (".metadata", "__0_0.distcp"),
       must_refuse=DCP_EPS, isolate=True),
)
CLASS_BY_NAME = {c.name: c for c in CLASSES}


def case_list(classes: list[str] | None = None, *, total: int | None = None, one_each: bool = False,
              keyed: bool = False) -> list[Case]:
    """The corpus. ``keyed``: the cases a reader with a key is run on (the ones that rewrite the
    manifest, the pristine reference, and the keyed-only classes: unsigned, wrongly signed, data
    fitted under its CRC-32, rolled back, another run's step). ``total``: about
    that many cases -- fewer: every class keeps its share (at least one, its first variants),
    more: the random classes grow; ``one_each``: the first case of every class."""
    chosen = [CLASS_BY_NAME[n] for n in classes] if classes else list(CLASSES)
    chosen = [c for c in chosen if keyed or not c.policy.get("keyed_only")]
    full = sum(len(c.variants) or c.count for c in chosen)
    factor = total / full if total is not None and full else 1.0
    fixed = sum(len(c.variants) for c in chosen)
    random_n = sum(c.count for c in chosen if not c.variants)
    grow = (total - fixed) / random_n if total is not None and total > full and random_n else None
    out = []
    for c in chosen:
        n = len(c.variants) or c.count
        k = 1 if one_each else n if factor == 1.0 else max(1, round(n * (grow if grow and not c.variants else
                                                                           min(1.0, factor))))
        variants = c.variants[:k] if c.variants else tuple(str(i) for i in range(k))
        for i, v in enumerate(variants):
            case = Case(c.name, i, v, c.kind, **{**c.policy, **c.per_variant.get(v, {})})
            if keyed and not (case.kind == "ck" and (case.rewrites or case.benign or case.keyed_only)):
                continue
            if keyed and case.cls in ("old-fallback", "stray-nonregular"):
                continue
            out.append(case)
    return out


ISSUE_CASES = (("nonregular", "index.h5:socket"), ("nonregular", "manifest.json:devzero"),
               ("nonregular", "latest:fifo"), ("latest-old", "this-step2"),
               ("extra-trainer", "step=999"),
               ("extra-trainer", "step=1e30"), ("extra-trainer", "step=abc"), ("extra-trainer", "no-scheduler"),
               ("extra-trainer", "param_groups=[]"), ("step-disagree", "dir-step-1"), ("extra-model", "dim=2**20"),
               ("forger", "dtype-float32-int32"), ("hf-config-huge", "hidden-65536x64-layers"))
"""The attacks issue 24 names, beyond the first case of each class: the unit test runs these too."""


def sample(keyed: bool = False) -> list[Case]:
    """The first case of every class and :data:`ISSUE_CASES` (what ``make test`` runs)."""
    out = case_list(one_each=True, keyed=keyed)
    pool = case_list(keyed=keyed)
    for cls, variant in ISSUE_CASES:
        case = next((c for c in pool if c.cls == cls and c.variant == variant), None)
        if case is not None and case not in out:
            out.append(case)
    return out


def case_from_id(case_id: str) -> Case:
    """The case of an id such as ``flip-index/007-7`` (any index: --cases scales the random classes)."""
    name, rest = case_id.split("/", 1)
    c = CLASS_BY_NAME[name]
    index, variant = int(rest[:3]), rest[4:]
    return Case(c.name, index, variant, c.kind, **{**c.policy, **c.per_variant.get(variant, {})})


def judge(case: Case, ep: str, outcome: str, keyed: bool) -> tuple[str, bool]:
    """(the outcome, relabelled ``accepted`` where a refusal was due; whether it passes)."""
    strict = keyed and case.rewrites
    if outcome == "ok-correct" and not case.benign and (strict or ep in case.must_refuse):
        outcome = "accepted"
    if outcome in FATAL:
        return outcome, False
    if case.benign:
        return outcome, outcome == "ok-correct"
    if outcome == "silent-wrong":
        return outcome, not strict and (ep in case.forger_eps or (case.rewrites and ep in REPORTS))
    return outcome, True


# ------------------------------------------------------------------------------------------
# worker side: the reference, the crafting, the entry points
# ------------------------------------------------------------------------------------------
def _status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM", "VmSize")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    return out


def _reset_hwm() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


class Ctx:
    """Paths of the references and, in a worker, the trainer resume loads into."""

    def __init__(self, workdir: Path, keyed: bool) -> None:
        self.workdir, self.keyed = Path(workdir), keyed
        self.ref = self.workdir / ("ref-key" if keyed else "ref")
        self.plain = self.workdir / "ref"  # the unkeyed references: HF and DCP directories, 'unsigned'
        self.ck = self.ref / "ck"
        self.foreign = self.ref / "foreign"
        self.hf = self.plain / "hf"
        self.dcp = self.plain / "dcp"
        self._trainer = None
        self._expected = None

    @property
    def expected(self) -> dict:
        if self._expected is None:
            import torch

            self._expected = torch.load(self.ref / "expected.pt", weights_only=False)
        return self._expected

    def trainer(self):
        if self._trainer is None:
            self._trainer = _build_trainer()
        return self._trainer


def _configs(seed: int = 0):
    from hpcml.models.transformer import TransformerConfig
    from hpcml.train.trainer import TrainConfig

    return TransformerConfig(**MODEL), TrainConfig(**TRAIN, seed=seed)


def _build_trainer(seed: int = 0):
    from mpi4py import MPI

    from hpcml.train.recipe import build_llm_trainer

    cfg, train = _configs(seed)
    return build_llm_trainer(cfg, train, comm=MPI.COMM_SELF)


def _key_supported() -> bool:
    import inspect

    from hpcml.ckpt import writer

    return "key" in inspect.signature(writer.save).parameters


def _save(trainer, root: Path, key: str | None) -> None:
    """A trainer (or its :class:`_Saved` snapshot) as save_trainer saves it, signed by ``key``."""
    from hpcml import ckpt

    kw = {"key": key.encode()} if key is not None else {}
    s = trainer if isinstance(trainer, _Saved) else _snapshot(trainer)
    ckpt.save(root, s.step, s.tensors, comm=s.comm, extra=s.extra, layout=s.layout, tensor_attrs=s.attrs, **kw)


@contextlib.contextmanager
def key_env(keyed: bool):
    """HPCML_CKPT_KEY set to the corpus key (``keyed``) or unset, for the block."""
    old = os.environ.pop("HPCML_CKPT_KEY", None)
    if keyed:
        os.environ["HPCML_CKPT_KEY"] = KEY_TEXT
    try:
        yield
    finally:
        os.environ.pop("HPCML_CKPT_KEY", None)
        if old is not None:
            os.environ["HPCML_CKPT_KEY"] = old


def build_references(workdir: Path, with_key: bool = True) -> dict:
    """The reference run (steps 1 and 2), another run's step 2, the HF and DCP directories, and
    what every entry point gives on the pristine reference; with a key (``with_key`` and
    ``ckpt.save`` takes one) the same checkpoints signed, and one signed by another key."""
    import torch

    t0 = time.perf_counter()
    keyed_too = with_key and _key_supported()
    run = _build_trainer(0)
    run.fit(OLD)
    first = _snapshot(run)
    run.fit(STEP)
    other = _build_trainer(1)
    other.fit(STEP)
    info = {"problems": [], "key": "run" if keyed_too else "n/a: hpcml.ckpt.save takes no key"}
    for keyed in (False, True) if keyed_too else (False,):
        ctx = Ctx(workdir, keyed)
        if ctx.ref.exists():
            shutil.rmtree(ctx.ref)
        ctx.ref.mkdir(parents=True)
        with key_env(False):
            key = KEY_TEXT if keyed else None
            _save(first, ctx.ck, key)
            _save(run, ctx.ck, key)
            _save(other, ctx.foreign, key)
            if keyed:
                _save(run, ctx.ref / "other-key", OTHER_KEY_TEXT)
            else:
                from hpcml.interop import torchtitan
                from hpcml.interop.hf import export_hf

                export_hf(ctx.ck, ctx.hf)
                torchtitan.to_dcp(ctx.ck, ctx.dcp)
        assert (ctx.ck / "latest").read_text().strip() == STEP_DIR, "the reference's latest"
        expected = {}
        with key_env(keyed):
            for ep in CK_EPS if keyed else ALL_EPS:
                target = {"hf": ctx.hf, "dcp": ctx.dcp}.get(_EP_KIND[ep], ctx.ck)
                scratch = Path(tempfile.mkdtemp(dir=ctx.ref, prefix="expect-"))
                try:
                    outcome, detail, output = _call(ctx, ep, target, scratch)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
                if outcome != "ok":
                    info["problems"].append(f"{'key ' if keyed else ''}{ep}: {outcome}: {detail}")
                expected[ep] = output
        torch.save(expected, ctx.ref / "expected.pt")
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info


@dataclasses.dataclass
class _Saved:
    """What :func:`_save` takes of a trainer, taken at one step."""

    step: int
    tensors: dict
    extra: dict
    layout: dict
    attrs: dict
    comm: object


def _snapshot(tr) -> _Saved:
    import copy

    return _Saved(tr.step, {n: t.detach().clone() for n, t in tr.state_tensors().items()},
                  copy.deepcopy(tr.state_extra()), tr.grid.layout.degrees, tr.tensor_attrs(), tr.grid.comm)


_EP_KIND = {**{e: "ck" for e in CK_EPS}, "init-from": "hf", "convert-in": "dcp"}


# -- crafting helpers ------------------------------------------------------------------------
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


def _manifest(step: Path) -> dict:
    m = json.loads((step / "manifest.json").read_text())
    m.pop("manifest_sha256", None)
    return m


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _sig_keys(m: dict) -> list[str]:
    return [k for k in m if any(s in k.lower() for s in ("sig", "hmac", "mac_", "_mac", "auth"))]


def _forge(step: Path, m: dict, drop_sig: bool = False, raw: bytes | None = None) -> None:
    """Write ``m`` as manifest.json with its SHA-256 recomputed, as the format spec says (no
    library call: a forger needs no key and no hpcml). A signature field, if any, is kept (now
    stale) unless ``drop_sig``."""
    body = {k: v for k, v in m.items() if k != "manifest_sha256" and not (drop_sig and k in _sig_keys(m))}
    if raw is None:
        raw = _canonical({**body, "manifest_sha256": hashlib.sha256(_canonical(body)).hexdigest()})
    (step / "manifest.json").write_bytes(raw)


def _data_ranges(m: dict, file: str, prefix: str = "") -> list[tuple[int, int]]:
    out = []
    for name, t in m["tensors"].items():
        if not name.startswith(prefix):
            continue
        nb = _ITEMSIZE.get(t["dtype"], 1)
        for p in t["pieces"]:
            if p["file"] == file:
                out += [(a, math.prod(p["chunk"]) * nb) for a in p["at"]]
    return out


def _gaps(size: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for a, n in sorted(ranges):
        if a > at:
            out.append((at, min(a, size) - at))
        at = max(at, a + n)
    if at < size:
        out.append((at, size - at))
    return [(a, n) for a, n in out if n > 0]


def _meta_sha(path: Path, m: dict, file: str) -> str:
    data = path.read_bytes()
    h = hashlib.sha256()
    for a, n in _gaps(len(data), _data_ranges(m, file)):
        h.update(data[a:a + n])
    return h.hexdigest()


def _recompute(step: Path, m: dict) -> dict:
    """Every file digest in ``m`` recomputed from the files as they are now."""
    for f, info in m["files"].items():
        p = step / f
        if p.is_symlink() or not p.is_file():
            continue
        info["bytes"] = p.stat().st_size
        if f == "index.h5":
            info["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            info["meta_sha256"] = _meta_sha(p, m, f)
    return m


def _flip(path: Path, rng: random.Random, lo: int = 0, hi: int | None = None) -> int:
    data = bytearray(path.read_bytes())
    hi = len(data) if hi is None else hi
    pos = rng.randrange(lo, hi)
    data[pos] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return pos


def _base(ctx: Ctx, d: Path, src: Path | None = None) -> tuple[Path, Path]:
    """A copy of the reference root with `latest` and the latest step only."""
    src = src or ctx.ck
    root = d / "ck"
    root.mkdir()
    shutil.copy2(src / "latest", root / "latest")
    shutil.copytree(src / STEP_DIR, root / STEP_DIR)
    return root, root / STEP_DIR


def _nonregular(path: Path, kind: str, tripwires: list) -> None:
    """Plant a non-regular file at ``path`` (removed first)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # bound by its relative name: AF_UNIX paths are short (108 bytes)
        s, cwd = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), os.getcwd()
        try:
            os.chdir(path.parent)
            s.bind(path.name)
        finally:
            os.chdir(cwd)
            s.close()
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "chardev":
        try:
            os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
        except (PermissionError, OSError):
            path.symlink_to("/dev/zero")  # no CAP_MKNOD: the nearest thing
    elif kind == "dir":
        path.mkdir()
        (path / "x").write_text("x")
    else:
        raise ValueError(kind)


class Tripwire:
    """A FIFO outside the checkpoint that must never be opened: a thread waits to write into
    it and records whether any reader opened it (re-armed per operation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.exists():
            os.mkfifo(path)
        self.opened = False
        self._checking = False
        self._thread = None

    def arm(self) -> None:
        self.opened, self._checking = False, False
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:
            with open(self.path, "wb"):
                self.opened = not self._checking
        except OSError:
            pass

    def check(self) -> bool:
        """Whether it was opened since :meth:`arm`; releases the waiting thread."""
        self._checking = True
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return self.opened
        self._thread.join(5)
        os.close(fd)
        return self.opened


@dataclasses.dataclass
class Made:
    target: Path
    tripwires: list = dataclasses.field(default_factory=list)


def _rewrite_dataset(shard: Path, dataset: str, **create) -> None:
    import h5py

    with h5py.File(shard, "a") as f:
        attrs = dict(f[dataset].attrs)
        shape, dtype = f[dataset].shape, f[dataset].dtype
        del f[dataset]
        ds = f.create_dataset(dataset, shape=shape, dtype=dtype, **create)
        for k, v in attrs.items():
            ds.attrs[k] = v


def _a_tensor(m: dict, prefix: str = "model/layers.0.attention.wq.weight") -> str:
    return next(n for n in sorted(m["tensors"]) if n.startswith(prefix))


# -- the generators: gen(case, ctx, d) -> Made ---------------------------------------------------
def _g_pristine(case, ctx, d):
    root, step = _base(ctx, d)
    return Made(step if case.variant == "stepdir" else root)


def _g_stray(case, ctx, d):
    root, step = _base(ctx, d)
    _nonregular(step / "rank_00009.h5", case.variant, [])
    _nonregular(step / f"notes.{case.variant}", case.variant, [])
    return Made(root)


def _g_old_fallback(case, ctx, d):
    root, step = _base(ctx, d)
    step.rename(root / (STEP_DIR + ".old"))
    return Made(root)


def _g_flip(region):
    def gen(case, ctx, d):
        rng = random.Random(case.seed)
        root, step = _base(ctx, d)
        m = _manifest(step)
        if region in ("manifest.json", "index.h5"):
            _flip(step / region, rng)
        elif region == "latest":
            _flip(root / "latest", rng, 0, len(STEP_DIR))
        else:
            shard = step / "rank_00000.h5"
            if region == "meta":
                gaps = _gaps(shard.stat().st_size, _data_ranges(m, "rank_00000.h5"))
                a, n = rng.choice(gaps)
            else:
                ranges = _data_ranges(m, "rank_00000.h5", "model/" if region == "model" else "optim/")
                a, n = rng.choice(ranges)
            _flip(shard, rng, a, a + n)
        return Made(root)
    return gen


def _g_trunc(file):
    def gen(case, ctx, d):
        rng = random.Random(case.seed)
        root, step = _base(ctx, d)
        p = step / file
        size = p.stat().st_size
        n = [0, 1, size - 1, size // 2][case.index] if case.index < 4 else rng.randrange(size)
        with open(p, "r+b") as f:
            f.truncate(n)
        return Made(root)
    return gen


def _g_grow(case, ctx, d):
    rng = random.Random(case.seed)
    root, step = _base(ctx, d)
    with open(step / "rank_00000.h5", "ab") as f:
        f.write(bytes(rng.randrange(256) for _ in range([1, 4096, 100000][case.index % 3])))
    return Made(root)


def _g_stale(src_of):
    def gen(case, ctx, d):
        root, step = _base(ctx, d)
        src = src_of(ctx)
        names = {"shard": ["rank_00000.h5"], "index": ["index.h5"], "manifest": ["manifest.json"],
                 "manifest+index": ["manifest.json", "index.h5"],
                 "index+shard": ["index.h5", "rank_00000.h5"]}[case.variant]
        for n in names:
            shutil.copy2(src / n, step / n)
        return Made(root)
    return gen


def _g_latest_old(case, ctx, d):
    root, step = _base(ctx, d)
    six = "step_00000006"
    (root / "latest").write_text(six + "\n")
    if case.variant == "foreign-step2":
        shutil.rmtree(step)
        shutil.copytree(ctx.foreign / STEP_DIR, root / (six + ".old"))
    elif case.variant == "this-step2":
        step.rename(root / (six + ".old"))
    elif case.variant == "old-symlink":
        shutil.move(str(step), str(d / "elsewhere"))
        (root / (six + ".old")).symlink_to(d / "elsewhere")
    elif case.variant == "step-is-fifo":
        step.rename(root / (six + ".old"))
        os.mkfifo(root / six)
    elif case.variant == "old-manifest-fifo":
        step.rename(root / (six + ".old"))
        _nonregular(root / (six + ".old") / "manifest.json", "fifo", [])
    return Made(root)


def _g_latest_bad(case, ctx, d):
    root, step = _base(ctx, d)
    latest = root / "latest"
    v = case.variant
    if v == "symlink":
        (d / "elsewhere").write_text(STEP_DIR + "\n")
        latest.unlink()
        latest.symlink_to(d / "elsewhere")
    elif v == "step_2-dir-symlink":
        shutil.move(str(step), str(d / "moved"))
        step.symlink_to(d / "moved")
    else:
        text = {"missing-step": b"step_00000009\n", "dotdot": b"../ck/" + STEP_DIR.encode(),
                "absolute": str(step).encode(), "300-bytes": b"step_" + b"0" * 295 + b"2", "empty": b"",
                "binary": bytes(range(256))}[v]
        latest.write_bytes(text)
    return Made(root)


def _g_symlink(case, ctx, d):
    root, step = _base(ctx, d)
    (d / "outside").mkdir()
    if case.variant == "stepdir":
        shutil.move(str(step), str(d / "outside" / STEP_DIR))
        step.symlink_to(d / "outside" / STEP_DIR)
    else:
        p = step / case.variant
        shutil.move(str(p), str(d / "outside" / case.variant))
        p.symlink_to(d / "outside" / case.variant)
    return Made(root)


def _g_external(case, ctx, d):
    import h5py

    root, step = _base(ctx, d)
    made = Made(root)
    if case.variant.startswith("fifo"):
        wire = Tripwire(d / "environ")
        made.tripwires.append(wire)
        target = str(wire.path)
    else:
        target = "/dev/zero"
    m = _manifest(step)
    name = _a_tensor(m, "model/layers.0.attention.wq.weight")
    ds = m["tensors"][name]["pieces"][0]["dataset"]
    _rewrite_dataset(step / "rank_00000.h5", ds, external=[(target, 0, h5py.h5f.UNLIMITED)])
    if case.variant.endswith("recomputed"):
        _forge(step, _recompute(step, m))
    return made


def _g_index_outside(case, ctx, d):
    import h5py
    import numpy as np

    root, step = _base(ctx, d)
    wire = Tripwire(d / "environ")
    made = Made(root, [wire])
    m = _manifest(step)
    name = _a_tensor(m, "model/layers.0.attention.wq.weight")
    shape = tuple(m["tensors"][name]["shape"])
    with h5py.File(step / "index.h5", "a") as f:
        del f[name]
        if case.variant.startswith("extlink"):
            f[name] = h5py.ExternalLink(str(wire.path), "/x")
        else:
            layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
            layout[:] = h5py.VirtualSource(str(wire.path), "x", shape=shape)
            f.create_virtual_dataset(name, layout)
    if case.variant.endswith("recomputed"):
        _forge(step, _recompute(step, m))
    return made


def _g_huge(case, ctx, d):
    root, step = _base(ctx, d)
    m = _manifest(step)
    name = _a_tensor(m, "model/layers.0.attention.wq.weight")
    t = m["tensors"][name]
    p = t["pieces"][0]
    v = case.variant
    if v == "shape-2^40x2^20":
        t["shape"] = [1 << 40, 1 << 20]
    elif v == "shape-32dims-2^31":
        t["shape"] = [1 << 31] * 32
        p.update(offset=[0] * 32, shape=[1 << 31] * 32, chunk=[1 << 31] * 32)
    elif v == "piece-2^40":
        t["shape"] = [1 << 40, t["shape"][1]]
        p["shape"] = [1 << 40, p["shape"][1]]
    elif v == "chunk-2^40":
        p["chunk"] = [1 << 40, 1 << 20]
        p["at"], p["crc"] = p["at"][:1], p["crc"][:1]
    elif v == "at-2^62":
        p["at"][0] = 1 << 62
    elif v == "bytes-2^62":
        m["files"]["rank_00000.h5"]["bytes"] = 1 << 62
    elif v == "zero-by-2^62-no-pieces":
        t["shape"], t["pieces"] = [0, 1 << 62], []
    elif v == "logical-shape-2^40":
        t["attrs"]["logical_shape"] = [1 << 40, 1 << 20]
    elif v == "offset-2^63":
        p["offset"] = [(1 << 63) - 1, 0]
    elif v == "fused-widths-2^62":
        t["attrs"].update(fused_widths=[1 << 62, -(1 << 62) + t["shape"][0]], fused_dim=0)
    _forge(step, m)
    return Made(root)


def _g_many(case, ctx, d):
    """One tensor of 65,536 single-element pieces in a 64 KiB shard of its own, every digest
    recomputed: a ~19 MB manifest (the 32-dimensional variant)."""

    root, step = _base(ctx, d)
    m = _manifest(step)
    n = 65537 if case.variant == "65537-pieces" else 65536
    dims = 32 if case.variant.startswith("uint8-32dims") else 1
    dtype = "uint8" if dims == 32 else "float32"
    item = _ITEMSIZE[dtype]
    rng = random.Random(case.seed)
    data = bytes(rng.randrange(256) for _ in range(n * item))
    pad = (20 << 20) if case.variant.endswith("20MB-shard") else 0  # a shard as large as the manifest
    (step / "rank_00001.h5").write_bytes(data + bytes(pad))
    if dims == 32:
        shape = [2] * 16 + [1] * 16
        coords = [[(i >> (15 - k)) & 1 for k in range(16)] + [0] * 16 for i in range(n)]
    else:
        shape = [n]
        coords = [[i] for i in range(n)]
    pieces = [{"file": "rank_00001.h5", "dataset": f"rank_state/rank_00001/flat/@{i}", "offset": c,
               "shape": [1] * dims, "chunk": [1] * dims, "at": [i * item],
               "crc": [zlib.crc32(data[i * item:(i + 1) * item])]} for i, c in enumerate(coords)]
    m["tensors"]["rank_state/rank_00001/flat"] = {"dtype": dtype, "shape": shape, "scalar": False,
                                                 "partition": "replicated", "attrs": {}, "pieces": pieces}
    m["files"]["rank_00001.h5"] = {"bytes": len(data) + pad, "meta_sha256": hashlib.sha256(bytes(pad)).hexdigest()}
    _forge(step, m)
    return Made(root)


def _g_nonregular(case, ctx, d):
    root, step = _base(ctx, d)
    target, kind = case.variant.split(":")
    if target == "stepdir":
        shutil.rmtree(step)
        _nonregular(step, kind, [])
    elif target == "latest":
        _nonregular(root / "latest", kind, [])
    else:
        _nonregular(step / target, kind, [])
    return Made(root)


def _edit_extra(m: dict, v: str) -> None:
    e = m["extra"]
    if v.startswith("step="):
        e["step"] = {"-5": -5, "999": 999, "1e30": 10 ** 30, "abc": "abc", "null": None, "2.5": 2.5,
                     "true": True}[v[5:]]
    elif v == "no-step":
        del e["step"]
    elif v == "no-scheduler":
        del e["scheduler"]
    elif v == "scheduler=str":
        e["scheduler"] = "abc"
    elif v == "scheduler.last_epoch=abc":
        e["scheduler"]["last_epoch"] = "abc"
    elif v == "param_groups=[]":
        e["param_groups"] = []
    elif v == "param_groups=[{}]":
        e["param_groups"] = [{}]
    elif v == "param_groups=str":
        e["param_groups"] = "abc"
    elif v == "param_groups.lr=abc":
        for g in e["param_groups"]:
            g["lr"] = "abc"
    elif v == "no-schedule-no-train_config":
        e.pop("schedule", None)
        e.pop("train_config", None)
    elif v == "schedule.steps=-1":
        e["schedule"]["steps"] = -1
    elif v == "data=list":
        e["data"] = [1, 2, 3]
    else:
        _edit_model(e, v)


def _edit_model(e: dict, v: str) -> None:
    model = e["model"]
    c = model["config"]
    if v == "n_layers=1e6":
        c["n_layers"] = 10 ** 6
    elif v == "dim=2**20":
        c["dim"] = 1 << 20
    elif v == "n_layers=1e6,dim=2**20":
        c["n_layers"], c["dim"] = 10 ** 6, 1 << 20
    elif v == "n_heads=0":
        c["n_heads"] = 0
    elif v == "vocab_size=-1":
        c["vocab_size"] = -1
    elif v == "config=str":
        model["config"] = "abc"
    elif v == "type=other":
        model["type"] = "mamba"
    elif v == "unknown-key":
        c["n_wings"] = 3
    else:
        raise ValueError(v)


def _g_extra(recompute: bool):
    def gen(case, ctx, d):
        root, step = _base(ctx, d)
        m = _manifest(step)
        if recompute:
            _edit_extra(m, case.variant)
            _forge(step, m)
        else:  # edited in place: the recorded digest is the saved one
            raw = json.loads((step / "manifest.json").read_text())
            _edit_extra(raw, case.variant)
            _forge(step, m, raw=_canonical(raw))
        return Made(root)
    return gen


def _g_step_disagree(case, ctx, d):
    root, step = _base(ctx, d)
    m = _manifest(step)
    if case.variant == "extra-step-1":
        m["extra"]["step"] = OLD
        _forge(step, m)
        return Made(root)
    m["step"] = OLD  # the directory, the manifest and latest say step 1; the trainer's state says 2
    new = root / OLD_DIR
    step.rename(new)
    (root / "latest").write_text(OLD_DIR + "\n")
    _forge(new, m)
    return Made(root)


def _edit_field(m: dict, v: str, step: Path) -> bytes | None:
    name = _a_tensor(m, "model/layers.0.attention.wq.weight")
    t = m["tensors"][name]
    p = t["pieces"][0]
    if v == "8GiB-declared":
        t["shape"] = [1 << 20, 2048]
    elif v == "piece-larger-than-file":
        p.update(shape=[1 << 20, t["shape"][1]], chunk=[1 << 20, t["shape"][1]])
    elif v == "chunk-beyond-file":
        p["at"][0] = 1 << 40
    elif v == "overlapping-chunks":
        p["at"][-1] = p["at"][0]
    elif v == "file-outside":
        p["file"] = "../rank_00000.h5"
    elif v == "unlisted-file":
        p["file"] = "rank_00007.h5"
    elif v == "absolute-name":
        m["tensors"]["/etc/x"] = m["tensors"].pop(name)
    elif v == "format-1":
        m["format_version"] = "1.1"
    elif v == "negative-step":
        m["step"] = -1
    elif v == "bool-as-int":
        t["shape"] = [True, t["shape"][1]]
    elif v == "unknown-dtype":
        t["dtype"] = "object"
    elif v == "no-index":
        m["files"].pop("index.h5")
    elif v == "deep-nesting":
        m["extra"]["deep"] = "@@DEEP@@"
        body = _canonical(m)
        deep = b"[" * 200000 + b"]" * 200000
        return body.replace(b'"@@DEEP@@"', deep)
    elif v == "huge-int-literal":
        m["extra"]["big"] = "@@BIG@@"
        return _canonical(m).replace(b'"@@BIG@@"', b"9" * 100000)
    elif v == "float-1e400":
        m["extra"]["inf"] = "@@INF@@"
        return _canonical(m).replace(b'"@@INF@@"', b"1e400")
    elif v == "nul-in-name":
        m["tensors"]["model/a\x00b"] = m["tensors"].pop(name)
    elif v == "world_size-0":
        m["world_size"] = 0
    elif v == "layout-list":
        m["layout"] = [1, 2]
    elif v == "files-dotdot":
        m["files"]["../rank_00000.h5"] = m["files"].pop("rank_00000.h5")
    elif v == "scalar-wrong":
        t["scalar"] = True
    elif v == "crc-negative":
        p["crc"][0] = -1
    elif v == "at-float":
        p["at"][0] = float(p["at"][0])
    elif v == "pieces-dict":
        t["pieces"] = {"0": p}
    elif v == "attrs-list":
        t["attrs"] = [1]
    elif v == "partition-int":
        t["partition"] = 3
    elif v == "fused-widths-bogus":
        t["attrs"].update(fused_widths=[3, 5], fused_dim=7)
    elif v == "tensor-null":
        m["tensors"][name] = None
    else:
        raise ValueError(v)
    return None


def _g_field(case, ctx, d):
    root, step = _base(ctx, d)
    m = _manifest(step)
    raw = _edit_field(m, case.variant, step)
    if raw is not None:  # a body the canonical JSON cannot carry: its digest over the text as parsed back
        try:
            parsed = json.loads(raw)
            digest = hashlib.sha256(_canonical(parsed)).hexdigest()
        except (ValueError, RecursionError):
            digest = "0" * 64
        raw = raw[:-1] + b',"manifest_sha256":"' + digest.encode() + b'"}'
        _forge(step, m, raw=raw)
    else:
        _forge(step, m)
    return Made(root)


def _g_forger(case, ctx, d):
    root, step = _base(ctx, d)
    m = _manifest(step)
    T = m["tensors"]
    v = case.variant
    if v == "swap-wq-layers":
        a, b = "model/layers.0.attention.wq.weight", "model/layers.1.attention.wq.weight"
        T[a]["pieces"], T[b]["pieces"] = T[b]["pieces"], T[a]["pieces"]
    elif v == "swap-exp_avg-exp_avg_sq":
        a, b = "optim/layers.0.feed_forward.w1.weight/exp_avg", "optim/layers.0.feed_forward.w1.weight/exp_avg_sq"
        T[a]["pieces"], T[b]["pieces"] = T[b]["pieces"], T[a]["pieces"]
    elif v == "dtype-float32-int32":
        T["model/layers.0.attention.wo.weight"]["dtype"] = "int32"
    elif v == "dtype-of-optim-int32":
        T["optim/layers.1.attention.wo.weight/exp_avg"]["dtype"] = "int32"
    elif v == "logical-shape-shrunk":
        t = T["model/tok_embeddings.weight"]
        t["attrs"]["logical_shape"] = [t["shape"][0] - 1, t["shape"][1]]
    elif v == "swap-pieces-via-at":
        a, b = T["model/layers.0.feed_forward.w2.weight"], T["model/layers.1.feed_forward.w2.weight"]
        for pa, pb in zip(a["pieces"], b["pieces"]):
            pa["at"], pb["at"] = pb["at"], pa["at"]
            pa["crc"], pb["crc"] = pb["crc"], pa["crc"]
    _forge(step, m, drop_sig=case.index % 2 == 1)
    return Made(root)


def crc_preserving(orig: bytes, edited: bytes, fix_at: int) -> bytes:
    """``edited`` (as long as ``orig``) with the 4 bytes at ``fix_at`` chosen so that its CRC-32
    equals ``orig``'s. A CRC-32 is affine over GF(2): the 32 bits at ``fix_at`` move it by a
    linear map of full rank, so solving 32 equations fits any target."""
    n, zero = len(orig), zlib.crc32(bytes(len(orig)))
    basis: list[tuple[int, int]] = []  # (effect on the CRC, the bits that make it), reduced
    for bit in range(32):
        c = bytearray(n)
        c[fix_at + bit // 8] = 1 << (bit % 8)
        v, comb = zlib.crc32(bytes(c)) ^ zero, 1 << bit
        for bv, bc in basis:
            if v ^ bv < v:
                v, comb = v ^ bv, comb ^ bc
        if v:
            basis.append((v, comb))
    want, sol = zlib.crc32(orig) ^ zlib.crc32(edited), 0
    for bv, bc in sorted(basis, reverse=True):
        if want ^ bv < want:
            want, sol = want ^ bv, sol ^ bc
    out = bytearray(edited)
    for bit in range(32):
        if sol >> bit & 1:
            out[fix_at + bit // 8] ^= 1 << (bit % 8)
    assert zlib.crc32(bytes(out)) == zlib.crc32(orig), "the CRC-32 fit"
    return bytes(out)


def forge_chunk(step: Path, name: str, chunk: int = 0) -> None:
    """Chunk ``chunk`` of tensor ``name`` (float32) rewritten in its shard: its first value
    1000.0, the next four bytes fitted so the chunk's CRC-32 is unchanged; nothing else touched."""
    p = json.loads((step / "manifest.json").read_text())["tensors"][name]["pieces"][0]
    at, nb = p["at"][chunk], 4 * math.prod(p["chunk"])
    with open(step / p["file"], "r+b") as f:
        f.seek(at)
        orig = f.read(nb)
        f.seek(at)
        f.write(crc_preserving(orig, struct.pack("<f", 1000.0) + orig[4:], 4))


def _g_crc_fit(case, ctx, d):
    root, step = _base(ctx, d)
    name = {"model-first-value": "model/layers.0.attention.wq.weight",
            "optim-first-value": "optim/layers.1.feed_forward.w2.weight/exp_avg",
            "model-last-chunk": "model/tok_embeddings.weight"}[case.variant]
    pieces = _manifest(step)["tensors"][name]["pieces"]
    forge_chunk(step, name, len(pieces[0]["at"]) - 1 if case.variant == "model-last-chunk" else 0)
    return Made(root)


def _g_rollback(case, ctx, d):
    """The whole reference directory, signed state included; `latest` sent back to step 1."""
    root = d / "ck"
    shutil.copytree(ctx.ck, root, symlinks=True)
    if case.variant == "step2-removed":
        shutil.rmtree(root / STEP_DIR)
    (root / "latest").write_text(OLD_DIR + "\n")
    return Made(root)


def _g_other_run(case, ctx, d):
    """Another run's signed step 2 (same key, another directory id) in this directory."""
    root, step = _base(ctx, d)
    shutil.copy2(ctx.ck / "signed_state.json", root / "signed_state.json")
    if case.variant == "replaces-step2":
        shutil.rmtree(step)
        shutil.copytree(ctx.foreign / STEP_DIR, step)
    else:
        m = _manifest(ctx.foreign / STEP_DIR)
        three = f"step_{STEP + 1:08d}"
        shutil.copytree(ctx.foreign / STEP_DIR, root / three)
        m["step"] = m["extra"]["step"] = STEP + 1  # a forger renumbers it too: the signature then fails
        if case.index % 2:
            _forge(root / three, m)
        (root / "latest").write_text(three + "\n")
    return Made(root)


def _g_unsigned(case, ctx, d):
    src = ctx.plain / "ck" if case.cls == "unsigned" else ctx.ref / "other-key"
    root, _ = _base(ctx, d, src)
    return Made(root)


# -- Hugging Face directories --
def _hf_base(ctx, d) -> Path:
    out = d / "hf"
    shutil.copytree(ctx.hf, out)
    return out


def _hf_config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def _g_hf_pristine(case, ctx, d):
    return Made(_hf_base(ctx, d))


def _g_hf_config(case, ctx, d):
    out = _hf_base(ctx, d)
    c = _hf_config(out)
    v = case.variant
    raw = None
    if v == "hidden-65536x64-layers":
        c.update(hidden_size=65536, num_hidden_layers=64, intermediate_size=4 * 65536)
    elif v == "layers-1e6":
        c["num_hidden_layers"] = 10 ** 6
    elif v == "vocab-1e9":
        c["vocab_size"] = 10 ** 9
    elif v == "intermediate-1e9":
        c["intermediate_size"] = 10 ** 9
    elif v == "positions-1e12":
        c["max_position_embeddings"] = 10 ** 12
    elif v == "not-json":
        raw = b"{not json"
    elif v == "list":
        raw = b"[1, 2]"
    elif v == "model_type":
        c["model_type"] = "gpt2"
    elif v == "rope_scaling":
        c["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    elif v == "head_dim":
        c["head_dim"] = 3
    elif v == "2MiB":
        c["padding"] = "x" * (2 << 20)
    elif v == "vocab-str":
        c["vocab_size"] = "64"
    elif v == "kv-heads-3":
        c["num_key_value_heads"] = 3
    elif v == "eps-negative":
        c["rms_norm_eps"] = -1.0
    elif v == "tie-str":
        c["tie_word_embeddings"] = "yes"
    (out / "config.json").write_bytes(raw if raw is not None else json.dumps(c).encode())
    return Made(out)


def _st_header(path: Path) -> tuple[int, dict, bytes]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n]), data[8 + n:]


def _st_write(path: Path, header: dict, body: bytes, n: int | None = None) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes((len(h) if n is None else n).to_bytes(8, "little") + h + body)


def _g_hf_flip(case, ctx, d):
    rng = random.Random(case.seed)
    out = _hf_base(ctx, d)
    p = out / "model.safetensors"
    n, _, _ = _st_header(p)
    _flip(p, rng, 0, 8 + n)
    return Made(out)


def _g_hf_trunc(case, ctx, d):
    rng = random.Random(case.seed)
    out = _hf_base(ctx, d)
    p = out / "model.safetensors"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate([0, 7, size - 1][case.index] if case.index < 3 else rng.randrange(size))
    return Made(out)


def _g_hf_header(case, ctx, d):
    out = _hf_base(ctx, d)
    p = out / "model.safetensors"
    n, h, body = _st_header(p)
    v = case.variant
    names = sorted(k for k in h if k != "__metadata__")
    first = names[0]
    if v == "length-2^63":
        data = bytearray(p.read_bytes())
        data[:8] = ((1 << 63) - 1).to_bytes(8, "little")
        p.write_bytes(bytes(data))
        return Made(out)
    if v == "length-64MiB+1":
        data = bytearray(p.read_bytes())
        data[:8] = ((64 << 20) + 1).to_bytes(8, "little")
        p.write_bytes(bytes(data))
        return Made(out)
    if v == "offsets-outside":
        a, b = h[first]["data_offsets"]
        h[first]["data_offsets"] = [a + (1 << 40), b + (1 << 40)]
    elif v == "offsets-overlap":  # the last tensor moved 4 bytes onto its neighbour, its length kept
        last = max((k for k in names), key=lambda k: h[k]["data_offsets"][0])
        a, b = h[last]["data_offsets"]
        h[last]["data_offsets"] = [a - 4, b - 4]
    elif v == "dtype-F64":
        h[first]["dtype"] = "F64"
    elif v == "shape-wrong":
        h[first]["shape"] = [h[first]["shape"][0] + 1] + h[first]["shape"][1:]
    elif v == "extra-tensor":
        end = max(e["data_offsets"][1] for k, e in h.items() if k != "__metadata__")
        h["model.layers.0.self_attn.q_proj.bias"] = {"dtype": "F32", "shape": [1], "data_offsets": [end, end + 4]}
        body = body + b"\0\0\0\0"
    elif v == "not-object":
        _st_write(p, [1, 2], body)  # type: ignore[arg-type]
        return Made(out)
    _st_write(p, h, body)
    return Made(out)


def _g_hf_nonregular(case, ctx, d):
    out = _hf_base(ctx, d)
    target, kind = case.variant.split(":")
    if target == "index":
        shutil.move(str(out / "model.safetensors"), str(out / "model-00001-of-00001.safetensors"))
        _nonregular(out / "model.safetensors.index.json", kind, [])
    else:
        _nonregular(out / target, kind, [])
    return Made(out)


def _g_hf_links(case, ctx, d):
    out = _hf_base(ctx, d)
    v = case.variant
    if v == "safetensors-symlink-out":
        shutil.move(str(out / "model.safetensors"), str(d / "elsewhere.safetensors"))
        (out / "model.safetensors").symlink_to(d / "elsewhere.safetensors")
    elif v == "config-symlink-passwd":
        (out / "config.json").unlink()
        (out / "config.json").symlink_to("/etc/passwd")
    else:
        shutil.move(str(out / "model.safetensors"), str(d / "x.safetensors"))
        n, h, _ = _st_header(d / "x.safetensors")
        name = {"index-dotdot": "../x.safetensors", "index-absolute": str(d / "x.safetensors"),
                "index-missing-file": "model-00009-of-00009.safetensors"}[v]
        index = {"metadata": {}, "weight_map": {k: name for k in h if k != "__metadata__"}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return Made(out)


# -- DCP directories --
def _dcp_base(ctx, d) -> Path:
    out = d / "dcp"
    shutil.copytree(ctx.dcp, out)
    return out


def _g_dcp_pristine(case, ctx, d):
    return Made(_dcp_base(ctx, d))


def _g_dcp_flip(file):
    def gen(case, ctx, d):
        rng = random.Random(case.seed)
        out = _dcp_base(ctx, d)
        _flip(out / file, rng)
        return Made(out)
    return gen


def _g_dcp_trunc(case, ctx, d):
    rng = random.Random(case.seed)
    out = _dcp_base(ctx, d)
    p = out / (".metadata" if case.index % 2 == 0 else "__0_0.distcp")
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(rng.randrange(size))
    return Made(out)


def _g_dcp_nonregular(case, ctx, d):
    out = _dcp_base(ctx, d)
    target, kind = case.variant.split(":")
    _nonregular(out / target, kind, [])
    return Made(out)


def _g_dcp_links(case, ctx, d):
    out = _dcp_base(ctx, d)
    p = out / case.variant
    shutil.move(str(p), str(d / ("outside" + case.variant)))
    p.symlink_to(d / ("outside" + case.variant))
    return Made(out)


GENERATORS = {
    "pristine": _g_pristine, "stray-nonregular": _g_stray, "old-fallback": _g_old_fallback,
    "flip-manifest": _g_flip("manifest.json"), "flip-index": _g_flip("index.h5"), "flip-shard-meta": _g_flip("meta"),
    "flip-shard-model": _g_flip("model"), "flip-shard-optim": _g_flip("optim"), "flip-latest": _g_flip("latest"),
    "trunc-shard": _g_trunc("rank_00000.h5"), "trunc-index": _g_trunc("index.h5"),
    "trunc-manifest": _g_trunc("manifest.json"), "grow-shard": _g_grow,
    "stale": _g_stale(lambda ctx: ctx.ck / OLD_DIR), "foreign": _g_stale(lambda ctx: ctx.foreign / STEP_DIR),
    "latest-old": _g_latest_old, "latest-bad": _g_latest_bad, "symlink": _g_symlink,
    "external-storage": _g_external, "index-outside": _g_index_outside, "huge-shape": _g_huge,
    "many-pieces": _g_many, "nonregular": _g_nonregular, "extra-trainer": _g_extra(True),
    "extra-edited": _g_extra(False), "extra-model": _g_extra(True), "step-disagree": _g_step_disagree,
    "manifest-field": _g_field, "forger": _g_forger, "unsigned": _g_unsigned, "wrong-key": _g_unsigned,
    "crc-fit": _g_crc_fit, "rollback": _g_rollback, "other-run": _g_other_run,
    "hf-pristine": _g_hf_pristine, "hf-config-huge": _g_hf_config, "hf-config-bad": _g_hf_config,
    "hf-flip-header": _g_hf_flip, "hf-trunc": _g_hf_trunc, "hf-header": _g_hf_header,
    "hf-nonregular": _g_hf_nonregular, "hf-links": _g_hf_links,
    "dcp-pristine": _g_dcp_pristine, "dcp-flip-metadata": _g_dcp_flip(".metadata"),
    "dcp-flip-data": _g_dcp_flip("__0_0.distcp"), "dcp-trunc": _g_dcp_trunc, "dcp-nonregular": _g_dcp_nonregular,
    "dcp-links": _g_dcp_links,
}
assert set(GENERATORS) == set(CLASS_BY_NAME), set(GENERATORS) ^ set(CLASS_BY_NAME)


def make_case(case: Case, ctx: Ctx, d: Path) -> Made:
    if d.exists():
        _rmtree(d)
    d.mkdir(parents=True)
    return GENERATORS[case.cls](case, ctx, d)


def _rmtree(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    if d.exists():  # e.g. a directory made unreadable
        subprocess.run(["rm", "-rf", str(d)], check=False)


# -- the entry points: _call(ctx, ep, target, scratch) -> ("ok" | "refused" | "untidy", detail, output) --
@contextlib.contextmanager
def captured():
    """stdout and stderr of the block, Python's and native writes to fds 1 and 2 alike."""
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            s.flush()
    saved = os.dup(1), os.dup(2)
    files = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    res: dict[str, str] = {}
    pyout, pyerr = io.StringIO(), io.StringIO()
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        with contextlib.redirect_stdout(pyout), contextlib.redirect_stderr(pyerr):
            yield res
    finally:
        for s in (sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                s.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for f in files:
            f.seek(0)
        res["out"] = pyout.getvalue() + files[0].read().decode(errors="replace")
        res["err"] = pyerr.getvalue() + files[1].read().decode(errors="replace")
        for f in files:
            f.close()


def _cli(argv: list[str], prog: str = "hpcml") -> tuple[str, str, str]:
    """("ok" | "refused" | "untidy", detail, stdout) of ``hpcml argv`` in-process."""
    from hpcml.cli import main

    with captured() as io_:
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return (*_cli_outcome(rc, io_["err"], verify=argv[:2] == ["ckpt", "verify"], prog=prog), io_["out"])


def _cli_outcome(rc: int, err: str, verify: bool = False, prog: str = "hpcml") -> tuple[str, str]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if rc == 0:
        return "ok", ""
    if "Traceback" in err:
        return "untidy", f"exit {rc} with a traceback: {lines[-1][:300] if lines else ''}"
    if verify and rc == 1 and lines and all(ln.startswith("hpcml ckpt verify: ") for ln in lines):
        return "refused", lines[0][:300]
    if rc == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "):
        return "refused", lines[0][:300]
    errs = [ln for ln in lines if ln.startswith(f"{prog}: error: ")]
    if prog != "hpcml" and rc == 2 and len(errs) == 1:  # a workflow: its log lines may come first
        return "refused", errs[0][:300]
    return "untidy", f"exit {rc}, {len(lines)} stderr lines: " + " | ".join(ln[:200] for ln in lines[:4])


def _ep_verify(ctx, target, scratch):
    outcome, detail, _ = _cli(["ckpt", "verify", str(target)])
    return outcome, detail, None


def _ep_inspect(ctx, target, scratch):
    outcome, detail, out = _cli(["ckpt", "inspect", str(target), "--json"])
    if outcome != "ok":
        return outcome, detail, None
    info = json.loads(out)
    for k in ("path", "extra", "save_id"):  # where it is, the JSON state as stored, which save: shown as is
        info.pop(k, None)
    return outcome, detail, info


def _ep_export(ctx, target, scratch):
    from safetensors.torch import load_file

    out = scratch / "m.safetensors"
    outcome, detail, _ = _cli(["ckpt", "export", str(target), str(out)])
    return outcome, detail, (load_file(str(out)) if outcome == "ok" else None)


def _ep_export_hf(ctx, target, scratch):
    from safetensors.torch import load_file

    out = scratch / "hf"
    outcome, detail, _ = _cli(["ckpt", "export", str(target), str(out), "--format", "hf"])
    if outcome != "ok":
        return outcome, detail, None
    files = sorted(p.name for p in out.iterdir())
    tensors = {}
    for p in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    return outcome, detail, {"files": files, "config": json.loads((out / "config.json").read_text()),
                             "tensors": tensors}


def _ep_convert(ctx, target, scratch):
    from hpcml.ckpt.dcp_safe import DcpReader

    out = scratch / "dcp"
    outcome, detail, _ = _cli(["ckpt", "convert", str(target), str(out), "--to", "dcp"])
    if outcome != "ok":
        return outcome, detail, None
    r = DcpReader(out)
    return outcome, detail, {k: r.value(k) for k in sorted(r.entries) if k != "hpcml.extra"}


def _ep_consolidate(ctx, target, scratch):
    import h5py

    out = scratch / "one.h5"
    outcome, detail, _ = _cli(["ckpt", "consolidate", str(target), str(out)])
    if outcome != "ok":
        return outcome, detail, None
    got = {}
    with h5py.File(out, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                got[name] = {"data": obj[()], "attrs": {k: _plain(v) for k, v in obj.attrs.items()}}
        f.visititems(visit)
        got["@step"] = _plain(f.attrs.get("step"))
    return outcome, detail, got


def _plain(v):
    import numpy as np

    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return v


def _ep_convert_in(ctx, target, scratch):
    from hpcml.ckpt.checked import Checkpoint

    out = scratch / "ck"
    outcome, detail, _ = _cli(["ckpt", "convert", str(target), str(out), "--to", "hpcml"])
    if outcome != "ok":
        return outcome, detail, None
    with Checkpoint(out) as ck:
        got = {n: ck.read(n)[0] for n in ck.names()}
        got["@step"], got["@extra"] = ck.step, ck.extra
    return outcome, detail, got


def _trainer_state(tr) -> dict:
    return {"tensors": {n: t.detach().clone() for n, t in tr.state_tensors().items()}, "step": tr.step,
            "scheduler": tr.scheduler.state_dict(), "schedule": tr.schedule.state(),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in tr.optimizer.param_groups]}


def _scramble(tr) -> None:
    """Every value a resume must set, set to something no checkpoint holds."""
    import torch

    with torch.no_grad():
        for t in tr.state_tensors(create=True).values():
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype != torch.uint8:
                t.fill_(-7)
    torch.manual_seed(424242)
    tr.step = -12345
    tr.scheduler.last_epoch = -12345
    for g in tr.optimizer.param_groups:
        g["lr"] = -1.0


def _ep_resume(ctx, target, scratch):
    from hpcml.train.checkpointing import load_trainer

    tr = ctx.trainer()
    _scramble(tr)
    with captured():
        load_trainer(tr, target)
    return "ok", "", _trainer_state(tr)


def _workflow():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hpcml_corpus_llm_pretrain", REPO / "workflows" / "llm_pretrain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_WF = None


def _ep_init_from(ctx, target, scratch):
    """workflows/llm_pretrain.py --init-from DIR, in-process, with training stubbed out: what
    the trainer holds when fit() would start."""
    global _WF
    if _WF is None:
        _WF = _workflow()
    from hpcml.train import recipe  # the script imports its trainer builder from here when main runs

    wf, seen = _WF, {}
    build = recipe.build_llm_trainer

    def recording(*a, **k):
        tr = build(*a, **k)

        def fit(*_a, **_k):
            seen["params"] = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
            seen["step"] = tr.step
            tr.step = tr.config.steps
            return []
        tr.fit = fit
        return tr

    recipe.build_llm_trainer = recording
    hook = sys.excepthook
    try:
        with captured() as io_:
            try:
                rc = wf.main(["--init-from", str(target), "--steps", "1", "--global-batch", "2", "--seq-len", "16",
                              "--no-progress"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        recipe.build_llm_trainer = build
        sys.excepthook = hook
    outcome, detail = _cli_outcome(rc, io_["err"], prog="llm_pretrain")
    if outcome != "ok":
        return outcome, detail, None
    if "params" not in seen:
        return "untidy", "exit 0 without building a trainer", None
    return "ok", "", seen


EPS = {"verify": _ep_verify, "inspect": _ep_inspect, "resume": _ep_resume, "export": _ep_export,
       "export-hf": _ep_export_hf, "convert": _ep_convert, "consolidate": _ep_consolidate,
       "init-from": _ep_init_from, "convert-in": _ep_convert_in}


def _call(ctx: Ctx, ep: str, target: Path, scratch: Path):
    """(outcome, detail, output): "ok" with its output, "refused", "untidy", "traceback" or "memory"."""
    from hpcml.errors import HpcmlError

    try:
        return EPS[ep](ctx, target, scratch)
    except HpcmlError as e:
        msg = str(e)
        if "\n" in msg:
            return "untidy", f"{type(e).__name__} over {msg.count(chr(10)) + 1} lines: {msg[:300]}", None
        return "refused", f"{type(e).__name__}: {msg[:300]}", None
    except MemoryError as e:
        return "memory", f"MemoryError: {str(e)[:200]}", None
    except Exception as e:  # noqa: BLE001 -- the very thing measured
        msg = str(e)
        if isinstance(e, RuntimeError) and ("allocate memory" in msg or "DefaultCPUAllocator" in msg):
            return "memory", f"{type(e).__name__}: {msg[:200]}", None
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f" (at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})" if tb is not None else ""
        return "traceback", f"{type(e).__name__}: {msg[:300]}{where}", None


def same(a, b, path: str = "") -> str | None:
    """None if equal (tensors bitwise, NaN equal to NaN), else where they first differ."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
        eq = torch.equal(a, b) or (a.is_floating_point() and bool(torch.all((a == b) | (a.isnan() & b.isnan()))))
        return None if eq else f"{path}: values differ"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a2, b2 = np.asarray(a), np.asarray(b)
        if a2.dtype != b2.dtype or a2.shape != b2.shape:
            return f"{path}: {a2.dtype} {list(a2.shape)} vs {b2.dtype} {list(b2.shape)}"
        ok = np.array_equal(a2, b2, equal_nan=a2.dtype.kind == "f")
        return None if ok else f"{path}: values differ"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            extra, missing = sorted(set(a) - set(b))[:3], sorted(set(b) - set(a))[:3]
            return f"{path}: keys differ (+{extra} -{missing})"
        for k in a:
            why = same(a[k], b[k], f"{path}/{k}")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = same(x, y, f"{path}[{i}]")
            if why:
                return why
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                       and not isinstance(a, bool) and not isinstance(b, bool)):
        return f"{path}: {type(a).__name__} {str(a)[:40]} vs {type(b).__name__} {str(b)[:40]}"
    return None if a == b else f"{path}: {str(a)[:60]} vs {str(b)[:60]}"


def run_op(ctx: Ctx, case: Case, ep: str, made: Made, scratch: Path) -> dict:
    """One entry point on one crafted case, classified (before :func:`judge`)."""
    for w in made.tripwires:
        w.arm()
    t0 = time.perf_counter()
    outcome, detail, output = _call(ctx, ep, made.target, scratch)
    seconds = time.perf_counter() - t0
    outside = [str(w.path) for w in made.tripwires if w.check()]
    if outcome == "ok":
        if ep == "verify":
            outcome = "ok-correct" if case.benign else "silent-wrong"
            detail = "" if case.benign else "verify found nothing wrong"
        else:
            why = same(output, ctx.expected[ep])
            outcome, detail = ("ok-correct", "") if why is None else ("silent-wrong", why[:300])
    if outside:
        outcome, detail = "outside", f"opened {outside[0]} ({outcome}: {detail})"[:300]
    return {"outcome": outcome, "detail": detail, "seconds": round(seconds, 4)}


def run_case_inprocess(ctx: Ctx, case: Case, eps=None) -> list[dict]:
    """Every entry point of ``case`` in this process (no time or memory limit: the unit test
    runs only the classes that cannot hang or explode this way)."""
    d = ctx.workdir / "inproc" / (("key-" if ctx.keyed else "") + case.id.replace("/", "_"))
    rows = []
    with key_env(ctx.keyed):
        made = make_case(case, ctx, d)
        rows = _run_made(ctx, case, made, d, eps)
    return rows


def _run_made(ctx: Ctx, case: Case, made: Made, d: Path, eps) -> list[dict]:
    rows = []
    try:
        for ep in eps or case.eps:
            scratch = d / "out" / ep
            scratch.mkdir(parents=True, exist_ok=True)
            r = run_op(ctx, case, ep, made, scratch)
            outcome, ok = judge(case, ep, r["outcome"], ctx.keyed)
            rows.append({"case": case.id, "class": case.cls, "ep": ep, "keyed": ctx.keyed, **r, "outcome": outcome,
                         "pass": ok, "growth_mb": None})
            _rmtree(scratch)
    finally:
        _rmtree(d)
    return rows


def worker_main(args) -> int:
    """A long-lived worker: reads {"case", "eps", "keyed"} lines, answers with gen/start/done
    lines. HPCML_CKPT_KEY is set for a keyed case and unset otherwise."""
    rfile = os.fdopen(args.rfd, "r")
    wfd = args.wfd

    def send(obj) -> None:
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(wfd, data):]

    import resource

    import torch

    import hpcml.cli  # noqa: F401 -- the imports are the start-up cost, paid once

    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    ctxs = {False: Ctx(workdir, False)}
    if (workdir / "ref-key" / "expected.pt").exists():
        ctxs[True] = Ctx(workdir, True)
    for c in ctxs.values():
        c.expected  # noqa: B018
    trainer = ctxs[False].trainer()
    for c in ctxs.values():
        c._trainer = trainer
    size = _status_kb()["VmSize"] * 1024
    with contextlib.suppress(ValueError, OSError):  # a safety net behind the parent's RSS watch
        resource.setrlimit(resource.RLIMIT_AS, (size + (6 << 30), resource.RLIM_INFINITY))
    send({"ready": True, "pid": os.getpid(), "rss": _status_kb()["VmRSS"]})
    for line in rfile:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        keyed = bool(msg.get("keyed"))
        case, ctx = case_from_id(msg["case"]), ctxs.get(keyed)
        d = workdir / "cases" / (("key-" if keyed else "") + case.id.replace("/", "_"))
        with key_env(keyed):
            try:
                if ctx is None:
                    raise RuntimeError("no keyed reference in the workdir")
                made = make_case(case, ctx, d)
            except Exception as e:  # noqa: BLE001 -- a generator bug is the harness's, reported as such
                send({"gen": case.id, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            send({"gen": case.id, "ok": True})
            for ep in msg["eps"]:
                scratch = d / "out" / ep
                scratch.mkdir(parents=True, exist_ok=True)
                _reset_hwm()
                rss0 = _status_kb()["VmRSS"]
                send({"start": ep, "rss": rss0})
                bad = (msg.get("sabotage") or {}).get(ep)
                r = _sabotage(bad) if bad else run_op(ctx, case, ep, made, scratch)
                growth = (_status_kb()["VmHWM"] - rss0) / 1024
                if growth > LIMIT_MB and r["outcome"] not in FATAL:
                    r = {**r, "outcome": "memory", "detail": f"peak RSS grew {growth:.0f} MB ({r['outcome']})"}
                send({"done": ep, **r, "growth_mb": round(growth, 1)})
                _rmtree(scratch)
        _rmtree(d)
        send({"case_done": case.id})
    return 0


def _sabotage(how: str) -> dict:
    """Misbehave instead of an entry point: the harness's own check (its limits hold)."""
    if how == "hang":
        time.sleep(3600)
    elif how == "memory":
        hog = bytearray(1 << 30)
        for i in range(0, len(hog), 4096):
            hog[i] = 1
        time.sleep(3600)
    elif how == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)

    def raising(*_):
        raise KeyError("sabotage")
    EPS["sabotage"] = raising
    return {**dict(zip(("outcome", "detail"), _call(None, "sabotage", Path("/"), Path("/"))[:2])), "seconds": 0.0}


# ------------------------------------------------------------------------------------------
# parent side: workers, limits, the table
# ------------------------------------------------------------------------------------------
class Worker:
    """One worker process and its two pipes; restarted when killed."""

    def __init__(self, workdir: Path, idx: int) -> None:
        self.workdir, self.idx = workdir, idx
        self.proc: subprocess.Popen | None = None
        self.wfile = None
        self.rfd: int | None = None
        self.starts = 0

    def start(self) -> None:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("HPCML_CKPT_KEY", None)
        with open(self.workdir / f"worker-{self.idx}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", "--workdir", str(self.workdir),
                 "--rfd", str(r1), "--wfd", str(w2)],
                pass_fds=(r1, w2), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True, cwd=str(REPO))
        os.close(r1)
        os.close(w2)
        self.wfile = os.fdopen(w1, "w")
        self.rfd, self.buf = r2, b""
        self.starts += 1
        msg = self.recv(300)
        if not isinstance(msg, dict) or not msg.get("ready"):
            self.kill()
            raise RuntimeError(f"worker did not start ({msg}); see {self.workdir}/worker-{self.idx}.log")

    def send(self, obj) -> None:
        self.wfile.write(json.dumps(obj) + "\n")
        self.wfile.flush()

    def recv(self, timeout: float, rss_limit_kb: int | None = None):
        """The next message; "timeout", "memory" or ("died", how)."""
        deadline = time.monotonic() + timeout
        while True:
            if b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                return json.loads(line)
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([self.rfd], [], [], min(left, 0.02))
            if ready:
                chunk = os.read(self.rfd, 1 << 16)
                if not chunk:
                    return ("died", self._death())
                self.buf += chunk
            elif rss_limit_kb is not None and _rss_kb(self.proc.pid) > rss_limit_kb:
                return "memory"

    def _death(self) -> str:
        rc = self.proc.wait()
        self.proc = None
        return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
        if self.wfile is not None:
            with contextlib.suppress(Exception):
                self.wfile.close()
            self.wfile = None
        if self.rfd is not None:
            os.close(self.rfd)
            self.rfd = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_in_worker(w: Worker, case: Case, keyed: bool, limit_s: float = LIMIT_S,
                  sabotage: dict | None = None, stop_after_kill: bool = False) -> list[dict]:
    """Every entry point of ``case`` in worker ``w`` under the limits; restarts it when killed.
    ``sabotage``: entry point -> hang | memory | crash | traceback, done instead (a self-check).
    ``stop_after_kill``: once an entry point was killed, the rest of the case is ``skipped``
    (a test that fails anyway need not wait for every hang)."""
    rows, remaining = [], list(case.eps)

    def row(ep, outcome, detail, seconds=None, growth=None):
        outcome, ok = judge(case, ep, outcome, keyed)
        rows.append({"case": case.id, "class": case.cls, "ep": ep, "keyed": keyed, "outcome": outcome,
                     "pass": ok, "detail": detail, "seconds": seconds, "growth_mb": growth})

    while remaining:
        if not w.alive():
            w.kill()
            w.start()
        w.send({"case": case.id, "eps": remaining, "keyed": keyed, "sabotage": sabotage})
        msg = w.recv(120)
        if not isinstance(msg, dict) or "gen" not in msg:
            w.kill()
            for ep in remaining:
                row(ep, "gen-error", f"generating the case: {msg}")
            return rows
        if not msg["ok"]:
            for ep in remaining:
                row(ep, "gen-error", msg["error"])
            return rows
        while remaining:
            ep = remaining[0]
            start = w.recv(120)
            if not isinstance(start, dict) or start.get("start") != ep:
                w.kill()
                row(ep, "crash" if isinstance(start, tuple) else "hang", f"before the operation: {start}")
                remaining.pop(0)
                break
            t0 = time.monotonic()
            # a sabotaged entry point gets the limit under test; the others keep the corpus's own
            lim = limit_s if not sabotage or ep in sabotage else max(limit_s, LIMIT_S)
            done = w.recv(lim, rss_limit_kb=start["rss"] + LIMIT_MB * 1024)
            took = round(time.monotonic() - t0, 3)
            if isinstance(done, dict):
                row(ep, done["outcome"], done["detail"], done["seconds"], done["growth_mb"])
                remaining.pop(0)
                continue
            if done == "timeout":
                w.kill()
                row(ep, "hang", f"killed after {lim:.0f} s", took)
            elif done == "memory":
                w.kill()
                row(ep, "memory", f"RSS over baseline + {LIMIT_MB} MB: killed", took)
            else:
                row(ep, "crash", f"worker died: {done[1]}", took)
                w.kill()
            remaining.pop(0)
            if stop_after_kill:
                for rest in remaining:
                    row(rest, "skipped", f"after a {rows[-1]['outcome']} in {ep}")
                return rows
            break
        else:
            end = w.recv(60)
            if not (isinstance(end, dict) and end.get("case_done") == case.id):
                w.kill()
    return rows


def setup_references(workdir: Path, with_key: bool = True) -> dict:
    """:func:`build_references` in a process of its own."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HPCML_CKPT_KEY", None)
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--setup", "--workdir", str(workdir)]
                       + ([] if with_key else ["--no-key-setup"]), capture_output=True, text=True, env=env,
                       cwd=str(REPO), timeout=900)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return {"error": (r.stderr.strip().splitlines() or lines or ["?"])[-1], "rc": r.returncode}
    return json.loads(lines[-1])


def run_matrix(cases: list[tuple], workdir: Path, jobs: int, progress: bool = True,
               limit_s: float = LIMIT_S, stop_after_kill: bool = False) -> list[dict]:
    """Every (case, keyed[, sabotage]) through its entry points, in ``jobs`` workers."""
    todo: queue.Queue = queue.Queue()
    for c in cases:
        todo.put(c)
    rows: list[dict] = []
    lock = threading.Lock()
    done = [0]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        w = Worker(workdir, i)
        try:
            while True:
                try:
                    c, keyed, *bad = todo.get_nowait()
                except queue.Empty:
                    return
                got = run_in_worker(w, c, keyed, limit_s, bad[0] if bad else None, stop_after_kill)
                with lock:
                    rows.extend(got)
                    done[0] += 1
                    bad = [r for r in got if not r["pass"]]
                    if progress and (bad or done[0] % 25 == 0):
                        mark = " ".join(f"{r['ep']}={r['outcome']}" for r in bad)
                        print(f"  [{done[0]}/{len(cases)}] {'key ' if keyed else ''}{c.id} {mark}",
                              file=sys.stderr, flush=True)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            with contextlib.suppress(Exception):
                w.send({"quit": True})
            w.kill()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    order = {(c[0].id, c[1]): i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: (order[(r["case"], r["keyed"])], ALL_EPS.index(r["ep"])))
    return rows


def table(rows: list[dict], markdown: bool = False) -> str:
    """class x entry point -> outcome counts (R refused, OK ok-correct, SW silent-wrong, ...);
    ``!`` marks a cell with a failure, ``*`` silent-wrong that is the documented no-key forger."""
    keys = []
    for r in rows:
        k = ("key " if r["keyed"] else "") + r["class"]
        if k not in keys:
            keys.append(k)
    eps = [e for e in ALL_EPS if any(r["ep"] == e for r in rows)]
    cells: dict = {}
    for r in rows:
        k = ("key " if r["keyed"] else "") + r["class"]
        c = cells.setdefault((k, r["ep"]), {"n": {}, "fail": False, "expected_sw": False})
        c["n"][r["outcome"]] = c["n"].get(r["outcome"], 0) + 1
        c["fail"] |= not r["pass"]
        c["expected_sw"] |= r["outcome"] == "silent-wrong" and r["pass"]

    def cell(k, e):
        c = cells.get((k, e))
        if c is None:
            return "-"
        s = " ".join(f"{n}{SHORT[o]}" for o, n in sorted(c["n"].items(), key=lambda x: OUTCOMES.index(x[0])))
        return s + ("*" if c["expected_sw"] else "") + (" !" if c["fail"] else "")

    counts = {k: len({r["case"] for r in rows if ("key " if r["keyed"] else "") + r["class"] == k}) for k in keys}
    head = ["class", "cases"] + eps
    body = [[k, str(counts[k])] + [cell(k, e) for e in eps] for k in keys]
    total = ["total", str(sum(counts.values()))]
    for e in eps:
        n: dict = {}
        for r in rows:
            if r["ep"] == e:
                n[r["outcome"]] = n.get(r["outcome"], 0) + 1
        total.append(" ".join(f"{v}{SHORT[o]}" for o, v in sorted(n.items(), key=lambda x: OUTCOMES.index(x[0]))))
    body.append(total)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in body])


LEGEND = ("R refused, OK ok-correct, SW silent-wrong (* the documented no-key forger), ACC accepted (a refusal "
          "was due), TB traceback, UT untidy (non-zero exit, not one hpcml line), H hang (> 10 s), M memory "
          "(> 512 MB), C crash, OUT a file outside opened, GEN case not generated; ! a failure in the cell; "
          "- not an entry point of this kind")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=None, help="about this many cases (scales the random classes; "
                   "default: every class at its own count, >= 300 in all)")
    p.add_argument("--classes", default=None, help="comma-separated class names (default: all; --list)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--key", choices=["both", "no", "only"], default="both",
                   help="run the no-key matrix, the keyed one (HPCML_CKPT_KEY), or both")
    p.add_argument("--workdir", default=None, help="where references and cases go (default: a new temp dir)")
    p.add_argument("--reuse", action="store_true", help="reuse the references already in --workdir")
    p.add_argument("--json", default=None, help="write every row and the table here")
    p.add_argument("--markdown", default=None, help="write the table as Markdown here (for docs/benchmarks.md)")
    p.add_argument("--list", action="store_true", help="list the classes and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-key-setup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rfd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--wfd", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.setup:
        with captured():
            info = build_references(Path(args.workdir), with_key=not args.no_key_setup)
        print(json.dumps(info))
        return 0
    classes = args.classes.split(",") if args.classes else None
    unknown = [c for c in classes or [] if c not in CLASS_BY_NAME]
    if unknown:
        p.error(f"unknown classes {unknown}: see --list")
    if args.list:
        for c in CLASSES:
            n = len(case_list([c.name], keyed=bool(c.policy.get("keyed_only"))))
            print(f"{c.name:<18} {c.kind:<3} {n:>3}  {c.what}")
        print(f"total {len(case_list(classes))} cases (+{len(case_list(classes, keyed=True))} with a key)")
        return 0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hcc-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    meta: dict = {"workdir": str(workdir), "limit_s": LIMIT_S, "limit_mb": LIMIT_MB, "jobs": args.jobs}
    print(f"references in {workdir} ...", file=sys.stderr, flush=True)
    if args.reuse and (workdir / "ref" / "expected.pt").exists():
        ref = {"problems": [], "reused": True,
               "key": "run" if (workdir / "ref-key" / "expected.pt").exists() else "n/a: not built"}
    else:
        ref = setup_references(workdir, with_key=args.key != "no")
    meta["reference"] = ref
    if "error" in ref:
        print(f"ckpt_corpus: the reference could not be built: {ref['error']}", file=sys.stderr)
        return 1
    if ref["problems"]:
        print(f"ckpt_corpus: the pristine reference fails: {ref['problems']}", file=sys.stderr)
        return 1
    todo: list[tuple[Case, bool]] = []
    if args.key in ("both", "no"):
        todo += [(c, False) for c in case_list(classes, total=args.cases)]
    meta["key"] = ref["key"] if args.key != "no" else "not run (--key no)"
    if args.key in ("both", "only") and ref["key"] == "run":
        todo += [(c, True) for c in case_list(classes, total=args.cases, keyed=True)]
    elif args.key != "no":
        print(f"key: {ref['key']}", file=sys.stderr)
    meta["cases"] = sum(not k for _, k in todo)
    meta["key_cases"] = sum(k for _, k in todo)
    print(f"{meta['cases']} cases + {meta['key_cases']} with a key, x their entry points, {args.jobs} workers ...",
          file=sys.stderr, flush=True)
    rows = run_matrix(todo, workdir, jobs=args.jobs)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    failures = [r for r in rows if not r["pass"]]
    text = table(rows)
    print(text)
    print(LEGEND)
    print(f"{len({(r['case'], r['keyed']) for r in rows})} cases, {len(rows)} operations, {len(failures)} failures, "
          f"{meta['seconds']:.0f} s; key: {meta['key']}")
    for r in failures:
        print(f"FAIL {'key ' if r['keyed'] else ''}{r['case']} {r['ep']}: {r['outcome']}: {r['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "table": text, "rows": rows}, indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(table(rows, markdown=True) + "\n\n" + LEGEND + "\n")
    if not args.workdir:
        _rmtree(workdir)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
