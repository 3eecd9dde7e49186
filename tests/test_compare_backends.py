"""megatron_mok.tools.logparse and scripts/compare_backends.py (no GPU; a stand-in training module, and one
real Megatron run of the one-GPU recipe's CPU-tiny variant)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron_mok.tools import logparse  # noqa: E402

COMPARE = REPO / "scripts" / "compare_backends.py"


def _iter_line(it, total=20, ms=100.0, loss=10.0, gbs=8, prefix=""):
    return (
        f"{prefix} [2026-11-29 20:01:02.123456] iteration {it:8d}/{total:8d} | consumed samples: {it * gbs:12d} | "
        f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 3.000000E-03 | global batch size: {gbs:5d} | "
        f"lm loss: {loss:.6E} | mtp_1 loss: 5.500000E+00 | seq_load_balancing_loss: 1.000000E+00 | "
        f"loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


ARGS_DUMP = textwrap.dedent(
    """\
    ------------------------ arguments ------------------------
      global_batch_size ............................... 8
      moe_backend ..................................... mok
      seq_length ...................................... 64
      train_iters ..................................... 20
      world_size ...................................... 2
    -------------------- end of arguments ---------------------
    """
)


def _log(iters, first=1, loss0=10.0, extra=""):
    lines = [ARGS_DUMP, "WARNING: could not find the metadata file /x/latest_checkpointed_iteration.txt",
             "    will not load any checkpoints and will start from random"]
    for i, it in enumerate(range(first, first + iters)):
        # first two iterations slow (warm-up), then 100 / 110 ms alternating
        ms = 900.0 if i < 2 else (100.0 if i % 2 else 110.0)
        lines.append(_iter_line(it, ms=ms, loss=loss0 - 0.1 * i))
    lines.append("[mok-stats] rank=0 local_rank=0 host=n1 pid=1 exit=0 peak_rss_mib=800.0 "
                 "cuda_max_allocated_mib=NA cuda_max_reserved_mib=NA")
    lines.append("[mok-stats] rank=1 local_rank=1 host=n1 pid=2 exit=0 peak_rss_mib=812.5 "
                 "cuda_max_allocated_mib=NA cuda_max_reserved_mib=NA")
    return "\n".join(lines) + "\n" + extra


def test_parse_iterations_args_and_stats():
    log = logparse.parse_log(_log(6))
    assert [r.iteration for r in log.iterations] == [1, 2, 3, 4, 5, 6]
    r = log.iterations[0]
    assert r.train_iters == 20 and r.global_batch_size == 8 and r.step_ms == 900.0
    assert r.lm_loss == pytest.approx(10.0)
    assert r.time == datetime(2026, 11, 29, 20, 1, 2, 123456).timestamp()  # the line's stamp, local time
    assert r.fields["mtp_1 loss"] == pytest.approx(5.5) and r.fields["grad norm"] == pytest.approx(2.345)
    assert log.arg("seq_length", int) == 64 and log.arg("moe_backend") == "mok"
    assert log.started_from_scratch and log.loaded_iterations == []
    assert [s.peak_rss_mib for s in log.rank_stats] == [800.0, 812.5]
    assert log.errors == []


def test_summarize_tokens_per_second_per_gpu():
    s = logparse.summarize(logparse.parse_log(_log(6)), warmup=2)
    assert s["warmup_excluded"] == 2
    assert s["step_ms"] == [110.0, 100.0, 110.0, 100.0]
    assert s["median_step_ms"] == pytest.approx(105.0)
    # 8 sequences x 64 tokens / 0.105 s / 2 ranks
    assert s["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / 0.105 / 2)
    assert s["loss_finite"] and s["final_loss"] == pytest.approx(9.5)
    assert s["peak_memory_mib"] == 812.5 and "RSS" in s["peak_memory_source"]
    assert len(s["loss_curve"]) == 6


def test_summarize_few_iterations_keeps_last():
    s = logparse.summarize(logparse.parse_log(_log(2)), warmup=5)
    assert s["warmup_excluded"] == 1 and s["step_ms"] == [900.0]


def test_resume_and_labels_and_gpu_memory():
    text = "\n".join([
        "0:   successfully loaded checkpoint from /r/checkpoints [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration 6",
        _iter_line(7, prefix="1:"),
        _iter_line(8, loss=float("nan"), prefix="1:"),
        "0:   [2026-11-29 20:01:03.1] successfully saved checkpoint from iteration       8 to /r/checkpoints "
        "[ t 1/1, gtp_remat 1/1, p 1/1 ]",
        "0: [Rank 0] (after 7 iterations) memory (MB) | allocated: 100.50 | max allocated: 2048.25 | "
        "reserved: 3000.00 | max reserved: 3100.00",
    ])
    log = logparse.parse_log(text)
    assert log.loaded_iterations == [6] and log.saved_iterations == [8]
    assert [r.iteration for r in log.iterations] == [7, 8]
    assert math.isnan(log.iterations[1].lm_loss)
    s = logparse.summarize(log, warmup=0, world_size=8, seq_length=4096)
    assert not s["loss_finite"]
    assert s["peak_memory_mib"] == 2048.25 and "Megatron" in s["peak_memory_source"]


def test_cuda_stats_win_over_megatron_report():
    text = _log(3) + ("[mok-stats] rank=1 local_rank=1 host=n1 pid=2 exit=0 peak_rss_mib=1.0 "
                      "cuda_max_allocated_mib=70000.0 cuda_max_reserved_mib=75000.0\n")
    s = logparse.summarize(logparse.parse_log(text))
    assert s["peak_memory_mib"] == 70000.0 and "cuda" in s["peak_memory_source"]


def test_unavailable_reason_names_deep_ep():
    text = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "x.py", line 3, in <module>',
        "[rank0]: ModuleNotFoundError: --moe-backend hybridep needs the deep_ep package: No module named 'deep_ep'",
        "[rank1]: RuntimeError: Connection closed by peer",
    ])
    log = logparse.parse_log(text)
    reason = logparse.unavailable_reason(log)
    assert reason and "deep_ep" in reason and "hybridep" in reason
    # a real crash after training started is not "unavailable"
    assert logparse.unavailable_reason(logparse.parse_log(_log(2) + "RuntimeError: boom\n")) is None
    # a generic error is not "unavailable" either
    assert logparse.unavailable_reason(logparse.parse_log("RuntimeError: boom\n")) is None


def test_classify():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_backends", COMPARE)
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    ok = logparse.parse_log(_log(4))
    assert cb.classify(0, ok, logparse.summarize(ok)) == ("ok", None)
    dead = logparse.parse_log("ImportError: No module named 'deep_ep'\n")
    st, why = cb.classify(1, dead, logparse.summarize(dead))
    assert st == "skipped" and "deep_ep" in why
    boom = logparse.parse_log("RuntimeError: CUDA error: an illegal memory access\n")
    assert cb.classify(1, boom, logparse.summarize(boom)) == ("failed", "RuntimeError: CUDA error: an illegal memory access")


def _fake_entry(tmp_path: Path) -> Path:
    """A stand-in training module: prints Megatron-format lines; 'hybridep' fails like a missing deep_ep.

    With --profile it copies $FAKE_TRACE to <tensorboard-dir>/../torch_profile/rank-0.json.gz (as
    Megatron's trace handler names it); FAKE_SLOWDOWN makes later iterations slower, FAKE_LOSS_GAP
    shifts alltoall's loss, FAKE_CONTROL_NOISE the loss of a run with the router in fp64 (both
    growing from 0 at the first iteration to the value at the last, as rounding differences do)."""
    d = tmp_path / "fakeentry"
    d.mkdir()
    (d / "fake_meg.py").write_text(textwrap.dedent(
        """\
        import argparse, os, shutil, sys, time
        p = argparse.ArgumentParser()
        p.add_argument('--moe-backend'); p.add_argument('--train-iters', type=int)
        p.add_argument('--seq-length', type=int, default=32); p.add_argument('--global-batch-size', type=int, default=4)
        p.add_argument('--mok-param-digest-every', type=int, default=0)
        p.add_argument('--mok-precision', default='bf16'); p.add_argument('--moe-router-dtype', default='fp32')
        p.add_argument('--mok-wgrad-accumulation', default='auto')
        p.add_argument('--cuda-graph-impl', default='none')
        p.add_argument('--no-check-for-nan-in-loss-and-grad', dest='nan_check', action='store_false')
        p.add_argument('--deterministic-mode', action='store_true')
        p.add_argument('--profile', action='store_true'); p.add_argument('--tensorboard-dir')
        p.add_argument('--profile-step-start', type=int); p.add_argument('--profile-step-end', type=int)
        a, _ = p.parse_known_args()
        if a.moe_backend == 'hybridep':
            raise ModuleNotFoundError("--moe-backend hybridep needs deep_ep: No module named 'deep_ep'")
        r, w = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
        every = a.mok_param_digest_every
        drift = 0
        if 'FAKE_MARK_DIR' in os.environ:  # a rerun that is not bitwise equal to the first run
            mark = os.path.join(os.environ['FAKE_MARK_DIR'], 'ran_%s_%d' % (a.moe_backend, r))
            drift = int(os.path.exists(mark) and 'FAKE_RERUN_DRIFT' in os.environ)
            open(mark, 'w').close()
        if r == 0:
            print('FAKE precision=%s deterministic=%s router=%s wgrad=%s graph=%s nan_check=%s' % (
                a.mok_precision, a.deterministic_mode, a.moe_router_dtype, a.mok_wgrad_accumulation,
                a.cuda_graph_impl, a.nan_check))
            print('------------------------ arguments ------------------------')
            for k, v in [('global_batch_size', a.global_batch_size), ('seq_length', a.seq_length), ('world_size', w)]:
                print('  %s %s %s' % (k, '.' * (48 - len(k)), v))
            print('-------------------- end of arguments ---------------------')
        if a.profile and r == 0:
            dst = os.path.join(a.tensorboard_dir, '..', 'torch_profile')
            os.makedirs(dst, exist_ok=True)
            shutil.copy(os.environ['FAKE_TRACE'], os.path.join(dst, 'rank-0.json.gz'))
        slow = float(os.environ.get('FAKE_SLOWDOWN', '0'))
        gap = float(os.environ.get('FAKE_LOSS_GAP', '0')) if a.moe_backend == 'alltoall' else 0.0
        if a.moe_router_dtype == 'fp64':  # the noise control: only rounding changes
            gap += float(os.environ.get('FAKE_CONTROL_NOISE', '0'))
        for it in range(1, a.train_iters + 1):
            time.sleep(0.01)
            if every and ((it - 1) % every == 0 or it == a.train_iters):
                print('[megatron_mok] param-digest rank=%d iteration=%d value=%016x'
                      % (r, it - 1, 1000 * r + it + drift * (it > 3)), flush=True)
            if r == w - 1:
                ms = (50.0 if a.moe_backend == 'mok' else 100.0) * (1 + slow * it)
                print(' [x] iteration %8d/%8d | elapsed time per iteration (ms): %.1f | global batch size: %5d | '
                      'lm loss: %.6E | grad norm: 1.000 | number of skipped iterations:   0 | '
                      'number of nan iterations:   0 |' % (it, a.train_iters, ms, a.global_batch_size,
                                                           10.0 - it * 0.1 + gap * it / a.train_iters),
                      flush=True)
        """
    ))
    return d


def _kernel_trace() -> list:
    """A GPU-style torch profiler trace of one step with known answers (see test_profile_breakdown).

    Main thread 1: forward (attention, MoE, a dense add), the optimizer and one op after it;
    autograd thread 2: the backward nodes, linked to the forward ops by sequence numbers."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "python_function", "tid": 1, "ts": 10, "dur": 800,
         "name": "megatron/core/pipeline_parallel/schedules.py(696): forward_backward_no_pipelining"},
        {"ph": "X", "cat": "python_function", "name": "nn.Module: SelfAttention_0", "tid": 1, "ts": 20, "dur": 40},
        {"ph": "X", "cat": "python_function", "name": "nn.Module: MoKMoELayer", "tid": 1, "ts": 70, "dur": 80},
        {"ph": "X", "cat": "python_function", "name": "megatron/core/optimizer/optimizer.py(1854): step",
         "tid": 1, "ts": 850, "dur": 100},
    ]
    fwd = [("aten::mm", 25, 10), ("aten::softmax", 40, 11), ("aten::mm", 80, 12), ("MoKFunction", 100, 13),
           ("aten::add", 160, 14)]
    for name, ts, seq in fwd:
        ev.append({"ph": "X", "cat": "cpu_op", "name": name, "tid": 1, "ts": ts, "dur": 4,
                   "args": {"Sequence number": seq, "Fwd thread id": 0}})
    bwd = [("AddBackward0", 300, 10, 14), ("MoKFunctionBackward", 320, 40, 13), ("MmBackward0", 370, 20, 12),
           ("torch::autograd::AccumulateGrad", 392, 5, None), ("SoftmaxBackward0", 400, 10, 11),
           ("MmBackward0", 415, 10, 10)]
    for name, ts, dur, seq in bwd:
        args = {} if seq is None else {"Sequence number": seq, "Fwd thread id": 1}
        ev.append({"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: " + name, "tid": 2,
                   "ts": ts, "dur": dur, "args": args})
    # (launch tid, launch ts, kernel start, kernel end)
    launches = [(1, 25, 30, 40), (1, 40, 45, 55), (1, 80, 85, 125), (1, 100, 130, 170), (1, 160, 175, 185),
                (2, 301, 305, 315), (2, 321, 325, 365), (2, 371, 375, 385), (2, 393, 395, 400), (2, 401, 405, 410),
                (2, 416, 420, 430), (1, 860, 865, 915), (1, 900, 920, 940), (1, 960, 962, 972)]
    for corr, (tid, lts, ks, ke) in enumerate(launches, start=100):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "ts": lts, "dur": 1,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": f"kernel_{corr}", "tid": 7, "ts": ks, "dur": ke - ks,
                   "args": {"correlation": corr}})
    return ev


def _load_compare():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_backends", COMPARE)
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    return cb


def test_profile_breakdown_attributes_kernels_to_their_windows():
    cb = _load_compare()
    p = cb.profile_breakdown(_kernel_trace())
    assert p["mode"] == "gpu" and p["steps"] == 1
    assert p["step_us"] == pytest.approx(972 - 30)
    b = p["breakdown_us"]
    # MoE: forward window 85..170 (gap 125..130 included), backward 325..400 (AccumulateGrad right after it)
    assert b["moe"] == pytest.approx(85 + 75)
    assert b["attention"] == pytest.approx(25 + 25)
    assert b["optimizer"] == pytest.approx(70) and b["dense"] == pytest.approx(20) and b["other"] == pytest.approx(10)
    assert b["idle"] == pytest.approx(942 - 310)
    assert p["moe_share"] == pytest.approx(160 / 942)
    assert p["moe_kernel_share"] == pytest.approx(135 / 270)
    assert p["windows"]["moe"] == {"forward": 1, "backward": 1}
    assert p["windows"]["attention"] == {"forward": 1, "backward": 1}
    assert sum(b.values()) == pytest.approx(p["step_us"])


def test_profile_breakdown_without_module_windows_says_why():
    cb = _load_compare()
    ev = [e for e in _kernel_trace() if not e["name"].startswith("nn.Module")]
    p = cb.profile_breakdown(ev)
    assert p["breakdown_us"]["moe"] == 0 and "--pytorch-profiler-collect-callstack" in p["notes"][0]
    with pytest.raises(ValueError):
        cb.profile_breakdown([{"ph": "X", "cat": "python_function", "name": "x", "tid": 1, "ts": 0, "dur": 1}])


def test_analyze_trace_reads_gzip_and_adds_kernel_categories(tmp_path):
    import gzip

    cb = _load_compare()
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _kernel_trace()}, f)
    p = cb.analyze_trace(path)
    assert p["moe_share"] == pytest.approx(160 / 942) and "kernel_categories_us" in p
    # GPU idle >= 100 us: 185..305 (launched at 301, inside the backward's first node) and 430..865
    assert p["idle_gaps"]["idle_us"] == pytest.approx(120 + 435)
    assert p["idle_gaps"]["by_host_op_us"] == pytest.approx(
        {"autograd::engine::evaluate_function: AddBackward0": 120, "(untraced host work)": 435})
    bad = cb.analyze_trace(tmp_path / "missing.json.gz")
    assert "error" in bad and "FileNotFoundError" in bad["error"]


def test_compare_end_to_end_with_stand_in(tmp_path):
    entry_dir = _fake_entry(tmp_path)
    cfg = tmp_path / "c.args"
    cfg.write_text("--seq-length 32\n--global-batch-size 4\n")
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(entry_dir), "HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, str(COMPARE), "--config", str(cfg), "--backends", "mok,alltoall,hybridep",
         "--nproc-per-node", "2", "--iters", "5", "--warmup", "1", "--entry", "fake_meg",
         "--python", sys.executable, "--out", str(out), "--timeout", "120"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "compare.json").read_text())
    b = rep["backends"]
    assert b["mok"]["status"] == "ok" and b["alltoall"]["status"] == "ok"
    assert b["mok"]["tokens_per_s_per_gpu"] == pytest.approx(4 * 32 / 0.05 / 2)
    assert b["alltoall"]["tokens_per_s_per_gpu"] == pytest.approx(4 * 32 / 0.1 / 2)
    assert b["mok"]["median_step_ms"] == 50.0 and len(b["mok"]["loss_curve"]) == 5
    assert b["alltoall"]["loss_max_abs_diff_vs_mok"] == 0.0
    assert b["mok"]["peak_memory_mib"] > 0  # measured by rank_stats.py (max RSS on CPU)
    assert b["hybridep"]["status"] == "skipped" and "deep_ep" in b["hybridep"]["reason"]
    md = (out / "compare.md").read_text()
    assert "| hybridep | skipped |" in md and "| mok | ok |" in md
    assert (out / "logs" / "mok.log").is_file()
    if rep.get("png_error"):  # the ranks' interpreter has no matplotlib
        assert "matplotlib" in rep["png_error"] and not (out / "compare.png").exists()
    else:
        assert (out / "compare.png").stat().st_size > 1000 and "compare.png" in md


def test_compare_from_logs(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(_log(6))
    b.write_text("ModuleNotFoundError: No module named 'deep_ep'\n")
    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, str(COMPARE), "--from-logs", f"mok={a}", f"hybridep={b}", "--warmup", "2",
                        "--out", str(out), "--", "--lr", "1e-4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "compare.json").read_text())
    assert rep["backends"]["mok"]["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / 0.105 / 2)
    assert rep["backends"]["hybridep"]["status"] == "skipped"
    # the flags the logs ran with over the config, as given after --
    assert "Megatron flags over the config: `--lr 1e-4`" in (out / "compare.md").read_text()


@pytest.mark.parametrize("argv, msg", [
    (["--config", "/nonexistent.args"], "config file not found"),
    (["--config", "{cfg}", "--backends", "mok,nccl"], "unknown backend"),
])
def test_compare_bad_arguments(tmp_path, argv, msg):
    cfg = tmp_path / "c.args"
    cfg.write_text("--seq-length 8\n")
    argv = [x.format(cfg=cfg) for x in argv]
    r = subprocess.run([sys.executable, str(COMPARE), *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and msg in r.stderr


def test_megatron_zero_memory_report_on_cpu_falls_back_to_rss():
    text = _log(3) + ("[Rank 0] (after 1 iterations) memory (MB) | allocated: 0.00 | max allocated: 0.00 | "
                      "reserved: 0.00 | max reserved: 0.00\n")
    s = logparse.summarize(logparse.parse_log(text))
    assert s["peak_memory_mib"] == 812.5 and "RSS" in s["peak_memory_source"]


@pytest.mark.parametrize("drift", [False, True])
def test_compare_rerun_checks_bitwise_reproducibility(tmp_path, drift):
    entry_dir = _fake_entry(tmp_path)
    cfg = tmp_path / "c.args"
    cfg.write_text("--seq-length 32\n--global-batch-size 4\n")
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(entry_dir), "HOME": str(tmp_path), "FAKE_MARK_DIR": str(tmp_path)}
    if drift:
        env["FAKE_RERUN_DRIFT"] = "1"
    r = subprocess.run(
        [sys.executable, str(COMPARE), "--config", str(cfg), "--backends", "mok,alltoall", "--rerun", "mok",
         "--param-digest-every", "2", "--nproc-per-node", "2", "--iters", "6", "--warmup", "1", "--entry", "fake_meg",
         "--python", sys.executable, "--out", str(out), "--timeout", "120", "--no-rank-stats"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    rep = json.loads((out / "compare.json").read_text())
    check = rep["backends"]["mok_rerun"]["bitwise_vs_first_run"]
    assert check["loss_curve_identical"] is True
    assert check["param_digest_iterations"] == [0, 2, 4, 5]
    assert rep["backends"]["mok"]["param_digests"]["2"] == {"0": f"{3:016x}", "1": f"{1003:016x}"}
    assert "bitwise_vs_first_run" not in rep["backends"]["alltoall"]
    md = (out / "compare.md").read_text()
    if drift:
        assert r.returncode == 1 and "NOT bitwise reproducible: mok_rerun" in r.stderr
        assert check["param_digests_identical"] is False and "bitwise DIFFERENT" in md
    else:
        assert r.returncode == 0, r.stderr
        assert check["param_digests_identical"] is True and "bitwise identical to the first run" in md


def test_compare_rerun_needs_a_listed_backend(tmp_path):
    cfg = tmp_path / "c.args"
    cfg.write_text("--seq-length 8\n")
    r = subprocess.run([sys.executable, str(COMPARE), "--config", str(cfg), "--backends", "mok", "--rerun", "alltoall"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "every rerun backend must also be in --backends" in r.stderr


def test_param_digest_sees_every_bit_and_position():
    torch = pytest.importorskip("torch")
    from megatron_mok.adapter.steps import param_digest

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8)).to(torch.bfloat16)
    d0 = param_digest(m)
    assert d0 == param_digest(m) and len(d0) == 16
    w = m[0].weight.data
    bits = w.view(torch.int16)
    bits[3, 5] ^= 1  # one bit of one element
    d1 = param_digest(m)
    bits[3, 5] ^= 1
    assert d1 != d0 and param_digest(m) == d0
    a, b = w[0, 0].clone(), w[0, 1].clone()
    if not torch.equal(a, b):
        w[0, 0], w[0, 1] = b, a  # same values, other positions
        assert param_digest(m) != d0


def _run_compare(tmp_path, *args, env_extra=None, trace=True):
    entry_dir = _fake_entry(tmp_path)
    cfg = tmp_path / "c.args"
    cfg.write_text("# a comment line\n--seq-length 32  # trailing comment\n--global-batch-size 4\n--transformer-impl local\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(entry_dir), "HOME": str(tmp_path)}
    if trace:
        import gzip

        tp = tmp_path / "template.json.gz"
        with gzip.open(tp, "wt") as f:
            json.dump({"traceEvents": _kernel_trace()}, f)
        env["FAKE_TRACE"] = str(tp)
    env.update(env_extra or {})
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(COMPARE), "--config", str(cfg), "--nproc-per-node", "1", "--entry", "fake_meg",
         "--python", sys.executable, "--out", str(out), "--timeout", "120", "--no-rank-stats", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    rep = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else None
    return r, rep, out


def test_compare_variants_profile_and_megatron_fp8_skip(tmp_path):
    r, rep, out = _run_compare(tmp_path, "--backends", "mok,mok_fp8,mok_unfused,mok_fp8_graph,alltoall,alltoall_fp8",
                               "--iters", "8", "--warmup", "1", "--profile-iters", "4:5")
    assert r.returncode == 0, r.stderr
    b = rep["backends"]
    assert [k for k in b] == ["mok", "mok_fp8", "mok_unfused", "mok_fp8_graph", "alltoall", "alltoall_fp8"]
    assert "FAKE precision=fp8 deterministic=False router=fp32 wgrad=auto graph=full_iteration nan_check=False" in \
        (out / "logs" / "mok_fp8_graph.log").read_text()
    assert "graph=none nan_check=True" in (out / "logs" / "mok.log").read_text()
    assert "FAKE precision=fp8" in (out / "logs" / "mok_fp8.log").read_text()
    assert "FAKE precision=bf16" in (out / "logs" / "mok.log").read_text()
    assert "wgrad=unfused" in (out / "logs" / "mok_unfused.log").read_text()  # after the recipe's flags
    assert b["mok_unfused"]["status"] == "ok"
    fp8 = b["alltoall_fp8"]
    assert fp8["status"] == "skipped" and "TransformerEngine" in fp8["reason"] and "--transformer-impl local" in fp8["reason"]
    assert "alltoall_fp8: skipped: Megatron's FP8 recipe" in r.stderr
    assert b["mok"]["speedup_vs_alltoall"] == pytest.approx(2.0)
    assert rep["profile_excluded"] == [3, 4, 5]
    assert b["mok"]["timed_iterations"] == [2, 6, 7, 8]
    for name in ("mok", "mok_fp8", "alltoall"):
        assert b[name]["moe_share"] == pytest.approx(160 / 942), name
        assert (out / "profile" / name / "torch_profile" / "rank-0.json.gz").is_file()
    assert "MoE share 17.0 % of the profiled step" in r.stderr
    md = (out / "compare.md").read_text()
    assert "| alltoall_fp8 | skipped |" in md and "## Step breakdown" in md and "2.00x" in md


def test_compare_soak_passes_with_stable_runs(tmp_path):
    r, rep, out = _run_compare(tmp_path, "--soak", "--backends", "mok,alltoall", "--rerun", "mok", "--iters", "50",
                               "--param-digest-every", "10", trace=False)
    assert r.returncode == 0, r.stderr
    assert "FAKE precision=bf16 deterministic=True" in (out / "logs" / "mok.log").read_text()
    soak = rep["soak"]
    assert soak["ok"] and soak["iters"] == 50
    assert rep["backends"]["mok_rerun"]["bitwise_vs_first_run"]["param_digest_iterations"] == [0, 10, 20, 30, 40, 49]
    names = list(soak["checks"])
    assert "mok_rerun: bitwise identical parameter digests" in names
    assert "alltoall: steps 40-50 within 2% of 10-20" in names
    assert soak["backends"]["alltoall"]["loss_max_abs_diff_vs_mok"] == 0.0
    # the noise controls: each backend again with the router in fp64, not themselves compared with mok
    for ctrl in ("mok_control", "alltoall_control"):
        assert f"{ctrl}: ran all iterations" in names
        assert not any(n.startswith(f"{ctrl}: loss") for n in names)
    assert [(c["control"], c["of"], c["max_rel_gap"]) for c in soak["noise_controls"]] == [
        ("mok_control", "mok", 0.0), ("alltoall_control", "alltoall", 0.0)]
    assert soak["tolerances"]["loss_window_relative"] == 0.02  # no noise: the 2 % floor
    md = (out / "compare.md").read_text()
    assert "Soak: 50 iterations, PASS" in md and "| mok_control | alltoall_control vs alltoall |" in md
    assert "[compare] soak: PASS" in r.stderr


@pytest.mark.parametrize("env, failing", [
    ({"FAKE_SLOWDOWN": "0.01"}, "steps 40-50 within 2% of 10-20"),
    ({"FAKE_LOSS_GAP": "0.5"}, "loss"),
])
def test_compare_soak_fails_on_drift_or_loss_gap(tmp_path, env, failing):
    r, rep, _ = _run_compare(tmp_path, "--soak", "--backends", "mok,alltoall", "--iters", "50", env_extra=env,
                             trace=False)
    assert r.returncode == 1
    bad = [k for k, c in rep["soak"]["checks"].items() if not c["ok"]]
    assert bad and all(failing in k for k in bad), bad
    if "FAKE_SLOWDOWN" in env:  # a real slowdown moves the window's fastest steps too, and the report says so
        pb = rep["soak"]["backends"]["mok"]
        assert pb["p10_step_ms_late"] > pb["p10_step_ms_early"] > 0
        assert "10th percentile" in rep["soak"]["checks"][bad[0]]["detail"]


def test_soak_loss_tolerance_follows_the_noise_control(tmp_path):
    # alltoall up to 0.3 above mok (~6 % of the loss at the end); its noise control as far again above
    # alltoall: a gap of the size rounding alone makes in this run passes, without the control it fails
    env = {"FAKE_LOSS_GAP": "0.3", "FAKE_CONTROL_NOISE": "0.3"}
    r, rep, _ = _run_compare(tmp_path, "--soak", "--backends", "mok,alltoall", "--iters", "50", env_extra=env,
                             trace=False)
    assert r.returncode == 0, r.stderr
    check = rep["soak"]["checks"]["alltoall: loss curve vs mok (5-iteration means)"]
    assert check["ok"] and "2 x the worst window of 2 noise control(s)" in check["detail"]
    assert "router=fp64" in (tmp_path / "out" / "logs" / "alltoall_control.log").read_text()
    assert "router=fp32" in (tmp_path / "out" / "logs" / "alltoall.log").read_text()
    # one control, of the other backend, bounds the same way; the worst control sets the bound
    (tmp_path / "one").mkdir()
    r, rep, _ = _run_compare(tmp_path / "one", "--soak", "--backends", "mok,alltoall", "--iters", "50",
                             "--noise-control", "mok", env_extra=env, trace=False)
    assert r.returncode == 0, r.stderr
    assert [c["control"] for c in rep["soak"]["noise_controls"]] == ["mok_control"]
    assert rep["soak"]["noise_control"]["control"] == "mok_control"
    (tmp_path / "second").mkdir()
    r, rep, _ = _run_compare(tmp_path / "second", "--soak", "--backends", "mok,alltoall", "--iters", "50",
                             "--noise-control", "none", env_extra=env, trace=False)
    assert r.returncode == 1 and rep["soak"]["noise_control"] is None and rep["soak"]["noise_controls"] == []
    assert not rep["soak"]["checks"]["alltoall: loss curve vs mok (5-iteration means)"]["ok"]


def test_noise_control_flips_the_router_precision():
    cb = _load_compare()
    assert cb.noise_control_args(["--moe-router-dtype", "fp32"]) == ["--moe-router-dtype", "fp64"]
    assert cb.noise_control_args(["--moe-router-dtype", "fp64"]) == ["--moe-router-dtype", "fp32"]
    assert cb.noise_control_args([]) == ["--moe-router-dtype", "fp64"]


def test_backend_args_make_mok_strict_on_gpus_only():
    cb = _load_compare()
    assert cb.backend_args("mok_fp8", gpu=True) == ("mok", ["--mok-precision", "fp8", "--mok-strict"])
    assert cb.backend_args("mok", gpu=False) == ("mok", [])
    assert cb.backend_args("mok", gpu=True, strict=False) == ("mok", [])
    assert cb.backend_args("alltoall", gpu=True) == ("alltoall", [])
    assert cb.backend_args("alltoall_fp8", gpu=True) is None


def test_soak_checks_catch_nan_and_digest_mismatch():
    cb = _load_compare()
    curve = [[i, 5.0 - 0.01 * i] for i in range(1, 51)]
    nan_curve = [[i, float("nan") if i == 30 else l] for i, l in curve]
    ok = {"status": "ok", "loss_curve": curve, "last_iteration": 50}
    results = {
        "mok": dict(ok),
        "alltoall": {**ok, "loss_curve": nan_curve},
        "mok_rerun": {**ok, "bitwise_vs_first_run": {"loss_curve_identical": True, "param_digest_iterations": [0, 10],
                                                     "param_digests_identical": False}},
        "hybridep": {"status": "skipped", "reason": "No module named 'deep_ep'"},
    }
    times = {i: 100.0 for i in range(1, 51)}
    fields = {b: {"elapsed time per iteration (ms)": times, "grad norm": {i: 1.0 for i in range(1, 51)}}
              for b in results}
    soak = cb.soak_checks(results, fields, 50, 10)
    assert not soak["ok"]
    failed = sorted(k for k, c in soak["checks"].items() if not c["ok"])
    assert failed == ["alltoall: no NaN/inf", "mok_rerun: bitwise identical parameter digests"], failed
    assert soak["backends"]["hybridep"]["reason"].startswith("No module")


def test_soak_drift_reports_the_gpu_telemetry_of_its_windows(tmp_path, monkeypatch):
    """nvidia-smi samples beside a run (a stand-in nvidia-smi here) are read back, lines that are no
    samples skipped; the drift check states the SM clock, power and temperature medians of the
    windows' time spans (from the iteration lines' stamps) and still fails on the step times."""
    cb = _load_compare()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho \"$1 $2 $3 $4\" > \"$(dirname \"$0\")/args\"\n"
                   "echo '2026/11/29 20:01:02.500, 0, 1980, 2619, 650.5, 61'\n"
                   "echo '2026/11/29 20:01:03.500, 0, [N/A], 2619, 651.0, 61'\n"
                   "echo 'Unable to determine the device handle'\n"
                   "echo '2026/11/29 20:01:04.500, 0, 1830, 2619, 700.0, 70'\nsleep 30\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    csv = tmp_path / "mok.gpu.csv"
    sampler = cb.start_gpu_sampler(csv)
    deadline = time.time() + 10
    while len(cb.read_gpu_samples(csv)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    cb.stop_gpu_sampler(sampler)
    assert "--query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu" in (
        smi.parent / "args").read_text()
    samples = cb.read_gpu_samples(csv)
    assert [(x["sm_mhz"], x["power_w"], x["temp_c"]) for x in samples] == [(1980, 650.5, 61), (1830, 700.0, 70)]
    t0 = datetime(2026, 11, 29, 20, 1, 2).timestamp()
    curve = [[i, 5.0 - 0.01 * i] for i in range(1, 51)]
    results = {"mok": {"status": "ok", "loss_curve": curve, "last_iteration": 50}}
    times = {i: 100.0 if i <= 30 else 110.0 for i in range(1, 51)}
    stamps = {10: t0, 20: t0 + 1.0, 40: t0 + 2.0, 50: t0 + 3.0}  # the windows (10, 20] and (40, 50]
    fields = {"mok": {"elapsed time per iteration (ms)": times, "grad norm": {i: 1.0 for i in range(1, 51)},
                      "log time (s)": stamps, cb.GPU_SAMPLES: samples}}
    soak = cb.soak_checks(results, fields, 50, 0)
    check = soak["checks"]["mok: steps 40-50 within 2% of 10-20"]
    assert not check["ok"]  # the step times decide; the telemetry explains
    assert "GPU SM clock 1980 -> 1830 MHz, power 650 -> 700 W, 61 -> 70 C (medians of 1 and 1 samples)" in (
        check["detail"]), check["detail"]
    assert soak["backends"]["mok"]["gpu_late"]["sm_mhz"] == 1830
    # a run's log with a .gpu.csv beside it: medians over its timed iterations (all stamped 20:01:02.123456)
    (tmp_path / "run.log").write_text(_log(6))
    (tmp_path / "run.gpu.csv").write_text("2026/11/29 20:01:02.123456, 0, 1755, 2619, 600.0, 55\n")
    r = cb.result_from_log(tmp_path / "run.log", 0, 1.0, 2)
    assert r["gpu_telemetry"] == {"samples": 1, "sm_mhz": 1755, "mem_mhz": 2619, "power_w": 600.0, "temp_c": 55}
    fields["mok"].pop(cb.GPU_SAMPLES)  # no telemetry: the check as before
    assert "GPU" not in cb.soak_checks(results, fields, 50, 0)["checks"]["mok: steps 40-50 within 2% of 10-20"][
        "detail"]


def test_from_logs_leaves_profiled_iterations_out_of_the_timing(tmp_path):
    a = tmp_path / "a.log"
    a.write_text(_log(10))  # 900, 900, then 100/110 alternating
    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, str(COMPARE), "--from-logs", f"mok={a}", "--warmup", "2",
                        "--profile-iters", "5:7", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "compare.json").read_text())["backends"]["mok"]
    assert m["timed_iterations"] == [3, 8, 9, 10] and m["excluded_from_timing"] == [4, 5, 6, 7]
    assert m["median_step_ms"] == pytest.approx(105.0)


@pytest.mark.parametrize("text", ["5", "0:2", "7:7", "a:b"])
def test_bad_profile_iters(tmp_path, text):
    cfg = tmp_path / "c.args"
    cfg.write_text("--seq-length 8\n")
    r = subprocess.run([sys.executable, str(COMPARE), "--config", str(cfg), "--profile-iters", text],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--profile-iters wants S:E" in r.stderr


@pytest.mark.timeout(300)
def test_compare_on_the_one_gpu_tiny_recipe_with_megatron(tmp_path):
    """Real Megatron on CPU (1 rank, gloo): the recipe's tiny variant with mok and alltoall, profiled."""
    pytest.importorskip("megatron.training")
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, str(COMPARE), "--config", str(REPO / "configs" / "deepseek-v3-1gpu-tiny.args"),
         "--backends", "mok,alltoall,alltoall_fp8", "--nproc-per-node", "1", "--iters", "4", "--warmup", "1",
         "--profile-iters", "2:3", "--python", sys.executable, "--out", str(out), "--timeout", "240"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=290,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads((out / "compare.json").read_text())
    b = rep["backends"]
    assert b["alltoall_fp8"]["status"] == "skipped"
    for name in ("mok", "alltoall"):
        assert b[name]["status"] == "ok" and b[name]["iterations_logged"] == 4, name
        prof = b[name]["profile"]
        assert prof["mode"] == "cpu" and prof["steps"] == 1, prof
        # two MoE layers and two attention modules per micro-batch, 4 micro-batches, forward and backward
        assert prof["windows"]["moe"] == {"forward": 8, "backward": 8}, prof["windows"]
        assert prof["windows"]["attention"] == {"forward": 8, "backward": 8}, prof["windows"]
        assert 0.0 < prof["moe_share"] < 1.0 and prof["breakdown_us"]["optimizer"] > 0
    # same initialization and data: the first loss agrees to fp32 rounding
    assert b["alltoall"]["loss_curve"][0][1] == pytest.approx(b["mok"]["loss_curve"][0][1], rel=1e-5)
