"""torch.distributed.checkpoint (DCP) in torchtitan's layout, both ways, on one process.

The torchtitan side is a reference written here from torchtitan's own code (the commit in
``hpcml.interop.torchtitan``): ``FusedQKVLinear._split_qkv_on_save`` for the
model entries, ``_merge_qkv_on_load``'s grouped rows for a fused optimizer state, the flat
``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>`` optimizer dict, ``lr_scheduler``,
``train_state`` and a pickled ``dataloader`` entry. What hpcml reads back must resume with
the losses the original run goes on to have, and what it writes must ``dcp.load`` into that
reference's shape. A directory that would run code or read outside itself is refused.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpcml import ckpt
from hpcml.ckpt.dcp_safe import DcpReader
from hpcml.cli import main
from hpcml.errors import CheckpointError
from hpcml.models.transformer import TransformerConfig
from hpcml.interop import torchtitan as tt
from hpcml.train.checkpointing import load_trainer, save_trainer
from hpcml.train.recipe import build_llm_trainer
from hpcml.train.trainer import TrainConfig

TINY = TransformerConfig.preset("tiny")  # 8 query heads, 4 key/value heads of 8
MODELS = {"plain": replace(TINY, tie_embeddings=True), "fused": replace(TINY, fused_qkv=True, fused_mlp=True)}
TRAIN = TrainConfig(steps=8, global_batch=4, seq_len=16, warmup_steps=2, progress=False)
SAVED_AT, AFTER = 3, 3


def _save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def titan(cfg: TransformerConfig, ours: dict[str, torch.Tensor], fused_optim: bool, optim: bool = True
          ) -> dict[str, torch.Tensor]:
    """torchtitan names for hpcml tensors (parameters, or one optimizer state of each)."""
    hd, kv, per = cfg.head_dim, cfg.kv_heads, cfg.n_heads // cfg.kv_heads
    out = {"tok_embeddings.weight": ours["tok_embeddings.weight"], "norm.weight": ours["norm.weight"]}
    if not cfg.tie_embeddings or not optim:  # a tied weight: both names in the model, one in the optimizer
        out["lm_head.weight"] = ours["tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"]
    for i in range(cfg.n_layers):
        p, a, f = f"layers.{i}.", f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        if cfg.fused_qkv:
            t = ours[f"{a}wqkv.weight"]
            q, k, v = (t,) * 3 if t.dim() == 0 else t.split([cfg.n_heads * hd, kv * hd, kv * hd])
        else:
            q, k, v = (ours[f"{a}w{x}.weight"] for x in "qkv")
        if fused_optim:  # FusedQKVLinear._merge_qkv_on_load
            out[f"{a}qkv_linear.wqkv.weight"] = q if q.dim() == 0 else torch.cat(  # (a step: any of the three)
                [q.reshape(kv, per, hd, -1), k.reshape(kv, 1, hd, -1), v.reshape(kv, 1, hd, -1)], 1).flatten(0, 2)
        else:
            out.update({f"{a}qkv_linear.wq.weight": q, f"{a}qkv_linear.wk.weight": k, f"{a}qkv_linear.wv.weight": v})
        w13 = ours.get(f"{f}w13.weight")
        w1, w3 = (ours[f"{f}w1.weight"], ours[f"{f}w3.weight"]) if w13 is None else \
            ((w13, w13) if w13.dim() == 0 else w13.chunk(2))
        out.update({f"{a}wo.weight": ours[f"{a}wo.weight"], f"{f}w1.weight": w1, f"{f}w2.weight": ours[f"{f}w2.weight"],
                    f"{f}w3.weight": w3, f"{p}attention_norm.weight": ours[f"{p}attention_norm.weight"],
                    f"{p}ffn_norm.weight": ours[f"{p}ffn_norm.weight"]})
    return {k: v.detach().clone() for k, v in out.items()}


def titan_state(trainer, cfg: TransformerConfig, fused_optim: bool = True) -> dict:
    """What torchtitan's CheckpointManager saves for this model and optimizer at this step."""
    params = dict(trainer.model.named_parameters())
    by_param = {p: n for n, p in params.items()}
    optimizer: dict = {}
    for s in ("step", "exp_avg", "exp_avg_sq"):
        state = {by_param[p]: st[s] for p, st in trainer.optimizer.state.items()}
        optimizer.update({f"state.{n}.{s}": t for n, t in titan(cfg, state, fused_optim).items()})
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "fused": True, "foreach": False}  # torchtitan's flags
              for g in trainer.optimizer.param_groups]
    which = {n: torch.tensor(int(p.dim() < 2)) for n, p in params.items()}  # hpcml's group of each parameter
    for n, g in titan(cfg, which, fused_optim).items():
        optimizer.update({f"param_groups.{n}.{k}": v for k, v in groups[int(g)].items()})
    return {**titan(cfg, params, False, optim=False), "optimizer": optimizer,
            "lr_scheduler": {"last_epoch": trainer.scheduler.last_epoch},
            "train_state": {"step": trainer.step, "ntokens_seen": trainer.step * TRAIN.global_batch * TRAIN.seq_len},
            "dataloader": {"world_size": 1, "dp_rank_0": pickle.dumps({"sample_idx": 5})}}


def _trainer(cfg: TransformerConfig):
    from mpi4py import MPI

    return build_llm_trainer(cfg, TRAIN, comm=MPI.COMM_SELF)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Per model: an hpcml run saved at step 3 both ways (its hpcml checkpoint, and torchtitan's
    DCP of it, fused and split optimizer state), the reference state, then 3 more steps' losses."""
    base = tmp_path_factory.mktemp("dcp")
    out = {}
    for name, cfg in MODELS.items():
        d = base / name
        trainer = _trainer(cfg)
        trainer.fit(SAVED_AT)
        save_trainer(trainer, d / "hpcml")
        ref, split = titan_state(trainer, cfg), titan_state(trainer, cfg, fused_optim=False)
        _save(ref, d / "titan")
        _save(split, d / "titan_split")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
        losses = [trainer.train_step()["loss"] for _ in range(AFTER)]
        out[name] = {"cfg": cfg, "dir": d, "ref": ref, "split": split, "groups": groups, "losses": losses}
    return out


@pytest.mark.parametrize("name", MODELS)
def test_titan_dcp_resumes_with_the_original_losses(runs, name):
    run = runs[name]
    done = tt.from_dcp(run["dir"] / "titan", run["dir"] / "in", run["cfg"], schedule_steps=TRAIN.steps)
    assert done.step == SAVED_AT
    fresh = _trainer(run["cfg"])
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.zero_()
    load_trainer(fresh, run["dir"] / "in")
    assert fresh.step == SAVED_AT
    assert [fresh.train_step()["loss"] for _ in range(AFTER)] == run["losses"]  # bitwise
    for g, want in zip(fresh.optimizer.param_groups, run["groups"]):  # implementation flags stay hpcml's
        assert (g["foreach"], g["fused"], g["weight_decay"]) == (want["foreach"], want["fused"], want["weight_decay"])


def test_default_schedule_goes_on_from_titans_learning_rate(runs, tmp_path):
    run = runs["plain"]
    tt.from_dcp(run["dir"] / "titan", tmp_path, run["cfg"])
    fresh = _trainer(run["cfg"])
    load_trainer(fresh, tmp_path)
    lr = run["ref"]["optimizer"]["param_groups.norm.weight.lr"]
    assert fresh.train_step()["lr"] == pytest.approx(lr, rel=1e-12)
    assert ckpt.read_extra(tmp_path)[2]["schedule"]["anchor"][0] == SAVED_AT


@pytest.mark.parametrize("name", MODELS)
def test_split_titan_optimizer_imports_the_same_tensors(runs, name, tmp_path):
    run = runs[name]
    tt.from_dcp(run["dir"] / "titan_split", tmp_path, run["cfg"])
    want = {**ckpt.read_tensors(run["dir"] / "hpcml", "model/"), **ckpt.read_tensors(run["dir"] / "hpcml", "optim/")}
    got = {**ckpt.read_tensors(tmp_path, "model/"), **ckpt.read_tensors(tmp_path, "optim/")}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("name,fused_optim", [("plain", True), ("fused", True), ("fused", False)])
def test_export_loads_into_torchtitans_state_dict(runs, name, fused_optim, tmp_path):
    run = runs[name]
    tt.to_dcp(run["dir"] / "hpcml", tmp_path / "out", run["cfg"], titan_fused_qkv=fused_optim)
    ref = run["ref" if fused_optim else "split"]
    want = {k: v for k, v in ref.items() if k != "dataloader"}  # --checkpoint.exclude_from_loading dataloader
    empty = {k: ({n: torch.empty_like(t) if isinstance(t, torch.Tensor) else None for n, t in v.items()}
                 if isinstance(v, dict) else torch.empty_like(v)) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(empty, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    for k, v in want.items():
        for n, t in (v.items() if isinstance(v, dict) else [("", v)]):
            got = empty[k][n] if isinstance(v, dict) else empty[k]
            if n.endswith((".fused", ".foreach")):
                continue  # hpcml's implementation flags go out as they were
            assert (torch.equal(got, t) if isinstance(t, torch.Tensor) else got == t), (k, n)


def test_round_trip_through_dcp_is_exact(runs, tmp_path):
    run = runs["fused"]
    tt.to_dcp(run["dir"] / "hpcml", tmp_path / "dcp", run["cfg"])
    tt.from_dcp(tmp_path / "dcp", tmp_path / "back", run["cfg"])
    assert ckpt.read_extra(tmp_path / "back")[1:] == ckpt.read_extra(run["dir"] / "hpcml")[1:]
    a, b = ckpt.read_tensors(run["dir"] / "hpcml", ""), ckpt.read_tensors(tmp_path / "back", "")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# -- refusals --------------------------------------------------------------------------------
class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _refused(fn, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def _metadata(path: Path):
    with open(path / ".metadata", "rb") as f:  # our own test file: trusted
        return pickle.load(f)


def _rewrite(path: Path, md) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_malicious_metadata_is_refused_unrun(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    _refused(lambda: DcpReader(tmp_path / "evil"), r"refused to unpickle posix\.system")
    assert not marker.exists()


def test_malicious_value_entry_is_refused_unrun(runs, tmp_path):
    marker = tmp_path / "pwned"
    state = {k: v for k, v in runs["plain"]["ref"].items() if k != "train_state"}
    _save({**state, "train_state": {"step": Evil(marker), "ntokens_seen": 0}}, tmp_path / "d")
    _refused(lambda: tt.from_dcp(tmp_path / "d", tmp_path / "out", TINY), r"refused to unpickle posix\.system")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_reader_reads_what_torch_reads(tmp_path):
    """bf16, int64, 0-d, empty, a view of a larger storage, and a tensor saved in two pieces
    (as two ranks save one): DcpReader agrees with torch's own dcp.load."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    whole = torch.randn(5, 4)
    state = {"bf": torch.randn(3, 2).bfloat16(), "ids": torch.arange(7), "step": torch.tensor(3.0),
             "empty": torch.zeros(0, 4), "view": torch.randn(6, 6)[1:3, 2:5], "part0": whole[:3].clone(),
             "part1": whole[3:].clone(), "lr": 0.25, "betas": (0.9, 0.95), "name": "x"}
    _save(state, tmp_path)
    md = _metadata(tmp_path)
    rec = md.state_dict_metadata.pop("part0")
    md.state_dict_metadata.pop("part1")
    rec.size = torch.Size([5, 4])
    rec.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])),
                  ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 4]))]
    for part, row in (("part0", 0), ("part1", 3)):
        md.storage_data[MetadataIndex("whole", torch.Size([row, 0]))] = md.storage_data.pop(
            MetadataIndex(part, torch.Size([0, 0])))
    md.state_dict_metadata["whole"] = rec
    _rewrite(tmp_path, md)
    reader = DcpReader(tmp_path)
    for k in ("bf", "ids", "step", "empty", "view"):
        assert torch.equal(reader.tensor(k), state[k]) and reader.tensor(k).dtype == state[k].dtype, k
    assert torch.equal(reader.tensor("whole"), whole)
    values = (reader.value("lr"), reader.value("betas"), reader.value("name"), reader.value("step"))
    assert values == (0.25, (0.9, 0.95), "x", 3.0)
    theirs = {"whole": torch.empty(5, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(theirs, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(theirs["whole"], whole)


def test_storage_outside_the_directory_or_its_file_is_refused(runs, tmp_path):
    src = runs["plain"]["dir"] / "titan"
    for case, change in (("outside", {"relative_path": "../titan_split/__0_0.distcp"}), ("range", {"length": 1 << 40})):
        d = tmp_path / case
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        md = _metadata(d)
        info = next(iter(md.storage_data.values()))
        for k, v in change.items():
            setattr(info, k, v)
        _rewrite(d, md)
        _refused(lambda: DcpReader(d), "not a plain file name inside" if case == "outside" else "claims bytes")
    md = _metadata(src)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "tok_embeddings.weight")
    data = bytearray((src / info.relative_path).read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF  # one byte of the tensor's data
    (tmp_path / "crc").mkdir()
    (tmp_path / "crc" / ".metadata").write_bytes((src / ".metadata").read_bytes())
    (tmp_path / "crc" / info.relative_path).write_bytes(bytes(data))
    _refused(lambda: DcpReader(tmp_path / "crc").tensor("tok_embeddings.weight"), r"data/0 fails its CRC-32")


def test_missing_and_misshaped_tensors_are_refused(runs, tmp_path):
    ref, cfg = runs["plain"]["ref"], runs["plain"]["cfg"]
    _save({k: v for k, v in ref.items() if k != "layers.1.attention.qkv_linear.wk.weight"}, tmp_path / "missing")
    _refused(lambda: tt.from_dcp(tmp_path / "missing", tmp_path / "o1", cfg),
             r"no 'layers\.1\.attention\.qkv_linear\.wk\.weight' \(torchtitan's name for hpcml "
             r"model/layers\.1\.attention\.wk\.weight\)")
    _save({**ref, "tok_embeddings.weight": torch.zeros(TINY.padded_vocab + 1, TINY.dim)}, tmp_path / "shape")
    _refused(lambda: tt.from_dcp(tmp_path / "shape", tmp_path / "o2", cfg),
             r"'tok_embeddings\.weight' is \[257, 64\], expected \[256, 64\] for hpcml model/tok_embeddings\.weight")
    _refused(lambda: tt.from_dcp(runs["fused"]["dir"] / "titan", tmp_path / "o3", cfg),  # untied into tied
             r"titan holds \d+ entries the model does not, e\.g\. "
             r"\['optimizer\.(state|param_groups)\.lm_head\.weight\.")
    _refused(lambda: tt.from_dcp(runs["plain"]["dir"] / "titan", tmp_path / "o4", replace(cfg, n_layers=3)),
             r"entries the model does not, e\.g\. \['layers\.3\.")
    _refused(lambda: tt.to_dcp(runs["plain"]["dir"] / "hpcml", tmp_path / "o5", replace(cfg, n_kv_heads=2)),
             r"model/layers\.0\.attention\.wk\.weight is \[32, 64\], the model config expects \[16, 64\]")


def test_cli_convert_both_ways_and_refusal(runs, tmp_path, capsys):
    run = runs["fused"]
    assert main(["ckpt", "convert", str(run["dir"] / "hpcml"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    assert main(["ckpt", "convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--to", "hpcml",
                 "--fused-qkv", "--fused-mlp"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"wrote {tmp_path / 'dcp'} (torchtitan DCP): step 3, ")
    assert out[1].startswith(f"wrote {tmp_path / 'back' / 'step_00000003'} (hpcml): step 3, ")
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Evil(tmp_path / "pwned")))
    assert main(["ckpt", "convert", str(tmp_path / "evil"), str(tmp_path / "x"), "--to", "hpcml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused to unpickle posix.system" in err and not (tmp_path / "pwned").exists()
