"""What ``bench workload``'s options mean: the rates, the eviction policies, the profile's lengths, and the
engine's and host pool's memory."""

from __future__ import annotations

import argparse

import numpy as np

from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.eviction import POLICIES


def parse_policies(text: str | None) -> list[str | None]:
    """The eviction policies to replay under; ``[None]``: the runtime's default alone."""
    if text is None:
        return [None]
    policies = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not policies or set(policies) - set(POLICIES):
        raise ValueError(f"--eviction must name some of {', '.join(POLICIES)}, not {text!r}")
    return policies


def profile_tokens(max_tokens: int) -> list[int]:
    """The history lengths the profile is measured at: 64 tokens times powers of 4, up to the longest
    history, so that its ``c_token`` follows attention's growth (what cost-aware eviction values chunks by)."""
    return sorted({*(CHUNK_TOKENS << 2 * i for i in range(8) if CHUNK_TOKENS << 2 * i < max_tokens), max_tokens})


def kv_blocks(args: argparse.Namespace) -> int:
    return args.kv_blocks or 4 * -(-args.max_tokens // CHUNK_TOKENS)


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, not {text!r}") from None
    if not rates or not all(r > 0 and np.isfinite(r) for r in rates):
        raise ValueError(f"--rates must be positive sessions per second, not {text!r}")
    return rates


def memory_settings(args: argparse.Namespace, eviction: str | None) -> dict:
    """The settings of ``--eviction``'s policy and ``--host-mib`` that are given."""
    return {
        **({"eviction": eviction} if eviction is not None else {}),
        **({"store": {"host_bytes": args.host_mib << 20}} if args.host_mib is not None else {}),
    }
