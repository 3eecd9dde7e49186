"""megatron_mok.logparse and scripts/compare_backends.py (no GPU, no Megatron run needed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron_mok import logparse  # noqa: E402

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
    """A stand-in training module: prints Megatron-format lines; 'hybridep' fails like a missing deep_ep."""
    d = tmp_path / "fakeentry"
    d.mkdir()
    (d / "fake_meg.py").write_text(textwrap.dedent(
        """\
        import argparse, os, sys, time
        p = argparse.ArgumentParser()
        p.add_argument('--moe-backend'); p.add_argument('--train-iters', type=int)
        p.add_argument('--seq-length', type=int, default=32); p.add_argument('--global-batch-size', type=int, default=4)
        a, _ = p.parse_known_args()
        if a.moe_backend == 'hybridep':
            raise ModuleNotFoundError("--moe-backend hybridep needs deep_ep: No module named 'deep_ep'")
        r, w = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
        every = int(os.environ.get('MOK_PARAM_DIGEST_EVERY', '0'))
        drift = 0
        if 'FAKE_MARK_DIR' in os.environ:  # a rerun that is not bitwise equal to the first run
            mark = os.path.join(os.environ['FAKE_MARK_DIR'], 'ran_%s_%d' % (a.moe_backend, r))
            drift = int(os.path.exists(mark) and 'FAKE_RERUN_DRIFT' in os.environ)
            open(mark, 'w').close()
        if r == 0:
            print('------------------------ arguments ------------------------')
            for k, v in [('global_batch_size', a.global_batch_size), ('seq_length', a.seq_length), ('world_size', w)]:
                print('  %s %s %s' % (k, '.' * (48 - len(k)), v))
            print('-------------------- end of arguments ---------------------')
        for it in range(1, a.train_iters + 1):
            time.sleep(0.01)
            if every and ((it - 1) % every == 0 or it == a.train_iters):
                print('[megatron_mok] param-digest rank=%d iteration=%d value=%016x'
                      % (r, it - 1, 1000 * r + it + drift * (it > 3)), flush=True)
            if r == w - 1:
                print(' [x] iteration %8d/%8d | elapsed time per iteration (ms): %.1f | global batch size: %5d | '
                      'lm loss: %.6E |' % (it, a.train_iters, 50.0 if a.moe_backend == 'mok' else 100.0,
                                            a.global_batch_size, 10.0 - it * 0.1), flush=True)
        """
    ))
    return d


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
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "compare.json").read_text())
    assert rep["backends"]["mok"]["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / 0.105 / 2)
    assert rep["backends"]["hybridep"]["status"] == "skipped"


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
    from megatron_mok.adapter.pretrain import param_digest

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
