#!/usr/bin/env python3
"""Where the GPU time of a training step goes, from a torch profiler Chrome trace.

    python scripts/trace_summary.py runs/x/torch_profile/rank-0.json.gz --steps 2 [--top 25] [--json out.json]

Megatron writes such a trace with `--profile --use-pytorch-profiler --profile-step-start S
--profile-step-end E --tensorboard-dir DIR` (to DIR/../torch_profile/rank-N.json.gz);
`scripts/gpu_check.sh` stage `profile` does it for mok and alltoall. Device kernels (trace events
of category "kernel") are summed by name and by category; times are per profiled step.

--gaps US lists the stretches of at least US microseconds in which the GPU ran nothing (kernels,
copies and memsets merged), between the first and the last device event: for each, when the host
launched the work that ended it (after the GPU went idle: the GPU waited for the host), the host
call that launched it, the outermost CPU ops the host ran meanwhile and any synchronizing call
among them. The idle time is also summed by those outermost ops.
"""

from __future__ import annotations

import argparse
import bisect
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


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_SYNC_RE = re.compile(r"Synchronize|cudaMemcpy(?!Async)|_local_scalar_dense|aten::item")


def host_gaps(events: list, min_gap_us: float) -> dict:
    """GPU idle stretches of at least min_gap_us and what the host did during them (module doc)."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    dev = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0) or 0), e) for e in xs
                 if e.get("cat") in _DEVICE_CATS)
    if not dev:
        raise ValueError("the trace holds no device events")
    launch = {}
    for e in xs:
        if e.get("cat") in _LAUNCH_CATS and (e.get("args") or {}).get("correlation") is not None:
            launch[e["args"]["correlation"]] = e
    # host events as (start, end, event), by start, the longer first where two start together
    ops = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0) or 0), e) for e in xs
                  if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")
                  and not str(e.get("name", "")).startswith("ProfilerStep")),
                 key=lambda o: (o[0], o[0] - o[1]))
    starts = [o[0] for o in ops]
    longest = max((te - ts for ts, te, _ in ops), default=0.0)

    def outermost_in(t0, t1, tid):
        """Outermost host events of thread tid overlapping [t0, t1), started before t1 (the launch
        at t1 itself is not one of them)."""
        found, end = [], float("-inf")
        for ts, te, e in ops[bisect.bisect_left(starts, t0 - longest):]:
            if ts >= t1:
                break
            if e.get("tid") != tid or te < t0 or ts < end:
                continue
            found.append(e)
            end = te
        return found

    gaps, busy_end, prev = [], dev[0][1], dev[0][2]
    for s, t, e in dev[1:]:
        if s - busy_end >= min_gap_us:
            gaps.append((busy_end, s, prev, e))
        if t > busy_end:
            busy_end, prev = t, e
    out, by_op = [], defaultdict(float)
    for g0, g1, before, after in gaps:
        le = launch.get((after.get("args") or {}).get("correlation"))
        item = {"start_us": g0, "idle_us": g1 - g0, "kernel_before": before.get("name", "?"),
                "kernel_after": after.get("name", "?")}
        if le is not None:
            lt = float(le["ts"])
            host = outermost_in(g0, lt, le.get("tid"))
            names = [h.get("name", "?") for h in host]
            syncs = [n for n in names if _SYNC_RE.search(n)]  # in time order
            item.update({"launched_after_idle_us": lt - g0, "launch_call": le.get("name", "?"),
                         "host_ops": names[:12], "host_syncs": sorted(set(syncs))})
            if lt < g0:  # launched before the GPU went idle: a device-side wait, not the host
                label = "launched before the gap (device-side wait)"
            else:
                label = f"sync {syncs[0]}" if syncs else (names[0] if names else "(untraced host work)")
        else:
            label = "(no launch event)"
        item["label"] = label
        by_op[label] += g1 - g0
        out.append(item)
    span = dev[-1][1] - dev[0][0]
    return {"min_gap_us": min_gap_us, "span_us": span, "idle_us": sum(g["idle_us"] for g in out),
            "gaps": out, "idle_by_label_us": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="profiled steps in the trace (times are divided by it)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None, help="also write the summary here")
    p.add_argument("--gaps", type=float, default=None, metavar="US",
                   help="also list the GPU idle stretches of at least US microseconds (module doc)")
    a = p.parse_args(argv)
    try:
        events = load_events(a.trace)
        s = summarize(events, a.steps)
        if a.gaps is not None:
            s["gaps"] = host_gaps(events, a.gaps)
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
    if a.gaps is not None:
        g = s["gaps"]
        print(f"GPU idle in stretches >= {a.gaps:g} us: {g['idle_us'] / 1e3:.1f} ms of "
              f"{g['span_us'] / 1e3:.1f} ms ({len(g['gaps'])} stretches); by the host op at the gap (ms):")
        for label, us in list(g["idle_by_label_us"].items())[:a.top]:
            print(f"  {us / 1e3:8.2f}  {label[:110]}")
        print(f"longest {a.top} stretches:")
        for item in sorted(g["gaps"], key=lambda i: -i["idle_us"])[:a.top]:
            print(f"  {item['idle_us'] / 1e3:7.2f} ms  launched +{item.get('launched_after_idle_us', 0) / 1e3:.2f} ms "
                  f"by {item.get('launch_call', '?')}: {item['label'][:60]} | host: "
                  f"{', '.join(item.get('host_ops', [])[:5])[:150]} | after: {item['kernel_after'][:50]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
