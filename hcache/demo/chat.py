"""``hcache demo``: a scripted multi-turn chat where every turn after the first is restored by every method.

Each turn is first answered by full recompute (no stored state): that reply continues the conversation
and is the reference. Then, with the device KV dropped, the same turn is answered again by each restore
method; its reply must be token-for-token identical. With ``stored_dtype`` other than ``"auto"`` the
state is stored in 8 bits: replies restored from it may differ, and the demo says how many did.

Each method is timed ``repeats`` times per turn, the methods interleaved (recompute, RE, H, KV, mixed,
recompute, RE, ...), every run after dropping the device KV and every reply checked: a method's TTFT is
the median of its runs, shown with their range, so that a moment of load on a shared machine moves one
run of each method, not one method.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..config import HCacheConfig
from ..machine.facts import machine_facts, source_commit
from ..model.loader import DEFAULT_MODEL, load_model
from ..planning.plan import RestorePlan
from ..serving.runtime import HCacheRuntime

SYSTEM = (
    "You are a concise travel guide. Background for this conversation: Paris is the capital and largest "
    "city of France, on the Seine river. It is known for the Eiffel Tower, completed in 1889 for the World's "
    "Fair, the Louvre, the world's most visited museum and home of the Mona Lisa, and the Gothic cathedral "
    "of Notre-Dame. The city has twenty districts called arrondissements, spiralling out from the centre. "
    "Its metro opened in 1900. Lyon, Marseille and Bordeaux are other large French cities, and Bordeaux is "
    "famous for its wine. Answer in one or two sentences."
)
QUESTIONS = [
    "What is the capital of France?",
    "When was the Eiffel Tower completed?",
    "Which museum holds the Mona Lisa?",
    "Name another large French city and what it is famous for.",
    "When did the Paris metro open?",
    "What are the districts of Paris called?",
]


@dataclass
class MethodRow:
    restored_tokens: int  # the fewest of its runs (they restore the same unless one fell back)
    ttft_s: float  # median of its runs
    stored_bytes_per_token: int
    bytes_read: int  # the most of its runs
    identical: bool  # every run's reply equal to the reference
    fallback: str | None  # the first run's fallback, if any run fell back
    lossy: bool = False  # restored from state stored in 8 bits: a differing reply is no failure
    ttft_s_min: float = 0.0
    ttft_s_max: float = 0.0
    ttft_s_runs: list[float] = field(default_factory=list)  # in run order
    runs_differing: int = 0  # runs whose reply differs from the reference


def _methods(num_layers: int) -> dict[str, RestorePlan | None]:
    mixed = RestorePlan.split(num_layers, re=num_layers // 5, kv=2 * num_layers // 5)
    return {
        "recompute": None,
        "RE": RestorePlan.uniform(num_layers, "RE"),
        "H": RestorePlan.uniform(num_layers, "H"),
        "KV": RestorePlan.uniform(num_layers, "KV"),
        f"mixed {mixed}": mixed,
    }


def run_demo(
    model: str = DEFAULT_MODEL,
    turns: int = 4,
    max_new_tokens: int = 48,
    store_dir: str | None = None,
    json_path: str | None = None,
    stored_dtype: str = "auto",
    repeats: int = 3,
) -> bool:
    """Run the chat; print a table per turn; return whether every reply restored from lossless state
    matched recompute. Each method runs ``repeats`` times per turn, interleaved with the others; its TTFT
    is the median. The arguments are checked before the model loads or the store opens."""
    HCacheConfig.of(stored_dtype=stored_dtype)
    if not 1 <= turns <= len(QUESTIONS):
        raise ValueError(f"turns must be between 1 and {len(QUESTIONS)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer of at least 1, not {repeats!r}")
    commit = source_commit()
    loaded = load_model(model)
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"the demo needs a model with a tokenizer; {model!r} has none")
    tmp = None if store_dir else tempfile.mkdtemp(prefix="hcache-demo-")
    try:
        runtime = HCacheRuntime(loaded, store_dir or tmp, save="all", stored_dtype=stored_dtype)
        encodings = runtime.config.encodings
        methods = _methods(runtime.spec.num_layers)
        report = {
            "demo": {
                "model": model,
                "turns": turns,
                "max_new_tokens": max_new_tokens,
                "stored_dtype": stored_dtype,
                "repeats": repeats,
                "store": store_dir,
            },
            "commit": commit,
            "machine": machine_facts(),
            "model": model,
            "spec": runtime.spec.describe(),
            "stored_dtype": stored_dtype,
            "ttft": f"median of {repeats} interleaved runs per method and turn",
            "turns": [],
        }
        ids = tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        all_ok, lossy_runs, lossy_differ = True, 0, 0
        bar = tqdm(total=turns * repeats * len(methods), desc="demo", unit="run", leave=False)
        for turn in range(turns):
            runs: dict[str, list] = {name: [] for name in methods}
            reference = None
            for _ in range(repeats):
                for name, plan in methods.items():  # interleaved: recompute, RE, H, KV, mixed, recompute, ...
                    runtime.drop_device_cache()
                    r = runtime.generate(ids, max_new_tokens, plan=plan, restore=plan is not None)
                    if reference is None:  # the first recompute's reply continues the chat
                        reference = r.output_ids
                    runs[name].append(r)
                    bar.update()
            every = runtime.stack.states.every  # a hybrid's state is stored once every this many chunks
            stored = {
                name: plan.stored_bytes_per_token(runtime.spec, encodings, every) if plan else 0
                for name, plan in methods.items()
            }
            rows = {name: _row(results, reference, round(stored[name])) for name, results in runs.items()}
            all_ok &= all(row.identical or row.lossy for row in rows.values())
            lossy_runs += sum(r.lossy for results in runs.values() for r in results)
            lossy_differ += sum(row.runs_differing for row in rows.values() if row.lossy)
            reply = tok.decode(reference, skip_special_tokens=True).strip()
            tqdm.write(_table(turn + 1, len(ids), QUESTIONS[turn], reply, rows, repeats))
            report["turns"].append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": len(ids),
                    "question": QUESTIONS[turn],
                    "reply": reply,
                    "methods": {name: asdict(row) for name, row in rows.items()},
                }
            )
            if turn + 1 < turns:
                end = [] if reference[-1] == tok.eos_token_id else tok.encode("<|im_end|>", add_special_tokens=False)
                follow = f"\n<|im_start|>user\n{QUESTIONS[turn + 1]}<|im_end|>\n<|im_start|>assistant\n"
                ids = ids + reference + end + tok.encode(follow, add_special_tokens=False)
        bar.close()
        report["all_identical"] = all_ok and not lossy_differ
        report["lossy_replies_differing"] = lossy_differ
        if all_ok and not lossy_differ:
            print("all restored replies identical to recompute")
        elif all_ok:
            print(
                f"{lossy_differ} of {lossy_runs} replies restored from 8-bit stored state (stored_dtype={stored_dtype}) "
                "differ from recompute, as lossy state may make them; every other restored reply is identical"
            )
        else:
            print("MISMATCH: a restored reply differs")
        if json_path:
            Path(json_path).write_text(json.dumps(report, indent=2))
        return all_ok
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _row(results: list, reference: list[int], stored_bytes_per_token: int) -> MethodRow:
    """One method's runs in one turn, as a row: the median TTFT and its range; the reply checked in every run."""
    ttfts = [r.ttft_s for r in results]
    differing = sum(r.output_ids != reference for r in results)
    return MethodRow(
        restored_tokens=min(r.restored_tokens for r in results),
        ttft_s=statistics.median(ttfts),
        stored_bytes_per_token=stored_bytes_per_token,
        bytes_read=max(r.bytes_read for r in results),
        identical=not differing,
        fallback=next((r.fallback for r in results if r.fallback), None),
        lossy=any(r.lossy for r in results),
        ttft_s_min=min(ttfts),
        ttft_s_max=max(ttfts),
        ttft_s_runs=ttfts,
        runs_differing=differing,
    )


def _table(turn: int, prompt_tokens: int, question: str, reply: str, rows: dict[str, MethodRow], repeats: int) -> str:
    lines = [
        f"\nturn {turn}: {prompt_tokens} prompt tokens. Q: {question}",
        f"A: {reply}",
        f"{'method':<22}{'restored':>9}{'TTFT ms':>10}{'min-max ms':>14}{'stored B/token':>16}{'read KiB':>10}  same reply",
    ]
    for name, r in rows.items():
        same = (
            "yes"
            if r.identical
            else f"no (8-bit state{f', {r.runs_differing} of {repeats}' if repeats > 1 else ''})"
            if r.lossy
            else "NO"
        )
        lines.append(
            f"{name:<22}{r.restored_tokens:>9}{r.ttft_s * 1e3:>10.1f}{_range(r):>14}{r.stored_bytes_per_token:>16}"
            f"{r.bytes_read / 1024:>10.0f}  {same}"
        )
    lines.append(f"TTFT: median of {repeats} run{'s' if repeats > 1 else ''} per method, interleaved")
    return "\n".join(lines)


def _range(row: MethodRow) -> str:
    low, high = row.ttft_s_min * 1e3, row.ttft_s_max * 1e3
    return f"{low:.0f}-{high:.0f}" if high >= 100 else f"{low:.1f}-{high:.1f}"
