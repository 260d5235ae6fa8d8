"""Pretrain a decoder transformer on synthetic tokens, or a packed corpus (--data), under any parallel layout.

    mpiexec -n 4 python workflows/llm_pretrain.py --tp 2 --pp 2 --steps 20 --seed 0 --run-dir runs/x
    python workflows/llm_pretrain.py --steps 20 --seed 0          # one process, same losses
    mpiexec -n 4 python workflows/llm_pretrain.py --tp 2 --pp 2 --steps 10 --ckpt-dir ck --ckpt-every 5
    mpiexec -n 2 python workflows/llm_pretrain.py --steps 20 --ckpt-dir ck --resume   # any layout resumes
    mpiexec -n 2 python workflows/llm_pretrain.py --init-from llama-dir --tp 2 --steps 20   # fine-tune a HF Llama
    mpiexec -n 4 python workflows/llm_pretrain.py --model tiny-moe --ep 4 --steps 20   # experts over 4 ranks
    mpiexec -n 4 python workflows/llm_pretrain.py --moe 8x2 --ep 2 --tp 2 --moe-balance bias
    hpcml job --site frontier --nodes 1-2 --walltime 02:00:00 -- python workflows/llm_pretrain.py \
        --tp 8 --ckpt-dir ck --ckpt-every 50 --auto-resume    # requeued on the walltime or a lost node

Exit status: 0 done; 2 bad input; 75 stopped by SIGTERM/SIGUSR1 after saving (not finished).

The same seed gives the same losses on every layout (to floating-point tolerance): every
rank builds the same initial weights and takes its slice of the same global batch.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch's import: a walltime warning now is a stop request, not a kill
    from hpcml import stop

    stop.install()

import argparse
import json
import sys
from dataclasses import replace

from pathlib import Path

from hpcml.ckpt import refuse_saves_over
from hpcml.data import TokenDataset, end_of_document, open_tokens
from hpcml.env import NOT_FINISHED
from hpcml.errors import CheckpointError, ConfigError, DivergenceError, HpcmlError, PopulationDivergedError
from hpcml.grid import check_pop, install_abort_handler
from hpcml.interop import hf
from hpcml.models.transformer import PRESETS, TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.parallel.config import GRAD_SYNCS, PP_SCHEDULES, REDUCE_DTYPES


def replicas(text: str) -> int | str:
    """``--dp-replicate``: a number of replicas, or ``node`` (argparse names the flag on a bad value)."""
    return text if text == "node" else int(text)


def moe_fields(spec: str) -> dict:
    """``--moe 8x2`` -> n_experts 8, top-2 (``8``: top-2)."""
    parts = spec.lower().split("x")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--moe {spec!r}: expected E or ExK with integers, e.g. 8x2")
    return {"n_experts": int(parts[0]), "moe_top_k": int(parts[1]) if len(parts) == 2 else 2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, choices=sorted(PRESETS), help="model preset (default tiny)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a Hugging Face Llama directory (config.json + safetensors): its config and "
                        "weights, step 0, fresh optimizer (docs/huggingface.md)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: what the others leave)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--cp", type=int, default=1, help="Ulysses sequence-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE; folds over cp x dp)")
    p.add_argument("--moe", default=None, metavar="E[xK]",
                   help="make the preset a mixture of experts: E experts, top-K (default 2), e.g. 8x2")
    p.add_argument("--moe-balance", default=None, choices=["aux", "bias", "none"],
                   help="MoE balancing: Switch aux + z loss, aux-loss-free bias, or none")
    p.add_argument("--moe-every", type=int, default=None, help="every Nth block is MoE (default 1: all)")
    p.add_argument("--moe-capacity", type=float, default=None, help="capacity factor (default: dropless)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters over dp (FSDP2); default replicates (DDP)")
    p.add_argument("--zero2", action="store_true", help="with --fsdp: keep parameters gathered after forward")
    p.add_argument("--dp-replicate", type=replicas, default=1, metavar="R|node",
                   help="with --fsdp: HSDP, R replicas each sharding over its dp / R ranks ('node': one per node)")
    p.add_argument("--hpz", action="store_true", help="with --fsdp: ZeRO++ hpZ, backward gathers inside the node")
    p.add_argument("--qwz", action="store_true", help="with --fsdp: ZeRO++ qwZ, weights all-gathered in int8")
    p.add_argument("--qgz", action="store_true", help="with --fsdp: ZeRO++ qgZ, gradients reduced in int8 across nodes")
    p.add_argument("--quant-block", type=int, default=256, help="qwZ/qgZ: values per int8 block and its scale")
    p.add_argument("--grad-sync", choices=GRAD_SYNCS, default=None,
                   help="with --fsdp: reduce-scatter gradients after each micro-batch (default: sharded gradients) "
                        "or once a step (fewer collectives, every rank holding its unsharded fp32 gradients)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron-SP norms over tp")
    p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default="fp32",
                   help="the dtype gradients are reduced in over dp (bf16: half the bytes)")
    p.add_argument("--activation", choices=("swiglu", "gelu"), default=None,
                   help="the blocks' MLP, where not the preset's (its width kept): gelu for GPT/MPT blocks")
    p.add_argument("--norm", choices=("rmsnorm", "layernorm"), default=None, help="the blocks' norm")
    p.add_argument("--positions", choices=("rope", "learned", "alibi"), default=None,
                   help="rotary, a learned table added to the embedding (GPT-2's), or ALiBi's linear biases of the "
                        "scores (BLOOM's, MPT's)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases on every projection and norm (GPT's, MPT's)")
    p.add_argument("--fused-qkv", action="store_true", help="one wqkv weight per layer (checkpointed in logical order)")
    p.add_argument("--fused-mlp", action="store_true", help="one w13 (gate/up) weight per layer")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="one weight for the embedding and the output (Llama 3.2 1B/3B); needs --tp 1 and --pp 1")
    p.add_argument("--schedule", default="1f1b", choices=PP_SCHEDULES, help="pipeline schedule")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute block activations")
    p.add_argument("--cp-kind", choices=("ulysses", "allgather"), default="ulysses",
                   help="cp: Ulysses' all-to-all (heads divisible by cp) or keys/values all-gathered (any kv heads)")
    p.add_argument("--fpdt-chunk", type=int, default=0, metavar="N",
                   help="FPDT on cp: strided chunks of N positions per rank, attention/MLP/loss chunk by chunk "
                        "(docs/parallel.md; 0: plain Ulysses)")
    p.add_argument("--loss-chunk", type=int, default=0, metavar="N",
                   help="the output layer and loss N positions at a time, gradients taken in forward (the fp32 "
                        "logits never whole: long sequences, large vocabularies); 0: whole")
    p.add_argument("--memory-account", action="store_true",
                   help="bytes saved for backward per layer in each step's metrics (saved_mib, saved_mib_per_layer)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all dp ranks")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2, help="warmup steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-data", metavar="FILE.h5", help="a held-out token file: its val_loss in the metrics every "
                                                         "--val-every steps and after the last")
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=4, help="global batches of --val-data each time")
    p.add_argument("--data", metavar="FILE.h5[:WEIGHT]", action="append",
                   help="a token file of 'hpcml data pack' (docs/data.md); repeated: a mixture, each file its WEIGHT "
                        "of the samples (default 1). Default: synthetic tokens. The order is seeded by --seed")
    p.add_argument("--doc-mask", action="store_true", help="with --data: attention stays within each packed "
                                                           "document (ended by the data's end-of-document token)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s of one device, for MFU")
    p.add_argument("--run-dir", default=None, help="where metrics.jsonl and config.json go")
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here (and on SIGTERM / SIGUSR1)")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps and the last one (0: only on signals)")
    p.add_argument("--keep", type=int, default=3, help="keep the newest K checkpoints")
    p.add_argument("--resume", action="store_true", help="resume from CKPT_DIR/latest (any layout saved it)")
    p.add_argument("--auto-resume", action="store_true",
                   help="resume from CKPT_DIR/latest when there is one, else start at step 0 (a batch job "
                        "that is requeued after the walltime or a lost node runs the same command again)")
    p.add_argument("--async-save", action="store_true", help="periodic saves overlap training (writer process)")
    p.add_argument("--async-overlap", choices=("auto", "on", "off"), nargs="?", const="on", default="auto",
                   help="with --async-save: the snapshot copy runs beside the next forward/backward too "
                        "(auto, the default: on where the model is on a GPU)")
    p.add_argument("--pop", type=int, default=1, help="a population of POP members of this layout, each on its own "
                   "share of the data, checkpoints in CKPT_DIR/member_K (docs/populations.md)")
    p.add_argument("--member", action="append", metavar="JSON", help="a population member's own layout, once a "
                   "member (e.g. '{\"tp\": 2}' '{\"dp\": 2, \"fsdp\": true}'): degrees, ParallelConfig fields, "
                   "micro_batch; sets --pop")
    p.add_argument("--pop-scratch", metavar="DIR", help="where members of different layouts exchange models "
                   "(checkpoints resharded on load; default CKPT_DIR/exchange)")
    p.add_argument("--tournament-every", type=int, default=0, help="with --pop: LTFB tournaments every N steps")
    p.add_argument("--pbt-every", type=int, default=0, help="with --pop: population-based training every N steps")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def population_members(args: argparse.Namespace, degrees: dict) -> list[dict] | None:
    """``--member`` JSON objects, one a member (``--pop`` set from their number), or None."""
    if not args.member:
        if args.pop_scratch and args.pop < 2:
            raise ConfigError("--pop-scratch is where a population's members exchange models: give --pop or --member")
        return None
    if len(args.member) < 2:
        raise ConfigError("--member gives one member's layout of a population: give it once a member, twice or more "
                          "(one trainer takes the layout flags, --tp ...)")
    if args.pop not in (1, len(args.member)):
        raise ConfigError(f"--member given {len(args.member)} times for --pop {args.pop}: one layout a member")
    flags = sorted(f"--{k}" for k, v in degrees.items() if v != 1 or k == "dp")
    if flags:
        raise ConfigError(f"--member sets each member's layout: not with {', '.join(flags)}")
    members = []
    for i, text in enumerate(args.member):
        try:
            members.append(json.loads(text))
        except ValueError as e:
            raise ConfigError(f"--member {text[:60]!r}: not JSON ({e}); expected an object such as '{{\"tp\": 2}}'") \
                from None
        if not isinstance(members[-1], dict):
            raise ConfigError(f"--member {i} {text[:60]!r}: expected a JSON object such as '{{\"tp\": 2}}'")
    args.pop = len(members)
    return members


def main(argv=None) -> int:
    args = parse_args(argv)  # --help and a mistyped flag answer before torch is imported (~3 CPU-s a rank)
    from mpi4py import MPI

    from hpcml import ckpt
    from hpcml.train.config import TrainConfig
    from hpcml.train.recipe_checks import check_llm_layout, member_configs, resume_point

    install_abort_handler()
    try:
        if args.init_from and args.model:
            raise ConfigError("--model and --init-from both name the model: give one")
        if args.init_from:  # a tied embedding cannot be split over tp or pp: untie it there (same function at step 0)
            untie = {"tie_embeddings": False} if args.tp > 1 or args.pp > 1 else {}
            model_cfg = hf.config_from_hf(args.init_from, **untie)
        else:
            model_cfg = TransformerConfig.preset(args.model or "tiny")
        if args.seq_len > model_cfg.max_seq_len:
            model_cfg = replace(model_cfg, max_seq_len=args.seq_len)
        if args.moe:
            model_cfg = replace(model_cfg, **moe_fields(args.moe))
        moe_kw = {k: v for k, v in (("moe_balance", args.moe_balance), ("moe_every", args.moe_every),
                                    ("moe_capacity", args.moe_capacity)) if v is not None}
        if moe_kw and not model_cfg.n_experts:
            raise ConfigError(f"{', '.join('--' + k.replace('_', '-') for k in moe_kw)} "
                              f"need{'s' if len(moe_kw) == 1 else ''} a MoE model: give --moe "
                              f"E[xK] or a MoE preset (tiny-moe, mixtral-8x7b, grin-moe)")
        if moe_kw:
            model_cfg = replace(model_cfg, **moe_kw)
        if args.tie_embeddings:
            model_cfg = replace(model_cfg, tie_embeddings=True)
        if args.fused_qkv or args.fused_mlp:
            model_cfg = replace(model_cfg, fused_qkv=args.fused_qkv, fused_mlp=args.fused_mlp)
        if args.activation or args.norm or args.bias is not None or args.positions:
            if args.init_from:
                raise ConfigError("--activation, --norm, --bias and --positions change the blocks, and --init-from's "
                                  "weights are a "
                                  "Llama's: give a --model preset to train other blocks")
            model_cfg = model_cfg.with_blocks(args.activation, args.norm, args.bias, args.positions)
        parallel = ParallelConfig(fsdp=args.fsdp, reshard_after_forward=not args.zero2,
                                  sequence_parallel=args.sequence_parallel, pp_schedule=args.schedule,
                                  activation_checkpointing=args.activation_checkpointing, fpdt_chunk=args.fpdt_chunk,
                                  cp_kind=args.cp_kind, hpz=args.hpz, qwz=args.qwz, qgz=args.qgz,
                                  quant_block=args.quant_block, dp_replicate=args.dp_replicate,
                                  reduce_dtype=args.reduce_dtype, grad_sync=args.grad_sync,
                                  loss_chunk=args.loss_chunk)
        data = open_tokens(args.data, seq_len=args.seq_len, seed=args.seed) if args.data else None
        if args.doc_mask and data is None:
            raise ConfigError("--doc-mask needs --data: synthetic tokens have no documents")
        train = TrainConfig(steps=args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch,
                            seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup, seed=args.seed,
                            bf16=args.bf16, peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                            run_dir=args.run_dir, progress=not args.no_progress, memory_account=args.memory_account,
                            doc_mask_eod=end_of_document(data) if args.doc_mask else None)
        degrees = {"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep}
        if args.dp is not None:
            degrees["dp"] = args.dp
        members = population_members(args, degrees)  # sets --pop
        if (args.resume or args.auto_resume) and not args.ckpt_dir:
            raise ConfigError(f"--{'resume' if args.resume else 'auto-resume'} needs --ckpt-dir")
        if args.auto_resume and args.ckpt_dir and args.pop == 1 and (Path(args.ckpt_dir) / "latest").exists():
            args.resume = True
        if args.ckpt_every < 0 or args.keep < 1:
            raise ConfigError(f"--ckpt-every must be >= 0 and --keep >= 1, got {args.ckpt_every} and {args.keep}")
        resuming = args.ckpt_dir and (args.resume if args.pop == 1 else args.resume or args.auto_resume)
        saved = resume_point(args.ckpt_dir, args.pop, args.steps) if resuming else None  # missing: an error here
        if saved is not None and saved[0] > args.steps:
            raise ConfigError(f"{saved[1]} holds step {saved[0]}, past --steps {args.steps}: nothing to train; give "
                              f"--steps above {saved[0]} to train on from it")
        if saved is not None and saved[0] == args.steps:  # a job requeued or resubmitted after its last save
            if MPI.COMM_WORLD.Get_rank() == 0:
                print(json.dumps({"losses": [], "steps": [], "finished_before": saved[0]}))
                print(f"llm_pretrain: already finished: {saved[1]} holds step {saved[0]} of --steps {args.steps}; "
                      f"nothing to train (give more --steps to train on)", file=sys.stderr)
            return 0
        if args.ckpt_dir and not args.resume and (args.pop == 1 or not args.auto_resume):
            members_dirs = sorted(Path(args.ckpt_dir).glob("member_*")) if args.pop > 1 else []
            advice = ("rerun with --resume (or --auto-resume) to continue from it, or give another --ckpt-dir to "
                      "start over") if not args.auto_resume else (
                      f"--auto-resume found no 'latest' there: write the step's name (e.g. step_00000100) into "
                      f"{Path(args.ckpt_dir) / 'latest'} to resume it, or give another --ckpt-dir to start over")
            for where in (Path(args.ckpt_dir), *members_dirs):  # an earlier run's saves are never written over
                refuse_saves_over(where, advice)
        if data is not None and data.vocab_size > model_cfg.vocab_size and not args.init_from:
            # a preset's embedding grows to the corpus's tokenizer, padded to a multiple of 128 (any tp splits it)
            model_cfg = replace(model_cfg, vocab_size=-(-data.vocab_size // 128) * 128)
        val = TokenDataset(args.val_data, seq_len=args.seq_len, seed=args.seed) if args.val_data else None
        resume_from = None
        if (args.tournament_every or args.pbt_every) and args.pop < 2:
            raise ConfigError("--tournament-every and --pbt-every select among the members of a population: give "
                              "--pop K >= 2")
        # every layout check before torch's import: a mistake costs a fraction of a second, not ~3 CPU-s a rank
        world = MPI.COMM_WORLD.Get_size()
        if members is not None:
            member_configs(members, model_cfg, train, parallel, world)
        else:
            check_llm_layout(model_cfg, train, parallel, world // check_pop(args.pop, world), degrees, data)
        if args.ckpt_dir and args.pop == 1:  # another job saving there: refused now too (the hook keeps the lock)
            ckpt.lock.hold_on(args.ckpt_dir, MPI.COMM_WORLD)
        from hpcml.train.checkpointing import CheckpointHook, load_trainer
        from hpcml.train.population_online import export_best, member_keep, member_path, member_resume
        from hpcml.train.recipe import best_member, build_llm_member, build_llm_trainer

        if args.pop > 1:
            scratch = args.pop_scratch or (str(Path(args.ckpt_dir) / "exchange") if args.ckpt_dir else None)
            trainer = build_llm_member(model_cfg, train, parallel, pop=args.pop, data=data, val=val,
                                       tournament_every=args.tournament_every, pbt_every=args.pbt_every,
                                       val_batches=args.val_batches, members=members, scratch=scratch,
                                       **({} if members else degrees))
            args.ckpt_dir = member_path(args.ckpt_dir, trainer.grid)
            if args.resume or args.auto_resume:  # the newest step every member holds
                resume_from = member_resume(args.ckpt_dir, trainer.grid, required=args.resume)
                args.resume = resume_from is not None
        else:
            trainer = build_llm_trainer(model_cfg, train, parallel, data=data, **degrees)
        if val is not None:  # its checks raise alike on every rank
            trainer.validate_on(val, every=args.val_every, batches=args.val_batches)
        if args.ckpt_dir:
            overlap = {"on": True, "off": False}.get(args.async_overlap, "auto")
            keep = member_keep(args.ckpt_dir, trainer.grid, args.keep)  # a member spares the step all hold
            hook = CheckpointHook(args.ckpt_dir, args.ckpt_every, keep=keep, async_save=args.async_save,
                                  overlap=overlap, resumed=args.resume or args.auto_resume)
            hook.claim(trainer.grid.comm)  # another job saving there: one line on every rank, no traceback
            trainer.hooks.append(hook)
            if args.resume:
                load_trainer(trainer, resume_from or args.ckpt_dir)
        if args.init_from and not args.resume:  # a requeued job resumes its own checkpoint instead
            hf.load_hf_into(trainer, args.init_from)
    except HpcmlError as e:  # raised alike on every rank, before any collective
        from hpcml import env

        if env.detect().rank == 0:
            print(f"llm_pretrain: error: {e}", file=sys.stderr)
        return 2
    try:
        history = trainer.fit()
    except DivergenceError as e:  # raised at the same step on every rank of the trainer (its loss is all-reduced)
        if trainer.grid.pop > 1 and not isinstance(e, PopulationDivergedError):  # one member's ranks only (no
            raise  # selection to replace it): the abort handler ends the job, no other member left waiting
        for hook in trainer.hooks:
            if isinstance(hook, CheckpointHook):
                hook.close()  # a save in flight holds finite weights: committed
        if trainer.grid.world_comm.Get_rank() == 0:  # the member's, or the population's one line
            print(f"llm_pretrain: error: {e}", file=sys.stderr)
        return 1
    from hpcml import stop

    stop.finished()  # done or saved: a warning from now on changes nothing (and must not kill us)
    for hook in trainer.hooks:
        if isinstance(hook, CheckpointHook):
            hook.close()  # exit waits for a save in flight
    unfinished = trainer.step < train.steps  # stopped by a signal (the walltime warning)
    best = {}
    if trainer.grid.pop > 1 and not unfinished:  # every member saved: the best one's model is the run's
        member, scores = best_member(trainer, val, args.val_batches)
        best = {"best_member": member, "member_val_losses": scores}
        if member is None:  # every member diverged after the last round (none was there to replace it)
            trainer.close()
            if trainer.grid.world_comm.Get_rank() == 0:
                print(f"llm_pretrain: error: every member of the population diverged: no model that takes finite "
                      f"steps and scores finite on the held-out data (scores {scores}) -- lower the learning rate",
                      file=sys.stderr)
            return 1
        if member is not None and args.ckpt_dir and trainer.grid.world_comm.Get_rank() == 0:
            try:
                export_best(Path(args.ckpt_dir).parent, member)
            except CheckpointError as e:  # --ckpt-every 0: nothing saved to hand on
                print(f"llm_pretrain: the best member's model is not in {Path(args.ckpt_dir).parent}: {e}",
                      file=sys.stderr)
    trainer.close()
    if trainer.grid.rank == 0:
        moe = {k: [m[k] for m in history] for k in trainer.model.stat_names}  # MoE balancing, per step
        member = {"member": trainer.grid.member} if trainer.grid.pop > 1 else {}  # a line a member
        print(json.dumps({**member, "layout": trainer.grid.layout.degrees, "losses": [m["loss"] for m in history],
                          "steps": [m["step"] for m in history], **moe, **best}))
        if unfinished and args.ckpt_dir:
            print(f"llm_pretrain: stopped by a signal at step {trainer.step} of {train.steps}, checkpoint saved: "
                  f"exit {NOT_FINISHED} (not finished; rerun with --resume or --auto-resume)", file=sys.stderr)
        elif unfinished:  # nothing to resume from: a requeue would start over, so this is a failure
            print(f"llm_pretrain: stopped by a signal at step {trainer.step} of {train.steps} with no --ckpt-dir: "
                  f"nothing saved, the steps are lost", file=sys.stderr)
    import torch.distributed as dist

    dist.destroy_process_group()
    return (NOT_FINISHED if args.ckpt_dir else 1) if unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
