"""Populations (issue 45): ``ProcessGrid(pop=K)`` splits the ranks into K members with grids and
meshes of their own, and a tournament swaps two members' models bit for bit and keeps, on
each, the one that scores better on its own validation data."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcml.train.data import SyntheticTokens
from hpcml.errors import ConfigError, GridError
from hpcml.grid import Layout, ProcessGrid
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.population import Tournament, TournamentConfig, pairing
from hpcml.train.recipe import build_llm_trainer

WORLD = MPI.COMM_WORLD.Get_size()
MODEL = TransformerConfig.preset("tiny")
TRAIN = TrainConfig(steps=3, global_batch=4, micro_batch=1, seq_len=32, progress=False)
pytestmark = pytest.mark.skipif(WORLD != 4, reason="a population of 2 members of 2 ranks")


def test_members_are_grids_of_their_own_and_pop_comm_joins_their_places(comm):
    grid = ProcessGrid(pop=2, tp=2)
    assert (grid.pop, grid.member, grid.world_size, grid.rank) == (2, comm.rank // 2, 2, comm.rank % 2)
    assert grid.comm.Get_size() == 2 and grid.layout.tp == 2 and grid.layout.dp == 1
    assert grid.comm.allgather(comm.rank) == [2 * grid.member, 2 * grid.member + 1]
    assert grid.pop_comm.allgather(comm.rank) == [grid.rank, grid.rank + 2]  # ordered by member
    assert grid.global_rank(1) == 2 * grid.member + 1 and grid.torch_rank_of(1 - grid.member) == comm.rank ^ 2
    td = grid.init_torch()  # joins the launch's process group; check_mesh compares the groups in world ranks
    assert dist.get_process_group_ranks(td.mesh.get_group("tp")) == [2 * grid.member, 2 * grid.member + 1]
    assert dist.get_process_group_ranks(td.group) == [2 * grid.member, 2 * grid.member + 1]
    assert dist.get_process_group_ranks(td.pop_group) == [grid.rank, grid.rank + 2]
    assert "population: 2 members of 2 ranks" in grid.describe()
    assert repr(grid).endswith(f"member={grid.member} of 2)")
    grid.free()


@pytest.mark.parametrize("pop,expect", [(3, "pop 3 does not divide 4 ranks"), (0, "pop 0: expected a positive"),
                                        (True, "pop True: expected a positive")])
def test_a_bad_population_is_one_line_on_every_rank(comm, pop, expect):
    with pytest.raises(GridError, match="^" + expect):
        ProcessGrid(pop=pop)


def test_a_population_size_that_differs_across_ranks_is_refused_on_every_rank(comm):
    with pytest.raises(GridError, match=r"^ProcessGrid arguments differ across ranks: rank\(s\) 0, 1 gave .*dp\(2\).*, "
                                        r"pop 2; rank\(s\) 2, 3 gave .*dp\(4\)"):
        ProcessGrid(pop=2 if comm.rank < 2 else 1)


def test_pairing_is_a_seeded_matching():
    for pop in range(1, 9):
        for r in range(5):
            p = pairing(pop, r, seed=3)
            assert p == pairing(pop, r, seed=3)
            assert all(p[p[m]] == m for m in range(pop))  # a matching
            assert sum(p[m] == m for m in range(pop)) == pop % 2  # one sits out when odd
    assert len({tuple(pairing(8, r)) for r in range(10)}) > 1  # partners change between rounds


def _local(t: torch.Tensor) -> bytes:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().numpy().tobytes()


def _weights(trainer) -> str:
    named = sorted(trainer.model.named_parameters())
    return hashlib.sha256(b"".join(n.encode() + _local(p) for n, p in named)).hexdigest()


def _moments(trainer) -> str:
    return hashlib.sha256(b"".join(_local(st[k]) for st in trainer.optimizer.state.values()
                                   for k in sorted(st))).hexdigest()


def _local_digest(trainer) -> str:
    return _weights(trainer) + _moments(trainer)


def _full_digest(trainer) -> str:
    """The member's whole state (weights and moments, gathered), the same on its ranks whatever the layout."""
    from hpcml.ckpt.state import training_tensors

    named = training_tensors(trainer.model.named_parameters(), trainer.optimizer)
    h = hashlib.sha256()
    for n in sorted(named):
        t = named[n]
        h.update(n.encode() + (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().tobytes())
    return h.hexdigest()


def _member_trainer(degrees: dict, pkw: dict):
    grid = ProcessGrid(pop=2, **degrees)
    trainer = build_llm_trainer(MODEL, replace(TRAIN, seed=10 + grid.member), ParallelConfig(**pkw), grid=grid)
    trainer.fit()  # each member from its own initial weights on its own data
    return grid, trainer


@pytest.mark.parametrize("degrees,pkw", [({"dp": 2}, {}), ({"tp": 2}, {}), ({"dp": 2}, {"fsdp": True})],
                         ids=["dp2", "tp2", "fsdp2"])
def test_a_tournament_leaves_both_members_with_the_winners_state_bit_for_bit(comm, degrees, pkw):
    grid, trainer = _member_trainer(degrees, pkw)
    val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=99)  # one held-out set for both
    before = _local_digest(trainer)
    t = Tournament(grid, trainer.model, lambda: trainer.evaluate(val, 2), optimizer=trainer.optimizer,
                   config=TournamentConfig(every=3))
    t(trainer, m := {})
    out = t.history[-1]
    assert m["tournament"]["round"] == 1 and out.partner == 1 - grid.member
    scores = grid.pop_comm.allgather(out.own_score)  # each member's own model on the same data
    assert out.partner_score == scores[1 - grid.member]  # its partner's model scored alike here
    winner = min(range(2), key=lambda k: (scores[k], k))
    assert out.kept == ("own" if winner == grid.member else "partner")
    digests = grid.pop_comm.allgather((before, _local_digest(trainer)))
    assert digests[0][1] == digests[1][1] == digests[winner][0]  # both now hold the winner's, on this rank's place
    assert digests[0][0] != digests[1][0]  # the members did differ
    assert trainer.evaluate(val, 2) == scores[winner]
    trainer.fit(5)  # training goes on after the swap
    assert trainer.step == 5
    trainer.close()


def test_each_member_keeps_what_wins_on_its_own_data(comm):
    grid, trainer = _member_trainer({"tp": 2}, {})
    val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=50 + grid.member)
    weights, moments = grid.pop_comm.allgather(_weights(trainer)), _moments(trainer)
    t = Tournament(grid, trainer.model, lambda: trainer.evaluate(val, 2), optimizer=trainer.optimizer,
                   config=TournamentConfig(every=1, optimizer=False))
    out = t.play(7)
    assert out.kept == ("partner" if out.partner_score < out.own_score else "own")
    assert len(set(grid.comm.allgather(out.kept))) == 1  # one decision per member
    assert _weights(trainer) == weights[grid.member if out.kept == "own" else 1 - grid.member]
    assert _moments(trainer) == moments  # optimizer=False: the moments stay the member's own
    trainer.close()


def test_members_of_other_models_are_refused_on_every_rank_before_anything_moves(comm):
    grid = ProcessGrid(pop=2, dp=2)
    grid.init_torch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4 + grid.member)  # member 1's model is another shape
    t = Tournament(grid, model, lambda: 0.0, config=TournamentConfig(every=1))
    with pytest.raises(ConfigError, match=r"^population: 4 rank\(s\) hold tensors of other shapes or dtypes"):
        t.play(0)
    assert model.out_features == 4 + grid.member


def test_a_diverged_member_takes_its_partners_model(comm):
    """A NaN loss compares False with anything: it must still lose, or a diverged member keeps its NaNs."""
    grid = ProcessGrid(pop=2, dp=2)
    grid.init_torch()
    torch.manual_seed(grid.member)
    model = torch.nn.Linear(3, 2)
    if grid.member == 1:
        with torch.no_grad():
            model.weight.fill_(float("nan"))
    theirs = grid.pop_comm.allgather(model.weight.detach().clone())

    def evaluate() -> float:
        return float(model.weight.detach().sum())  # NaN on the diverged weights, whoever holds them

    out = Tournament(grid, model, evaluate, config=TournamentConfig(every=1)).play(0)
    assert out.kept == ("own" if grid.member == 0 else "partner")
    assert torch.equal(model.weight, theirs[0])  # both hold member 0's weights now


def test_members_with_different_tournament_seeds_are_refused_on_every_rank_not_left_waiting(comm):
    """A seed per member would pair the members differently in each: before, a silent hang in
    the swap (4 members); now one line on every rank before anything moves."""
    grid = ProcessGrid(pop=2)
    grid.init_torch()
    trainer = build_llm_trainer(MODEL, replace(TRAIN, steps=2), ParallelConfig(), grid=grid)
    t = Tournament(grid, trainer.model, lambda: 0.0, optimizer=trainer.optimizer,
                   config=TournamentConfig(every=1, seed=grid.member))
    with pytest.raises(ConfigError, match=r"members disagree on \(seed, every, round\): \[\(0, 1, 1\), \(1, 1, 1\)\]"):
        t.play(1)
    trainer.close()


def test_tournament_config_is_checked():
    with pytest.raises(ConfigError, match=r"TournamentConfig\(every=0\): expected a whole number of steps >= 1"):
        TournamentConfig(every=0)


def test_a_population_saved_and_resumed_plays_the_same_tournaments_bit_for_bit(comm):
    """Each member checkpoints to its own directory; the pairing is drawn from (seed, round) and
    the round from the step, so members resumed from their checkpoints meet the same partners
    and end bit for bit where the uninterrupted population ends."""
    import tempfile
    from pathlib import Path

    from hpcml.train.checkpointing import load_trainer, save_trainer

    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-pop-") if comm.rank == 0 else None))
    grid = ProcessGrid(pop=2, dp=2)
    cfg = replace(TRAIN, steps=8, seed=10 + grid.member, lr=3e-3 * (1 + 9 * grid.member))  # member 1 far off

    def member():
        trainer = build_llm_trainer(MODEL, cfg, ParallelConfig(fsdp=True), grid=grid)
        val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=50 + grid.member)
        t = Tournament(grid, trainer.model, lambda: trainer.evaluate(val, 2), optimizer=trainer.optimizer,
                       config=TournamentConfig(every=2, seed=4))
        trainer.hooks.append(t)
        return trainer, t

    trainer, t = member()
    trainer.fit(4)
    save_trainer(trainer, root / f"member{grid.member}")
    trainer.fit(8)
    whole = (_local_digest(trainer), [(o.round, o.partner, o.kept) for o in t.history])
    trainer.close()
    fresh, t2 = member()
    with torch.no_grad():  # everything must come from the checkpoint
        for _, p in fresh.model.named_parameters():
            p.zero_()
    load_trainer(fresh, root / f"member{grid.member}")
    assert fresh.step == 4
    fresh.fit(8)
    assert (_local_digest(fresh), [(o.round, o.partner, o.kept) for o in t2.history]) == (whole[0], whole[1][2:])
    assert [o.round for o in t.history] == [1, 2, 3, 4]
    fresh.close()


def test_pbt_plan_copies_the_worst_from_the_best():
    from hpcml.train.pbt import plan

    assert plan([3.0, 1.0, 2.0, 4.0], 0.25, 0, 1) == {3: 1}
    assert plan([float("nan"), 1.0, 2.0, 4.0], 0.25, 0, 1) == {0: 1}  # a diverged member ranks last
    two = plan([5.0, 1.0, 2.0, 4.0, 3.0, 0.5, 6.0, 7.0], 0.25, 3, 2)
    assert set(two) == {6, 7} and set(two.values()) <= {5, 1}
    assert plan([1.0], 0.5, 0, 0) == {} and plan([2.0, 1.0], 0.5, 0, 0) == {0: 1}


def test_pbt_copies_the_best_members_state_bit_for_bit_and_perturbs_its_hyperparameters(comm):
    """2 members x dp2: after a round the worse member holds the better one's weights and moments
    on every rank, its learning rate, weight decay and warmup are the better one's times a
    perturbation (the warmup a whole number of steps, and the next step's rate follows it), the
    history says so, and a checkpoint of it resumes with the new hyperparameters."""
    import json
    import tempfile
    from pathlib import Path

    from hpcml.train.checkpointing import load_trainer, save_trainer
    from hpcml.train.pbt import PBTConfig, PopulationBasedTraining, hyperparameters

    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-pbt-") if comm.rank == 0 else None))
    grid = ProcessGrid(pop=2, dp=2)
    cfg = replace(TRAIN, steps=4, seed=10 + grid.member, lr=3e-3 * (1 + 30 * grid.member),  # member 1 far too fast
                  warmup_steps=4 + 2 * grid.member)
    trainer = build_llm_trainer(MODEL, cfg, ParallelConfig(), grid=grid)
    val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=77)
    pbt = PopulationBasedTraining(grid, trainer, lambda: trainer.evaluate(val, 2),
                                  config=PBTConfig(every=4, fraction=0.5, history=root / "pbt.jsonl", seed=1,
                                                   hyperparameters=("lr", "weight_decay", "warmup")))
    trainer.fit(4)
    before = grid.pop_comm.allgather((_local_digest(trainer), hyperparameters(trainer)))
    r = pbt.play(1)
    worst = max(range(2), key=lambda m: r.scores[m])
    best = 1 - worst
    assert r.source == (best if grid.member == worst else None)
    assert _local_digest(trainer) == before[best][0]  # weights and moments of the best, on every rank
    mine = hyperparameters(trainer)
    if grid.member == worst:
        ratios = {h: mine[h] / before[best][1][h] for h in ("lr", "weight_decay")}
        assert all(any(abs(x - f) < 1e-12 for f in (0.8, 1.25)) for x in ratios.values()), ratios
        assert mine["warmup"] in {round(before[best][1]["warmup"] * f) for f in (0.8, 1.25)}
        assert mine["warmup"] != before[best][1]["warmup"] and trainer.schedule.warmup == mine["warmup"]
        assert all(g["lr"] == pytest.approx(g["initial_lr"] * trainer.schedule(trainer.step))
                   for g in trainer.optimizer.param_groups)
    else:
        assert mine == before[best][1]
    assert r.hyperparameters[grid.member] == pytest.approx(mine)
    comm.Barrier()
    lines = [json.loads(x) for x in (root / "pbt.jsonl").read_text().splitlines()]
    assert {m["member"]: m["copied"] for m in lines[0]["members"]} == {best: None, worst: best}
    assert lines[0]["round"] == 1 and lines[0]["step"] == 4
    save_trainer(trainer, root / f"member{grid.member}")
    fresh = build_llm_trainer(MODEL, cfg, ParallelConfig(), grid=grid)
    load_trainer(fresh, root / f"member{grid.member}")
    assert hyperparameters(fresh) == pytest.approx(mine)  # the explored values survive a resume
    assert fresh.schedule(5) == trainer.schedule(5)  # the warmup too, whatever the config said
    trainer.close()
    fresh.close()
    comm.Barrier()
    if comm.rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_pbt_config_is_checked():
    from hpcml.train.pbt import PBTConfig

    with pytest.raises(ConfigError, match=r"PBTConfig\(fraction=0.75\): expected a fraction in \(0, 0.5\]"):
        PBTConfig(every=1, fraction=0.75)
    with pytest.raises(ConfigError, match=r"PBTConfig\(hyperparameters=\('momentum',\)\): expected some of lr"):
        PBTConfig(every=1, hyperparameters=("momentum",))
    with pytest.raises(ConfigError, match=r"PBTConfig\(perturb=\(0.0,\)\): expected one or more positive"):
        PBTConfig(every=1, perturb=(0.0,))


def test_a_population_of_field_surrogates_plays_tournaments_bit_for_bit(comm):
    """The surrogate trainer as members (FSDP over each member's dp 2): each on its own shard of
    a simulation's samples; after every tournament both hold the winner's state, bit for bit."""
    import numpy as np

    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.stream.buffer import Sample
    from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer

    nx = ny = 8
    x, y = np.meshgrid(np.linspace(-1, 1, nx), np.linspace(-1, 1, ny), indexing="ij")

    def blob(sim: int, v: float, w: float, t: float) -> Sample:
        u = np.exp(-((x - v * t) ** 2 + y ** 2) / w).astype(np.float32)[None]
        return Sample(sim=sim, step=int(t * 10), t=t, params=np.array([v, w], np.float32), fields=u)

    rng = np.random.default_rng(0)
    pool = [blob(s, v, w, t) for s, (v, w) in enumerate(zip(rng.uniform(0.2, 0.8, 24), rng.uniform(0.1, 0.4, 24)))
            for t in np.linspace(0, 1, 5)]
    grid = ProcessGrid(pop=2, dp=2)
    mine, held_out = pool[grid.member:100:2], pool[100:]  # each member its own shard; one held-out set
    torch.manual_seed(grid.member)  # the members start apart
    model = MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=nx, ny=ny, hidden=32, depth=2))
    cfg = FieldTrainConfig(steps=6, batch=4, lr=1e-3 * (1 + 9 * grid.member), progress=False, seed=grid.member)
    trainer = FieldTrainer(model, grid, cfg, FieldScales(param_lo=(0.2, 0.1), param_hi=(0.8, 0.4), t_max=1.0),
                           ParallelConfig(fsdp=True))
    P, T, F = (np.stack([s.params for s in held_out]), np.array([s.t for s in held_out]),
               np.stack([s.fields[0] for s in held_out]))
    t = Tournament(grid, trainer.model, lambda: trainer.rel_l2(P, T, F), optimizer=trainer.optimizer,
                   config=TournamentConfig(every=3))
    digests = []

    def after(tr, metrics):
        if "tournament" in metrics:
            digests.append(grid.pop_comm.allgather(_local_digest(tr)))

    def next_batch(step: int) -> list[Sample]:
        at = (step * 2 + grid.coords["dp"]) * 4
        return [mine[(at + i) % len(mine)] for i in range(4)]

    trainer.fit(next_batch, 6, hooks=[t, after])
    assert [o.round for o in t.history] == [1, 2] and len(digests) == 2
    assert all(d[0] == d[1] for d in digests)  # both members hold one model after each round
    assert all(np.isfinite(o.own_score) for o in t.history)
    trainer.close()


@pytest.mark.parametrize("members,model", [([{"tp": 2}, {"dp": 2}], "tiny"), ([{"ep": 2}, {"tp": 2}], "tiny-moe")],
                         ids=["tp2-fsdp2", "experts-ep2-tp2"])
def test_members_of_different_layouts_swap_through_the_reshard_bit_for_bit(comm, members, model):
    """tp 2 against FSDP over dp 2, and a MoE's experts over ep 2 against tp 2
    (ProcessGrid(members=...)): the swap goes through each member's checkpoint, loaded into the
    other layout; afterwards both hold the winner's full weights and moments bit for bit."""
    import shutil
    import tempfile
    from pathlib import Path

    scratch = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-pop-mixed-") if comm.rank == 0 else None))
    grid = ProcessGrid(members=members)
    assert grid.pop == 2 and grid.layout.degrees == Layout.from_degrees(2, members[grid.member]).degrees
    trainer = build_llm_trainer(TransformerConfig.preset(model), replace(TRAIN, seed=10 + grid.member),
                                ParallelConfig(fsdp=members[grid.member] == {"dp": 2}), grid=grid)
    if model == "tiny-moe":  # the expert member's mesh is its own, and its groups are MPI's
        from hpcml.grid.torch_dist import check_mesh

        assert (grid.torch.expert_mesh is not None) == (grid.member == 0)
        check_mesh(grid, grid.torch.mesh, grid.torch.expert_mesh)
    trainer.fit()
    val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=99)

    def full() -> str:
        return _full_digest(trainer)

    before = grid.pop_comm.allgather(full())
    t = Tournament(grid, trainer.model, lambda: trainer.evaluate(val, 2), optimizer=trainer.optimizer,
                   config=TournamentConfig(every=3, scratch=scratch))
    out = t.play(1)
    scores = grid.pop_comm.allgather(out.own_score)
    winner = min(range(2), key=lambda k: (scores[k], k))
    after = grid.pop_comm.allgather(full())
    assert before[0] != before[1] and after[0] == after[1] == before[winner]
    assert out.kept == ("own" if winner == grid.member else "partner")
    trainer.fit(5)  # and both train on
    trainer.close()
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def test_pbt_copies_between_members_of_different_layouts_through_the_reshard_bit_for_bit(comm):
    """tp 2 against FSDP over dp 2: the worse member's copy of the better one goes through the
    better one's checkpoint, loaded into the copier's layout: its whole state then is the
    better one's, bit for bit, its hyperparameters the better one's times a perturbation, and
    both train on."""
    import tempfile
    from pathlib import Path

    from hpcml.train.pbt import PBTConfig, PopulationBasedTraining, hyperparameters

    scratch = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-pbt-mixed-") if comm.rank == 0 else None))
    grid = ProcessGrid(members=[{"tp": 2}, {"dp": 2}])
    cfg = replace(TRAIN, seed=10 + grid.member, lr=3e-3 * (1 + 30 * grid.member))  # member 1 far too fast
    trainer = build_llm_trainer(MODEL, cfg, ParallelConfig(fsdp=grid.member == 1), grid=grid)
    trainer.fit()
    val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=77)

    def full() -> str:
        return _full_digest(trainer)

    before = grid.pop_comm.allgather((full(), hyperparameters(trainer)))
    pbt = PopulationBasedTraining(grid, trainer, lambda: trainer.evaluate(val, 2),
                                  config=PBTConfig(every=3, fraction=0.5, seed=1, scratch=scratch))
    r = pbt.play(1)
    worst = max(range(2), key=lambda m: r.scores[m])
    best = 1 - worst
    assert before[0][0] != before[1][0] and full() == before[best][0]
    mine = hyperparameters(trainer)
    if grid.member == worst:
        assert r.source == best
        assert all(any(abs(mine[h] / before[best][1][h] - f) < 1e-12 for f in (0.8, 1.25))
                   for h in ("lr", "weight_decay"))
        assert mine["warmup"] == before[best][1]["warmup"]  # not explored: copied with the weights
    else:
        assert r.source is None and mine == before[best][1]
    trainer.fit(5)  # and both train on
    trainer.close()
    comm.Barrier()
    if comm.rank == 0:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


def test_members_of_different_layouts_need_a_scratch_directory(comm):
    grid = ProcessGrid(members=[{"tp": 2}, {"dp": 2}])
    grid.init_torch()
    with pytest.raises(ConfigError, match=r"^Tournament: the members have different layouts.*\(scratch=DIR\)"):
        Tournament(grid, torch.nn.Linear(2, 2), lambda: 0.0, config=TournamentConfig(every=1))
    from hpcml.train.pbt import PBTConfig, PopulationBasedTraining

    with pytest.raises(ConfigError, match=r"^PopulationBasedTraining: the members have different layouts.*"
                                          r"PBTConfig\(scratch=DIR\)"):
        PopulationBasedTraining(grid, None, lambda: 0.0, config=PBTConfig(every=1))
    with pytest.raises(GridError, match=r"^members \[\{'tp': 2\}\]: expected a list of 2 degree mappings"):
        ProcessGrid(pop=2, members=[{"tp": 2}])
    with pytest.raises(GridError, match=r"^give either members or a layout and degrees, not both \(got members and "
                                        r"\['tp'\]\)"):
        ProcessGrid(members=[{"tp": 2}, {"dp": 2}], tp=2)
    with pytest.raises(GridError, match=r"^members entry 'tp=2': expected degrees such as \{'tp': 2\}"):
        ProcessGrid(members=["tp=2", {"dp": 2}])


def _llm_pretrain():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflows"))
    try:
        import llm_pretrain
    finally:
        sys.path.pop(0)
    return llm_pretrain


def test_llm_pretrain_runs_a_population_that_stops_as_one_and_resumes_the_step_all_members_hold(comm, monkeypatch):
    """``llm_pretrain.py --pop 2 --tournament-every 2`` (what ``hpcml plan --pop --emit`` writes):
    each member saves to member_K and records its tournaments; a walltime warning seen by one
    member stops both at the same step (before, the other ran on into a tournament and waited
    forever); an auto-resume where one member lost its newest save resumes both at the step
    both hold, and plays the same rounds on."""
    import contextlib
    import io
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from hpcml import stop
    from hpcml.env import NOT_FINISHED

    lp = _llm_pretrain()
    # main() ends by destroying the process group, as a script should; in this one process the
    # later tests' meshes of the same ranks would meet torch's caches of the destroyed groups
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-llmpop-") if comm.rank == 0 else None))
    member = comm.rank // (comm.size // 2)
    base = ["--pop", "2", "--tournament-every", "2", "--global-batch", "4", "--seq-len", "32", "--no-progress",
            "--ckpt-dir", str(root / "ckpt"), "--ckpt-every", "2", "--run-dir", str(root / "run")]
    assert lp.main([*base, "--steps", "4"]) == 0
    comm.Barrier()
    rounds = [[json.loads(x) for x in (root / "run" / f"member_{m}" / "tournaments.jsonl").read_text().splitlines()]
              for m in (0, 1)]
    assert [[(r["step"], r["partner"]) for r in rs] for rs in rounds] == [[(2, 1), (4, 1)], [(2, 0), (4, 0)]]
    assert all((root / "ckpt" / f"member_{m}" / "step_00000004").is_dir() for m in (0, 1))
    comm.Barrier()
    if comm.rank == 0:  # member 1's newest save lost: both resume at step 2
        shutil.rmtree(root / "ckpt" / "member_1" / "step_00000004")
        (root / "ckpt" / "member_1" / "latest").write_text("step_00000002\n")
    comm.Barrier()
    if member == 0:
        stop.request("SIGUSR1")  # the warning reaches member 0's ranks only
    try:
        rc = lp.main([*base, "--steps", "8", "--auto-resume"])
    finally:
        stop.clear()
        for s in stop.STOP_SIGNALS:
            import signal

            signal.signal(s, signal.SIG_DFL)
    comm.Barrier()
    assert rc == NOT_FINISHED  # both members stopped after step 3, and saved
    assert all((root / "ckpt" / f"member_{m}" / "step_00000003").is_dir() for m in (0, 1))
    assert lp.main([*base, "--steps", "6", "--auto-resume"]) == 0
    comm.Barrier()
    rounds = [[json.loads(x) for x in (root / "run" / f"member_{m}" / "tournaments.jsonl").read_text().splitlines()]
              for m in (0, 1)]
    assert [[r["step"] for r in rs] for rs in rounds] == [[2, 4, 4, 6]] * 2  # step 4 played again after the rollback
    # the last step saved in every member: run again, nothing to train, said, before torch's work (no round more)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert lp.main([*base, "--steps", "6", "--auto-resume"]) == 0
        assert lp.main([*base, "--steps", "5", "--auto-resume"]) == 2
    said = err.getvalue().strip().splitlines()
    if comm.rank == 0:
        assert said == [f"llm_pretrain: already finished: {root / 'ckpt'} (every member's step_00000006) holds step 6 "
                        f"of --steps 6; nothing to train (give more --steps to train on)",
                        f"llm_pretrain: error: {root / 'ckpt'} (every member's step_00000006) holds step 6, past "
                        f"--steps 5: nothing to train; give --steps above 6 to train on from it"], said
    comm.Barrier()
    played = [(root / "run" / f"member_{m}" / "tournaments.jsonl").read_text().splitlines() for m in (0, 1)]
    assert [len(rs) for rs in played] == [4, 4]
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def test_llm_pretrain_runs_members_of_different_layouts_that_swap_through_the_reshard(comm, monkeypatch, capsys):
    """``llm_pretrain.py --member '{"tp": 2}' --member '{"dp": 2, "fsdp": true}'``: one job, two
    layouts; each tournament goes through the members' checkpoints in ``--pop-scratch``: after
    the last one (at the last step, saved after it) the members' checkpoints hold one model bit
    for bit exactly when the two chose the same one; a member's plan that cannot run is refused
    on every rank in one line."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from hpcml.ckpt import read_tensors

    lp = _llm_pretrain()
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)  # as in the test above
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-llmmix-") if comm.rank == 0 else None))
    try:
        base = ["--member", '{"tp": 2}', "--member", '{"dp": 2, "fsdp": true}', "--tournament-every", "2",
                "--global-batch", "4", "--seq-len", "32", "--no-progress", "--steps", "4",
                "--ckpt-dir", str(root / "ckpt"), "--ckpt-every", "4", "--run-dir", str(root / "run")]
        assert lp.main(base) == 0
        comm.Barrier()
        out = capsys.readouterr().out
        if comm.rank % 2 == 0:  # each member's rank 0 prints its line
            line = json.loads(out.strip().splitlines()[-1])
            assert line["member"] == comm.rank // 2 and line["layout"]["tp"] == (2 if comm.rank == 0 else 1)
        rounds = [[json.loads(x) for x in (root / "run" / f"member_{m}" / "tournaments.jsonl")
                   .read_text().splitlines()] for m in (0, 1)]
        assert [[r["step"] for r in rs] for rs in rounds] == [[2, 4], [2, 4]]
        assert sorted(p.name for p in (root / "ckpt" / "exchange").iterdir()) == ["member00000", "member00001"]
        saved = [read_tensors(root / "ckpt" / f"member_{m}" / "step_00000004", "model/") for m in (0, 1)]
        assert len(saved[0]) > 10 and saved[0].keys() == saved[1].keys()
        kept = sorted(rs[-1]["kept"] for rs in rounds)  # each member judges on its own data: they may differ
        same = all(torch.equal(saved[0][n], saved[1][n]) for n in saved[0])
        assert same == (kept == ["own", "partner"]), kept  # one model after the last round iff they agreed
        # the best member on held-out data common to both: its newest step is the run's checkpoints/ own
        best = json.loads((root / "ckpt" / "best.json").read_text())["member"]
        assert (root / "ckpt" / "latest").read_text().strip() == "step_00000004"
        ours = read_tensors(root / "ckpt", "model/")
        assert ours.keys() == saved[best].keys() and all(torch.equal(ours[n], saved[best][n]) for n in ours)
        if comm.rank % 2 == 0:
            assert line["best_member"] == best and len(line["member_val_losses"]) == 2
            assert best == min(range(2), key=lambda m: (line["member_val_losses"][m], m))
        bad = ["--member", '{"tp": 3}', "--member", '{"dp": 2}', "--steps", "1", "--no-progress"]
        assert lp.main(bad) == 2
        if comm.rank == 0:
            assert "member 0 ({'tp': 3}):" in capsys.readouterr().err
        assert lp.main(["--member", '{"tp": 2}', "--member", '{"dp": 2}', "--tournament-every", "2", "--steps", "1",
                        "--no-progress"]) == 2
        if comm.rank == 0:
            assert "members of different layouts exchange their models through checkpoints: give a scratch " \
                   "directory" in capsys.readouterr().err
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def test_llm_pretrain_selection_without_a_population_is_refused_in_one_line(comm, capsys):
    lp = _llm_pretrain()
    assert lp.main(["--tournament-every", "2", "--steps", "2", "--no-progress"]) == 2
    if comm.rank == 0:
        assert "--tournament-every and --pbt-every select among the members of a population: give --pop K >= 2" \
            in capsys.readouterr().err


def test_a_member_without_a_selection_hook_trains_alone(comm):
    """Members stay independent unless a tournament or PBT ties them: member 0 trains while the
    others wait (the benchmark's one long trainer; a stop agreed in the loop itself hung it)."""
    grid = ProcessGrid(pop=2)
    grid.init_torch()
    if grid.member == 0:
        trainer = build_llm_trainer(MODEL, replace(TRAIN, steps=2), ParallelConfig(), grid=grid)
        trainer.fit()
        assert trainer.step == 2
        trainer.close()
    assert comm.allreduce(1) == comm.size



def _diverging_member(diverged: set[int], every: int, how: str = "weights", selection: str = "tournament"):
    """2 members x dp2 under tournaments (or PBT rounds) every ``every`` steps; after step 1 the
    members in ``diverged`` take only NaN steps (skipped) until step ``every``: their weights made
    NaN (``how="weights"``, as a real divergence), or only their gradients (``"gradients"``:
    weights that still score finite, as a learning rate far too high leaves them)."""
    from hpcml.train.pbt import PBTConfig, PopulationBasedTraining

    grid = ProcessGrid(pop=2, dp=2)
    trainer = build_llm_trainer(MODEL, replace(TRAIN, steps=16, seed=10 + grid.member), ParallelConfig(), grid=grid)
    val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=99)
    score = lambda: trainer.evaluate(val, 2)  # noqa: E731
    t = (Tournament(grid, trainer.model, score, optimizer=trainer.optimizer, config=TournamentConfig(every=every))
         if selection == "tournament" else
         PopulationBasedTraining(grid, trainer, score, config=PBTConfig(every=every, fraction=0.5, seed=1)))
    trainer.hooks.append(t)
    trainer.fit(1)
    if grid.member in diverged and how == "weights":
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.fill_(float("nan"))
    elif grid.member in diverged:
        norm = trainer.model.local_sq_grad_norm
        trainer.model.local_sq_grad_norm = lambda: torch.tensor(float("nan")) if trainer.step < every else norm()
    return grid, trainer, t


@pytest.mark.parametrize("how,selection", [("weights", "tournament"), ("gradients", "tournament"),
                                           ("gradients", "pbt")])
def test_a_member_that_diverges_waits_for_the_round_that_gives_it_a_finite_model(comm, how, selection):
    """Before, a member that diverged raised alone and the abort ended every member's training;
    now its steps are skipped until the next round, where it scores NaN (whatever its weights
    score: they took no step) and so takes the other's model, and it trains on."""
    import math

    from hpcml.train import loop

    grid, trainer, t = _diverging_member({1}, 12, how, selection)
    trainer.fit(16)  # member 1: steps 2-12 skipped (diverged at the 10th), the round after step 12 replaces it
    skipped = [m["step"] for m in trainer.history if m.get("skipped")]
    assert skipped == ([] if grid.member == 0 else list(range(2, 13)))
    assert loop.MAX_NONFINITE_IN_ROW < len(skipped) or grid.member == 0  # past the count that ends a lone run
    assert trainer.step == 16 and not trainer.diverged and trainer.nonfinite_in_row == 0
    assert all(math.isfinite(m["loss"]) for m in trainer.history[12:])  # steps 13-16 train, on both
    if selection == "pbt":
        r = t.history[-1]
        assert math.isnan(r.scores[1]) and math.isfinite(r.scores[0])
        assert r.source == (0 if grid.member == 1 else None)
        return trainer.close()
    out = t.history[-1]
    assert out.round == 1 and out.kept == ("own" if grid.member == 0 else "partner")
    assert math.isnan(out.own_score) == (grid.member == 1) and math.isfinite(out.partner_score) == (grid.member == 1)
    trainer.close()


@pytest.mark.parametrize("how", ["weights", "gradients"])
def test_a_population_whose_every_member_diverged_ends_on_every_rank_in_one_line(comm, how):
    from hpcml.errors import DivergenceError, PopulationDivergedError

    grid, trainer, t = _diverging_member({0, 1}, 12, how)
    with pytest.raises(PopulationDivergedError, match=r"^every member of the population diverged: none has a model "
                                                      r"that takes finite steps .* at tournament round 1 "
                                                      r"\(scores \[nan, nan\]\) -- lower the learning rate"):
        trainer.fit(16)
    assert trainer.step == 12 and trainer.diverged and not t.history  # at the round, before anything moved
    assert issubclass(PopulationDivergedError, DivergenceError)
    trainer.close()


@pytest.mark.parametrize("every,steps,where", [(12, 14, "at tournament round 1 (scores [nan, nan])"),
                                               (30, 14, "on the held-out data (scores [nan, nan])")],
                         ids=["at-a-round", "after-the-last-round"])
def test_llm_pretrain_population_that_diverged_exits_1_in_one_line(comm, capsys, every, steps, where):
    """``--lr 1e6``: every gradient NaN, the loss finite (the weights still score finite). Every
    member diverged at a round, or after the last one, is exit 1 and one line -- not exit 0 with
    a 'best member' that took one step, nor an abort."""
    lp = _llm_pretrain()
    rc = lp.main(["--pop", "2", "--dp", "2", "--tournament-every", str(every), "--lr", "1e6", "--steps", str(steps),
                  "--no-progress"])
    assert rc == 1
    if comm.rank == 0:
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("llm_pretrain:")]
        assert len(err) == 1 and err[0].startswith("llm_pretrain: error: every member of the population diverged")
        assert where in err[0] and "lower the learning rate" in err[0]
