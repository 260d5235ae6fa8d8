"""Checkpoint logic that needs no MPI: ownership planning, coverage, chunking, encodings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcml import ckpt
from hpcml.ckpt import codec, format as fmt, tools
from hpcml.ckpt.manifest import coverage as check_coverage
from hpcml.ckpt.chunks import ChunkMeta, assign_owners, check_fused, fused_boxes, fused_runs, fused_spec
from hpcml.ckpt.shard import storage_chunk
from hpcml.ckpt.single import require_parallel_hdf5 as _require_parallel_hdf5
from hpcml.ckpt.pipeline import index_and_commit, local_pieces, normalized, plan_pending, write_local
from hpcml.errors import CheckpointError, MissingFeatureError


def meta(name, offset, shape, nbytes):
    return ChunkMeta(name, (8, 8), offset, shape, "float32", nbytes)


def test_replicas_written_once_and_bytes_balanced():
    # 4 ranks hold the same two replicated tensors (DDP) and one private shard each
    rep = [meta("a", (0, 0), (8, 8), 256), meta("b", (0, 0), (8, 8), 256)]
    per_rank = [rep + [meta(f"s{r}", (r * 2, 0), (2, 8), 64)] for r in range(4)]
    owner = assign_owners(per_rank)
    assert len(owner) == 6
    assert {owner[("a", (0, 0), (8, 8))], owner[("b", (0, 0), (8, 8))]} == {0, 1}  # spread, not both on rank 0
    assert all(owner[(f"s{r}", (r * 2, 0), (2, 8))] == r for r in range(4))  # only the holder can write a shard
    assert assign_owners(per_rank) == owner  # deterministic: every rank computes the same


def test_coverage():
    assert check_coverage((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    assert check_coverage((4, 4), [((0, 0), (2, 4))]) == "8 of 16 elements not covered by any piece"
    assert check_coverage((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))]) == \
        "pieces overlap: they hold 20 elements, the tensor 16"
    # the same volume, overlapping, with a gap: caught by the pairs, not the sum
    assert check_coverage((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))]).startswith("pieces overlap")
    # a huge declared tensor is judged without allocating it
    assert check_coverage((1 << 40, 1 << 20), [((0, 0), (1 << 40, 1 << 20))]) is None


@pytest.mark.parametrize("shape,itemsize,expected", [
    ((4096, 4096), 4, (512, 512)),     # 64 MiB -> 1 MiB chunks
    ((64, 64), 4, (16, 16)),           # small: 1 KiB chunks, so 4-way row or column reads align
    ((64,), 4, (64,)),
    ((), 4, None),
])
def test_storage_chunks(shape, itemsize, expected):
    assert storage_chunk(shape, itemsize) == expected


def test_bf16_is_stored_as_its_bit_pattern():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    arr = codec.to_numpy(t)
    assert arr.dtype == np.uint16 and arr.tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()
    assert torch.equal(codec.from_numpy(arr, "bfloat16"), t)
    assert codec.storage(torch.bfloat16) == (np.uint16, "bfloat16")
    assert fmt.numpy_dtype("bfloat16") is np.uint16  # what the index and the tools use, without torch


def test_unsupported_dtypes_are_checkpoint_errors_naming_them():
    with pytest.raises(CheckpointError, match=r"^cannot checkpoint model/z of dtype torch.complex64: expected one of "
                                              r"float32, float64, float16, bfloat16, int64, int32, uint8, bool$"):
        codec.storage(torch.complex64, "model/z")
    with pytest.raises(CheckpointError, match=r"^unknown stored dtype 'float8': expected one of float32, "):
        codec.from_numpy(np.zeros(2, np.uint8), "float8")
    with pytest.raises(CheckpointError, match=r"^unknown stored dtype 'float8': expected one of float32, "):
        fmt.numpy_dtype("float8")


def test_names():
    assert fmt.step_dir(1000) == "step_00001000" and fmt.shard_name(3) == "rank_00003.h5"
    assert fmt.STEP_RE.match("step_00001000") and not fmt.STEP_RE.match("step_00001000.tmp")


# --- fused sub-parameters (QKV with GQA widths 8:2:2 heads, hd = 2: q = 16, k = v = 4 rows) ---
QKV = [16, 4, 4]
COLS = 3


def _held(rank: int, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(DTensor-global offset, shape) of tp rank ``rank`` of ``n``: rows [r*24/n, (r+1)*24/n)."""
    return (rank * 24 // n, 0), (24 // n, COLS)


def _boxes(n: int) -> list[list[tuple[int, tuple, tuple]]]:
    return [fused_boxes(QKV, 0, n, *_held(r, n)) for r in range(n)]


def test_fused_chunks_each_tp_rank_writes():
    # tp1: the whole logical tensor, one chunk, as for any other tensor
    assert _boxes(1) == [[(0, (0, 0), (24, COLS))]]
    # tp2: rank r holds [wq_r; wk_r; wv_r] and writes each at its logical offset
    assert _boxes(2) == [[(0, (0, 0), (8, COLS)), (8, (16, 0), (2, COLS)), (10, (20, 0), (2, COLS))],
                         [(0, (8, 0), (8, COLS)), (8, (18, 0), (2, COLS)), (10, (22, 0), (2, COLS))]]
    # the chunks of all ranks tile the logical tensor exactly once (what `hpcml ckpt verify` checks)
    for n in (1, 2, 4):
        assert check_coverage((24, COLS), [(off, shp) for boxes in _boxes(n) for _, off, shp in boxes]) is None


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fused_hyperslabs_each_target_rank_reads(n):
    q, k, v = QKV
    for r, boxes in enumerate(_boxes(n)):
        expect = [(0, r * q // n, q // n), (q // n, q + r * k // n, k // n),
                  (q // n + k // n, q + k + r * v // n, v // n)]
        if n == 1:  # q, k, v adjacent in both layouts: one read
            expect = [(0, 0, 24)]
        assert [(lo, off[0], shp[0]) for lo, off, shp in boxes] == expect
        assert all(off[1] == 0 and shp[1] == COLS for _, off, shp in boxes)
    # the reassembly: logical rows read into the local block give [wq_r; wk_r; wv_r]
    logical = torch.arange(24 * COLS).reshape(24, COLS)
    wq, wk, wv = logical.split(QKV)
    for r, boxes in enumerate(_boxes(n)):
        local = torch.empty(24 // n, COLS, dtype=logical.dtype)
        for lo, off, shp in boxes:
            local[lo:lo + shp[0]] = logical[off[0]:off[0] + shp[0]]
        assert torch.equal(local, torch.cat([wq.chunk(n)[r], wk.chunk(n)[r], wv.chunk(n)[r]]))


def test_fused_runs_of_a_partial_block_and_other_dim():
    # an FSDP shard of a tp2 shard: physical rows [4, 10) of rank 0's block [wq_0 (8); wk_0 (2); wv_0 (2)]
    assert fused_runs(QKV, 2, 4, 6) == [(0, 4, 4), (4, 16, 2)]
    # across two blocks: rows [10, 14) = wv_0's last 2, then wq_1's first 2
    assert fused_runs(QKV, 2, 10, 4) == [(0, 20, 2), (2, 8, 2)]
    # fused along dim 1 (e.g. a column-fused weight): the other dims keep their offset
    assert fused_boxes([4, 2], 1, 2, (5, 3), (7, 3)) == [(0, (5, 2), (7, 2)), (2, (5, 5), (7, 1))]


def test_fused_pieces_of_a_plain_tensor_are_the_tensor():
    w = torch.arange(24.0 * COLS).reshape(24, COLS)
    metas, locals_, _ = local_pieces({"model/wqkv": w}, {"model/wqkv": {"fused_widths": QKV}})
    assert [(m.offset, m.shape) for m in metas] == [((0, 0), (24, COLS))]
    assert torch.equal(locals_[metas[0].key], w)


def test_fused_declarations_are_checked():
    assert check_fused("model/wqkv", QKV, 0, (24, COLS), 4) is None
    assert check_fused("model/wqkv", QKV, 0, (20, COLS), 1) == (
        "fused tensor model/wqkv: fused_widths [16, 4, 4] sum to 24, but its size on fused_dim 0 is 20 (shape [20, 3])")
    assert check_fused("model/wqkv", [16, 6, 6], 0, (28, COLS), 4) == (
        "fused tensor model/wqkv: fused_widths [16, 6, 6] are not all divisible by its 4 tensor-parallel shards "
        "on dim 0; uneven sub-parameter shards are not supported")
    assert check_fused("model/wqkv", QKV, 2, (24, COLS), 1) == (
        "fused tensor model/wqkv: fused_dim 2 is not a dimension of its shape [24, 3]")
    assert check_fused("model/wqkv", [16, 0, 8], 0, (24, COLS), 1) == (
        "fused tensor model/wqkv: fused_widths [16, 0, 8] must be a non-empty list of positive integers")
    from hpcml.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"^fused tensor model/wqkv: fused_widths \[16, 4, 2\] sum to 22"):
        local_pieces({"model/wqkv": torch.zeros(24, COLS)}, {"model/wqkv": {"fused_widths": [16, 4, 2]}})


def test_fused_attributes_as_stored_and_read():
    assert fused_spec({"logical_shape": [4, 4]}) is None and fused_spec(None) is None
    assert fused_spec({"fused_widths": np.asarray(QKV, dtype=np.int64)}) == (QKV, 0)  # h5py hands back arrays
    assert fused_spec({"fused_widths": QKV, "fused_dim": np.int64(1)}) == (QKV, 1)
    assert normalized({"fused_widths": (16, 4, 4), "x": 1}) == {"x": 1, "fused_widths": QKV, "fused_dim": 0}
    assert normalized({"logical_shape": [4, 4]}) == {"logical_shape": [4, 4]}
    from hpcml.ckpt.state import fused_attrs

    assert fused_attrs({"l.0.wqkv.weight": QKV}) == {
        f"{p}": {"fused_widths": QKV, "fused_dim": 0}
        for p in ("model/l.0.wqkv.weight", "optim/l.0.wqkv.weight/exp_avg", "optim/l.0.wqkv.weight/exp_avg_sq")}


def test_a_checkpoint_saved_before_the_first_step_resumes_bitwise(tmp_path):
    """A walltime warning during start-up saves at step 0, before AdamW made its state: the
    next job must resume from it and take the same first step a fresh run would."""
    torch.manual_seed(0)
    model, fresh = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    fresh.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt.save(tmp_path, 0, ckpt.training_tensors(model.named_parameters(), opt), extra={"step": 0})
    assert not any(opt.state.values())  # the save wrote AdamW's zero state without touching the optimizer
    resumed = torch.nn.Linear(4, 3)
    opt_resumed = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    report = ckpt.load(tmp_path, ckpt.training_tensors(resumed.named_parameters(), opt_resumed, create=True))
    assert (report.missing, report.unexpected, report.mismatched) == ([], [], [])
    x = torch.randn(5, 4)
    for m, o in ((fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1)), (resumed, opt_resumed)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    assert torch.equal(fresh.weight, resumed.weight) and torch.equal(fresh.bias, resumed.bias)


def test_single_file_without_parallel_hdf5_is_a_missing_feature():
    with pytest.raises(MissingFeatureError, match=r"^single_file=True needs h5py built with MPI \(parallel HDF5\), "
                                                  r"but h5py [0-9.]+ here was built without it; rebuild it with "
                                                  r"HDF5_MPI=ON$") as e:
        _require_parallel_hdf5(mpi=False)
    assert not isinstance(e.value, CheckpointError)  # a missing feature of a dependency, not a broken checkpoint
    _require_parallel_hdf5()  # this environment's h5py is the MPI build (tests/unit/test_cli.py::test_info_json)


def test_export_format_is_checked_before_reading(tmp_path):
    from hpcml.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^export format 'onnx' unknown: expected safetensors or torch$"):
        tools.export(tmp_path / "no-such-checkpoint", tmp_path / "m.onnx", "onnx")
    from hpcml import interop

    with pytest.raises(ConfigError, match=r"^export format 'onnx' unknown: expected safetensors, torch or hf$"):
        interop.export(tmp_path / "no-such-checkpoint", tmp_path / "m.onnx", "onnx")
    with pytest.raises(ConfigError, match=r"^export format 'hf' unknown: expected safetensors or torch \(hf: "):
        tools.export(tmp_path / "no-such-checkpoint", tmp_path / "m", "hf")


def test_inspect_names_the_placement_of_tensors_rank0_does_not_hold(tmp_path):
    """pp=2 on 2 ranks: each stage holds only its own layers, so rank 0, which writes the
    index, holds none of stage 1's tensors. Both ranks run their real save steps here
    (plan, shard, index, commit), only the two MPI collectives are done by hand."""
    torch.manual_seed(0)
    stages = [{"model/tok_embeddings.weight": torch.randn(8, 4), "model/layers.0.w": torch.randn(4, 4)},
              {"model/layers.1.w": torch.randn(4, 4), "model/output.weight": torch.randn(8, 4),
               "optim/step": torch.tensor(3.0)}]
    pieces = [local_pieces(t) for t in stages]
    parts = [(p[0], {n for n, t in ts.items() if t.dim() == 0}, "0" * 32) for p, ts in zip(pieces, stages)]  # allgather
    pending = [plan_pending(r, 2, None, tmp_path, 7, pieces[r], parts, extra={"step": 7}, layout={"pp": 2, "dp": 1},
                        keep=None, tensor_attrs=None, snapshot=True, t0=0.0) for r in range(2)]
    statuses = [write_local(p) for p in pending]
    gathered = [(s, {n: p.placements[n] for n in {c.name for c in p.mine}}) for s, p in zip(statuses, pending)]
    assert index_and_commit(pending[0], gathered) is None  # the gather to rank 0, then rank 0's part
    info = tools.inspect(tmp_path)
    assert info["world_size"] == 2 and info["layout"] == {"pp": 2, "dp": 1}
    assert {n: t["partition"] for n, t in info["tensors"].items()} == {
        "model/layers.0.w": "replicated", "model/tok_embeddings.weight": "replicated",
        "model/layers.1.w": "replicated", "model/output.weight": "replicated", "optim/step": "replicated"}
    assert [s["file"] for s in info["shards"]] == ["rank_00000.h5", "rank_00001.h5"]
    assert tools.verify(tmp_path) == []
    back = ckpt.read_tensors(tmp_path, "")
    assert all(torch.equal(back[n], t) for ts in stages for n, t in ts.items())


@pytest.mark.parametrize("tensors, said", [
    ({1: torch.ones(2)}, "tensor name 1 (int): expected a str; rename it before saving"),
    ({"": torch.ones(2)}, "tensor name '' is not a plain HDF5 path (printable, no spaces); rename it before saving"),
    ({"my param": torch.ones(2)}, "tensor name 'my param' is not a plain HDF5 path"),
    ({"a/../b": torch.ones(2)}, "tensor name 'a/../b' is not a plain HDF5 path"),
    ({"/abs": torch.ones(2)}, "tensor name '/abs' is not a plain HDF5 path"),
    ({"a//b": torch.ones(2)}, "tensor name 'a//b' is not a plain HDF5 path"),
    ({"a": torch.ones(2), "a/b": torch.ones(2)}, "tensor names 'a' and 'a/b': HDF5 cannot hold 'a' both as a tensor "
                                                 "and as the group of 'a/b'; rename one"),
    ({"w": [1, 2]}, "'w' is a list: expected a torch.Tensor or DTensor (a non-tensor value goes in extra=, a "
                    "JSON-able dict)"),
])
def test_a_save_the_reader_would_refuse_is_refused_before_anything_is_written(tmp_path, tensors, said):
    """Names the reader refuses were once written and committed: `latest` then named a
    checkpoint no load could open, and keep= rotated the good ones out. Now the save says why,
    in the reader's words, and the directory keeps what it held."""

    root = tmp_path / "ck"
    ckpt.save(root, 1, {"model/w": torch.arange(3.0)}, keep=1)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(root, 2, tensors, keep=1)
    assert said in str(e.value)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step_00000001"]
    out = {"model/w": torch.zeros(3)}
    assert ckpt.load(root, out).step == 1 and out["model/w"].tolist() == [0.0, 1.0, 2.0]
    assert fmt.name_problem("layers.0.attention.wq.weight") is None and fmt.name_problem("é/a.") is None


@pytest.mark.parametrize("extra, said", [
    ({"best_loss": float("nan")}, "extra['best_loss'] is nan: JSON has no NaN or infinity (a reader refuses it); "
                                  "store None or a string"),
    ({"hist": [1.0, float("inf")]}, "extra['hist'][1] is inf: JSON has no NaN"),
    ({"m": np.float32(0.5)}, "extra['m'] is of type float32: expected JSON values (numbers, strings, lists, dicts); "
                             "tensors go with the tensors; numpy's: convert with float() or int()"),
    ({"t": torch.ones(2)}, "extra['t'] is of type Tensor: expected JSON values"),
    ({("a", 1): 2}, "extra: key ('a', 1) is of type tuple: JSON keys are strings"),
    ("config", "extra is of type str: expected a dict of JSON values"),
    ({"step": 7}, "extra['step'] is 7, not the step saved (2): a reader takes it for an edit and refuses the "
                  "checkpoint"),
    ({"notes": "x" * (9 << 20)}, "its manifest would be 94"),  # more than a reader takes beside 12 bytes of shards
])
def test_extra_state_the_reader_would_refuse_is_refused_at_the_save(tmp_path, extra, said):
    """A NaN metric, a numpy scalar or a tensor in extra= once made a save that committed (or a
    traceback): the NaN, a non-dict or a manifest past the reader's size limit left `latest`
    naming a checkpoint no load could open. Now the save names the value; nothing changes."""
    root = tmp_path / "ck"
    ckpt.save(root, 1, {"model/w": torch.arange(3.0)}, extra={"lr": 0.1})
    with pytest.raises(CheckpointError) as e:
        ckpt.save(root, 2, {"model/w": torch.arange(3.0)}, extra=extra)
    assert said in str(e.value)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step_00000001"]
    assert ckpt.read_extra(root)[1:] == (1, {"lr": 0.1})


def test_what_a_load_cannot_fill_is_named_not_a_traceback(tmp_path):
    """A newcomer's first load: the model itself, a list, or a dict holding a non-tensor was a
    TypeError or AttributeError from deep inside; a float checkpoint loaded into an integer
    tensor was silently truncated. Now one line each; a float loads into any float."""
    m = torch.nn.Linear(4, 4)
    ckpt.save(tmp_path, 1, m.state_dict())
    with pytest.raises(CheckpointError, match=r"^tensors is of type Linear: expected a dict of names to tensors to "
                                              r"fill \(model.state_dict\(\): its tensors are the model's own"):
        ckpt.load(tmp_path, m)
    with pytest.raises(CheckpointError, match=r"^tensors is of type list: expected a dict of names to tensors"):
        ckpt.load(tmp_path, [torch.empty(4)])
    with pytest.raises(CheckpointError, match=r"^'weight' is of type list: expected a torch.Tensor or DTensor"):
        ckpt.load(tmp_path, {"weight": [0.0] * 16})
    into = {"weight": torch.zeros(4, 4, dtype=torch.int64), "bias": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=r"does not fit the model: of another kind \(a float loads into any "
                                              r"float, an integer into any integer\) \['weight: checkpoint float32, "
                                              r"model int64'\]"):
        ckpt.load(tmp_path, into)
    assert not into["weight"].any() and not into["bias"].any()  # nothing filled
    report = ckpt.load(tmp_path, into, strict=False)
    assert report.mismatched == ["weight: checkpoint float32, model int64"] and torch.equal(into["bias"], m.bias)
    wide = {"weight": torch.zeros(4, 4, dtype=torch.float64), "bias": torch.zeros(4, dtype=torch.bfloat16)}
    ckpt.load(tmp_path, wide)
    assert torch.equal(wide["weight"], m.weight.double()) and torch.equal(wide["bias"], m.bias.bfloat16())
    # a newcomer's model built on meta and never given memory: it "loaded" 2 MB and stayed on meta
    meta = {"weight": torch.empty(4, 4, device="meta"), "bias": torch.zeros(4)}
    for strict in (True, False):
        with pytest.raises(CheckpointError, match=r"^'weight' is on the meta device: it has no memory to fill \(a "
                                                  r"model built on meta: model.to_empty\(device=...\) first\)"):
            ckpt.load(tmp_path, meta, strict=strict)
    assert not meta["bias"].any()
    # an expand()ed target: torch's own "more than one element of the written-to tensor..." before
    shared = {"weight": torch.zeros(1, 4).expand(4, 4), "bias": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=r"^'weight' of shape \(4, 4\) has stride 0 along a dimension \(an "
                                              r"expand\(\)ed view\): its elements share memory"):
        ckpt.load(tmp_path, shared)


def test_a_refused_consolidation_leaves_no_file_behind(tmp_path):
    """``hpcml ckpt consolidate`` of a checkpoint with a flipped data byte fails in one line and
    leaves nothing at the output (it left ``OUT.tmp``, half written, behind)."""
    import json as _json

    from hpcml.ckpt import tools

    ckpt.save(tmp_path / "ck", 1, {"model/a": torch.arange(64.0), "model/b": torch.arange(4096.0)})
    step = tmp_path / "ck" / "step_00000001"
    piece = _json.loads((step / "manifest.json").read_text())["tensors"]["model/b"]["pieces"][0]
    with open(step / piece["file"], "r+b") as f:
        f.seek(piece["at"][0] + 100)
        b = f.read(4)
        f.seek(piece["at"][0] + 100)
        f.write(bytes(x ^ 0xFF for x in b))
    out = tmp_path / "one.h5"
    with pytest.raises(CheckpointError, match="model/b.*CRC-32"):
        tools.consolidate(tmp_path / "ck", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
