#!/usr/bin/env python3
"""The current results table (and plot) from bench/results/*.json (written by scripts/bench_layer.py).

    python scripts/plot_bench.py              # bench/README_table.md, README.md's table, bench/results/layers.png
    python scripts/plot_bench.py --no-plot    # the same without the PNG (no matplotlib needed)
    python scripts/plot_bench.py --check      # exit 1 if README.md or bench/README_table.md is not what the files give
    python scripts/plot_bench.py FILE.json    # print the table of these files; write nothing

The table has one line per mok row (shape, T, pass, precision, routing, variant): its time, the
fastest baseline of the same precision and of any precision with mok's speedup over each (baseline ms /
mok ms), TFLOP/s, and the roofline (bench_layer.py's roofline_ms: max(FLOPs / R_mm, HBM bytes / HBM
rate, NVLink bytes / NVLink rate)) with the fraction of it reached (roofline ms / measured ms).
README.md gets that table between the lines ``<!-- results:begin -->`` and ``<!-- results:end -->``
(nothing else of README.md changes); bench/README_table.md gets it with every row of every backend
and the commands that produced the files. bench/results/ holds only files that measure the current
code, so the table is the current state.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
README = os.path.join(ROOT, "README.md")
TABLE_MD = os.path.join(ROOT, "bench", "README_table.md")
PNG = os.path.join(RESULTS, "layers.png")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SHAPE_ORDER = ["deepseek-v3", "kimi-k2", "glm-5", "qwen3.5-397b", "deepseek-v4-pro"]
BASELINE_PRECISION = {"alltoall": "bf16", "alltoall_fp8": "fp8", "symm_a2a": "bf16"}


def load(paths) -> list[dict]:
    """The layer-benchmark documents among the JSON files ``paths``."""
    docs, names = [], []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
        names.append(os.path.relpath(os.path.abspath(p), ROOT))
    return load_docs(docs, names)


def load_docs(docs: list, names: list[str] | None = None) -> list[dict]:
    """The layer-benchmark documents among ``docs`` (others, e.g. end-to-end comparisons, are
    skipped), each with its file name in ``_file``."""
    out = []
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or "gpu" not in d or "results" not in d:
            continue
        out.append(dict(d, _file=names[i] if names else d.get("_file", f"results_{i}.json")))
    return out


def is_mok(backend: str) -> bool:
    return backend == "mok" or backend.startswith("mok@")


def precision_of(row: dict) -> str:
    if row.get("precision"):
        return row["precision"]
    if row["backend"] in BASELINE_PRECISION:
        return BASELINE_PRECISION[row["backend"]]
    return "fp8" if "precision=fp8" in row["backend"] else "bf16"


def _case(doc: dict, row: dict) -> tuple:
    return (doc["gpu"], doc.get("ep", row.get("ep", 1)), row.get("pass_", doc.get("pass_", "fwd")), row["shape"],
            row["tokens"], row.get("routing", "random"))


def _sort_key(doc: dict, row: dict) -> tuple:
    gpu, ep, pas, shape, T, routing = _case(doc, row)
    return (gpu, ep, 0 if pas == "fwd" else 1, SHAPE_ORDER.index(shape) if shape in SHAPE_ORDER else 99, shape, T,
            routing != "random", routing, precision_of(row) != "bf16", not is_mok(row["backend"]),
            row["backend"] != "mok", row["backend"])


def mok_lines(docs: list[dict]) -> list[dict]:
    """One entry per mok row: the row, its document, and the fastest ok baseline of the same precision
    and of any precision in the same case (None where none ran)."""
    baselines: dict = {}
    for d in docs:
        for r in d["results"]:
            if not is_mok(r["backend"]) and r.get("status") == "ok":
                baselines.setdefault(_case(d, r), []).append(r)
    out = []
    for d in docs:
        for r in d["results"]:
            if not is_mok(r["backend"]):
                continue
            pool = baselines.get(_case(d, r), [])
            same = [b for b in pool if precision_of(b) == precision_of(r)]
            out.append({"doc": d, "row": r, "same": min(same, key=lambda b: b["ms"]) if same else None,
                        "any": min(pool, key=lambda b: b["ms"]) if pool else None})
    out.sort(key=lambda e: _sort_key(e["doc"], e["row"]))
    return out


def _vs(base: dict | None, row: dict) -> str:
    if base is None:
        return "–"
    return f"{base['backend']} {base['ms']:.2f} ms ({base['ms'] / row['ms']:.2f}x)"


def _roof(row: dict) -> tuple[str, str]:
    roof = row.get("roofline")
    if not roof or "roofline_ms" not in row:
        return "–", "–"
    return f"{row['roofline_ms']:.2f} ({roof.get('bound', '?')})", f"{100 * row['roofline_ms'] / row['ms']:.0f}%"


def _roof_here(row: dict) -> str:
    """The fraction of the same roofline at the GPU's own measured HBM copy rate."""
    if "roofline_this_gpu_ms" not in row:
        return "–"
    return f"{100 * row['roofline_this_gpu_fraction']:.0f}% ({row['roofline_this_gpu_bound']})"


def results_table(docs: list[dict]) -> str:
    """The one current results table (markdown)."""
    lines = ["| GPU | EP | pass | shape | T | routing | precision | mok variant | mok ms | "
             "same-precision baseline (speedup) | fastest baseline, any precision (speedup) | TFLOP/s | "
             "roofline ms (bound) | % of roofline | % at this GPU's HBM |",
             "|---|---:|---|---|---:|---|---|---|---:|---|---|---:|---:|---:|---:|"]
    for e in mok_lines(docs):
        d, r = e["doc"], e["row"]
        gpu, ep, pas, shape, T, routing = _case(d, r)
        head = f"| {gpu.replace('NVIDIA ', '')} | {ep} | {pas} | {shape} | {T} | {routing} | {precision_of(r)} | " \
               f"{r['backend']} |"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status', '?')}: {str(r.get('error', ''))[:80]} | | | | | | |")
            continue
        roof_ms, frac = _roof(r)
        lines.append(f"{head} {r['ms']:.2f} | {_vs(e['same'], r)} | {_vs(e['any'], r)} | {r.get('tflops', 0):.0f} | "
                     f"{roof_ms} | {frac} | {_roof_here(r)} |")
    if len(lines) == 2:
        return "No current results: bench/results/ holds no layer benchmark file (scripts/bench_layer.py writes them)."
    return "\n".join(lines)


def readme_block(docs: list[dict]) -> str:
    """What goes between README.md's markers."""
    table = results_table(docs)
    if not docs:
        return table
    rates = sorted({(d["gpu"].replace("NVIDIA ", ""), _rate(d, "bf16"), _rate(d, "fp8")) for d in docs})
    return (table + "\n\n"
            + "Speedup: the baseline's time over mok's. Roofline: max(FLOPs / R_mm, HBM bytes / 4.2 TB/s, NVLink "
            "bytes / NVLink rate), with R_mm the dense matmul rate of the row's precision measured in the same run ("
            + "; ".join(f"{g}: bf16 {b}, e4m3 {f} TFLOP/s" for g, b, f in rates)
            + "); % of roofline: the roofline's time over the measured time; % at this GPU's HBM: the same with "
            "the GPU's own device-to-device copy rate, measured in the same run, in place of 4.2 TB/s (an H100 "
            "copies ~3.0 TB/s, so at 4.2 an H100 row's HBM bound is out of its reach). Generated by `scripts/plot_bench.py` "
            "from `bench/results/*.json`; every row of every backend and the commands are in "
            "[bench/README_table.md](bench/README_table.md).")


def _rate(doc: dict, precision: str) -> str:
    v = (doc.get("rates") or {}).get("matmul_tflops", {}).get(precision)
    return f"{v:.0f}" if v else "–"


def all_rows_table(doc: dict) -> str:
    """Every row of one file (baselines included)."""
    lines = ["| pass | shape | T | routing | backend | precision | ms | TFLOP/s | roofline ms (bound) | % of roofline | "
             "% at this GPU's HBM | check |",
             "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in sorted(doc["results"], key=lambda r: _sort_key(doc, r)):
        _, _, pas, shape, T, routing = _case(doc, r)
        head = f"| {pas} | {shape} | {T} | {routing} | {r['backend']} | {precision_of(r)} |"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status', '?')}: {str(r.get('error', ''))[:80]} | | | | | |")
            continue
        check = ""
        if "gate_rel_err_vs_fp32_reference" in r:
            check = f"{r['gate_rel_err_vs_fp32_reference']:.1e} vs fp32 reference"
        elif "bitwise_equal" in r:
            check = ("bitwise = " if r["bitwise_equal"] else "bits differ from ") + r.get("bitwise_equal_to", "?")
        elif "rel_err_vs_mok" in r:
            check = f"{r['rel_err_vs_mok']:.1e} vs mok"
        roof_ms, frac = _roof(r)
        lines.append(f"{head} {r['ms']:.3f} | {r.get('tflops', 0):.0f} | {roof_ms} | {frac} | {_roof_here(r)} | {check} |")
    return "\n".join(lines)


def table_md(docs: list[dict]) -> str:
    """bench/README_table.md."""
    out = ["# Layer benchmark: current results", "",
           "Generated by `scripts/plot_bench.py` from `bench/results/*.json` (each written by "
           "`scripts/bench_layer.py`); do not edit by hand.", "", results_table(docs), ""]
    for d in sorted(docs, key=lambda d: d["_file"]):
        rates = d.get("rates") or {}
        out += [f"## {d['_file']}", "",
                f"{d['gpu']}, EP={d.get('ep')}, pass={d.get('pass_', 'fwd')}, torch {d.get('torch')}, CUDA "
                f"{d.get('cuda')}. Matmul rates of the run: bf16 {_rate(d, 'bf16')}, e4m3 {_rate(d, 'fp8')} TFLOP/s; "
                f"HBM {rates.get('hbm_bytes_per_s', 0) / 1e12:.2f} TB/s"
                + (f" (this GPU's copy {rates['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s)" if rates.get("hbm_copy_bytes_per_s")
                   else "") + ", NVLink "
                f"{rates.get('nvlink_bytes_per_s', 0) / 1e9:.0f} GB/s a direction.", ""]
        out += [f"    {c}" for c in (d.get("commands") or [d.get("command", "?")])]
        out.append("")
        if d.get("note"):
            out += [f"Note: {d['note']}", ""]
        out += [all_rows_table(d), ""]
    return "\n".join(out).rstrip() + "\n"


def replace_between_markers(text: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    """text with everything between the begin and end marker lines replaced by body."""
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0 or j < i or text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"README.md needs exactly one {begin} line and one {end} line after it")
    head = text[:i + len(begin)]
    return f"{head}\n{body.strip()}\n{text[j:]}"


def plot(docs: list[dict], png: str) -> None:
    """Per (GPU, EP, pass): each backend's fraction of its precision's roofline, by case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for d in docs:
        for r in d["results"]:
            if r.get("status") == "ok" and "roofline_ms" in r:
                gpu, ep, pas = _case(d, r)[:3]
                groups.setdefault((gpu, ep, pas), []).append((d, r))
    if not groups:
        return
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 4 * len(groups)), squeeze=False)
    for ax, ((gpu, ep, pas), items) in zip(axes[:, 0], sorted(groups.items())):
        cases = sorted({_case(d, r)[3:] for d, r in items},
                       key=lambda c: (SHAPE_ORDER.index(c[0]) if c[0] in SHAPE_ORDER else 99, c))
        backends = sorted({r["backend"] for _, r in items}, key=lambda b: (not is_mok(b), b != "mok", b))
        width = 0.8 / len(backends)
        for i, be in enumerate(backends):
            vals = []
            for case in cases:
                hit = [r for d, r in items if r["backend"] == be and _case(d, r)[3:] == case]
                vals.append(100 * hit[0]["roofline_ms"] / hit[0]["ms"] if hit else 0.0)
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=be)
        ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{s}\nT={t} {r}" for s, t, r in cases], fontsize=8)
        ax.set_ylabel("% of its precision's roofline")
        ax.set_ylim(0, 100)
        ax.set_title(f"{gpu} EP={ep} {'forward' if pas == 'fwd' else 'backward'}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="print the table of these files instead of writing the current one")
    p.add_argument("--results", default=RESULTS, help="the results folder (default bench/results)")
    p.add_argument("--readme", default=README, help="the README whose marked table is replaced")
    p.add_argument("--md", default=TABLE_MD)
    p.add_argument("--png", default=PNG)
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--no-readme", action="store_true", help="leave the README alone")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the README's table or --md differs from what the files give")
    a = p.parse_args(argv)
    if a.files:
        docs = load(a.files)
        print(results_table(docs))
        for d in docs:
            print(f"\n{d['_file']}:\n{all_rows_table(d)}")
        return 0
    docs = load(sorted(glob.glob(os.path.join(a.results, "*.json"))))
    md = table_md(docs)
    readme_text = new_readme = None
    if not a.no_readme:
        with open(a.readme) as f:
            readme_text = f.read()
        try:
            new_readme = replace_between_markers(readme_text, readme_block(docs))
        except ValueError as exc:
            print(f"plot_bench: {a.readme}: {exc}", file=sys.stderr)
            return 1
    if a.check:
        stale = []
        if not os.path.exists(a.md):
            stale.append(a.md)
        else:
            with open(a.md) as f:
                if f.read() != md:
                    stale.append(a.md)
        if new_readme is not None and new_readme != readme_text:
            stale.append(a.readme)
        for path in stale:
            print(f"plot_bench: {os.path.relpath(path, ROOT)} is not what bench/results gives; run "
                  "python scripts/plot_bench.py", file=sys.stderr)
        return 1 if stale else 0
    with open(a.md, "w") as f:
        f.write(md)
    written = [a.md]
    if new_readme is not None and new_readme != readme_text:
        with open(a.readme, "w") as f:
            f.write(new_readme)
        written.append(a.readme)
    if not a.no_plot and docs:
        plot(docs, a.png)
        written.append(a.png)
    print("wrote " + ", ".join(os.path.relpath(w, ROOT) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
