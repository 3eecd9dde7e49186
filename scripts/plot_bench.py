#!/usr/bin/env python3
"""Regenerate the benchmark table (markdown) and plot (PNG) from bench/results/*.json.

    python scripts/plot_bench.py                      # all JSON files under bench/results
    python scripts/plot_bench.py FILE.json ... --md bench/README_table.md --png bench/results/layers.png
    python scripts/plot_bench.py --no-plot FILE.json   # markdown table to stdout only (no matplotlib)

Without FILE arguments, the files named in bench/results/CURRENT.txt (the measurements of the
current code) come first in the table and are the only ones plotted; the others follow in the
table as history.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_ORDER = ["mok", "mok@precision=fp8", "mok_ab", "mok_staged", "mok_recompute", "alltoall", "symm_a2a"]


def load(paths):
    docs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        if "gpu" not in d:  # not a layer benchmark (e.g. an end-to-end comparison from compare_backends.py)
            continue
        d["_file"] = os.path.relpath(p, ROOT)
        docs.append(d)
    return docs


def _current_files() -> list:
    """Absolute paths listed in bench/results/CURRENT.txt (one file name per line, # comments)."""
    path = os.path.join(ROOT, "bench", "results", "CURRENT.txt")
    if not os.path.exists(path):
        return []
    names = [ln.split("#", 1)[0].strip() for ln in open(path)]
    out = [os.path.join(ROOT, "bench", "results", n) for n in names if n]
    missing = [p for p in out if not os.path.exists(p)]
    if missing:
        raise SystemExit(f"bench/results/CURRENT.txt names missing files: {missing}")
    return out


def table(docs) -> str:
    lines = []
    for d in docs:
        lines.append(f"### {d['_file']}: {d['gpu']}, EP={d['ep']}, pass={d.get('pass_', 'fwd')}, torch {d['torch']}, "
                     f"CUDA {d['cuda']}, bf16 matmul 8192^3 = {d['matmul_8192_tflops']:.0f} TFLOP/s")
        lines.append("")
        lines.append(f"`{d['command']}`")
        lines.append("")
        if d.get("note"):
            lines.append(f"Note: {d['note']}")
            lines.append("")
        mem = any("saved_bytes_per_token" in r for r in d["results"])
        lines.append("| shape | T/GPU | routing | backend | ms (median of max over ranks) | TFLOP/s | % of matmul | vs mok | rel. err |"
                     + (" saved for bwd (KiB/token) | bwd peak (KiB/token) |" if mem else ""))
        lines.append("|---|---:|---|---|---:|---:|---:|---:|---|" + ("---:|---:|" if mem else ""))
        by_key = {}
        for r in d["results"]:
            by_key.setdefault((r["shape"], r["tokens"], r.get("routing", "random")), {})[r["backend"]] = r
        for (shape, T, routing), group in sorted(by_key.items()):
            mok = group.get("mok")
            for be in sorted(group, key=lambda b: BACKEND_ORDER.index(b) if b in BACKEND_ORDER else 99):
                r = group[be]
                if r.get("status") != "ok":
                    lines.append(f"| {shape} | {T} | {routing} | {be} | error: {r.get('error', '?')[:80]} | | | | |"
                                 + (" | |" if mem else ""))
                    continue
                speed = f"{r['ms'] / mok['ms']:.2f}x" if mok and mok.get("status") == "ok" and be != "mok" else ""
                err = ""
                if "gate_rel_err_vs_fp32_reference" in r:
                    err = f"{r['gate_rel_err_vs_fp32_reference']:.1e} vs fp32 ref"
                elif r.get("bitwise_equal_to_mok"):
                    err = "bitwise = mok"
                elif "rel_err_vs_mok" in r:
                    err = f"{r['rel_err_vs_mok']:.1e} vs mok"
                kib = (lambda key: f"{r[key] / 1024:.1f}" if key in r else "")
                label = f"{be} ({r['ab_env']})" if be == "mok_ab" and "ab_env" in r else be
                lines.append(f"| {shape} | {T} | {routing} | {label} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                             f"{100 * r.get('roofline_frac', 0):.0f}% | {speed} | {err} |"
                             + (f" {kib('saved_bytes_per_token')} | {kib('bwd_peak_bytes_per_token')} |" if mem else ""))
        lines.append("")
    lines.append("`vs mok`: that backend's time over mok's (above 1: mok is faster).")
    return "\n".join(lines)


def plot(docs, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(docs), 1, figsize=(12, 4 * len(docs)), squeeze=False)
    for ax, d in zip(axes[:, 0], docs):
        keys = sorted({(r["shape"], r["tokens"]) for r in d["results"]})
        present = list(dict.fromkeys(r["backend"] for r in d["results"]))  # in file order
        backends = [b for b in BACKEND_ORDER if b in present] + [b for b in present if b not in BACKEND_ORDER]
        width = 0.8 / max(1, len(backends))
        for i, be in enumerate(backends):
            vals = []
            for key in keys:
                r = next((r for r in d["results"] if (r["shape"], r["tokens"]) == key and r["backend"] == be), None)
                vals.append(r["tflops"] if r and r.get("status") == "ok" else 0.0)
            ax.bar([j + i * width for j in range(len(keys))], vals, width, label=be)
        ax.axhline(d["matmul_8192_tflops"], color="k", ls="--", lw=1, label="bf16 matmul 8192^3")
        ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{s}\nT={t}" for s, t in keys], fontsize=8)
        ax.set_ylabel(f"TFLOP/s per GPU ({'backward' if d.get('pass_') == 'bwd' else 'forward'})")
        ax.set_title(f"{d['_file']}: {d['gpu']} EP={d['ep']} ({d['date']})", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*")
    p.add_argument("--md", default=os.path.join(ROOT, "bench", "README_table.md"))
    p.add_argument("--png", default=os.path.join(ROOT, "bench", "results", "layers.png"))
    p.add_argument("--no-plot", action="store_true", help="print the markdown table only")
    args = p.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(ROOT, "bench", "results", "*.json")))
    if not files:
        raise SystemExit("no result files")
    current = [] if args.files else _current_files()
    docs = load(current) + load([f for f in files if os.path.abspath(f) not in current])
    md = table(docs)
    if args.no_plot:
        print(md)
        return
    n_cur = len(load(current))
    with open(args.md, "w") as f:
        f.write("# Layer benchmark (generated by scripts/plot_bench.py from bench/results/*.json)\n\n"
                + (f"The first {n_cur} sections measure the current code (bench/results/CURRENT.txt); the "
                   "rest are earlier versions, kept as history.\n\n" if n_cur else "") + md + "\n")
    plot(docs[:n_cur] or docs, args.png)
    print(f"wrote {args.md} and {args.png}")


if __name__ == "__main__":
    main()
