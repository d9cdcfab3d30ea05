"""Quality of 8-bit stored state (``stored_dtype``): teacher-forced SmolLM2 over multi-turn chats, restored by each method under each encoding, against the lossless restore.

Each conversation opens with a document of about 2K tokens and goes on for several turns; its text is
real English prose that Python ships (the language reference in ``pydoc_data.topics``), and every reply
is teacher-forced from the same text. The whole conversation is saved once into a lossless store and
two 8-bit ones (``save="all"``; ``stored_dtype`` ``"8bit"``, fp8 H and int8 KV, and the other way round,
``"H=int8,KV=fp8"``). Then, for every turn after the first, its history is restored by each plan (H, KV
and a mixed one) from the lossless store and from the 8-bit ones, and the turn's tokens are run over it;
the next-token distribution at each of those positions is compared with the same plan's lossless
restore's (bit-identical to recompute, as the tests check):
- ``top1``: the fraction of positions whose most likely next token is the same;
- ``kl_mean`` / ``kl_max``: KL(lossless || 8-bit) of the next-token distributions, in nats;
- ``ppl`` and ``ppl_increase``: perplexity of the text's own next tokens, and its change relative to
  the lossless restore's.

It also measures what the encodings are chosen by: per layer, the per-channel range of the saved hidden
states (the largest channel's absmax over the median channel's, and how many channels exceed 6x the
median) and the relative RMS error of each encoding on the saved H and KV of the first conversation; and
the stored bytes per token of each format in each encoding, scales and chunk headers included, over the
lossless chunk, for the model's dtype and for bfloat16.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..model.loader import DEFAULT_MODEL, load_model, model_dtype
from ..ops.quant import dequantise, quantise
from ..planning.plan import Method, RestorePlan, row_shapes
from ..serving.restore import restore_prefix
from ..storage.stored_state import stored_encodings, stored_tensors
from ..serving.runtime import HCacheRuntime
from ..storage.chunk import ChunkLayout
from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key

TEXT_SOURCE = "pydoc_data.topics (the Python language reference, shipped with Python)"
LOSSLESS = "auto"
ENCODINGS = ("8bit", "H=int8,KV=fp8")
# (row, plan, stored_dtype): each format in each 8-bit encoding, and the mixed plan in the chosen one
ROWS = (
    ("H fp8", "H", "8bit"),
    ("H int8", "H", "H=int8,KV=fp8"),
    ("KV int8", "KV", "8bit"),
    ("KV fp8", "KV", "H=int8,KV=fp8"),
    ("mixed 8bit", "mixed", "8bit"),
)
# (the document's topic, the topic the replies are read from, questions): one conversation each
CONVERSATIONS = (
    (
        "execmodel",
        "compound",
        (
            "What is a code block?",
            "How are names resolved?",
            "What are compound statements?",
            "And the with statement?",
        ),
    ),
    (
        "import",
        "assignment",
        (
            "What does the import system do?",
            "Where are modules looked up?",
            "How does assignment work?",
            "And augmented assignment?",
        ),
    ),
)
OUTLIER = 6.0  # a channel is an outlier when its absmax exceeds this many times the median channel's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default=None, help="float32 (default on a CPU), bfloat16 or float16")
    parser.add_argument(
        "--document-tokens", type=int, default=2048, help="tokens of each conversation's opening document"
    )
    parser.add_argument("--reply-tokens", type=int, default=352, help="tokens of each teacher-forced reply")
    parser.add_argument(
        "--rows",
        default=",".join(r for r, _, _ in ROWS),
        help="which of the rows to measure (fewer rows, fewer stores)",
    )
    parser.add_argument("--store", default=None, help="directory for the stores (default: a temporary one)")


def run(args: argparse.Namespace) -> dict:
    names = [r for r, _, _ in ROWS]
    unknown = [r for r in args.rows.split(",") if r not in names]
    if unknown:
        raise ValueError(f"--rows: unknown {unknown}; choose from {names}")
    loaded = load_model(args.model, dtype=model_dtype(args.dtype, "cpu"))
    spec, tok = loaded.spec, loaded.tokenizer
    if tok is None:
        raise ValueError(f"bench quality scores real text and needs a model with a tokenizer; {args.model} has none")
    convs = [
        _conversation(tok, doc, replies, questions, args.document_tokens, args.reply_tokens)
        for doc, replies, questions in CONVERSATIONS
    ]
    mixed = RestorePlan.split(spec.num_layers, re=spec.num_layers // 5, kv=2 * spec.num_layers // 5)
    plans = {
        "H": RestorePlan.uniform(spec.num_layers, Method.H),
        "KV": RestorePlan.uniform(spec.num_layers, Method.KV),
        "mixed": mixed,
    }
    blocks = 2 * -(-max(len(ids) for ids, _ in convs) // CHUNK_TOKENS) + 4
    with tempfile.TemporaryDirectory(prefix="hcache-quality-", dir=args.store) as root:
        chosen = [r for r in ROWS if r[0] in args.rows.split(",")]
        stored = dict.fromkeys((LOSSLESS, *(e for _, _, e in chosen)))
        runtimes = {
            e: HCacheRuntime(loaded, Path(root) / str(i), save="all", stored_dtype=e, num_blocks=blocks)
            for i, e in enumerate(stored)
        }
        try:
            for ids, _ in convs:
                for rt in runtimes.values():  # saves the whole conversation in every format
                    rt.generate(ids, 1, restore=False)
            lossless = runtimes[LOSSLESS]
            channels, errors = _h_channels(lossless, convs[0][0]), _errors(lossless, convs[0][0])
            stats: dict[str, list] = {}
            jobs = [
                (ids, s, e) for ids, starts in convs for s, e in zip(starts[1:], starts[2:])
            ]  # turns after the first
            for ids, start, end in tqdm(jobs, desc="turns"):
                target = torch.tensor(ids[start + 1 : end + 1])
                reference = {name: _score(lossless, ids, plans[name], start, end) for name in {p for _, p, _ in chosen}}
                for row, plan_name, stored_dtype in chosen:
                    logits = _score(runtimes[stored_dtype], ids, plans[plan_name], start, end)
                    stats.setdefault(row, []).append(_position_stats(reference[plan_name], logits, target))
            rows = {name: _summary(parts) for name, parts in stats.items()}
        finally:
            for rt in runtimes.values():
                rt.close()
    result = {
        "model": loaded.name,
        "dtype": spec.dtype,
        "text": TEXT_SOURCE,
        "conversations": [{"tokens": len(ids), "turn_starts": starts} for ids, starts in convs],
        "positions": next(iter(rows.values()))["positions"],
        "plans": {name: str(plan) for name, plan in plans.items()},
        "encodings": {
            e: {fmt: str(d).removeprefix("torch.") for fmt, d in stored_encodings(e).items()} for e in ENCODINGS
        },
        "quality": rows,
        "stored_bytes_ratio": _bytes_ratios(spec),
        "h_channels": channels,
        "relative_rms_error": errors,
    }
    _print(result)
    return result


def _conversation(tok, doc: str, replies: str, questions: tuple[str, ...], doc_tokens: int, reply_tokens: int):
    """A chat's token ids and where each turn starts (and the last ends): a system turn, a user turn with
    the document and a question and a reply, then a question and a reply per turn; replies are consecutive
    stretches of the ``replies`` topic."""
    from pydoc_data.topics import topics

    document = tok.decode(tok.encode(topics[doc], add_special_tokens=False)[:doc_tokens])
    reply_ids = tok.encode(topics[replies], add_special_tokens=False)
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "You answer questions about the document you are given."}], tokenize=True
    )
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    starts = []
    for i, question in enumerate(questions):
        starts.append(len(ids))
        user = f"{document}\n\n{question}" if i == 0 else question
        ids = ids + tok.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        ids = (
            ids
            + reply_ids[i * reply_tokens : (i + 1) * reply_tokens]
            + tok.encode("<|im_end|>\n", add_special_tokens=False)
        )
    starts.append(len(ids) - 1)  # the last position has no next token to score
    return ids, starts


@torch.no_grad()
def _score(rt: HCacheRuntime, ids: list[int], plan: RestorePlan, start: int, end: int) -> torch.Tensor:
    """Next-token logits at positions ``[start, end)`` of ``ids``, with the history before ``start``
    restored by ``plan`` from ``rt``'s store."""
    engine = rt.engine
    engine.flush_all()
    keys = chunk_keys(ids[:start], root_key(rt.fingerprint))
    outcome = restore_prefix(engine, rt.store, 0, ids[:start], keys, rt.fingerprint, plan, rt.stack.copier)
    if outcome.tokens != len(keys) * CHUNK_TOKENS or outcome.fallback:
        raise RuntimeError(f"plan {plan} restored {outcome.tokens} tokens ({outcome.fallback})")
    logits = engine.score(0, ids[outcome.tokens : end], end - start)
    engine.flush_all()
    return logits


def _position_stats(ref: torch.Tensor, got: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position: KL(lossless || 8-bit), whether the top-1 tokens agree, and both NLLs of the text's own
    next token (a turn's logits are dropped once these are taken: a conversation's would fill memory)."""
    ref_lp, got_lp = F.log_softmax(ref.double(), -1), F.log_softmax(got.double(), -1)
    return {
        "kl": (ref_lp.exp() * (ref_lp - got_lp)).sum(-1),
        "agree": ref.argmax(-1) == got.argmax(-1),
        "nll_ref": -ref_lp.gather(1, target[:, None])[:, 0],
        "nll_got": -got_lp.gather(1, target[:, None])[:, 0],
        "identical": torch.tensor(torch.equal(ref, got)),
    }


def _summary(parts: list[dict[str, torch.Tensor]]) -> dict:
    kl, agree, nll_ref, nll_got = (torch.cat([p[k] for p in parts]) for k in ("kl", "agree", "nll_ref", "nll_got"))
    return {
        "positions": len(kl),
        "top1": agree.double().mean().item(),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "ppl": nll_got.mean().exp().item(),
        "ppl_lossless": nll_ref.mean().exp().item(),
        "ppl_increase": (nll_got.mean() - nll_ref.mean()).exp().item() - 1,
        "identical": all(bool(p["identical"]) for p in parts),
    }


def _stored_rows(rt: HCacheRuntime, ids: list[int], fmt: str) -> list[torch.Tensor]:
    """Per layer, the saved ``fmt`` rows of a conversation's stored chunks, from a lossless store."""
    keys = chunk_keys(ids, root_key(rt.fingerprint))
    images = [rt.store.fetch(k).result() for k in keys]
    try:
        return [torch.cat([im.tensor(layer, fmt).clone() for im in images]) for layer in range(rt.spec.num_layers)]
    finally:
        for im in images:
            rt.store.release(im)


def _h_channels(rt: HCacheRuntime, ids: list[int]) -> list[dict]:
    out = []
    for layer, h in enumerate(_stored_rows(rt, ids, Method.H.value)):
        absmax = h.abs().amax(0).float()
        median = absmax.median().item()
        top = absmax.topk(3)
        out.append(
            {
                "layer": layer,
                "max_over_median": absmax.max().item() / median,
                "outlier_channels": int((absmax > OUTLIER * median).sum()),
                "top_channels": top.indices.tolist(),
                "top_absmax": [round(v, 2) for v in top.values.tolist()],
                "median_absmax": median,
            }
        )
    return out


def _errors(rt: HCacheRuntime, ids: list[int]) -> dict:
    """Per format and encoding, per layer: ``||x - dequantise(quantise(x))|| / ||x||``."""
    out = {}
    for fmt in (Method.H.value, Method.KV.value):
        rows = _stored_rows(rt, ids, fmt)
        out[fmt] = {
            name: [((x - dequantise(quantise(x, d), x.dtype)).norm() / x.norm()).item() for x in rows]
            for name, d in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn))
        }
    return out


def _bytes_ratios(spec) -> dict:
    """A chunk holding one format on every layer, 8-bit over lossless: scales and header included."""
    out = {}
    for dtype in dict.fromkeys((spec.dtype, "bfloat16")):
        s = dataclasses.replace(spec, dtype=dtype)
        for fmt in (Method.H.value, Method.KV.value):
            formats = [frozenset({fmt})] * s.num_layers

            def size(encodings: dict) -> int:
                return ChunkLayout.plan(
                    stored_tensors(row_shapes(s), s.torch_dtype, formats, encodings), "f" * 32
                ).nbytes

            for name, d in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
                out[f"{fmt} {name} vs {dtype}"] = size({fmt: d}) / size({})
    return out


def _print(result: dict) -> None:
    print(
        f"quality against the lossless restore, {result['positions']} teacher-forced positions ({result['model']}, {result['dtype']})"
    )
    print(f"{'plan / stored dtype':<18}{'top-1':>8}{'KL mean':>10}{'KL max':>9}{'ppl':>9}{'ppl +%':>8}")
    for name, r in result["quality"].items():
        print(
            f"{name:<18}{r['top1'] * 100:>7.2f}%{r['kl_mean']:>10.5f}{r['kl_max']:>9.4f}{r['ppl']:>9.3f}{r['ppl_increase'] * 100:>+8.3f}"
        )
    print(
        "stored bytes, 8-bit over lossless: "
        + ", ".join(f"{k} {v:.3f}" for k, v in result["stored_bytes_ratio"].items())
    )
    print(
        "hidden-state channels (layer: max/median absmax, outlier channels): "
        + ", ".join(f"{c['layer']}: {c['max_over_median']:.0f}x/{c['outlier_channels']}" for c in result["h_channels"])
    )
    for fmt, by in result["relative_rms_error"].items():
        for name, errs in by.items():
            print(f"{fmt} {name} relative RMS error per layer: max {max(errs):.4f}, mean {sum(errs) / len(errs):.4f}")
