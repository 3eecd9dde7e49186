#!/usr/bin/env python3
"""Where the GPU time of a training step goes, from a torch profiler Chrome trace.

    python scripts/trace_summary.py runs/x/torch_profile/rank-0.json.gz --steps 2 [--top 25] [--json out.json]

Megatron writes such a trace with `--profile --use-pytorch-profiler --profile-step-start S
--profile-step-end E --tensorboard-dir DIR` (to DIR/../torch_profile/rank-N.json.gz);
`scripts/gpu_check.sh` stage `profile` does it for mok and alltoall. Device kernels (trace events
of category "kernel") are summed by name and by category; times are per profiled step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict

# First match wins (case-insensitive); the order matters: mok's own kernels before the generic GEMM
# patterns, grouped GEMMs before plain ones.
CATEGORIES = [
    ("mok kernels", r"megatron_mok|\bmok::|megakernel|schedule_kernel|publish_barrier|bwd_(publish|pull|push)|"
                    r"swiglu_backward|zero_empty|epilogue_kernel|dispatch_kernel|combine_kernel|"
                    r"grouped_gemm_kernel|expert_gemm|expert_wgrad|barrier_kernel"),
    ("nccl", r"nccl"),
    ("grouped GEMM (torch._grouped_mm)", r"GroupProblemShape|grouped_mm|grouped_?gemm|group_gemm"),
    ("attention softmax / masking", r"softmax|masked_fill"),
    ("GEMM (cuBLAS / CUTLASS)", r"gemm|cutlass|nvjet|xmma|wgmma"),
    ("optimizer / multi-tensor", r"multi_tensor|foreach|adam|sgd"),
    ("copies / casts", r"copy|memcpy|\bcast|CatArray|cat_"),
    ("reductions", r"reduce|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def load_events(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def categorize(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def summarize(events: list, steps: int) -> dict:
    """Kernel time per step, by name and by category (microseconds), plus the busy span."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    by_name = defaultdict(lambda: [0.0, 0])
    first, last = None, None
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        dur = float(e.get("dur", 0.0))
        by_name[e.get("name", "?")][0] += dur
        by_name[e.get("name", "?")][1] += 1
        ts = float(e.get("ts", 0.0))
        first = ts if first is None else min(first, ts)
        last = ts + dur if last is None else max(last, ts + dur)
    if not by_name:
        raise ValueError("the trace holds no GPU kernel events (category 'kernel')")
    by_cat = defaultdict(float)
    for name, (us, _n) in by_name.items():
        by_cat[categorize(name)] += us
    total = sum(us for us, _ in by_name.values())
    return {
        "steps": steps,
        "kernel_us_per_step": total / steps,
        "span_us_per_step": (last - first) / steps,
        "by_category_us_per_step": {c: us / steps for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "kernels": [{"name": n, "us_per_step": us / steps, "launches_per_step": cnt / steps,
                     "category": categorize(n)}
                    for n, (us, cnt) in sorted(by_name.items(), key=lambda kv: -kv[1][0])],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="profiled steps in the trace (times are divided by it)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None, help="also write the summary here")
    a = p.parse_args(argv)
    try:
        s = summarize(load_events(a.trace), a.steps)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        print(f"trace_summary: {a.trace}: {err}", file=sys.stderr)
        return 1
    s["trace"] = a.trace
    print(f"{a.trace}: {s['kernel_us_per_step'] / 1e3:.1f} ms of kernels per step, "
          f"{s['span_us_per_step'] / 1e3:.1f} ms from first to last kernel")
    for cat, us in s["by_category_us_per_step"].items():
        print(f"  {cat:34s} {us / 1e3:8.2f} ms  {100 * us / s['kernel_us_per_step']:5.1f}%")
    print(f"top {a.top} kernels (ms per step, launches per step):")
    for k in s["kernels"][:a.top]:
        print(f"  {k['us_per_step'] / 1e3:8.2f}  {k['launches_per_step']:6.1f}  [{k['category']}] {k['name'][:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
