"""The committed benchmark results: every file names the command that produced it, the list of
current files is valid, and the README table regenerates from them (scripts/plot_bench.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def test_every_result_records_its_command():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for f in files:
        doc = json.loads(f.read_text())
        assert doc.get("command"), f"{f.name} does not record the command that produced it"


def test_current_list_names_existing_layer_results():
    names = [ln.split("#", 1)[0].strip() for ln in (RESULTS / "CURRENT.txt").read_text().splitlines()]
    names = [n for n in names if n]
    assert names
    for n in names:
        doc = json.loads((RESULTS / n).read_text())
        assert "gpu" in doc and doc["results"], n


def test_table_regenerates_from_the_json_files():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_bench.py"), "--no-plot"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first = r.stdout.split("\n", 1)[0]
    current = [ln for ln in (RESULTS / "CURRENT.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert current[0].split("#")[0].strip() in first
    # the committed table is what the script writes from the committed files
    committed = (REPO / "bench" / "README_table.md").read_text()
    assert r.stdout.strip() in committed


def test_benchmark_scripts_parse_their_arguments():
    """The GPU-only scripts at least start on CPU (a syntax error would otherwise surface on the device)."""
    for script in ("bench_layer.py", "plot_bench.py", "compare_backends.py"):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, (script, r.stderr[-2000:])
