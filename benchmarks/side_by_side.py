"""Ours and TRL's step on the same workload, as markdown tables (from the runs' JSON files).

    python benchmarks/side_by_side.py OURS.json TRL.json [OURS2.json ...]   # one table
    python benchmarks/side_by_side.py --dir /tmp/sbs                        # every table of side_by_side.sh

OURS: written by ``benchmarks/grpo_step.py --out`` (or one arm's file of ``--arms --out-dir``); TRL:
written by ``../shared/peers/trl_grpo_gpu_step.py`` (``$OUT/trl_<mode>.json``). Medians of steps 2 on
for ours, TRL's own median of its steps 2-4. ``--dir`` reads what ``benchmarks/side_by_side.sh`` leaves
there: ``w/*.json`` (workload W's arms and the growth arms), ``w_offpolicy.json``, ``w15.json``,
``w135.json``, ``w3b.json``, ``p128_seqs512.json``, ``trl_*.json``, ``small*.metrics.jsonl`` and ``trl_small.log``;
the seventeenth session's ``hostcosts`` parts: ``flat_logprobs.json``, ``flat/*.json``,
``w_offpolicy_plan.json`` and ``w_offpolicy_graphs.json``; ``samples/*.json`` (part ``samples21``;
its repeats and later interleaved parts as ``samples_<tag>/*.json``); and the update alone,
``head24/``, ``head22/`` and ``updprof/`` (``update_precision.py``'s JSON per shape); W's generation alone,
``runners27/`` and ``kv27/`` (``vllm_gen_variants.py``) and ``gen27/gen_probe.json``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

HEADER = (
    "| run | step | generation | update + logprob passes | weight sync | other | gap mean | peak alloc |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def ours_row(path: Path, label: str | None = None) -> str:
    d = _load(path)
    m = d["median_steps_2_on"]
    a = d["args"]
    if label is None:
        arm = d.get("arm", "run")
        name = path.stem if arm == "run" else arm  # a lone run (--out, not --arms) is named by its file
        label = f"posttrain {name}" + (" (unseeded)" if a.get("unseeded") else "")
    gap = m.get("logprob_gap_mean", float("nan"))
    gap_text = "" if math.isnan(gap) else f"{gap:.4f}"
    return (
        f"| {label} | {m['step_s']:.2f} s | {m['generation_s']:.2f} s | {m['update_s'] + m['logprob_pass_s']:.2f} s "
        f"({100 * m['mfu_update']:.1f} % MFU) | {m['weight_sync_s']:.3f} s | {m.get('other_s', 0.0):.2f} s | "
        f"{gap_text} | {m['peak_alloc_gib']:.1f} GiB |"
    )


def trl_step_s(path: Path) -> float:
    return float(_load(path)["median_step_s_2to4"])


def trl_row(path: Path, label: str | None = None) -> str:
    d = _load(path)
    later = d["steps"][1:] or d["steps"]
    gen = statistics.median(s.get("vLLM.generate", s.get("transformers.generate", 0.0)) for s in later)
    sync = statistics.median(s.get("sync_weights", 0.0) for s in later)
    name = label or f"TRL ({d['mode']})"
    return f"| {name} | {d['median_step_s_2to4']:.2f} s | {gen:.2f} s | | {sync:.3f} s | | | {d['peak_GiB']} GiB |"


def pair_table(ours: Path, trl: Path, more: list[Path]) -> str:
    lines = [HEADER, *(ours_row(p) for p in [ours, *more]), trl_row(trl)]
    ratio = trl_step_s(trl) / _load(ours)["median_steps_2_on"]["step_s"]
    return "\n".join(lines) + f"\n\nTRL / posttrain ({ours.stem}): {ratio:.2f}x"


def growth_table(r: Path) -> str:
    """Step time as the work grows, ours (shipped settings) and TRL where it ran: prompts at 256 tokens,
    completion length at 32 prompts, model size at W's batch."""
    rows = [
        "| axis | value | posttrain step | generation | update | TRL step | TRL / ours |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    grid = [
        (
            "prompts (x 8 samples, 256 tokens)",
            [
                (8, "w/p8"),
                (32, "w/seeded_first"),
                (64, "w/p64"),
                (128, "w/p128"),
                ("128, max_num_seqs 512", "p128_seqs512"),
                (256, "w/p256"),
            ],
            {8: "trl_p8", 32: "trl_w", 64: "trl_p64", 128: "trl_p128", 256: "trl_p256"},
        ),
        (
            "completion tokens (32 x 8)",
            [(64, "w/t64"), (256, "w/seeded_first"), (1024, "w/t1024"), (2048, "w/t2048")],
            {64: "trl_t64", 256: "trl_w", 1024: "trl_t1024", 2048: "trl_t2048"},
        ),
        (
            "model (W's batch)",
            [("135M", "w135"), ("0.4B", "w/seeded_first"), ("1.5B", "w15"), ("3B, micro-batches of 8", "w3b")],
            {"135M": "trl_w135", "0.4B": "trl_w", "1.5B": "trl_w15", "3B, micro-batches of 8": "trl_w3b"},
        ),
    ]
    for axis, points, trl_names in grid:
        for value, name in points:
            path = r / f"{name}.json"
            if not path.exists():
                continue
            m = _load(path)["median_steps_2_on"]
            trl = r / f"{trl_names.get(value, '-')}.json"
            trl_s = trl_step_s(trl) if trl.exists() else None
            rows.append(
                f"| {axis} | {value} | {m['step_s']:.2f} s | {m['generation_s']:.2f} s | "
                f"{m['update_s'] + m['logprob_pass_s']:.2f} s ({100 * m['mfu_update']:.0f} %) | "
                + (f"{trl_s:.2f} s | {trl_s / m['step_s']:.2f}x |" if trl_s else "| |")
            )
    return "\n".join(rows)


def small_table(r: Path) -> str:
    """The default recipe's small step: ours (metrics.jsonl timers, medians of steps 2 on) and TRL's
    (per-step times from its TRLLEARN history)."""
    out = ["| run | step (median, steps 2 on) | rollout | train | weight sync |", "| --- | --- | --- | --- | --- |"]
    for metrics in sorted(r.glob("small*.metrics.jsonl")):  # small (older parts), small_shipped, small_compiled, ...
        recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()][1:]
        step, rollout, train, sync = (
            statistics.median(x[key] for x in recs if key in x)
            for key in ("timer/e2e_step_s", "timer/rollout_s", "timer/train_s", "timer/weight_sync_s")
        )
        name = metrics.name.removesuffix(".metrics.jsonl")
        out.append(
            f"| posttrain default recipe, vLLM ({name}) | {step:.3f} s | {rollout:.3f} s | {train:.3f} s "
            f"| {sync:.3f} s |"
        )
    log = r / "trl_small.log"
    if log.exists():
        for line in log.read_text().splitlines():
            if line.startswith("TRLLEARN "):
                hist = json.loads(line[len("TRLLEARN ") :])["hist"]
                times = [b[1] - a[1] for a, b in itertools.pairwise(hist)]
                out.append(f"| TRL 1.16, same task, vLLM colocated | {statistics.median(times):.3f} s | | | |")
    return "\n".join(out)


def host_costs_table(r: Path) -> str:
    """``side_by_side.sh hostcosts``/``hostcosts2``: vLLM's calls with dict and flat logprobs
    (``vllm_flat_logprobs.py``), then W as shipped and one-step off-policy W two ways."""
    parts = []
    flat = r / "flat_logprobs.json"
    if flat.exists():
        lines = ["| call | total | vLLM call | reading | collector passes (s) |", "| --- | --- | --- | --- | --- |"]
        for arm, m in _load(flat)["medians"].items():
            lines.append(
                f"| {arm} | {m['total_s']:.3f} s | {m['call_s']:.3f} s | {m['read_s']:.3f} s | "
                f"{m['gc_passes']:.0f} ({m['gc_s']:.3f}) |"
            )
        parts.append("\n".join(lines))
    # samples21's arms, and its repeats kept beside it as samples_<tag>/ (labelled by that folder)
    dirs = ["flat", "samples", *sorted(d.name for d in r.glob("samples_*") if d.is_dir()), "gen27", "big27"]
    runs = [p for d in dirs for p in sorted((r / d).glob("*.json"), key=lambda p: p.stat().st_mtime)]
    runs = [p for p in runs if p.name != "gen_probe.json"]  # gen27's generation probe: generation_table's
    runs += [p for p in (r / f"{n}.json" for n in ("w_offpolicy_plan", "w_offpolicy_graphs")) if p.exists()]
    if runs and not (r / "w").exists():  # one-step off-policy W (offp26) when the W table is absent
        runs += [p for p in (r / f"{n}.json" for n in ("w_offpolicy", "w_offpolicy_eager")) if p.exists()]
    if runs:
        trl_w = r / "trl_w.json"  # TRL on W in the same lease (lease19s), when the W table above is absent
        trl = [trl_row(trl_w, "TRL 1.16, vLLM colocated 0.3")] if trl_w.exists() and not (r / "w").exists() else []
        rows = [ours_row(p, f"posttrain {p.parent.name}/{p.stem}" if p.parent.name in dirs[2:] else None) for p in runs]
        parts.append("\n".join([HEADER, *rows, *trl]))
    return "\n\n".join(parts)


def generation_table(r: Path) -> str:
    """W's generation alone: bare ``LLM.generate`` per request variant (``vllm_gen_variants.py --out``; parts
    ``runners27``, one file per vLLM model runner; ``kv27``, one per KV-cache setting; ``qwen27``, a Qwen2 policy per
    runner) and the same call
    through posttrain's engine (``grpo_step.py --gen-probe``'s ``gen_probe.json``, part ``gen27``)."""
    lines = ["| part | engine settings | request variant | median | tokens/s |", "| --- | --- | --- | --- | --- |"]
    for part in ("runners27", "kv27", "qwen27"):
        for path in sorted((r / part).glob("*.json")):
            res = _load(path)
            settings = ", ".join(f"{k}={v}" for k, v in res.get("engine_args", {}).items()) or "vLLM's defaults"
            if "v2_model_runner" in res:
                settings += f"; VLLM_USE_V2_MODEL_RUNNER={res['v2_model_runner']}"
            for name, v in res.items():
                if isinstance(v, dict) and "median_s" in v:
                    lines.append(
                        f"| {part}/{path.stem} | {settings} | {name} | {v['median_s']:.3f} s | {v['tok_per_s']} |"
                    )
    for path in sorted(r.glob("*/gen_probe.json")):
        for name, med in _load(path)["median_s"].items():
            lines.append(f"| {path.parent.name} | posttrain's engine after its W steps | {name} | {med:.3f} s | |")
    return "\n".join(lines) if len(lines) > 2 else ""


# update_precision.py's JSON per shape (parts layouts26, comp26, cgraphs26, sync25, head24a, head22, updprof, cgraphs)
UPDATE_DIRS = ("layouts26", "comp26", "cgraphs26", "sync25", "head24", "head22", "updprof", "cgraphs")


def update_table(r: Path) -> str:
    """The update alone, per arm in the order it ran (``update_precision.py --out``): median, MFU and,
    where profiled, the GPU's busy time; the parts ``head24a``, ``head22`` and ``updprof`` write them."""
    lines = [
        "| part | shape | arm | update | MFU | GPU busy (profiled) | peak alloc |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for part in UPDATE_DIRS:
        for path in sorted((r / part).glob("*.json")):
            for res in _load(path)["results"]:
                prof = res.get("profile")
                busy = f"{1e3 * prof['gpu_busy_s']:.0f} of {1e3 * prof['wall_s']:.0f} ms" if prof else ""
                lines.append(
                    f"| {part} | {res['shape']} | {res['arm']} | {res['median_s']:.3f} s | {100 * res['mfu']:.1f} % | "
                    f"{busy} | {res['peak_alloc_gib']:.1f} GiB |"
                )
    return "\n".join(lines) if len(lines) > 2 else ""


def dir_tables(r: Path) -> str:
    parts = []
    w = sorted((r / "w").glob("*.json"), key=lambda p: p.stat().st_mtime) if (r / "w").exists() else []
    w_arms = [p for p in w if not re.fullmatch(r"[pt]\d+", p.stem)]  # in the order they ran; growth arms apart
    trl_w = r / "trl_w.json"
    extra = [p for p in (r / f"{n}.json" for n in ("w_offpolicy", "w_offpolicy_mps", "w_compiled_mps")) if p.exists()]
    if w_arms:
        lines = [HEADER, *(ours_row(p) for p in [*w_arms, *extra])]
        if trl_w.exists():
            lines.append(trl_row(trl_w, "TRL 1.16, vLLM colocated 0.3"))
        parts.append("## Workload W (0.4B shape, 32 prompts x 8 samples x 256 tokens)\n\n" + "\n".join(lines))
    for name, title in (("w15", "1.5B shape"), ("w135", "135M shape"), ("w3b", "3B shape")):
        ours, trl = r / f"{name}.json", r / f"trl_{name}.json"
        if ours.exists() and trl.exists():
            parts.append(f"## W's batch on the {title}\n\n" + pair_table(ours, trl, []))
    if (growth := growth_table(r)).count("\n") > 1:  # more than its header
        parts.append("## How the cost grows\n\n" + growth)
    if (small := small_table(r)).count("\n") > 1:
        parts.append("## The default recipe's small step\n\n" + small)
    if host := host_costs_table(r):
        parts.append("## Interleaved arms and host costs (W and 1.5B arms, flat logprobs, off-policy)\n\n" + host)
    if generation := generation_table(r):
        parts.append("## W's generation alone (bare vLLM and posttrain's engine)\n\n" + generation)
    if update := update_table(r):
        parts.append("## The update alone (update_precision.py)\n\n" + update)
    return "\n\n".join(parts)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--dir"]:
        print(dir_tables(Path(argv[1])))
        return
    ours, trl, more = Path(argv[0]), Path(argv[1]), [Path(p) for p in argv[2:]]
    print(pair_table(ours, trl, more))


if __name__ == "__main__":
    main(sys.argv[1:])
