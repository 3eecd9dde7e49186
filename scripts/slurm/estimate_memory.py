#!/usr/bin/env python3
"""Back-of-the-envelope GPU memory per pipeline rank for a Megatron MoE config (no torch needed).

    python scripts/slurm/estimate_memory.py configs/deepseek-v3.args --nodes 128 --gpus-per-node 8
    python scripts/slurm/estimate_memory.py configs/deepseek-v3.args --nodes 32 \
        --set pipeline-model-parallel-size=8 expert-model-parallel-size=32 --set-layout 'Et*3|(tt|)*14tm|L'

What it counts, per GPU (every pipeline rank; the worst one decides):
  parameters (bf16, 2 B), gradients (fp32 main_grad, 4 B), optimizer states (Adam: fp32 master +
  m + v = 12 B; SGD: 4 B, +4 B with momentum) sharded over the data-parallel ranks with
  --use-distributed-optimizer (DP for dense parameters, expert-DP for routed experts);
  activations of the micro-batches in flight under Megatron's 1F1B / interleaved schedule
  (warm-up depth (pp-r-1)*2 + (vpp-1)*pp + 1 forward chunks on pipeline rank r), with the
  --recompute-modules taken into account; the mok workspace (its routed-row buffer is sized by
  --mok-capacity-factor x the worst case); a fixed allowance for the CUDA context, NCCL and the
  allocator (--overhead-gib).
Activation terms (bf16 unless noted, T = seq_length * micro_batch_size / TP tokens, R = T * topk
routed rows, balanced routing):
  every layer: layer input T*h; LN output T*h (unless 'layernorm' recompute); hidden-dropout
  masks 2*T*h bytes when --hidden-dropout > 0 (Megatron's default is 0.1)
  MLA: compressed q/kv and their normed copies T*(2*ql + 2*kvl + rope); Q,K,V T*n*(2*(dq+dr)+dv)
  (0 with 'mla_up_proj' recompute); attention output T*n*dv and the fp32 LSE T*n*4 B
  dense MLP: fc1 output T*2F and SwiGLU output T*F (0 with 'mlp' recompute)
  MoE: router fp32 logits/scores/probs + map T*E*13 B; shared expert T*3*Is (0 with
  'shared_experts'); routed, Megatron dispatchers (alltoall, flex/hybridep): dispatched rows R*h,
  fc1 output R*2I, SwiGLU output R*I (0 with 'moe_act'); routed, --moe-backend mok: its forward
  context, the gate/up outputs h [cap, 2I] only (none with --mok-recompute-gate-up; the rows are
  dispatched again, SwiGLU and the router-weight gradient come from the down dgrad's epilogue;
  docs/DESIGN.md), with cap = the routed-row capacity (--mok-capacity-factor x
  EP*T*min(topk, local experts) + 31 rows a local expert, rounded up to 128:
  megatron_mok.config.routed_capacity), and its fused
  shared expert's gate/up outputs T*2Is;
  everything but the layer input is 0 with 'moe' recompute
  mok workspace (once per rank): symmetric x [T, h] and combine [T*topk, h] buffers
  output layer: fp32 softmax of the cross entropy T*V*4 B per loss head (main + MTP)
The numbers are estimates (the real allocator adds fragmentation; routing imbalance adds rows).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron_mok.config import MoKConfig, routed_capacity  # noqa: E402

GIB = 2**30


def read_args(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        out.extend(line.split("#", 1)[0].split())
    return out


def args_to_dict(words: list[str]) -> dict:
    """--flag v1 v2 -> {'flag': ['v1','v2']}, --flag -> {'flag': []}. Later flags win."""
    d, key = {}, None
    for w in words:
        if w.startswith("--"):
            key = w[2:].replace("_", "-")
            if "=" in key:
                key, v = key.split("=", 1)
                d[key] = [v]
                key = None
            else:
                d[key] = []
        elif key is not None:
            d[key].append(w)
    return d


def expand_layout(layout: str) -> list[str]:
    """Megatron --pipeline-model-parallel-layout, e.g. 'Et*3|(tt|)*29m|L' -> one string per stage."""
    s = layout.replace(" ", "")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while group.search(s):
        s = group.sub(lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"([A-Za-z])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    return s.split("|")


def moe_pattern(freq: str | None, num_layers: int) -> list[int]:
    if freq is None:
        return [1] * num_layers
    f = freq.strip()
    if re.fullmatch(r"\d+", f):
        n = int(f)
        return [1 if i % n == 0 else 0 for i in range(num_layers)]
    if not re.fullmatch(r"[\[\]\d\s,*+()]+", f):
        raise SystemExit(f"cannot read --moe-layer-freq {freq!r}")
    pat = eval(f, {"__builtins__": {}}, {})  # only digits, brackets, * and + (checked above)
    if len(pat) != num_layers:
        raise SystemExit(f"--moe-layer-freq has {len(pat)} entries but --num-layers is {num_layers}")
    return list(pat)


class Model:
    def __init__(self, a: dict, vocab: int | None):
        g = lambda k, d=None, t=int: t(a[k][0]) if k in a and a[k] else d  # noqa: E731
        self.a = a
        self.L = g("num-layers")
        self.h = g("hidden-size")
        self.F = g("ffn-hidden-size", 4 * self.h)
        self.n = g("num-attention-heads")
        self.mla = "multi-latent-attention" in a
        self.ql = g("q-lora-rank", 0) or 0
        self.kvl = g("kv-lora-rank", 512)
        self.dq = g("qk-head-dim", 128)
        self.dr = g("qk-pos-emb-head-dim", 64)
        self.dv = g("v-head-dim", 128)
        self.kvc = g("kv-channels", self.h // self.n)
        self.groups = g("num-query-groups", self.n) if "group-query-attention" in a else self.n
        self.E = g("num-experts", 0) or 0
        self.I = g("moe-ffn-hidden-size", self.F)
        self.Is = g("moe-shared-expert-intermediate-size", 0) or 0
        self.k = g("moe-router-topk", 2)
        self.mtp = g("mtp-num-layers", 0) or 0
        self.swiglu = "swiglu" in a
        self.untied = "untie-embeddings-and-output-weights" in a
        self.qk_ln = "qk-layernorm" in a
        self.V = vocab or g("padded-vocab-size") or g("vocab-size") or 129280
        self.seq = g("seq-length")
        self.mbs = g("micro-batch-size", 1)
        self.gbs = g("global-batch-size")
        self.tp = g("tensor-model-parallel-size", 1)
        self.pp = g("pipeline-model-parallel-size", 1)
        self.ep = g("expert-model-parallel-size", 1)
        self.etp = g("expert-tensor-parallel-size", self.tp)
        self.dist_opt = "use-distributed-optimizer" in a
        self.optimizer = g("optimizer", "adam", str)
        self.momentum = g("sgd-momentum", 0.9, float)
        self.hidden_dropout = g("hidden-dropout", 0.1, float)
        self.recompute = set(a.get("recompute-modules", [])) if "recompute-granularity" in a else set()
        self.full_recompute = g("recompute-granularity", None, str) == "full"
        if g("recompute-granularity", None, str) == "selective" and not a.get("recompute-modules"):
            self.recompute = {"core_attn"}
        self.pattern = moe_pattern(g("moe-layer-freq", None, str), self.L) if self.E else [0] * self.L
        layout = g("pipeline-model-parallel-layout", None, str)
        if layout:
            self.stages = expand_layout(layout)
        else:
            per = self.L // self.pp
            self.stages = ["E" * (i == 0) + "t" * per + ("m" * self.mtp + "L") * (i == self.pp - 1)
                           for i in range(self.pp)]
        n_t = sum(s.count("t") for s in self.stages)
        if n_t != self.L:
            raise SystemExit(f"the pipeline layout has {n_t} transformer layers, --num-layers is {self.L}")
        if len(self.stages) % self.pp:
            raise SystemExit(f"{len(self.stages)} pipeline stages do not divide over PP={self.pp}")
        self.vpp = len(self.stages) // self.pp

    # ---------------------------------------------------------------- parameters (dense, expert)
    def attn_params(self):
        h, n = self.h, self.n
        if self.mla:
            q = h * self.ql + self.ql * n * (self.dq + self.dr) if self.ql else h * n * (self.dq + self.dr)
            kv = h * (self.kvl + self.dr) + self.kvl * n * (self.dq + self.dv)
            o = n * self.dv * h
            ln = (self.ql + self.kvl) if self.qk_ln else 0
            return q + kv + o + ln + h
        d = self.kvc
        return h * n * d + 2 * h * self.groups * d + n * d * h + h

    def mlp_params(self, ffn):
        return (3 if self.swiglu else 2) * self.h * ffn

    def layer_params(self, moe: bool):
        """(dense, expert) parameter counts of one transformer layer (whole model, unsharded)."""
        dense = self.attn_params() + self.h  # + pre-MLP norm
        if not moe:
            return dense + self.mlp_params(self.F), 0
        dense += self.E * self.h + self.E  # router + expert bias
        dense += self.mlp_params(self.Is) if self.Is else 0
        return dense, self.E * self.mlp_params(self.I)

    def stage_params(self, stage: str, first_layer: int):
        """(dense, expert) params held by one rank for one pipeline stage (after TP/EP sharding)."""
        dense = expert = 0
        li = first_layer
        for c in stage:
            if c == "E":
                dense += self.V * self.h / self.tp
            elif c == "t":
                d, e = self.layer_params(bool(self.pattern[li]))
                dense += d / self.tp
                expert += e / (self.ep * self.etp)
                li += 1
            elif c == "m":
                d, e = self.layer_params(bool(self.pattern[-1]))
                dense += (d + 2 * self.h * self.h + 3 * self.h) / self.tp
                expert += e / (self.ep * self.etp)
                if "E" not in stage:  # Megatron builds the embedding on the MTP stage too
                    dense += self.V * self.h / self.tp
            elif c == "L":
                dense += (self.V * self.h if self.untied else 0) / self.tp + self.h
        return dense, expert

    def total_params(self):
        d = e = 0
        for i in range(self.L):
            dd, ee = self.layer_params(bool(self.pattern[i]))
            d, e = d + dd, e + ee
        d += self.V * self.h * (2 if self.untied else 1) + self.h
        mtp_d, mtp_e = self.layer_params(bool(self.pattern[-1]))
        return d + e, self.mtp * (mtp_d + mtp_e + 2 * self.h * self.h + 3 * self.h)

    # ---------------------------------------------------------------- activations (bytes / micro-batch)
    def act_layer(self, moe: bool) -> float:
        T = self.seq * self.mbs / self.tp
        h, rc = self.h, self.recompute
        if self.full_recompute:
            return T * h * 2
        b = T * h * 2 * 2  # attention input + MLP/MoE input (the residual stream, kept for the LN backward)
        if "layernorm" not in rc:
            b += 2 * T * h * 2
        if self.hidden_dropout > 0:
            b += 2 * T * h  # 1-byte masks
        n = self.n / self.tp
        if self.mla:
            b += T * (2 * self.ql + 2 * self.kvl + self.dr) * 2
            if "mla_up_proj" not in rc:
                b += T * n * (2 * (self.dq + self.dr) + self.dv) * 2
            b += T * n * self.dv * 2 + T * n * 4
        else:
            d = self.kvc
            b += T * (n * d + 2 * self.groups / self.tp * d) * 2 + T * n * d * 2 + T * n * 4
        if not moe:
            if "mlp" not in rc:
                f = self.F / self.tp
                b += T * (2 * f + f) * 2 if self.swiglu else T * f * 2 * 2
            return b
        if "moe" in rc:
            return b
        b += T * self.E * 13
        mok = self.backend == "mok"
        fused_shared = mok and self.tp == 1  # the mok layer runs the shared expert itself at TP 1
        if self.Is and fused_shared:
            b += T * (2 * self.Is if self.save_gate_up else 0) * 2
        elif self.Is and "shared_experts" not in rc:
            b += T * 3 * self.Is / self.tp * 2
        if mok:
            b += self.mok_capacity() * (2 * self.I if self.save_gate_up else 0) * 2
            return b
        R = T * self.k
        b += R * h * 2 + R * 2 * self.I / self.etp * 2
        if "moe_act" not in rc:
            b += R * self.I / self.etp * 2
        return b

    def mok_capacity(self) -> int:
        T = self.seq * self.mbs // self.tp
        return routed_capacity(MoKConfig(capacity_factor=self.capacity_factor), self.ep, T, self.k, self.E // self.ep)

    def act_stage(self, stage: str, first_layer: int) -> float:
        T = self.seq * self.mbs / self.tp
        b, li = 0.0, first_layer
        for c in stage:
            if c == "t":
                b += self.act_layer(bool(self.pattern[li]))
                li += 1
            elif c == "m":
                b += self.act_layer(bool(self.pattern[-1])) + T * 2 * self.h * 2
            elif c == "L":
                heads = 1 + self.mtp
                b += heads * (T * self.V / self.tp * 4 + T * self.h * 2)
        return b


def estimate(m: Model, world: int, overhead_gib: float):
    if world % (m.tp * m.pp):
        raise SystemExit(f"world size {world} is not a multiple of TP*PP = {m.tp * m.pp}")
    if world % (m.etp * m.ep * m.pp):
        raise SystemExit(f"world size {world} is not a multiple of ETP*EP*PP = {m.etp * m.ep * m.pp}")
    dp = world // (m.tp * m.pp)
    edp = world // (m.etp * m.ep * m.pp)
    nmb = m.gbs // (m.mbs * dp) if m.gbs else 8 * m.pp
    if m.optimizer == "sgd":
        opt_b = 4 + (4 if m.momentum else 0)
    else:
        opt_b = 12
    # first decoder layer of every stage
    firsts, li = [], 0
    for s in m.stages:
        firsts.append(li)
        li += s.count("t")
    rows = []
    for r in range(m.pp):
        my = [v * m.pp + r for v in range(m.vpp)]
        dense = sum(m.stage_params(m.stages[s], firsts[s])[0] for s in my)
        expert = sum(m.stage_params(m.stages[s], firsts[s])[1] for s in my)
        param_b = 2 * (dense + expert)
        grad_b = 4 * (dense + expert)
        o_dense = opt_b * dense / (dp if m.dist_opt else 1)
        o_exp = opt_b * expert / (edp if m.dist_opt else 1)
        chunk_act = [m.act_stage(m.stages[s], firsts[s]) for s in my]
        if m.vpp > 1:
            warm = min(nmb * m.vpp, (m.pp - r - 1) * 2 + (m.vpp - 1) * m.pp)
            inflight = [(k // m.pp) % m.vpp for k in range(min(warm + 1, nmb * m.vpp))]
        else:
            inflight = [0] * min(nmb, m.pp - r)
        act = sum(chunk_act[c] for c in inflight)
        # transient backward working set: the biggest layer's activations without recompute (what a
        # recomputed layer re-materialises during its backward)
        saved = m.recompute, m.full_recompute
        m.recompute, m.full_recompute = set(), False
        layers = [m.act_layer(bool(p)) for p in m.pattern]
        m.recompute, m.full_recompute = saved
        act += max(layers) if layers else 0
        ws = 0.0
        if m.E and m.backend == "mok":  # symmetric x and combine buffers, shared by all layers
            T = m.seq * m.mbs / m.tp
            ws = (T + T * m.k) * m.h * 2
        total = param_b + grad_b + o_dense + o_exp + act + ws + overhead_gib * GIB
        rows.append(dict(rank=r, stages=[m.stages[s] for s in my], dense=dense, expert=expert, params=param_b,
                         grads=grad_b, opt=o_dense + o_exp, act=act, inflight=len(inflight), ws=ws, total=total))
    return dp, edp, nmb, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("config")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--set", nargs="+", default=[], metavar="FLAG=VALUE",
                   help="override config flags, e.g. pipeline-model-parallel-size=8 "
                        "recompute-modules='mla_up_proj layernorm moe_act'")
    p.add_argument("--set-layout", default=None, help="override --pipeline-model-parallel-layout")
    p.add_argument("--vocab", type=int, default=None, help="padded vocabulary (default: from the config, else 129280)")
    p.add_argument("--moe-backend", default=None, help="mok | alltoall | hybridep ... (default: the config's, else alltoall)")
    p.add_argument("--mok-capacity-factor", type=float, default=None,
                   help="size of mok's routed-row buffer as a fraction of the worst case (default: from the "
                        "config's --mok-capacity-factor, else 1.0)")
    p.add_argument("--mok-recompute-gate-up", action="store_true",
                   help="mok keeps no gate/up outputs for the backward (also read from the config)")
    p.add_argument("--overhead-gib", type=float, default=5.0,
                   help="CUDA context + NCCL + allocator slack (default %(default)s)")
    p.add_argument("--gpu-gib", type=float, default=139.8, help="usable memory of one GPU (H200: 139.8 GiB)")
    a = p.parse_args(argv)
    words = read_args(Path(a.config))
    for s in a.set:
        k, _, v = s.partition("=")
        words += [f"--{k}", *v.split()]
    if a.set_layout:
        words += ["--pipeline-model-parallel-layout", a.set_layout]
    d = args_to_dict(words)
    m = Model(d, a.vocab)
    m.backend = a.moe_backend or (d["moe-backend"][0] if d.get("moe-backend") else "alltoall")
    cf = a.mok_capacity_factor
    if cf is None:
        cf = float(d["mok-capacity-factor"][0]) if d.get("mok-capacity-factor") else 1.0
    m.capacity_factor = cf
    m.save_gate_up = not (a.mok_recompute_gate_up or "mok-recompute-gate-up" in d)
    world = a.nodes * a.gpus_per_node
    dp, edp, nmb, rows = estimate(m, world, a.overhead_gib)
    tot, mtp = m.total_params()
    print(f"{Path(a.config).name}: {tot / 1e9:.1f}B parameters (+{mtp / 1e9:.1f}B MTP), "
          f"{a.nodes} nodes x {a.gpus_per_node} GPUs = {world}")
    print(f"TP{m.tp} PP{m.pp} VPP{m.vpp} EP{m.ep} ETP{m.etp} -> DP {dp}, expert-DP {edp}; "
          f"{m.E // max(m.ep, 1) if m.E else 0} experts per rank per MoE layer; "
          f"{nmb} micro-batches of {m.mbs} x {m.seq} tokens per step")
    print(f"recompute: {'full' if m.full_recompute else ' '.join(sorted(m.recompute)) or 'none'}; "
          f"hidden dropout {m.hidden_dropout}; optimizer {m.optimizer}, distributed optimizer "
          f"{'on' if m.dist_opt else 'off'}; --moe-backend {m.backend}"
          + (f", capacity factor {cf} = {m.mok_capacity()} routed rows per rank "
             f"({m.mok_capacity() / (m.seq * m.mbs / m.tp * m.k):.2f}x the balanced load), gate/up outputs "
             f"{'kept' if m.save_gate_up else 'recomputed'}" if m.backend == "mok" else ""))
    per_layer = {kind: m.act_layer(kind == "moe") / GIB for kind in ("dense", "moe")}
    print(f"activations per micro-batch: dense layer {per_layer['dense']:.2f} GiB, MoE layer {per_layer['moe']:.2f} GiB")
    hdr = (f"{'rank':>4} {'stages':<22} {'dense P':>8} {'expert P':>8} {'params':>7} {'grads':>7} {'optim':>7} "
           f"{'mb':>3} {'activ.':>7} {'mok ws':>7} {'total':>7}  GiB")
    print(hdr)
    for r in rows:
        st = "+".join(r["stages"])
        st = st if len(st) <= 22 else st[:19] + "..."
        print(f"{r['rank']:>4} {st:<22} {r['dense'] / 1e9:>7.2f}B {r['expert'] / 1e9:>7.2f}B "
              f"{r['params'] / GIB:>7.1f} {r['grads'] / GIB:>7.1f} {r['opt'] / GIB:>7.1f} {r['inflight']:>3} "
              f"{r['act'] / GIB:>7.1f} {r['ws'] / GIB:>7.1f} {r['total'] / GIB:>7.1f}")
    worst = max(rows, key=lambda r: r["total"])
    verdict = "fits" if worst["total"] / GIB <= a.gpu_gib else "does NOT fit"
    print(f"worst rank {worst['rank']}: {worst['total'] / GIB:.1f} GiB (incl. {a.overhead_gib:g} GiB overhead) -> "
          f"{verdict} in {a.gpu_gib:g} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
