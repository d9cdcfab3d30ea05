"""Tokens restored after a restart when a disk quota holds fewer chunks than the workload saved.

Prompts share their first ``--shared`` tokens (a system prompt) and each has ``--own`` tokens of its own.
They are served ``--rounds`` times on a store whose disk quota holds ``--quota-chunks`` chunk files (the
host pool holds them all, so every round after the first restores from memory), then the runtime is
closed and reopened on the same directory, and each prompt is served once more without saving, so that
what it restores is what the quota kept. A quota that keeps the most used chunks keeps the shared one,
and every prompt restores at least the shared tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from ..storage.store_config import StoreConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="random:llama", help="model to serve ('random:llama', 'smollm2', ...)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts, served in turn each round")
    parser.add_argument("--shared", type=int, default=64, help="tokens every prompt starts with")
    parser.add_argument("--own", type=int, default=70, help="tokens of each prompt's own after the shared ones")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the prompts before the restart")
    parser.add_argument("--quota-chunks", type=int, default=4, help="disk quota, in chunk files")


def run(args: argparse.Namespace) -> dict:
    from ..model.loader import load_model
    from ..serving.runtime import HCacheRuntime

    loaded = load_model(args.model)
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, loaded.spec.vocab_size, (n,), generator=g).tolist()

    system = tokens(args.shared)
    prompts = [system + tokens(args.own) for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="hcache-bench-quota-") as tmp:
        with HCacheRuntime(loaded, Path(tmp) / "probe") as runtime:  # the size of one chunk file
            runtime.generate(tokens(CHUNK_TOKENS + 1), 1)
            runtime.store.flush()
            chunk_file = runtime.store.stores[0].used_bytes
        store, store_dir = StoreConfig(quota_bytes=args.quota_chunks * chunk_file), Path(tmp) / "store"
        with HCacheRuntime(loaded, store_dir, store=store) as runtime:
            for _ in range(args.rounds):
                for prompt in prompts:
                    runtime.generate(prompt, 1)
            runtime.store.flush()
            evictions = runtime.store.stores[0].evictions
            shared_key = chunk_keys(system, root_key(runtime.fingerprint))[:1]
        with HCacheRuntime(loaded, store_dir, store=store, save="none") as runtime:
            kept = runtime.store.stores[0].keys()
            restored = [runtime.generate(prompt, 1).restored_tokens for prompt in prompts]
    result = {
        "restored_tokens_after_restart": sum(restored),
        "restored_tokens_per_prompt": restored,
        "shared_chunk_kept": bool(shared_key) and shared_key[0] in kept,
        "chunks_kept": len(kept),
        "evictions_before_restart": evictions,
        "workload": {
            "model": args.model,
            "prompts": args.prompts,
            "shared_tokens": args.shared,
            "own_tokens": args.own,
            "rounds": args.rounds,
            "quota_chunks": args.quota_chunks,
            "chunk_file_bytes": chunk_file,
        },
    }
    print(
        f"quota of {args.quota_chunks} chunks, {args.prompts} prompts sharing {args.shared} tokens, {args.rounds} rounds, "
        f"then a restart:\n  restored tokens per prompt {restored}, {sum(restored)} in all; "
        f"shared chunk kept: {result['shared_chunk_kept']}; {len(kept)} chunks kept, {evictions} evicted before the restart"
    )
    return result
