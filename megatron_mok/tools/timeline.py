"""Where the forward megakernel's time goes: a summary of its per-task timeline.

``ops.megakernel_timeline(records)`` makes the megakernel stamp every task (a GEMM tile, or a pair
of tiles on a 2-CTA cluster) with %globaltimer: claimed by the producer, dependencies met, first
shared-memory stage full at the consumers, epilogue done; plus the SM, kind, m-unit and n-tile. The
last ``DISPATCH_RECORDS`` rows hold the dispatching CTAs' start and end. ``summarize`` turns one
launch's records into per-kind tile times and a split of the SMs' time into busy, waiting between
tiles, before the first tile and after the last.
"""

from __future__ import annotations

import torch

FIELDS = ("claim_ns", "ready_ns", "start_ns", "end_ns", "sm", "kind", "m_unit", "n_tile")
KINDS = ("shared_up", "shared_down", "routed_up", "routed_down")
DISPATCH_RECORDS = 1024  # must match kMaxTimelineRoles, the forward megakernel's constant in csrc/kernels


def new_records(num_tasks: int, device) -> torch.Tensor:
    """Zeroed records for up to ``num_tasks`` tasks plus the dispatching CTAs."""
    return torch.zeros((num_tasks + DISPATCH_RECORDS, len(FIELDS)), dtype=torch.int64, device=device)


def _us_at(ns: torch.Tensor, t0: int) -> float:
    return round((int(ns) - t0) / 1e3, 2)


def summarize(records: torch.Tensor, bins: int = 16, kinds: tuple = KINDS) -> dict:
    """Summary of one launch. Times in microseconds from the first stamp of the launch. ``kinds``:
    the kernel's task kind names, in the order of their numbers (``KINDS``).

    ``leader_time``: the sum over the SMs that ran tasks (the first CTA of each cluster) of the
    launch span, split into ``busy`` (first stage full -> epilogue done), ``between`` (epilogue done
    -> the next task's first stage full: waiting for dependencies or for data), ``head`` (launch ->
    first task) and ``tail`` (last task -> end of the launch), as fractions.
    ``busy_by_bin``: per time bin, the fraction of those SMs inside a task of each kind.
    """
    r = records.detach().to("cpu", torch.int64)
    if r.dim() != 2 or r.shape[1] != len(FIELDS) or r.shape[0] <= DISPATCH_RECORDS:
        raise ValueError(f"timeline records must be int64 [n > {DISPATCH_RECORDS}, {len(FIELDS)}], got {tuple(r.shape)}")
    tasks, disp = r[:-DISPATCH_RECORDS], r[-DISPATCH_RECORDS:]
    if tasks[-1, 0] > 0:  # the kernel stamps only tasks below the capacity: later ones are missing
        raise ValueError(f"timeline records full ({tasks.shape[0]} task rows): the launch may have had more tasks; "
                         "allocate more rows (new_records)")
    tasks = tasks[(tasks[:, 3] > 0) & (tasks[:, 2] > 0)]
    disp = disp[disp[:, 1] > 0]
    if tasks.numel() == 0:
        raise ValueError("no task was recorded (was the timeline enabled during the launch?)")
    t0 = int(tasks[:, 0].min())
    if disp.numel():
        t0 = min(t0, int(disp[:, 0].min()))
    t_end = int(tasks[:, 3].max())
    span = t_end - t0
    out: dict = {"span_us": round(span / 1e3, 2), "tasks": int(tasks.shape[0])}
    if disp.numel():
        d = disp[:, 1] - disp[:, 0]
        out["dispatch"] = {"ctas": int(disp.shape[0]), "first_start_us": _us_at(disp[:, 0].min(), t0),
                           "last_end_us": _us_at(disp[:, 1].max(), t0), "mean_us": round(float(d.float().mean()) / 1e3, 2)}
    per_kind = {}
    for k, name in enumerate(kinds):
        sel = tasks[tasks[:, 5] == k]
        if sel.numel() == 0:
            continue
        ex = (sel[:, 3] - sel[:, 2]).float()
        dep = (sel[:, 1] - sel[:, 0]).float()
        per_kind[name] = {"tasks": int(sel.shape[0]), "tile_us_mean": round(float(ex.mean()) / 1e3, 2),
                          "tile_us_median": round(float(ex.median()) / 1e3, 2),
                          "dep_wait_us_mean": round(float(dep.mean()) / 1e3, 2),
                          "first_start_us": _us_at(sel[:, 2].min(), t0),
                          "last_end_us": _us_at(sel[:, 3].max(), t0),
                          "busy_sm_ms": round(float(ex.sum()) / 1e6, 3)}
    out["per_kind"] = per_kind
    busy = between = head = tail = 0
    dep_gap = 0
    sms = tasks[:, 4].unique()
    for sm in sms.tolist():
        s = tasks[tasks[:, 4] == sm]
        s = s[s[:, 2].argsort()]
        busy += int((s[:, 3] - s[:, 2]).sum())
        gaps = (s[1:, 2] - s[:-1, 3]).clamp(min=0)
        between += int(gaps.sum())
        dep_gap += int((s[1:, 1] - s[:-1, 3]).clamp(min=0).minimum(gaps).sum())  # part of the gap before deps were met
        head += int(s[0, 2]) - t0
        tail += t_end - int(s[-1, 3])
    total = max(1, span * len(sms))
    out["leader_sms"] = len(sms)
    out["leader_time"] = {"busy": round(busy / total, 4), "between": round(between / total, 4),
                          "between_waiting_for_deps": round(dep_gap / total, 4), "head": round(head / total, 4),
                          "tail": round(tail / total, 4)}
    edges = torch.linspace(t0, t_end, bins + 1, dtype=torch.float64)
    by_bin = {}
    for k, name in enumerate(kinds):
        sel = tasks[tasks[:, 5] == k]
        if sel.numel() == 0:
            continue
        st, en = sel[:, 2].double(), sel[:, 3].double()
        frac = []
        for b in range(bins):
            lo, hi = edges[b], edges[b + 1]
            ov = (torch.minimum(en, hi) - torch.maximum(st, lo)).clamp(min=0).sum()
            frac.append(round(float(ov / ((hi - lo) * len(sms))), 3))
        by_bin[name] = frac
    out["bin_us"] = round(span / bins / 1e3, 2)
    out["busy_by_bin"] = by_bin
    return out
