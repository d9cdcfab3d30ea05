"""This step's computed tokens found in the forward's batch. The worker knows them in the scheduler's order,
by the cache slots vLLM gave them; the forward lays its batch out in the model runner's order, with the
slot each row is written to (its slot mapping). Matching the two by slot finds the rows, whatever the order,
and refuses a mapping that does not hold every token (a forward split into micro-batches)."""
from __future__ import annotations

import torch


def batch_rows(mapping: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """The rows of ``mapping`` (the forward's slot of each batch row) that hold ``slots``, in their order,
    on ``mapping``'s device; None if some slot is not in it."""
    ours = slots.to(mapping.device, mapping.dtype)
    order = torch.argsort(mapping)
    rows = order[torch.searchsorted(mapping[order], ours).clamp(max=len(mapping) - 1)]
    return rows if torch.equal(mapping[rows], ours) else None

