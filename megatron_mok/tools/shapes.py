"""The MoE layer shapes of the shipped model recipes (DESIGN.md; one shared expert each)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    hidden: int
    ffn: int  # routed and shared expert intermediate size I
    topk: int

    def forward_flops(self, tokens: int) -> int:
        """FLOPs of one layer forward on ``tokens`` tokens: routed pairs plus the shared expert."""
        return 6 * tokens * (self.topk + 1) * self.hidden * self.ffn


MOE_SHAPES = {
    s.name: s
    for s in (
        MoEShape("deepseek-v3", 256, 7168, 2048, 8),
        MoEShape("kimi-k2", 384, 7168, 2048, 8),
        MoEShape("glm-5", 256, 6144, 2048, 8),
        MoEShape("qwen3.5-397b", 512, 4096, 1024, 10),
        MoEShape("deepseek-v4-pro", 384, 7168, 3072, 6),
    )
}

# The MoE layer of the one-GPU training proxy (configs/deepseek-v3-1gpu.args): DeepSeek-V3's expert
# shape with 16 experts, so a micro-batch of T=2048 tokens routes ~1024 rows to an expert, as there.
# bench_layer.py measures it by name; it is not a model of its own (no recipe triple).
PROXY_SHAPES = {s.name: s for s in (MoEShape("deepseek-v3-1gpu", 16, 7168, 2048, 8),)}
