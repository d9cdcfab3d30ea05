"""This step's computed tokens found in the forward's batch. The worker knows them in the scheduler's order,
by the cache slots vLLM gave them; the forward lays its batch out in the model runner's order, with the
slot each row is written to (its slot mapping). Matching the two by slot finds the rows, whatever the order,
and tells whether the mapping holds every token (it may not: a forward split into micro-batches). That is
told on the device, not read here: on a GPU reading it would wait for the forward, in every step that saves
hidden states; the saver reads it once the rows it guards have landed (:meth:`ChunkSaver.vouch`)."""

from __future__ import annotations

import torch


def batch_rows(mapping: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``mapping`` (the forward's slot of each batch row) that hold ``slots``, in their order,
    and whether every slot is in it (a bool; where one is not, its row is another token's), both on
    ``mapping``'s device."""
    ours = slots.to(mapping.device, mapping.dtype)
    order = torch.argsort(mapping)
    rows = order[torch.searchsorted(mapping[order], ours).clamp(max=len(mapping) - 1)]
    return rows, (mapping[rows] == ours).all()
