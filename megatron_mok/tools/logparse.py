"""Parse Megatron training logs (stdout/stderr of all ranks, in any order) into numbers.

Used by scripts/compare_backends.py and the Slurm tests; no torch or Megatron import.

What it understands (Megatron-Core 0.19 wording; srun ``--label`` prefixes such as ``3: `` are fine):

* the arguments dump of rank 0 (``  seq_length ........ 4096``),
* the iteration lines of the last rank::

    [2026-11-29 20:01:02] iteration        3/      20 | consumed samples: 24 |
    elapsed time per iteration (ms): 1234.5 | ... | global batch size:     8 | lm loss: 1.0E+01 | ...

* ``successfully loaded checkpoint from DIR [ ... ] at iteration N`` and
  ``successfully saved checkpoint from iteration N to DIR``,
* Megatron's GPU memory report ``[Rank 0] (after 2 iterations) memory (MB) | allocated: ...``,
* the ``[mok-stats]`` line that scripts/slurm/rank_stats.py prints at exit of every rank,
* Python errors (the last ``SomethingError: message`` line), and a missing ``deep_ep``.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable

__all__ = [
    "IterationRecord",
    "RankStats",
    "RunLog",
    "parse_log",
    "parse_log_file",
    "summarize",
    "unavailable_reason",
]

_ITER_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_TIME_RE = re.compile(r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?)\]\s*iteration\b")
_ARGS_BEGIN_RE = re.compile(r"-{8,} arguments -{8,}")
_ARGS_END_RE = re.compile(r"-{8,} end of arguments -{8,}")
_ARG_LINE_RE = re.compile(r"^\s*(?:\d+:\s*)?\s+([A-Za-z_][\w]*) \.{2,} (.*?)\s*$")
_LOADED_RE = re.compile(r"successfully loaded checkpoint from (\S+).*?at iteration (\d+)")
_SAVED_RE = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) to (\S+)")
_NO_CKPT_RE = re.compile(r"will not load any checkpoints and will start from random")
_MEM_RE = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
    r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)"
)
_STATS_RE = re.compile(r"\[mok-stats\]((?:\s+\w+=\S+)+)")
_DIGEST_RE = re.compile(r"\[megatron_mok\] param-digest rank=(\d+) iteration=(\d+) value=([0-9a-f]+)")
_ERROR_RE = re.compile(
    r"^(?:\d+:\s*)?(?:\[[^\]]*\]:?\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)):\s*(.*)$"
)
_DEEP_EP_RE = re.compile(r"deep_ep|deep-ep|DeepEP", re.IGNORECASE)
_UNAVAILABLE_RE = re.compile(
    r"No module named|ModuleNotFoundError|ImportError|not installed|is not available|"
    r"requires? (?:the )?\S+ package|needs (?:the )?\S+ package|Found no NVIDIA driver|"
    r"CUDA is not available|Torch not compiled with CUDA",
    re.IGNORECASE,
)
_NUM_RE = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?(?:nan|inf)$", re.IGNORECASE)


def _num(s: str):
    s = s.strip()
    if _NUM_RE.match(s):
        v = float(s)
        if v.is_integer() and re.fullmatch(r"[-+]?\d+", s):
            return int(s)
        return v
    return None


@dataclass
class IterationRecord:
    iteration: int
    train_iters: int
    fields: dict  # every "key: number" of the line, e.g. {"lm loss": 10.2, "global batch size": 8}
    time: float | None = None  # the line's "[YYYY-MM-DD HH:MM:SS.ffffff]" stamp (local time), epoch seconds

    @property
    def step_ms(self):
        return self.fields.get("elapsed time per iteration (ms)")

    @property
    def lm_loss(self):
        return self.fields.get("lm loss")

    @property
    def global_batch_size(self):
        return self.fields.get("global batch size")


@dataclass
class RankStats:
    rank: str
    host: str | None
    exit: str | None
    peak_rss_mib: float | None
    cuda_max_allocated_mib: float | None
    cuda_max_reserved_mib: float | None


@dataclass
class RunLog:
    iterations: list = field(default_factory=list)  # IterationRecord, in log order (may repeat after a resume)
    args: dict = field(default_factory=dict)  # Megatron arguments dump, values as strings
    loaded_iterations: list = field(default_factory=list)  # "successfully loaded checkpoint ... at iteration N"
    saved_iterations: list = field(default_factory=list)
    started_from_scratch: bool = False
    memory_reports: list = field(default_factory=list)  # dicts from Megatron's report_memory
    rank_stats: list = field(default_factory=list)  # RankStats
    errors: list = field(default_factory=list)  # "XError: message" lines, in order
    deep_ep_lines: list = field(default_factory=list)
    param_digests: dict = field(default_factory=dict)  # iteration -> {rank: hex} (--mok-param-digest-every)

    # -- convenience -------------------------------------------------------------------------
    def arg(self, name: str, cast=None, default=None):
        v = self.args.get(name)
        if v is None or v == "None":
            return default
        if cast is None:
            return v
        try:
            return cast(v)
        except (TypeError, ValueError):
            return default

    def unique_iterations(self) -> list:
        """One record per iteration number (the last one logged wins), sorted."""
        by_it = {}
        for r in self.iterations:
            by_it[r.iteration] = r
        return [by_it[k] for k in sorted(by_it)]

    def loss_curve(self) -> list:
        return [(r.iteration, r.lm_loss) for r in self.unique_iterations() if r.lm_loss is not None]

    @property
    def last_iteration(self):
        return max((r.iteration for r in self.iterations), default=None)


def parse_log(text: str | Iterable[str]) -> RunLog:
    lines = text.splitlines() if isinstance(text, str) else [ln.rstrip("\n") for ln in text]
    log = RunLog()
    in_args = False
    for line in lines:
        if in_args:
            if _ARGS_END_RE.search(line):
                in_args = False
                continue
            m = _ARG_LINE_RE.match(line)
            if m:
                log.args[m.group(1)] = m.group(2)
                continue
        if _ARGS_BEGIN_RE.search(line):
            in_args = True
            continue
        m = _ITER_RE.search(line)
        if m and "|" in m.group(3):
            fields = {}
            for part in m.group(3).split("|"):
                if ":" not in part:
                    continue
                k, _, v = part.rpartition(":")
                val = _num(v)
                if val is not None:
                    fields[k.strip()] = val
            t = _TIME_RE.search(line)
            stamp = datetime.fromisoformat(t.group(1)).timestamp() if t else None
            log.iterations.append(IterationRecord(int(m.group(1)), int(m.group(2)), fields, stamp))
            continue
        m = _LOADED_RE.search(line)
        if m:
            log.loaded_iterations.append(int(m.group(2)))
            continue
        m = _SAVED_RE.search(line)
        if m:
            log.saved_iterations.append(int(m.group(1)))
            continue
        if _NO_CKPT_RE.search(line):
            log.started_from_scratch = True
            continue
        m = _MEM_RE.search(line)
        if m:
            log.memory_reports.append(
                {
                    "rank": int(m.group(1)),
                    "after_iterations": int(m.group(2)),
                    "allocated_mib": float(m.group(3)),
                    "max_allocated_mib": float(m.group(4)),
                    "reserved_mib": float(m.group(5)),
                    "max_reserved_mib": float(m.group(6)),
                }
            )
            continue
        m = _DIGEST_RE.search(line)
        if m:
            log.param_digests.setdefault(int(m.group(2)), {})[int(m.group(1))] = m.group(3)
            continue
        m = _STATS_RE.search(line)
        if m:
            kv = dict(p.split("=", 1) for p in m.group(1).split())

            def f(key):
                v = kv.get(key)
                try:
                    return None if v in (None, "NA") else float(v)
                except ValueError:
                    return None

            log.rank_stats.append(
                RankStats(
                    rank=kv.get("rank", "?"),
                    host=kv.get("host"),
                    exit=kv.get("exit"),
                    peak_rss_mib=f("peak_rss_mib"),
                    cuda_max_allocated_mib=f("cuda_max_allocated_mib"),
                    cuda_max_reserved_mib=f("cuda_max_reserved_mib"),
                )
            )
            continue
        if _DEEP_EP_RE.search(line) and _UNAVAILABLE_RE.search(line):
            log.deep_ep_lines.append(line.strip())
        m = _ERROR_RE.match(line.strip())
        if m and not line.lstrip().startswith(("warnings.warn", "File ")):
            log.errors.append(f"{m.group(1)}: {m.group(2)}".strip())
    return log


def parse_log_file(path) -> RunLog:
    with open(path, errors="replace") as fh:
        return parse_log(fh.read())


def unavailable_reason(log: RunLog) -> str | None:
    """Why a backend could not run at all (missing deep_ep, missing CUDA, ...), else None.

    Only a run that never logged an iteration counts as unavailable; the reason is the error
    line that names the missing piece.
    """
    if log.iterations:
        return None
    if log.deep_ep_lines:
        return _strip_label(log.deep_ep_lines[-1])
    for e in reversed(log.errors):
        if _UNAVAILABLE_RE.search(e):
            return e
    return None


def _strip_label(line: str) -> str:
    return re.sub(r"^\d+:\s*", "", line)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarize(
    log: RunLog,
    warmup: int = 2,
    world_size: int | None = None,
    global_batch_size: int | None = None,
    seq_length: int | None = None,
) -> dict:
    """Numbers of one run.

    tokens_per_s_per_gpu = global_batch_size * seq_length / step_time / world_size, with the
    median logged step time of the iterations after the first ``warmup`` logged ones (of the
    unique iteration numbers; if too few were logged, the last one is used and
    ``warmup_excluded`` says how many were dropped).
    """
    its = log.unique_iterations()
    world = world_size or log.arg("world_size", int)
    if world is None and log.rank_stats:
        world = len({s.rank for s in log.rank_stats})
    seq = seq_length or log.arg("seq_length", int)
    gbs = global_batch_size or log.arg("global_batch_size", int)
    if gbs is None and its and its[-1].global_batch_size:
        gbs = int(its[-1].global_batch_size)

    timed = [r for r in its if _finite(r.step_ms)]
    drop = min(warmup, max(len(timed) - 1, 0))
    steady = timed[drop:]
    step_ms = [float(r.step_ms) for r in steady]
    med = statistics.median(step_ms) if step_ms else None
    mean = statistics.fmean(step_ms) if step_ms else None
    tps = None
    if med and gbs and seq and world:
        tps = gbs * seq / (med / 1000.0) / world
    losses = log.loss_curve()
    tflops = [r.fields.get("throughput per GPU (TFLOP/s/GPU)") for r in steady]
    tflops = [t for t in tflops if _finite(t)]

    rss = [s.peak_rss_mib for s in log.rank_stats if s.peak_rss_mib is not None]
    cuda = [s.cuda_max_allocated_mib for s in log.rank_stats if s.cuda_max_allocated_mib is not None]
    meg_mem = [m["max_allocated_mib"] for m in log.memory_reports if m["max_allocated_mib"] > 0]  # 0 on CPU
    if cuda:
        peak, peak_src = max(cuda), "torch.cuda.max_memory_allocated (all ranks, at exit)"
    elif meg_mem:
        peak, peak_src = max(meg_mem), "Megatron memory report: max allocated"
    elif rss:
        peak, peak_src = max(rss), "max RSS per rank (getrusage)"
    else:
        peak, peak_src = None, None

    return {
        "iterations_logged": len(its),
        "first_iteration": its[0].iteration if its else None,
        "last_iteration": its[-1].iteration if its else None,
        "train_iters": its[-1].train_iters if its else log.arg("train_iters", int),
        "warmup_excluded": drop,
        "world_size": world,
        "global_batch_size": gbs,
        "seq_length": seq,
        "median_step_ms": med,
        "mean_step_ms": mean,
        "step_ms": step_ms,
        "tokens_per_s_per_gpu": tps,
        "tflops_per_gpu_median": statistics.median(tflops) if tflops else None,
        "loss_curve": [[i, l] for i, l in losses],
        "final_loss": losses[-1][1] if losses else None,
        "loss_finite": bool(losses) and all(_finite(l) for _, l in losses),
        "peak_memory_mib": peak,
        "peak_memory_source": peak_src,
        "peak_rss_mib_per_rank": {s.rank: s.peak_rss_mib for s in log.rank_stats},
        "cuda_max_allocated_mib_per_rank": (
            {s.rank: s.cuda_max_allocated_mib for s in log.rank_stats} if cuda else None
        ),
        "param_digests": {str(it): {str(r): v for r, v in sorted(d.items())}
                          for it, d in sorted(log.param_digests.items())},
        "loaded_iterations": list(log.loaded_iterations),
        "saved_iterations": list(log.saved_iterations),
    }
