"""Every valid layout of a model on N devices, scored: the grid's degree rules and the model's
plan rules prune, memory filters, the time model ranks.

The candidates are what the framework can run: for hpcml, ZeRO 0 (DDP), 2 and 3 (FSDP2 with
and without resharding after forward), recompute none or full, flash attention; for Megatron,
Megatron-DeepSpeed and torchtitan their own options (ZeRO-1, selective recompute) as well.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from hpcml.errors import ConfigError
from hpcml.grid.layout import divisors
from hpcml.models.transformer.config import TransformerConfig
from hpcml.plan import calibration
from hpcml.plan.devices import Device
from hpcml.plan.floor import least_dp_s, step_floor
from hpcml.plan.predict import (Prediction, dp_traffic, evaluate, load_model, megatron_wants_sp, memory_gib,
                                plan_rules, resolve_device, tied)
from hpcml.plan.candidate import CP_KINDS, PlanLayout
from hpcml.plan.forked import fork_map
from hpcml.plan.framework_rules import deepspeed_refuses

ZERO = {"hpcml": (0, 2, 3), "megatron": (0, 1, 3), "torchtitan": (0, 2, 3), "deepspeed": (0, 1, 2, 3)}
RECOMPUTE = {"hpcml": ("none", "full"), "megatron": ("none", "selective", "full"),
             "deepspeed": ("none", "selective", "full"),
             "torchtitan": ("none", "selective-op", "selective-layer", "full")}


FRAMEWORK_CP_KINDS = {"hpcml": CP_KINDS, "megatron": CP_KINDS, "torchtitan": CP_KINDS, "deepspeed": ("ulysses",)}
"""The context parallelism each framework runs: Ulysses' all-to-all (DeepSpeed's, Megatron-core's
``a2a``) and keys and values gathered (hpcml's ``cp_kind allgather``, Megatron-core's ``p2p`` and
``all_gather``, torchtitan's ring); a search not told ``cp_kind`` tries the second where the first
cannot split the heads over cp (:func:`search`): everywhere, it took 2-3 s for 16,384 GPUs."""
MIN_QUERY_ROWS = 128
"""Tokens a cp rank holds at least when a search tries all-gathered keys and values (not asked for):
its queries are its own tokens, and fewer than a FlashAttention tile of queries (128 rows) leave the
kernel mostly idle -- a thousand more layouts a 16,384-GPU search would price, none of them fast."""


def candidates(base: PlanLayout, cfg: TransformerConfig, dev: Device, *, max_micro_batch: int = 64,
               refused: list[int] | None = None, cp_kinds: tuple[str, ...] | None = None) -> Iterator[PlanLayout]:
    """Every layout of ``base``'s model, devices, sequence and batch that the grid and the model's
    plan accept (:func:`candidate_groups`, one by one)."""
    for group in candidate_groups(base, cfg, dev, max_micro_batch=max_micro_batch, refused=refused,
                                  cp_kinds=cp_kinds):
        yield from group


def candidate_groups(base: PlanLayout, cfg: TransformerConfig, dev: Device, *, max_micro_batch: int = 64,
                     refused: list[int] | None = None, cp_kinds: tuple[str, ...] | None = None
                     ) -> Iterator[list[PlanLayout]]:
    """:func:`group_heads`, each group whole: its layout in every recompute mode the framework runs."""
    for head in group_heads(base, cfg, dev, max_micro_batch=max_micro_batch, refused=refused, cp_kinds=cp_kinds):
        yield modes(head)


def modes(head: PlanLayout) -> list[PlanLayout]:
    """A group from its head (recompute none): the framework's recompute modes in order, ``full`` last."""
    return [head, *(head.unchecked(recompute=rc) for rc in RECOMPUTE[head.framework][1:])]


def group_heads(base: PlanLayout, cfg: TransformerConfig, dev: Device, *, max_micro_batch: int = 64,
                refused: list[int] | None = None, cp_kinds: tuple[str, ...] | None = None) -> Iterator[PlanLayout]:
    """Every layout of ``base``'s model, devices, sequence and batch that the grid and the
    model's plan accept: tp within a node, cp, pp, ep for MoE models, micro-batch, ZeRO stage,
    recompute, sequence parallelism, and the pipeline schedule. ``refused`` (a one-item
    counter): the model's plan is checked before a layout is built, and the layouts it refuses
    are counted there instead of yielded -- pruned before they cost anything (most of a large
    search is refused: 31,260 of 39,612 layouts of a 405B model on 16,384 GPUs). Yielded in groups
    alike but for the recompute mode, ``full`` last: the least memory of them. ``cp_kinds``: the
    context parallelism tried where cp > 1, those of them the framework runs (None: ``base``'s)."""
    fw, gpus = base.framework, base.gpus
    kinds = [k for k in (cp_kinds or (base.cp_kind,)) if k in FRAMEWORK_CP_KINDS[fw] or k == base.cp_kind]
    if base.fpdt_chunk:  # FPDT runs on Ulysses
        kinds = [base.cp_kind]
    sync, base = base.grad_sync, _with_sync(base, None)  # asked for, or both tried where hpcml's FSDP accumulates
    if base.recompute != RECOMPUTE[fw][0]:  # a group's head: the first mode (every layout below copies it)
        base = base.unchecked(recompute=RECOMPUTE[fw][0])
    if sync == "step" and fw != "hpcml":
        raise ConfigError(f"grad_sync step with framework {fw}: without a pipeline only hpcml's trainer can be told "
                          f"to reduce once a step ({fw} reduces each micro-batch's; under a pipeline every framework "
                          f"reduces once a step)")
    max_stages = cfg.n_layers + (2 if base.split == "ends" else 0)  # (ends: the embedding and the output as blocks)
    for tp in divisors(min(gpus, dev.gpus_per_node)):
        if gpus % tp:
            continue
        for cp, kind in ((cp, k) for cp in divisors(gpus // tp) for k in (kinds if cp > 1 else [base.cp_kind])):
            if base.seq_len % cp:
                continue
            if kind != base.cp_kind and (all((n // tp) % cp == 0 for n in (cfg.n_heads, cfg.kv_heads))
                                         or base.seq_len // cp < MIN_QUERY_ROWS):
                continue  # Ulysses splits these heads: the other kind only where it cannot (the search's time)
            at_kind = base if kind == base.cp_kind else base.unchecked(cp_kind=kind)
            for pp in divisors(gpus // (tp * cp)):
                if pp > max_stages:
                    continue
                dp = gpus // (tp * cp * pp)
                if base.global_batch % dp:
                    continue
                eps = [e for e in divisors(cp * dp) if cfg.n_experts % e == 0] if cfg.n_experts else [1]
                schedules = [("1f1b", None)] if pp == 1 or fw == "deepspeed" else \
                    [("1f1b", None), ("interleaved1f1b", base.stages_per_rank or 2)]
                rules_cfg, _, _, why = tied(cfg, fw, tp, pp, base.model)  # the same for every layout below
                for ep in eps:
                    # (hpcml's trainer runs SP without cp and experts; the other frameworks with both)
                    sp_ok = tp > 1 and (fw != "hpcml" or cp == 1 and not cfg.n_experts)
                    sps = (True,) if megatron_wants_sp(cfg, fw, tp) else (False, True) if sp_ok else (False,)
                    for sp in sps:
                        for schedule, v in schedules:
                            for mb in divisors(base.global_batch // dp):
                                if mb > max_micro_batch:
                                    break
                                if schedule == "interleaved1f1b" and (base.global_batch // (dp * mb)) % pp:
                                    continue
                                if pp * (v or 1) > max_stages:
                                    continue
                                try:  # the layout's own rules (hpcml's pipeline needs >= pp micro-batches, ...)
                                    lay = at_kind.with_degrees(tp=tp, cp=cp, pp=pp, ep=ep, sequence_parallel=sp,
                                                               schedule=schedule, stages_per_rank=v, micro_batch=mb)
                                except ConfigError:
                                    continue
                                for zero in ZERO[fw]:
                                    if fw == "deepspeed" and deepspeed_refuses(pp, zero, schedule, base.overlap):
                                        continue  # its pipeline: ZeRO 0-1; its BF16_Optimizer: no overlap
                                    if refused is not None and (why or plan_rules(rules_cfg, gpus, tp, cp, pp, ep,
                                                                                  zero >= 2, sp and fw == "hpcml",
                                                                                  schedule, v, kind,
                                                                                  lay.split)):
                                        refused[0] += len(RECOMPUTE[fw])
                                        continue
                                    try:  # (NeMo's remainders need ZeRO 0-1: the layout's own rule)
                                        at_zero = lay.with_zero(zero)
                                    except ConfigError:
                                        continue
                                    if zero >= 2 and pp > 1 and sync == "microbatch":
                                        continue  # (a pipeline reduces once a step)
                                    syncs = (None,) if zero < 2 or pp > 1 or lay.microbatches == 1 else \
                                        (sync,) if sync else (None, "step") if fw == "hpcml" else (None,)
                                    for gs in syncs:  # (the other modes made only where priced: :func:`modes`)
                                        yield _with_sync(at_zero, gs)


def _full_is_least(cfg: TransformerConfig, lay: PlanLayout) -> bool:
    """Full recompute needs the least memory of the modes: it keeps each block's input and one block
    whole for its recompute, where the others keep each block's activations (at least its input and
    more), so it is least wherever a rank holds two or more blocks; with one, keeping that block
    whole may be less than its input and the recompute's copy (then none is priced too: the
    selective modes keep each block's share and one block whole, never less than full)."""
    return cfg.n_layers >= 2 * lay.pp * lay.v


def _with_sync(lay: PlanLayout, sync: str | None) -> PlanLayout:
    """``lay`` with ``grad_sync`` set, unchecked: the search sets it only where it is valid."""
    if lay.grad_sync == sync:
        return lay
    return lay.unchecked(grad_sync=sync)


@dataclass(frozen=True)
class SearchResult:
    best: list[Prediction]
    candidates: int
    fitting: int
    """Of the layouts priced, those that fit."""
    refused: int
    unpriced: int = 0
    """Layouts not priced: their :func:`~hpcml.plan.floor.step_floor` is slower than the best's."""


def search(base: PlanLayout, *, top: int = 5, headroom: float = 0.0,
           cp_kinds: tuple[str, ...] | None = None, workers: int = 1) -> SearchResult:
    """The ``top`` fitting layouts by predicted tokens/s (ties: less memory first); a layout
    fits when its fullest rank needs at most ``1 - headroom`` of the device's memory.
    ``cp_kinds``: the context parallelism tried (None: ``base``'s; ``hpcml plan`` tries each its
    framework runs unless told ``--cp-kind``: a model with fewer key-value heads than a long
    context needs cp ranks is refused Ulysses, not all-gathered keys and values). ``workers``:
    processes that price the layouts (``hpcml plan``: the cores it may use), each its share of
    them in turn, where there are :data:`PARALLEL_MIN_GROUPS` groups or more -- the same best
    layouts; ``fitting`` and ``unpriced`` count what each priced against its own fastest."""
    cfg, dev = load_model(base.model), resolve_device(base)
    c = calibration.constants(dev)
    refused = [0]
    # the groups whose step can be shortest first (a group's floor is its first mode's, recompute none:
    # the others' recompute more), so the bar falls soon and the rest are never priced
    groups = sorted((step_floor(cfg, dev, c, h), k, h)
                    for k, h in enumerate(group_heads(base, cfg, dev, refused=refused, cp_kinds=cp_kinds)))
    n = len(groups) * len(RECOMPUTE[base.framework])
    parts = max(1, min(workers, len(groups) // PARALLEL_MIN_GROUPS))

    def work(i: int) -> dict:  # the i-th share: groups i, i + parts, ... (each share's floors ascend)
        return _price(groups[i::parts], cfg, dev, c, top, headroom)

    shares = fork_map(work, parts)  # (one part: work(0) here, nothing forked)
    shares = [s if s is not None else work(i) for i, s in enumerate(shares)]  # a failed child's share, here
    at = {k: h for _, k, h in groups}
    scored = [(evaluate(cfg, dev, c, modes(at[k])[i], time_if_oom=False, traffic=False), k, i)
              for s in shares for k, i in s["best"]]
    scored.sort(key=lambda e: (*_faster(e[0]), e[1], e[2]))  # ties in the order the candidates come
    best: list[Prediction] = []
    for p, _, _ in scored:  # a twin is listed once: the same layout but its ZeRO stage, priced the same
        if not any(_twin(p, q) for q in best):
            best.append(replace(p, dp_bytes=dp_traffic(cfg, dev, p.layout)))
            if len(best) == top:
                break
    return SearchResult(best, n + refused[0], sum(s["fitting"] for s in shares), refused[0],
                        sum(s["unpriced"] for s in shares))


PARALLEL_MIN_GROUPS = 2000
"""Groups a share of a parallel search has at least: a fork and the reply cost ~10-30 ms, a group
~10-100 us (the 16,384-GPU searches have 2,000-12,000 groups of a dense model, up to 35,000 of MoE)."""


def _price(groups: list[tuple[float, int, PlanLayout]], cfg: TransformerConfig, dev: Device, c,
           top: int, headroom: float) -> dict:
    """Price ``groups`` (their heads, ascending floors) until a floor is slower than the ``2 x top``-th
    fastest fitting step: ``{"best": [[k, i], ...] (group k's layout i, the 2 x top fastest, fastest first),
    "fitting": ..., "unpriced": ...}`` -- a dict of numbers, what a forked share sends back."""
    fitting = unpriced = 0
    scored: list[tuple[tuple, int, int]] = []
    kept: list[float] = []  # the 2 x top fastest steps so far, negated (a heap): a twin takes two places
    for at, (floor, k, head) in enumerate(groups):
        bar = -kept[0] if len(kept) == 2 * top else math.inf  # a layout no faster than it is not timed
        if floor > bar:  # nor is any after it (the floors ascend)
            unpriced += (len(groups) - at) * len(RECOMPUTE[head.framework])
            break
        group = modes(head)

        def price(lay: PlanLayout) -> Prediction:
            return evaluate(cfg, dev, c, lay, time_if_oom=False, traffic=False)
        # no faster than the best: not priced -- a mode's floor with the traffic no step hides (~3x the sort's
        # arithmetic, a tenth of a pricing); recompute none (the group's first) has the least of them:
        # slower, so is every mode
        slow = [bar < math.inf] * len(group)
        least = None  # (the data-parallel term, the same in every mode: asked for where the rest is under the bar)
        for i, lay in enumerate(group):
            if slow[i] and step_floor(cfg, dev, c, lay, comm=True, least_dp=0.0) <= bar:
                least = least_dp_s(cfg, dev, c, head) if least is None else least
                slow[i] = step_floor(cfg, dev, c, lay, comm=True, least_dp=least) > bar
            if i == 0 and slow[0]:
                slow[1:] = [True] * (len(group) - 1)
                break
        if all(slow):
            unpriced += len(group)
            continue
        priced = {}
        if not slow[-1]:
            priced[len(group) - 1] = price(group[-1])  # full recompute first
            if not _fits(priced[len(group) - 1], dev, headroom):
                if _full_is_least(cfg, group[-1]):
                    continue  # full keeps the least: none of the group fits
                priced[0] = price(group[0])
                if not _fits(priced[0], dev, headroom):
                    continue  # the selective modes keep more than full (each block's share, one block whole)
        elif _full_is_least(cfg, group[-1]) and memory_gib(cfg, dev, c, group[-1]) > dev.memory_gib * (1 - headroom):
            continue  # full, too slow to time, keeps the least memory: if it does not fit, no mode does
        unpriced += sum(slow)
        for i, lay in enumerate(group):
            if slow[i]:
                continue
            p = priced[i] if i in priced else price(lay)
            if _fits(p, dev, headroom):
                fitting += 1
                scored.append(((*_faster(p), k, i), k, i))
                heapq.heappush(kept, -p.step_s)
                if len(kept) > 2 * top:
                    heapq.heappop(kept)
    return {"best": [[k, i] for _, k, i in heapq.nsmallest(2 * top, scored)], "fitting": fitting,
            "unpriced": unpriced}


def _twin(p: Prediction, q: Prediction) -> bool:
    """``p`` is ``q`` but for its ZeRO stage, with the same step time and memory (ZeRO-2 and -3
    under a pipeline, whose stages gather once a step either way)."""
    return p.step_s == q.step_s and p.memory_gib == q.memory_gib and p.layout.zero != q.layout.zero \
        and p.layout.unchecked(zero=q.layout.zero) == q.layout


def _fits(p: Prediction, dev: Device, headroom: float) -> bool:
    """Runs, with ``headroom`` of the device's memory to spare."""
    return p.fits and p.memory_gib["total"] <= dev.memory_gib * (1 - headroom)


def _faster(p: Prediction) -> tuple[float, float]:
    """The search's order: more tokens/s first, then less memory."""
    return -p.tokens_per_s, p.memory_gib["total"]


def fastest_micro_batch(lay: PlanLayout, *, headroom: float = 0.0, max_micro_batch: int = 64) -> PlanLayout:
    """``lay`` at the micro-batch a search would pick for it: the fastest that fits within
    ``1 - headroom`` of the device (ties: less memory), among the divisors of its per-replica
    batch; ``lay`` itself when none fits (its prediction then says why). A layout given
    without a micro-batch asks about its other degrees: answered at micro-batch 1 it was
    predicted (and ``--emit`` ran it) up to 7x slower than the search's choice."""
    cfg, dev = load_model(lay.model), resolve_device(lay)
    c = calibration.constants(dev)
    fitting = []
    for mb in divisors(lay.global_batch // lay.dp):
        if mb > max_micro_batch:
            break
        try:  # the layout's own rules (a pipeline needs >= pp micro-batches, ...)
            p = evaluate(cfg, dev, c, replace(lay, micro_batch=mb), time_if_oom=False)
        except ConfigError:
            continue
        if _fits(p, dev, headroom):
            fitting.append(p)
    return min(fitting, key=_faster).layout if fitting else lay
