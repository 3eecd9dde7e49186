"""Pieces of scripts/bench_layer.py that run without a GPU: backend names, the roofline, the
speedup columns, the FP8 baseline's experts (on an emulated torch._scaled_grouped_mm), the fp32
reference of the correctness gate, and the symm_a2a helpers."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _bench():
    spec = importlib.util.spec_from_file_location("bench_layer", ROOT / "scripts" / "bench_layer.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_layer"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# ---- backend names ----------------------------------------------------------------------------------


def test_mok_variants_are_mokconfig_fields():
    bl = _bench()
    assert bl.config_overrides("mok") == {}
    assert bl.config_overrides("mok@fwd_comm_sms=8+minibatch_rows=2048") == {"fwd_comm_sms": 8, "minibatch_rows": 2048}
    assert bl.config_overrides("mok@precision=fp8") == {"precision": "fp8"}
    assert bl.config_overrides("mok@capacity_factor=0.5") == {"capacity_factor": 0.5}
    assert bl.config_overrides("mok@save_gate_up=False") == {"save_gate_up": False}
    assert bl.config_overrides("mok@precision=fp8+fp8_dgrad=false") == {"precision": "fp8", "fp8_dgrad": False}
    assert bl.config_overrides("mok@forward_kernel=staged") == {"forward_kernel": "staged"}
    for ok in ("mok", "mok@precision=fp8", "mok@forward_kernel=staged", "mok@save_gate_up=False",
               "mok@forward_kernel=persistent", "alltoall", "alltoall_fp8", "symm_a2a"):
        bl.check_backend(ok)
    cfg = bl.mok_config(bl.config_overrides("mok@precision=fp8"))
    assert cfg.precision == "fp8" and cfg.strict  # the bench never falls back to the reference silently
    assert not bl.mok_config({"strict": False}).strict
    assert bl.backend_precision("mok@precision=fp8+forward_kernel=staged") == "fp8"
    assert bl.backend_precision("alltoall_fp8") == "fp8" and bl.backend_precision("mok") == "bf16"


def test_environment_switches_and_old_names_are_refused():
    bl = _bench()
    with pytest.raises(ValueError, match="no longer exist"):
        bl.check_backend("mok%MOK_GEMM_PAIRED=0")
    with pytest.raises(ValueError, match="no longer exist"):
        bl.check_backend("mok@precision=fp8%MOK_FWD_OVERLAP=0")
    with pytest.raises(ValueError, match="mok@forward_kernel=staged"):
        bl.check_backend("mok_staged")
    with pytest.raises(ValueError, match="mok@save_gate_up=False"):
        bl.check_backend("mok_recompute")
    with pytest.raises(ValueError, match="MoKConfig fields"):
        bl.check_backend("mok@no_such_field=1")
    with pytest.raises(ValueError, match="forward_kernel"):  # MoKConfigError names the field
        bl.check_backend("mok@precision=fp8+forward_kernel=persistent")
    with pytest.raises(ValueError, match="not FIELD=VALUE"):
        bl.check_backend("mok@precision")
    with pytest.raises(ValueError, match="unknown backend"):
        bl.check_backend("deepep")


def test_arguments_parse_and_refuse_what_is_gone():
    bl = _bench()
    a = bl.parse_args(["--backends", "mok,mok@precision=fp8,alltoall,alltoall_fp8", "--routing", "random,skewed",
                       "--tokens", "4096,8192", "--pass", "bwd"])
    assert a.backends_list == ["mok", "mok@precision=fp8", "alltoall", "alltoall_fp8"]
    assert a.routings == ["random", "skewed"] and a.token_list == [4096, 8192] and a.shapes == ["deepseek-v3"]
    assert bl.parse_args(["--shape", "all"]).shapes == list(bl.MOE_SHAPES)
    assert bl.parse_args(["--shape", "deepseek-v3-1gpu"]).shapes == ["deepseek-v3-1gpu"]
    for bad in (["--backends", "mok_ab"], ["--ab-env", "MOK_GEMM_EXPERT=0"], ["--breakdown"],
                ["--timeline", "--pass", "bwd"], ["--routing", "zipf"], ["--shape", "gpt-oss"],
                ["--backends", "mok,mok"]):
        with pytest.raises(SystemExit):
            bl.parse_args(bad)


def test_command_line_is_stored_as_run():
    bl = _bench()
    argv = [str(ROOT / "scripts" / "bench_layer.py"), "--backends", "mok,mok@precision=fp8", "--note", "a b"]
    assert bl.command_line(argv, {}) == \
        "python scripts/bench_layer.py --backends mok,mok@precision=fp8 --note 'a b'"
    assert bl.command_line(argv, {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"}) == \
        "torchrun --nproc-per-node=8 scripts/bench_layer.py --backends mok,mok@precision=fp8 --note 'a b'"
    assert bl.command_line(argv, {"MOK_BENCH_CMD": "sbatch x.sh"}) == "sbatch x.sh"


def test_result_files_are_named_by_gpu_ep_and_pass_and_merge_by_case():
    bl = _bench()
    assert bl.gpu_slug("NVIDIA H200") == "h200" and bl.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert bl.result_path("NVIDIA H200", 1, "fwd").endswith("bench/results/h200_ep1_fwd.json")
    old = [dict(shape="s", tokens=1, routing="random", backend="mok", ms=2.0),
           dict(shape="s", tokens=1, routing="skewed", backend="mok", ms=3.0)]
    new = [dict(shape="s", tokens=1, routing="random", backend="mok", ms=1.0)]
    merged = bl.merge_results(old, new)
    assert [(r["routing"], r["ms"]) for r in merged] == [("random", 1.0), ("skewed", 3.0)]


# ---- roofline ---------------------------------------------------------------------------------------

RATES = {"matmul_tflops": {"bf16": 796.0, "fp8": 1436.0}, "hbm_bytes_per_s": 4.2e12, "nvlink_bytes_per_s": 390e9}


def _dsv3(T, pass_, precision):
    bl = _bench()
    stats = [dict(routed_rows=8 * T, active_experts=256, rows_out=0, rows_in=0)]  # EP=1: every row is local
    return bl.layer_roofline("deepseek-v3", T, pass_, precision, stats, RATES)


def test_roofline_matches_issue_35_at_deepseek_v3_ep1():
    """Issue #35's derived figures (H200: bf16 matmul 796 TFLOP/s, e4m3 1436, HBM 4.2 TB/s): the
    routed weights are 256 x 3 x 7168 x 2048 = 11.3 G values, 22.5 GB in bf16. Our figures count the
    shared expert and the activations as well, hence slightly above."""
    r = _dsv3(4096, "fwd", "bf16")
    assert r["bound"] == "hbm" and r["roofline_ms"] == pytest.approx(5.36, rel=0.02)
    assert r["hbm_bytes_detail"]["weights_read"] == pytest.approx(22.5e9, rel=0.01)
    assert r["nvlink_bytes"] == 0 and r["flops"] == 6 * 4096 * 9 * 7168 * 2048
    r = _dsv3(8192, "fwd", "bf16")
    assert r["bound"] == "compute" and r["roofline_ms"] == pytest.approx(8.16, rel=0.01)
    r = _dsv3(4096, "fwd", "fp8")
    assert r["bound"] == "hbm" and r["roofline_ms"] == pytest.approx(2.7, rel=0.03)
    assert r["hbm_bytes_detail"]["weights_read"] == pytest.approx(11.3e9, rel=0.01)
    r = _dsv3(8192, "fwd", "fp8")
    assert r["bound"] == "compute" and r["roofline_ms"] == pytest.approx(4.5, rel=0.02)
    r = _dsv3(4096, "bwd", "bf16")  # weights read + bf16 weight gradients written: 45 GB
    assert r["bound"] == "hbm" and r["roofline_ms"] >= 10.7 and r["roofline_ms"] == pytest.approx(10.7, rel=0.02)
    assert r["hbm_bytes_detail"]["weight_grads_written"] == pytest.approx(22.6e9, rel=0.01)
    r = _dsv3(8192, "bwd", "bf16")
    assert r["bound"] == "compute" and r["roofline_ms"] == pytest.approx(16.3, rel=0.01)
    r = _dsv3(4096, "bwd", "fp8")  # e4m3 weights read, bf16 gradients written, shared expert bf16
    assert r["bound"] == "hbm" and r["roofline_ms"] < _dsv3(4096, "bwd", "bf16")["roofline_ms"]


def test_roofline_inputs_and_bound():
    bl = _bench()
    cost = dict(flops=2e12, hbm_bytes=4.2e9, nvlink_bytes=0.39e9 * 5)
    r = bl.roofline(cost, 1000.0, 4.2e12, 390e9)
    assert (r["compute_ms"], r["hbm_ms"]) == (pytest.approx(2.0), pytest.approx(1.0))
    assert r["nvlink_ms"] == pytest.approx(5.0) and r["bound"] == "nvlink" and r["roofline_ms"] == pytest.approx(5.0)
    assert r["matmul_tflops"] == 1000.0 and r["nvlink_bytes_per_s"] == 390e9
    with pytest.raises(KeyError, match="fp8"):
        bl.layer_roofline("deepseek-v3", 4096, "fwd", "fp8", [dict(routed_rows=1, active_experts=1)],
                          dict(RATES, matmul_tflops={"bf16": 800.0, "fp8": None}))


def test_main_grad_pass_counts_fp32_main_grads():
    """bwd+main_grad (--main-grads): the same FLOPs, fp32 main grads read and written (8 bytes a
    weight) in place of the bf16 gradients written (2)."""
    bl = _bench()
    stats = dict(routed_rows=64, active_experts=4, rows_out=0, rows_in=0)
    args = dict(hidden=256, ffn=128, shared_ffn=128, topk=2, tokens=32, precision="bf16", **stats)
    bwd, fused = bl.pass_cost(pass_="bwd", **args), bl.pass_cost(pass_="bwd+main_grad", **args)
    weights = (4 + 1) * 3 * 256 * 128
    assert fused["flops"] == bwd["flops"]
    assert fused["hbm_bytes"] - bwd["hbm_bytes"] == 6 * weights
    assert fused["hbm_bytes_detail"]["weight_grads_into_main_grad"] == 8 * weights
    assert "weight_grads_written" not in fused["hbm_bytes_detail"]
    with pytest.raises(ValueError, match="pass"):
        bl.pass_cost(pass_="fwd+main_grad", **args)


def test_routing_stats_and_nvlink_bytes_at_ep2():
    bl = _bench()
    # 2 ranks, 4 experts (2 per rank), T=2, k=2
    top = torch.tensor([[[0, 2], [1, 3]],  # rank 0: slots to experts 0 (here), 2 (rank 1), 1 (here), 3 (rank 1)
                        [[2, 3], [0, 3]]])  # rank 1: 2, 3 (here), 0 (rank 0), 3 (here)
    s = bl.routing_stats(top, 4)
    assert s[0] == dict(routed_rows=3, active_experts=2, rows_out=2, rows_in=1)
    assert s[1] == dict(routed_rows=5, active_experts=2, rows_out=1, rows_in=2)
    H = 256
    c = bl.pass_cost(hidden=H, ffn=128, shared_ffn=128, topk=2, tokens=2, pass_="fwd", precision="bf16", **s[0])
    assert c["nvlink_bytes_in"] == 1 * 2 * H + 2 * 2 * H and c["nvlink_bytes_out"] == 2 * 2 * H + 1 * 2 * H
    c = bl.pass_cost(hidden=H, ffn=128, shared_ffn=128, topk=2, tokens=2, pass_="fwd", precision="fp8", **s[1])
    row8 = H + 4 * H / 128  # e4m3 rows and their scales travel in the dispatch; the combine is bf16
    assert c["nvlink_bytes_in"] == 2 * row8 + 1 * 2 * H and c["nvlink_bytes_out"] == 1 * row8 + 2 * 2 * H
    assert c["nvlink_bytes"] == max(c["nvlink_bytes_in"], c["nvlink_bytes_out"])
    assert bl.routing_stats(top[:1] % 4, 4)[0]["rows_out"] == 0  # EP=1: nothing crosses
    # the slowest rank bounds the layer
    uneven = [dict(s[0], active_experts=1), dict(s[1], active_experts=2)]
    r = bl.layer_roofline("deepseek-v3", 2, "fwd", "bf16", uneven, RATES)
    assert r["rank"] == 1 and r["bound"] == "hbm"  # more expert weights to read there


def test_rows_get_roofline_and_speedups():
    bl = _bench()
    case = dict(shape="deepseek-v3", tokens=4096, routing="random", pass_="fwd", ep=1, status="ok")
    rows = [dict(case, backend="mok", precision="bf16", ms=8.0),
            dict(case, backend="mok@precision=fp8", precision="fp8", ms=5.0),
            dict(case, backend="alltoall", precision="bf16", ms=13.0),
            dict(case, backend="alltoall_fp8", precision="fp8", ms=15.0),
            dict(case, backend="symm_a2a", precision="bf16", status="error", error="x"),
            dict(case, backend="mok", precision="bf16", ms=20.0, tokens=8192)]  # no baseline there
    stats = {("deepseek-v3", T, "random"): [dict(routed_rows=8 * T, active_experts=256, rows_out=0, rows_in=0)]
             for T in (4096, 8192)}
    bl.annotate_rows(rows, RATES, lambda s, T, r: stats[(s, T, r)])
    bl.annotate_speedups(rows)
    mok, fp8 = rows[0], rows[1]
    assert mok["roofline_fraction"] == pytest.approx(mok["roofline_ms"] / 8.0)
    assert mok["roofline"]["matmul_tflops"] == 796.0 and fp8["roofline"]["matmul_tflops"] == 1436.0
    assert mok["fastest_baseline_same_precision"] == "alltoall" and mok["speedup_vs_same_precision"] == 13.0 / 8.0
    assert fp8["fastest_baseline_same_precision"] == "alltoall_fp8" and fp8["speedup_vs_same_precision"] == 3.0
    assert fp8["fastest_baseline_any_precision"] == "alltoall" and fp8["speedup_vs_any_precision"] == 13.0 / 5.0
    assert "speedup_vs_any_precision" not in rows[2] and "roofline" not in rows[4]
    assert "speedup_vs_any_precision" not in rows[5] and "roofline_ms" in rows[5]
    assert "x same" in bl.summary_table(rows) and "ERROR" in bl.summary_table(rows)


# ---- the FP8 baseline ---------------------------------------------------------------------------------


def _emulated_ops(bl, align):
    """torch._scaled_grouped_mm's row-wise contract, in fp32 on the CPU, checking the layouts it takes."""

    def scaled_grouped_mm(a, b, sa, sb, offs):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
        assert a.stride(-1) == 1 and b.stride(-2) == 1  # A row-major, B column-major
        assert sa.shape == (a.shape[0],) and sb.shape == (b.shape[0], b.shape[2]) and offs.dtype == torch.int32
        assert all(int(o) % align == 0 for o in offs)
        out = torch.zeros(a.shape[0], b.shape[2])
        start = 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = (a[start:end].float() * sa[start:end, None]) @ (b[g].float() * sb[g][None, :])
            start = end
        return out.to(torch.bfloat16)

    return bl.GroupedOps(scaled_grouped_mm, lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))


def test_pad_plan_aligns_every_group():
    bl = _bench()
    counts = torch.tensor([3, 0, 17, 16])
    dst, offs, cap = bl.pad_plan(counts, 36, 16)
    assert offs.dtype == torch.int32 and offs.tolist() == [16, 16, 48, 64]
    assert dst.tolist() == [0, 1, 2] + list(range(16, 33)) + list(range(48, 64))
    assert cap >= 64 and cap % 16 == 0


def test_quantize_rowwise_scales_each_row():
    bl = _bench()
    t = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0, 1.0, -896.0]])
    q, s = bl.quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and s.tolist() == pytest.approx([2 / 448, 1e-4 / 448, 896 / 448])
    assert torch.allclose(q.float() * s[:, None], t, rtol=0.07)
    w = torch.randn(5, 6, 32)
    q1, s1 = bl.quantize_rowwise(w)
    q2, s2 = bl.quantize_rowwise(w, chunk=2)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2) and s1.shape == (5, 6)


def _fp32_experts(x, probs, fc1, fc2, counts):
    I = fc2.shape[2]
    out, start = [], 0
    for g, n in enumerate(counts.tolist()):
        h = x[start:start + n] @ fc1[g].t()
        out.append((F.silu(h[:, :I]) * h[:, I:] * probs[start:start + n, None]) @ fc2[g].t())
        start += n
    return torch.cat(out)


def test_fp8_grouped_experts_forward_and_backward_match_fp32():
    """FP8GroupedExperts (padding, row-wise e4m3 operands, dgrads in e4m3, bf16 wgrads) against the
    same experts in fp32 with autograd, within e4m3's precision."""
    bl = _bench()
    gen = torch.Generator().manual_seed(0)
    G, H, I = 3, 64, 32
    counts = torch.tensor([5, 0, 21])
    M = int(counts.sum())
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
    probs = torch.rand(M, generator=gen)
    fc1 = (torch.randn(G, 2 * I, H, generator=gen) / H**0.5).to(torch.bfloat16)
    fc2 = (torch.randn(G, H, I, generator=gen) / I**0.5).to(torch.bfloat16)
    gy = torch.randn(M, H, generator=gen).to(torch.bfloat16)
    w8 = bl.quantize_expert_weights_rowwise(fc1, fc2, transposed=True)
    assert w8.fc1[1].shape == (G, 2 * I) and w8.fc1_t[0].shape == (G, H, 2 * I) and w8.fc2_t[1].shape == (G, I)
    leaves = [t.clone().requires_grad_(True) for t in (x, probs, fc1, fc2)]
    y = bl.FP8GroupedExperts.apply(*leaves, w8, counts, _emulated_ops(bl, bl.FP8_GROUP_ALIGN))
    got = torch.autograd.grad(y, leaves, gy)
    ref_leaves = [t.float().clone().requires_grad_(True) for t in (x, probs, fc1, fc2)]
    ref = _fp32_experts(*ref_leaves, counts)
    want = torch.autograd.grad(ref, ref_leaves, gy.float())
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    assert y.dtype == torch.bfloat16 and rel(y.detach(), ref.detach()) < 0.1
    for name, g, w, leaf in zip(("dx", "dprobs", "dfc1", "dfc2"), got, want, leaves):
        assert g.dtype == leaf.dtype and rel(g, w) < 0.12, (name, rel(g, w))
    assert float(got[2][1].abs().max()) == 0.0 and float(got[3][1].abs().max()) == 0.0  # expert 1 has no rows


def test_fp8_baseline_says_why_it_cannot_run():
    bl = _bench()
    assert "CUDA" in bl.fp8_grouped_mm_unsupported(torch.device("cpu"))


# ---- correctness gate reference ------------------------------------------------------------------------


def test_reference_moe_sums_local_experts_only():
    bl = _bench()
    gen = torch.Generator().manual_seed(1)
    T, H, I, E, k = 6, 16, 8, 4, 2
    x = torch.randn(T, H, generator=gen)
    top = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=gen)
    fc1 = torch.randn(E, 2 * I, H, generator=gen)
    fc2 = torch.randn(E, H, I, generator=gen)
    want = torch.zeros(T, H)
    for t in range(T):
        for s in range(k):
            e = int(top[t, s])
            h = fc1[e] @ x[t]
            want[t] += probs[t, s] * (fc2[e] @ (F.silu(h[:I]) * h[I:]))
    full = bl.reference_moe(x, top, probs, fc1, fc2)
    assert torch.allclose(full, want, atol=1e-4)
    halves = bl.reference_moe(x, top, probs, fc1[:2], fc2[:2], 0) + bl.reference_moe(x, top, probs, fc1[2:], fc2[2:], 2)
    assert torch.allclose(halves, want, atol=1e-4)  # EP=2: each rank's experts, summed
    s1, s2 = torch.randn(2 * I, H, generator=gen), torch.randn(H, I, generator=gen)
    h = x @ s1.t()
    assert torch.allclose(bl.reference_shared(x, s1, s2), (F.silu(h[:, :I]) * h[:, I:]) @ s2.t(), atol=1e-4)


def test_make_routing_draws_what_make_case_draws():
    bl = _bench()
    for routing in ("random", "skewed"):
        top = bl.make_routing("qwen3.5-397b", 16, routing, 3, torch.device("cpu"))
        _, _, again = bl._draw_routing("qwen3.5-397b", 16, routing, 3, torch.device("cpu"), 0)
        assert torch.equal(top, again) and top.shape == (16, 10)
        assert all(len(set(r.tolist())) == 10 for r in top)  # k distinct experts a token


# ---- symm_a2a helpers -----------------------------------------------------------------------------------


def test_symm_a2a_sorts_received_rows_by_expert():
    """The symm_a2a baseline's receiver: rows of each expert contiguous, in arrival order, experts in
    order, unwritten rows (sentinel ids) last; offs are the group ends for torch._grouped_mm."""
    bench = _bench()
    nle = 5
    ids = torch.tensor([3, 0, 5, 3, 1, 0, 7, 3, -1, 1], dtype=torch.float32).to(torch.bfloat16)
    perm, offs = bench.sort_rows_by_expert(ids, nle)
    assert perm.tolist() == [1, 5, 4, 9, 0, 3, 7, 2, 6, 8]
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 4, 4, 7, 7]
    # all 256 ids a bf16 column can carry exactly
    ids = torch.arange(255, -1, -1).to(torch.bfloat16)
    perm, offs = bench.sort_rows_by_expert(ids, 256)
    assert perm.tolist() == list(range(255, -1, -1)) and offs.tolist() == list(range(1, 257))


def test_busy_time_merges_overlapping_kernels():
    bl = _bench()
    # two streams overlap on [2, 3); a gap [5, 6)
    assert bl.busy_time([(0.0, 3.0), (2.0, 5.0), (6.0, 7.0)]) == (6.0, 7.0)
    assert bl.busy_time([(1.0, 2.0), (1.2, 1.5)]) == (1.0, 1.0)
    assert bl.busy_time([]) == (0.0, 0.0)


def test_kernel_table_keeps_each_launch_of_a_kernel_apart():
    """A kernel launched twice an iteration (the down and the fc1 dgrad) gets the median of its first
    and of its second launch, in launch order; its ms is the per-iteration sum; a kernel whose count
    is not a multiple of the iterations gets no per-launch times; busy/idle from the merged spans."""
    bl = _bench()
    events, t = [], 0.0
    for i, (first, second) in enumerate([(870.0, 1330.0), (880.0, 1320.0), (860.0, 1340.0)]):
        events.append(("expert_gemm_kernel", t, t + first))
        events.append(("expert_gemm_kernel", t + first, t + first + second))
        t += first + second + 100.0  # a 100 us gap
        if i < 2:
            events.append(("bwd_push_kernel", t - 100.0, t - 50.0))
    table = bl.kernel_table(list(reversed(events)), iters=3)  # the order events arrive in does not matter
    gemm, push = table["top"]
    assert gemm["name"] == "expert_gemm_kernel" and gemm["launches_ms"] == [0.87, 1.33]
    assert gemm["ms"] == pytest.approx((870 + 1330 + 880 + 1320 + 860 + 1340) / 3e3, abs=1e-4)
    assert push["name"] == "bwd_push_kernel" and "launches_ms" not in push
    assert table["busy_ms"] == pytest.approx((3 * 2200 + 2 * 50) / 3e3, abs=1e-4)
    assert table["idle_ms"] == pytest.approx((2 * 100 - 2 * 50) / 3e3, abs=1e-4)


def test_symm_a2a_backward_gathers_match_index_select_autograd():
    bl = _bench()
    gen = torch.Generator().manual_seed(0)
    T, k, H = 5, 3, 4
    flat = torch.randint(0, 7, (T * k,), generator=gen)
    order = torch.argsort(flat, stable=True)
    back_order = torch.argsort(order)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(T * k, H, generator=gen, dtype=torch.float64)
    rows = bl._GatherRows.apply(x, order // k, None, back_order, k)
    (got,) = torch.autograd.grad(rows, x, g)
    (want,) = torch.autograd.grad(x.index_select(0, order // k), x, g)
    assert torch.equal(rows, x.index_select(0, order // k))
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    perm = torch.randperm(T * k, generator=gen)
    inv = torch.empty_like(perm).index_copy_(0, perm, torch.arange(T * k))
    src = torch.randn(T * k, H, generator=gen, dtype=torch.float64, requires_grad=True)
    (got,) = torch.autograd.grad(bl._GatherRows.apply(src, perm, inv, None, 0), src, g)
    (want,) = torch.autograd.grad(src.index_select(0, perm), src, g)
    assert torch.equal(got, want)


# ---- memory hygiene ---------------------------------------------------------------------------------


def test_chunked_rowwise_quantizer_gives_the_whole_stack_bits():
    """Chunks of experts (and chunks of a transposed view) quantize to the bits of the whole
    contiguous stack, into contiguous outputs: no whole-stack transpose or concatenation needed."""
    bl = _bench()
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(5, 48, 32, generator=gen) * torch.rand(5, 48, 1, generator=gen)).to(torch.bfloat16)
    whole_q, whole_s = bl.quantize_rowwise(w.transpose(1, 2).contiguous())
    for chunk in (1, 2, 8):
        q, s = bl.quantize_rowwise(w.transpose(1, 2), chunk)
        assert q.is_contiguous() and q.shape == (5, 32, 48) and s.shape == (5, 32)
        assert torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8)) and torch.equal(s, whole_s)
    w8 = bl.quantize_expert_weights_rowwise(w, w[:, :, :16].contiguous(), transposed=True, chunk=2)
    assert torch.equal(w8.fc1_t[0].view(torch.uint8), whole_q.view(torch.uint8)) and w8.fc1_t[0].is_contiguous()
    assert torch.equal(w8.fc1[0].view(torch.uint8), bl.quantize_rowwise(w)[0].view(torch.uint8))
    x = torch.randn(7, 32, generator=gen)
    before = x.clone()
    bl.quantize_rowwise(x)
    assert torch.equal(x, before)  # an fp32 input is left as it was


def test_make_case_weights_are_the_out_of_place_draw(monkeypatch):
    """make_case divides its fp32 weight draw in place (no second fp32 copy): the same bits as
    (randn / fan**0.5).to(bf16), the formula of the earlier benchmark."""
    bl = _bench()
    monkeypatch.setitem(bl.SHAPES, "tiny", (4, 64, 32, 2))
    c = bl.make_case("tiny", 16, "random", 5, torch.device("cpu"))
    g, x, top = bl._draw_routing("tiny", 16, "random", 5, torch.device("cpu"), 0)
    torch.randn(16, 2, generator=g)  # probs
    E, H, I = 4, 64, 32
    for name, shape, fan in (("fc1", (E, 2 * I, H), H), ("fc2", (E, H, I), I), ("sfc1", (2 * I, H), H),
                             ("sfc2", (H, I), I)):
        want = (torch.randn(*shape, generator=g) / fan**0.5).to(torch.bfloat16)
        assert torch.equal(c[name].view(torch.int16), want.view(torch.int16)), name
    assert torch.equal(c["x"], x) and torch.equal(c["top"], top)


def test_allocator_setting_is_the_callers_when_given():
    bl = _bench()
    assert bl.allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert bl.allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == {}
    assert bl.allocator_env({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
    assert bl.allocator_env({"PYTORCH_CUDA_ALLOC_CONF": ""}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = bl.allocator_env({})
    assert bl.allocator_record(mine, mine) == {"variable": "PYTORCH_CUDA_ALLOC_CONF",
                                               "value": "expandable_segments:True", "set_by": "scripts/bench_layer.py"}
    assert bl.allocator_record({"PYTORCH_ALLOC_CONF": "a", "PYTORCH_CUDA_ALLOC_CONF": "b"}, {})["value"] == "a"
    assert bl.allocator_record({"PYTORCH_CUDA_ALLOC_CONF": "b"}, {})["set_by"] == "caller"
    assert bl.allocator_record({}, {})["variable"] is None
    assert "PYTORCH_CUDA_ALLOC_CONF" not in bl.ALLOC_CONF_SET_BY_BENCH  # importing the file sets nothing


def test_resident_weights_of_deepseek_v3_at_ep1():
    """The memory arithmetic of the rows: 22.5 GB of bf16 weights, as much again in gradients, and
    the e4m3 copies (half that, twice with the dgrads' transposes)."""
    bl = _bench()
    gib = 2**30
    w = bl.resident_weight_bytes("deepseek-v3", "mok", "bwd")
    routed = 256 * 3 * 7168 * 2048
    assert w["bf16_weights"] == 2 * (routed + 3 * 7168 * 2048) and round(w["bf16_weights"] / 1e9, 1) == 22.6
    assert 2 * routed == 21 * gib and w["weight_grads"] == w["bf16_weights"] and "e4m3_weights" not in w
    assert bl.resident_weight_bytes("deepseek-v3", "mok", "fwd") == {"bf16_weights": w["bf16_weights"]}
    for be in ("mok@precision=fp8", "alltoall_fp8"):
        assert bl.resident_weight_bytes("deepseek-v3", be, "bwd")["e4m3_weights"] == 21 * gib
        assert bl.resident_weight_bytes("deepseek-v3", be, "fwd")["e4m3_weights"] == 10.5 * gib
    assert bl.resident_weight_bytes("deepseek-v3", "mok@precision=fp8+fp8_dgrad=False", "bwd")["e4m3_weights"] \
        == 10.5 * gib  # bf16 dgrads: no transposed copies
    assert bl.resident_weight_bytes("deepseek-v3", "alltoall", "bwd", ep=2)["weight_grads"] \
        == 2 * (routed // 2 + 3 * 7168 * 2048)


def _fake_driver(monkeypatch, bl, make_case, fns, empty_cache=lambda: None, gib=80):
    """bench_layer's driver on the CPU: one rank without a process group, a GPU of `gib` GiB, the
    baselines `fns` (name -> backend function), timing that returns at once."""
    import types

    fake_dist = types.SimpleNamespace(barrier=lambda *a, **k: None, get_rank=lambda *a: 0, get_world_size=lambda *a: 1,
                                      is_initialized=lambda: False, all_reduce=lambda *a, **k: None,
                                      ReduceOp=types.SimpleNamespace(MAX=None, MIN=None))
    cuda = bl.torch.cuda
    monkeypatch.setattr(bl, "dist", fake_dist)
    monkeypatch.setattr(bl, "make_case", make_case)
    monkeypatch.setattr(bl, "BASELINES", {"alltoall": "bf16", "alltoall_fp8": "fp8", "symm_a2a": "bf16"})
    monkeypatch.setattr(bl, "BACKEND_FNS", fns)
    monkeypatch.setattr(bl, "time_iters", lambda step, iters, warmup: [1.0] * iters)
    monkeypatch.setattr(cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(cuda, name, lambda *a, **k: 0)
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a, **k: (gib * 2**30, gib * 2**30))
    monkeypatch.setattr(bl.traceback, "print_exc", lambda *a, **k: None)


def test_rows_whose_weights_exceed_the_gpu_say_so_before_anything_is_built(monkeypatch, tmp_path):
    """DeepSeek-V4-Pro's backward at EP=1 keeps 94.75 GiB of weights and weight gradients: on an 80
    GiB GPU no token count fits, and the row says so with the figures instead of running out of
    memory; nothing is built when no row fits. Where some rows fit (DeepSeek-V3's bf16 backward on a
    60 GiB GPU, not its fp8 one with 21 GiB of e4m3 copies more), only the others are skipped."""
    bl = _bench()
    built, ran = [], []

    def fake_case(shape, T, routing, seed, dev):
        built.append((shape, T))
        return {"E": 4, "H": 8, "I": 4, "k": 2, "Is": 4, "T": T, "nle": 4, "x": torch.zeros(4)}

    def backend(name):
        def make(c, dev):
            ran.append(name)
            return lambda: torch.zeros(8)
        return make

    fns = {be: backend(be) for be in ("alltoall", "alltoall_fp8")}
    _fake_driver(monkeypatch, bl, fake_case, fns, gib=80)
    monkeypatch.setattr(bl, "PASS", "bwd")
    args = bl.parse_args(["--shape", "deepseek-v4-pro", "--backends", "alltoall,alltoall_fp8", "--tokens", "4096",
                          "--iters", "3", "--tmp-dir", str(tmp_path), "--skip-gate", "--pass", "bwd"])
    rows = bl.run_cases(args, args.backends_list, torch.device("cpu"))
    assert built == [] and ran == [] and [r["status"] for r in rows] == ["does_not_fit"] * 2
    assert rows[0]["error"].startswith("no T fits at EP=1: resident weights 94.75 GiB > the GPU's 80.00 GiB")
    assert "e4m3_weights 47.25" in rows[1]["error"]

    _fake_driver(monkeypatch, bl, fake_case, fns, gib=60)
    args = bl.parse_args(["--shape", "deepseek-v3", "--backends", "alltoall,alltoall_fp8", "--tokens", "4096",
                          "--iters", "3", "--tmp-dir", str(tmp_path), "--skip-gate", "--pass", "bwd"])
    rows = bl.run_cases(args, args.backends_list, torch.device("cpu"))
    assert built == [("deepseek-v3", 4096)] and ran == ["alltoall"]
    assert [r["status"] for r in rows] == ["ok", "does_not_fit"] and "63.16 GiB > the GPU's 60.00" in rows[1]["error"]


def test_every_row_starts_clean_and_a_failed_row_leaves_nothing(monkeypatch, tmp_path):
    """The driver on the CPU with fake backends: a row that fails (its frame holding a tensor), a row
    that keeps a tensor in its step closure, then a row that checks both are gone before it starts;
    the allocator cache is emptied between rows and between token counts, and a token count's
    inputs are built only once the previous one's are freed."""
    import weakref

    bl = _bench()
    events, held = [], {}
    ok = [True]

    def alive(name):
        return name in held and held[name]() is not None

    def fake_case(shape, T, routing, seed, dev):
        ok[0] &= not alive(f"x{T // 2}")  # the previous token count's inputs are gone
        events.append(f"case T={T}")
        x = torch.zeros(4)
        held[f"x{T}"] = weakref.ref(x)
        return {"E": 4, "H": 8, "I": 4, "k": 2, "Is": 4, "T": T, "nle": 4, "x": x}

    def failing(c, dev):
        events.append("failing")
        big = torch.zeros(1000)  # held by this frame, i.e. by the exception's traceback
        held["failing"] = weakref.ref(big)
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    def keeping(c, dev):
        ok[0] &= not alive("failing")
        events.append("keeping")
        kept = torch.ones(1000)
        held["keeping"] = weakref.ref(kept)
        return lambda: kept[:8].clone()

    def checking(c, dev):
        ok[0] &= not alive("failing") and not alive("keeping")
        events.append("checking")
        return lambda: torch.zeros(8)

    _fake_driver(monkeypatch, bl, fake_case, {"alltoall_fp8": failing, "alltoall": keeping, "symm_a2a": checking},
                 lambda: events.append("empty_cache"))
    monkeypatch.setattr(bl, "PASS", "fwd")
    args = bl.parse_args(["--backends", "alltoall_fp8,alltoall,symm_a2a", "--tokens", "16,32", "--iters", "3",
                          "--tmp-dir", str(tmp_path), "--skip-gate"])
    rows = bl.run_cases(args, args.backends_list, torch.device("cpu"))
    assert ok[0], events
    assert [(r["tokens"], r["backend"], r["status"]) for r in rows] == [
        (T, be, st) for T in (16, 32) for be, st in (("alltoall_fp8", "error"), ("alltoall", "ok"), ("symm_a2a", "ok"))]
    assert "OutOfMemoryError" in rows[0]["error"] and rows[1]["memory_at_start"]["free"] == 80 * 2**30
    # the cache is emptied after every row, and before a token count's inputs are built
    for i, e in enumerate(events):
        if e in ("failing", "keeping", "checking") and events[i - 1] not in ("case T=16", "case T=32"):
            assert events[i - 1] == "empty_cache", events
        if e.startswith("case"):
            assert events[i - 1] == "empty_cache", events
    assert not any(alive(k) for k in held)
