"""What a forward keeps for backward, counted (issue 27's memory account).

Activation memory is the bytes autograd saves between a micro-batch's forward and its
backward. :class:`SavedBytes` counts them with ``torch.autograd.graph.saved_tensors_hooks``
while the model runs: each saved tensor's storage once (views of one tensor, and a tensor
several ops save, count once), parameters, buffers and their views not at all (they are model
state, counted by the planner's parameter bytes; autocast's bf16 copies of the weights do
count: they live from forward to backward, and the planner prices them as saved), a
tensor-parallel DTensor by its local shard. A
storage is charged to the layer whose forward first saved it, the rest (embedding, loss) to
``outside``. A non-reentrant activation checkpoint saves its inputs through the same hooks,
so what checkpointing and FPDT's chunking keep is what is counted.

It measures what the graph holds, on any device, where peak RSS (CPU) also counts the
allocator's slack and everything else in the process; both go to ``metrics.jsonl`` when
``LoopConfig.memory_account`` is set.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

OUTSIDE = "outside"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s bytes on this rank (a DTensor's shard, the result inside
    a functional collective's wrapper)."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


class SavedBytes:
    """Counts the bytes saved for backward per layer while active (``with account:``). ``layers``
    maps a name to a module; each forward of a module of ``roots`` (a micro-batch) starts a new
    count, and :meth:`take` returns the counts since the last call."""

    def __init__(self, layers: dict[str, nn.Module], roots: list[nn.Module]) -> None:
        self.layers, self.roots = layers, roots
        self.current = OUTSIDE
        self.by_layer: dict[str, int] = {}
        self.done: list[dict[str, int]] = []
        self._seen: set[int] = set()
        self._state: set[int] = set()
        """Storages of parameters and buffers: at rest, the roots' as this forward holds them
        (FSDP gathers the root's before this account's hook runs), the current layer's."""
        self._layer_state: set[int] = set()
        self._rest: set[int] = set()
        self._stack: ExitStack | None = None

    @staticmethod
    def _storages(modules) -> set[int]:
        return {_local(t).untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}

    def _enter_layer(self, name: str, module: nn.Module):
        def hook(*_):
            self.current, self._layer_state = name, self._storages([module])
        return hook

    def _leave_layer(self, *_) -> None:
        # (a layer's gathered weights are freed after it under FSDP: an activation may take the address)
        self.current, self._layer_state = OUTSIDE, set()

    def _new_forward(self, *_) -> None:
        """A micro-batch's forward: its own count (a freed storage's address may come again)."""
        if self.by_layer:
            self.done.append(self.by_layer)
        self.by_layer, self._seen, self.current = {}, set(), OUTSIDE
        self._state = self._rest | self._storages(self.roots)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        # a weight: FSDP's gathered ones and DTensor's are Parameters too (a storage address alone
        # would not do: FSDP frees a gathered weight after its block, and an activation may reuse it);
        # a view of one (a transposed weight) is a Parameter's view: a DTensor's above its local tensor
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or isinstance(local._base, nn.Parameter) \
                or local.device.type == "meta":
            return t
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._seen and ptr not in self._state and ptr not in self._layer_state:
            self._seen.add(ptr)
            self.by_layer[self.current] = self.by_layer.get(self.current, 0) + storage.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        stack = ExitStack()
        for root in self.roots:
            stack.callback(root.register_forward_pre_hook(self._new_forward).remove)
        for name, module in self.layers.items():
            stack.callback(module.register_forward_pre_hook(self._enter_layer(name, module)).remove)
            stack.callback(module.register_forward_hook(self._leave_layer).remove)
        self._rest = self._storages([*self.layers.values(), *self.roots])
        self._state = set(self._rest)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    def take(self) -> list[dict[str, int]]:
        """Bytes saved per layer (and ``outside``) by each forward since the last call; forgets them."""
        self._new_forward()
        out, self.done = self.done, []
        return out


def account_of(model) -> SavedBytes:
    """The account of a :class:`~hpcml.parallel.ParallelModel`: its plan's FSDP units as the
    layers (a transformer's blocks), each local part's forward a micro-batch."""
    layers = {}
    for i, part in enumerate(model.parts):
        units = {id(u) for u in model.plan.fsdp_units(part)}
        prefix = f"{i}." if len(model.parts) > 1 else ""
        layers.update({prefix + name: m for name, m in part.named_modules() if id(m) in units})
    return SavedBytes(layers, list(model.parts))


def summary(counts: list[dict[str, int]]) -> dict[str, float]:
    """Per-step metrics from each micro-batch's counts: the largest micro-batch's total, and the
    largest single layer's, in MiB."""
    totals = [sum(c.values()) for c in counts] or [0]
    layers = [v for c in counts for k, v in c.items() if k != OUTSIDE] or [0]
    return {"saved_mib": max(totals) / 2**20, "saved_mib_per_layer": max(layers) / 2**20}


__all__ = ["OUTSIDE", "SavedBytes", "account_of", "summary"]
