"""scripts/trace_summary.py on a synthetic torch-profiler trace (no GPU needed)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import trace_summary  # noqa: E402


def _trace():
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    return {"traceEvents": [
        k("void mok::(anonymous namespace)::megakernel(mok::TMaps, mok::Params)", 0, 800.0),
        k("schedule_kernel", 900, 20.0),
        k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1000, 300.0),
        k("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<...>>>", 1400, 1000.0),
        k("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNN", 2500, 400.0),
        k("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 3000, 50.0),
        k("some_unknown_kernel", 3100, 30.0),
        k("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>", 3200, 400.0),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000.0},  # host op: not counted
    ]}


def test_summary_by_category_and_per_step(tmp_path):
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    s = trace_summary.summarize(trace_summary.load_events(str(path)), steps=2)
    cat = s["by_category_us_per_step"]
    assert cat["mok kernels"] == pytest.approx(410.0)
    assert cat["nccl"] == pytest.approx(150.0)
    assert cat["grouped GEMM (torch._grouped_mm)"] == pytest.approx(500.0)
    assert cat["GEMM (cuBLAS / CUTLASS)"] == pytest.approx(200.0)
    assert cat["attention softmax / masking"] == pytest.approx(200.0)
    assert cat["elementwise"] == pytest.approx(25.0) and cat["other"] == pytest.approx(15.0)
    assert s["kernel_us_per_step"] == pytest.approx(1500.0)
    assert s["span_us_per_step"] == pytest.approx(1800.0)
    assert s["kernels"][0]["category"] == "grouped GEMM (torch._grouped_mm)"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "trace_summary.py"), str(path), "--steps", "2",
                        "--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "1.5 ms of kernels per step" in r.stdout
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 2


def test_trace_without_kernels_is_an_error(tmp_path):
    path = tmp_path / "cpu_only.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 1}]}))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "trace_summary.py"), str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no GPU kernel events" in r.stderr
    with pytest.raises(ValueError, match="steps must be >= 1"):
        trace_summary.summarize([], steps=0)


def test_host_gaps_name_what_the_host_did(tmp_path):
    k = lambda name, ts, dur, corr: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                     "args": {"correlation": corr}}
    rt = lambda ts, corr: {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,  # noqa: E731
                           "tid": 1, "args": {"correlation": corr}}
    op = lambda name, ts, dur: {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1}  # noqa: E731
    events = [
        k("a", 0, 100, 1), rt(-50, 1),
        # 400 us idle: the host synchronized (aten::item) and launched b only afterwards
        op("aten::item", 90, 300), op("aten::_local_scalar_dense", 95, 290), k("b", 500, 100, 2), rt(480, 2),
        # 30 us idle: under the threshold
        k("c", 630, 100, 3), rt(400, 3),
        # 200 us idle, but c2 was launched long before: a device-side wait
        k("d", 930, 50, 4), rt(450, 4),
        # 300 us idle while the host ran a slow Python-level op
        op("aten::copy_", 990, 250), k("e", 1280, 10, 5), rt(1260, 5),
    ]
    g = trace_summary.host_gaps(events, min_gap_us=100)
    assert [round(x["idle_us"]) for x in g["gaps"]] == [400, 200, 300]
    first, second, third = g["gaps"]
    assert first["label"] == "sync aten::item" and first["host_syncs"] == ["aten::item"]
    assert first["launched_after_idle_us"] == pytest.approx(380)
    assert second["label"] == "launched before the gap (device-side wait)"
    assert third["label"] == "aten::copy_" and third["host_syncs"] == []
    assert g["idle_us"] == pytest.approx(900)
    assert g["idle_by_label_us"]["sync aten::item"] == pytest.approx(400)
    with pytest.raises(ValueError, match="no device events"):
        trace_summary.host_gaps([op("aten::add", 0, 1)], 10)
    path = tmp_path / "gaps.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "trace_summary.py"), str(path), "--gaps", "100"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "GPU idle in stretches >= 100 us: 0.9 ms" in r.stdout and "sync aten::item" in r.stdout
