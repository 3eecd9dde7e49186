"""The results table generator (scripts/plot_bench.py) on synthetic result files, and the committed
results: every file in bench/results records its command, and README.md's table and
bench/README_table.md are what the files give."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import plot_bench  # noqa: E402

README_TEXT = "# megatron-mok\n\nintro\n\n## Results\n\n<!-- results:begin -->\nold table\n<!-- results:end -->\n\n## After\n"


def _row(backend, precision, ms, T=4096, pass_="fwd", routing="random", roofline_ms=5.4, bound="hbm", **kw):
    r = dict(shape="deepseek-v3", tokens=T, backend=backend, ep=1, routing=routing, pass_=pass_, precision=precision,
             status="ok", ms=ms, tflops=3.25e12 / (ms * 1e-3) / 1e12, command="torchrun x", **kw)
    if roofline_ms is not None:
        r.update(roofline_ms=roofline_ms, roofline_fraction=roofline_ms / ms,
                 roofline={"roofline_ms": roofline_ms, "bound": bound})
    return r


def _doc():
    return {"gpu": "NVIDIA H200", "ep": 1, "pass_": "fwd", "torch": "2.11", "cuda": "13.0",
            "command": "torchrun --nproc-per-node=1 scripts/bench_layer.py --pass fwd",
            "commands": ["torchrun --nproc-per-node=1 scripts/bench_layer.py --pass fwd"],
            "rates": {"matmul_tflops": {"bf16": 796.0, "fp8": 1436.0}, "hbm_bytes_per_s": 4.2e12,
                      "nvlink_bytes_per_s": 390e9},
            "results": [
                _row("mok", "bf16", 8.0, gate_rel_err_vs_fp32_reference=3e-3),
                _row("mok@precision=fp8", "fp8", 5.5, roofline_ms=2.72),
                _row("mok@forward_kernel=persistent", "bf16", 8.5, bitwise_equal=True, bitwise_equal_to="mok"),
                _row("alltoall", "bf16", 13.0, rel_err_vs_mok=1e-3),
                _row("alltoall_fp8", "fp8", 16.0, roofline_ms=2.72),
                _row("mok", "bf16", 14.0, T=8192, roofline_ms=8.16, bound="compute"),
                dict(shape="deepseek-v3", tokens=8192, backend="alltoall_fp8", ep=1, routing="random", pass_="fwd",
                     precision="fp8", status="not_runnable", error="no torch._scaled_grouped_mm"),
                _row("mok@precision=fp8", "fp8", 9.5, T=8192, roofline_ms=4.52, bound="compute"),
                _row("alltoall", "bf16", 18.0, T=8192),
            ]}


def _lines(table: str) -> list[str]:
    return [ln for ln in table.splitlines() if ln.startswith("| H200")]


def test_table_has_one_line_per_mok_row_with_both_baselines():
    lines = _lines(plot_bench.results_table(plot_bench.load_docs([_doc()])))
    assert len(lines) == 5  # the mok rows; baselines only as columns
    assert lines[0].startswith("| H200 | 1 | fwd | deepseek-v3 | 4096 | random | bf16 | mok | 8.00 |")
    # bf16 mok: the fastest bf16 baseline is also the fastest of any precision
    assert "| alltoall 13.00 ms (1.62x) | alltoall 13.00 ms (1.62x) |" in lines[0]
    assert "| 5.40 (hbm) | 68% |" in lines[0]
    assert lines[1].split(" | ")[7] == "mok@forward_kernel=persistent"  # variants after the default
    fp8 = lines[2]
    assert "| fp8 | mok@precision=fp8 | 5.50 |" in fp8
    assert "| alltoall_fp8 16.00 ms (2.91x) | alltoall 13.00 ms (2.36x) |" in fp8
    assert "| 2.72 (hbm) | 49% |" in fp8
    assert "| 8192 |" in lines[3] and "| 8.16 (compute) | 58% |" in lines[3]
    # at T=8192 the fp8 baseline did not run: no same-precision baseline, the bf16 one is the fastest
    assert "| – | alltoall 18.00 ms (1.89x) |" in lines[4]


def test_table_of_no_files_says_so():
    assert "No current results" in plot_bench.results_table([])
    assert "No current results" in plot_bench.table_md([])


def test_markers_bound_what_is_replaced():
    new = plot_bench.replace_between_markers(README_TEXT, "| a |\n| b |")
    assert new == README_TEXT.replace("old table", "| a |\n| b |")
    assert plot_bench.replace_between_markers(new, "| a |\n| b |") == new  # idempotent
    for bad in ("no markers", README_TEXT.replace("<!-- results:end -->", ""),
                README_TEXT + "<!-- results:begin -->\n", README_TEXT.replace("begin", "x").replace("end", "begin")):
        with pytest.raises(ValueError, match="results:begin"):
            plot_bench.replace_between_markers(bad, "t")


def test_generator_writes_readme_table_and_check(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "h200_ep1_fwd.json").write_text(json.dumps(_doc()))
    (results / "e2e.json").write_text(json.dumps({"runs": []}))  # not a layer benchmark: skipped
    readme, md = tmp_path / "README.md", tmp_path / "README_table.md"
    readme.write_text(README_TEXT)
    args = ["--results", str(results), "--readme", str(readme), "--md", str(md), "--png", str(tmp_path / "l.png")]
    assert plot_bench.main([*args, "--check", "--no-plot"]) == 1  # nothing generated yet
    assert plot_bench.main([*args, "--no-plot"]) == 0
    text = readme.read_text()
    assert text.startswith("# megatron-mok\n\nintro\n\n## Results\n\n<!-- results:begin -->\n| GPU |")
    assert text.endswith("<!-- results:end -->\n\n## After\n") and "old table" not in text
    assert "bf16 796, e4m3 1436 TFLOP/s" in text
    table = md.read_text()
    assert "torchrun --nproc-per-node=1 scripts/bench_layer.py --pass fwd" in table
    assert "| fwd | deepseek-v3 | 4096 | random | alltoall | bf16 | 13.000 |" in table  # every row here
    assert "bitwise = mok" in table and "not_runnable: no torch._scaled_grouped_mm" in table
    assert plot_bench.main([*args, "--check"]) == 0
    doc = _doc()
    doc["results"][0]["ms"] = 7.0
    (results / "h200_ep1_fwd.json").write_text(json.dumps(doc))
    assert plot_bench.main([*args, "--check"]) == 1
    readme.write_text("no markers\n")
    assert plot_bench.main(args) == 1


def test_plot_draws_fractions(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "layers.png"
    plot_bench.plot(plot_bench.load_docs([_doc(), dict(copy.deepcopy(_doc()), pass_="bwd")]), str(png))
    assert png.stat().st_size > 1000


def test_files_argument_prints_without_writing(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(_doc()))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_bench.py"), "--no-plot", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| H200 | 1 | fwd | deepseek-v3 | 4096 |" in r.stdout and "alltoall_fp8" in r.stdout


# ---- the committed results ------------------------------------------------------------------------------


def test_every_result_records_its_command():
    for f in sorted((REPO / "bench" / "results").glob("*.json")):
        doc = json.loads(f.read_text())
        assert doc.get("command"), f"{f.name} does not record the command that produced it"
        for r in doc.get("results", []):
            assert r.get("command") in doc.get("commands", [doc["command"]]), (f.name, r.get("backend"))


def test_committed_tables_are_what_the_results_give():
    """README.md's marked table (once the markers are there) and bench/README_table.md are generated
    from bench/results: run python scripts/plot_bench.py after adding or removing a result file."""
    readme = (REPO / "README.md").read_text()
    args = ["--check"] + ([] if plot_bench.BEGIN in readme else ["--no-readme"])
    assert plot_bench.main(args) == 0


def test_benchmark_scripts_parse_their_arguments():
    """The GPU-only scripts at least start on CPU (a syntax error would otherwise surface on the device)."""
    for script in ("bench_layer.py", "plot_bench.py", "trace_summary.py"):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, (script, r.stderr[-2000:])
