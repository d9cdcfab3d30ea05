"""``hcache check``: one command that says what this machine has, what it achieves, and whether hcache
restores correctly on it.

Steps, in order: the environment (:mod:`.environment`), the copy and disk floors (:mod:`.floors`), every
restore method against recompute per family and engine (:mod:`.correctness`), and on a GPU the restore
speed against its bounds (:mod:`.speed`). The report is printed at the end; with ``--out`` or ``--save``
its JSON and a markdown table are written instead, rewritten after every step, so a run cut off still
leaves what it measured. A step that fails is recorded with its error and the next one runs. The command
exits 1 when a correctness case fails (or cannot run), 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
import traceback
from pathlib import Path

from ..machine.facts import machine_facts, machine_name, source_commit

RESULTS = Path("benchmarks/results")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="report this machine, measure its floors, check every restore against recompute, time restores (GPU)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="skip the slow parts: 16K histories, the disk and MII benchmarks, and the larger floors",
    )
    p.add_argument(
        "--out",
        default=None,
        help="write <out>.json and <out>.md after every step (default: write nothing, print the report)",
    )
    p.add_argument(
        "--save", action="store_true", help=f"write them under {RESULTS}/ instead, named check-<GPU or CPU>-<date>"
    )
    p.add_argument(
        "--store-dir", default=None, help="the store disk to describe and measure (default: a temporary directory)"
    )


def run(args: argparse.Namespace) -> int:
    # The steps import torch, and the command line imports this module to build its parser: import them here.
    import torch

    from .environment import describe_environment
    from .floors import measure_floors
    from .speed import measure_speed

    out = (
        RESULTS / f"check-{machine_name()}-{datetime.date.today().isoformat()}"
        if args.save
        else (Path(args.out) if args.out else None)
    )
    report = {"command": args.command_line, "commit": source_commit(), "machine": machine_facts(), "steps": {}}
    engines = ["reference", *(["fastgen"] if torch.cuda.is_available() else [])]
    with tempfile.TemporaryDirectory(prefix="hcache-check-store-") as tmp:
        store = Path(args.store_dir or tmp)
        steps = [
            ("environment", lambda keep: describe_environment(store)),
            ("floors", lambda keep: measure_floors(store, args.quick)),
            ("correctness", lambda keep: {"cases": _with_progress(engines, lambda cases: keep({"cases": cases}))}),
            ("speed", lambda keep: measure_speed(args.quick, lambda name: print(f"  speed: {name}", flush=True), keep)),
        ]
        for i, (name, step) in enumerate(steps, 1):
            print(f"[{i}/{len(steps)}] {name}", flush=True)
            start = time.perf_counter()

            def keep(partial: dict) -> None:
                """What a long step has so far, written now: a run cut off (a lent GPU's time running out)
                still leaves it, marked unfinished."""
                report["steps"][name] = {
                    **partial,
                    "unfinished": True,
                    "seconds": round(time.perf_counter() - start, 1),
                }
                if out:
                    _write(report, out)

            try:
                result = step(keep)
            except Exception as exc:  # recorded; the later steps still run and the report is still written
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
                print(f"  {name} failed: {result['error']}", flush=True)
            report["steps"][name] = {**result, "seconds": round(time.perf_counter() - start, 1)}
            if out:
                _write(report, out)
    failed = _failed(report["steps"]["correctness"])
    if out:
        print(f"wrote {out}.json and {out}.md; correctness: {failed or 'every case passed'}")
    else:
        print(
            f"\n{markdown(report)}\ncorrectness: {failed or 'every case passed'} (--out PATH or --save keeps this report)"
        )
    return 1 if failed else 0


def _with_progress(engines: list[str], keep) -> list[dict]:
    from tqdm import tqdm

    from .correctness import PLANS, check_restores, families_on

    done: list[dict] = []

    def progress(case: dict) -> None:
        bar.update()
        done.append(case)
        keep(done)

    with tqdm(
        total=sum(len(families_on(kind)) for kind in engines) * len(PLANS),
        desc="  correctness",
        unit="case",
        leave=False,
    ) as bar:
        return check_restores(engines, progress=progress)


def _failed(step: dict) -> str:
    if "error" in step:
        return f"could not run ({step['error']})"
    bad = [f"{c['engine']} {c['family']} {c['plan']}" for c in step["cases"] if not c["ok"]]
    return f"{len(bad)} case(s) failed: {', '.join(bad)}" if bad else ""


def _write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"# hcache check: {report['machine']['gpu'] and report['machine']['gpu']['name'] or report['machine']['cpu']}",
        "",
        f"`{report['command']}`, {report['machine']['date']}",
        "",
    ]
    for name, step in report["steps"].items():
        lines += [
            f"## {name} ({step['seconds']} s{', unfinished: the run was cut off here' if step.get('unfinished') else ''})",
            "",
        ]
        if "error" in step:
            lines += [f"failed: `{step['error']}`", ""]
        elif name == "correctness":
            lines += [
                "| engine | family | dtype | plan | restored | tokens equal | worst error less its bound (<= 0 passes) | ok |",
                "|---|---|---|---|---|---|---|---|",
            ]
            lines += [_case_row(c) for c in step["cases"]]
        else:
            lines += ["| figure | value |", "|---|---|"]
            lines += [
                f"| {key} | {_cell(value)} |" for key, value in _flat(step) if key not in ("seconds", "unfinished")
            ]
        lines.append("")
    return "\n".join(lines)


def _case_row(c: dict) -> str:
    if "error" in c:
        return f"| {c['engine']} | {c['family']} | | {c['plan']} | could not run: `{_cell(c['error'])}` | | | **NO** |"
    return (
        f"| {c['engine']} | {c['family']} | {c['dtype']} | {c['plan']} | {c['restored_tokens']}/{c['expected_tokens']} | "
        f"{c['tokens_equal']} | {c['worst_excess']:.3g} | {'yes' if c['ok'] else '**NO**'} |"
    )


def _flat(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, v in value.items():
            yield from _flat(v, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value).replace("|", "\\|")
