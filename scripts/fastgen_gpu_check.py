"""One GPU session's check of hcache on DeepSpeed-FastGen: correctness, then TTFT of a returning conversation.

1. Builds a random-weight Llama (Llama-2-7B's shape by default) with ``save_pretrained`` into a temp dir
   and loads it with FastGen (``hcache.engine.fastgen.build_fastgen_engine``).
2. Checks that a history restored from saved hidden states (hcache's H) gives the same greedy tokens as
   plain FastGen prefilling it.
3. Times TTFT of a returning conversation (``--history`` tokens of history, ``--turn`` new tokens) three
   ways: recompute (prefill everything), KV offload (K/V from pinned host memory) and hcache (hidden states
   from pinned host memory, K/V GEMM + RoPE). CUDA events, after a warm-up, median of ``--repeats``.
   Prints a table and writes JSON with the GPU name and date.

Needs a CUDA GPU (FastGen's kernels are CUDA-only): ``python scripts/fastgen_gpu_check.py --out result.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hcache, not an installed one


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-2-7B: 32)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (Llama-2-7B: 4096)")
    p.add_argument("--heads", type=int, default=32, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=32, help="KV heads (fewer than --heads for GQA)")
    p.add_argument("--intermediate", type=int, default=11008, help="MLP size")
    p.add_argument("--history", type=int, default=4096, help="tokens of conversation history to restore")
    p.add_argument("--turn", type=int, default=64, help="new tokens of the returning turn")
    p.add_argument("--greedy", type=int, default=16, help="greedy tokens compared in the correctness check")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per method (after one warm-up)")
    p.add_argument("--out", default="fastgen_gpu_check.json", help="JSON result file")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import torch

    from hcache.engine.fastgen import build_fastgen_engine, check_cuda

    try:
        check_cuda()
    except RuntimeError as e:
        print(f"fastgen_gpu_check: {e}", file=sys.stderr)
        return 2
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        num_hidden_layers=args.layers, intermediate_size=args.intermediate, vocab_size=32000,
        max_position_embeddings=max(4096, args.history + args.turn + args.greedy),
    )
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        with torch.device("cuda"):
            LlamaForCausalLM(cfg).half().save_pretrained(path)  # random weights: restore holds for any
        torch.cuda.empty_cache()
        engine = build_fastgen_engine(path)
    max_batch = engine.config.state_manager.max_ragged_batch_size
    history = torch.randint(0, cfg.vocab_size, (args.history,)).tolist()
    turn = torch.randint(0, cfg.vocab_size, (args.turn,)).tolist()

    class Saver:  # keeps every layer's hidden rows and K/V, as the saver would, in pinned host memory
        def __init__(self):
            self.hidden, self.kv = {}, {}

        def begin_batch(self, segments):
            pass

        def on_layer(self, layer, hidden, kv):
            self.hidden.setdefault(layer, []).append(hidden.to("cpu").pin_memory())
            self.kv.setdefault(layer, []).append(kv().to("cpu").pin_memory())

        def end_batch(self):
            pass

    def prefill(uid, tokens, capture=None):
        for off in range(0, len(tokens), max_batch):  # Dynamic SplitFuse's chunks
            logits = engine.step([(uid, tokens[off : off + max_batch])], capture)
        return logits

    def greedy(uid, logits):
        out = [int(logits.argmax(-1)[0])]
        for _ in range(args.greedy - 1):
            out.append(int(engine.step([(uid, [out[-1]])]).argmax(-1)[0]))
        return out

    saver = Saver()
    prefill(1, history, saver)
    hidden = {layer: torch.cat(rows) for layer, rows in saver.hidden.items()}
    kv = {layer: torch.cat(rows) for layer, rows in saver.kv.items()}
    expected = greedy(1, prefill(1, turn))
    engine.flush(1)

    def restore(uid, method):
        engine.begin_restore(uid, len(history))
        for layer in range(cfg.num_hidden_layers):
            if method == "hcache":
                engine.restore_from_hidden(uid, layer, hidden[layer])
            else:
                engine.restore_kv(uid, layer, kv[layer][:, 0], kv[layer][:, 1])
        engine.end_restore(uid, history)
        return prefill(uid, turn)

    ttft_runs = {
        "recompute": lambda uid: prefill(uid, history + turn),
        "kv_offload": lambda uid: restore(uid, "kv_offload"),
        "hcache": lambda uid: restore(uid, "hcache"),
    }
    tokens_match = {}
    for method in ("kv_offload", "hcache"):
        tokens_match[method] = greedy(2, ttft_runs[method](2)) == expected
        engine.flush(2)

    ttft_ms = {}
    for method, run in ttft_runs.items():
        times = []
        for i in range(args.repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            run(10 + i)
            end.record()
            torch.cuda.synchronize()
            engine.flush(10 + i)
            if i:  # the first run warms up
                times.append(start.elapsed_time(end))
        ttft_ms[method] = statistics.median(times)

    result = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size")},
        "history_tokens": args.history,
        "turn_tokens": args.turn,
        "tokens_match_recompute": tokens_match,
        "ttft_ms_median": ttft_ms,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{result['gpu']}  history={args.history} turn={args.turn}  greedy tokens match: {tokens_match}")
    print(f"{'method':<12}{'TTFT ms':>10}{'vs recompute':>14}")
    for method, ms in ttft_ms.items():
        print(f"{method:<12}{ms:>10.1f}{ttft_ms['recompute'] / ms:>13.2f}x")
    return 0 if all(tokens_match.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
