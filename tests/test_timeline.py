"""megatron_mok.tools.timeline.summarize on hand-made records (CPU)."""

import pytest
import torch

from megatron_mok.tools import timeline


def _records(rows, disp=()):
    r = timeline.new_records(len(rows), "cpu")
    for i, row in enumerate(rows):
        r[i] = torch.tensor(row)
    for i, (a, b) in enumerate(disp):
        r[len(rows) + i, :2] = torch.tensor([a, b])
        r[len(rows) + i, 4:6] = torch.tensor([0, -1])
    return r


def test_summary_splits_time():
    us = 1000
    # claim, ready, start, end, sm, kind, m, n; SM 0: two routed_up tiles with a 10 us gap, of which
    # 4 us waiting for the dependency; SM 1: one routed_down tile, idle at the end
    rows = [
        (0, 0, 10 * us, 40 * us, 0, 2, 0, 0),
        (35 * us, 46 * us, 50 * us, 80 * us, 0, 2, 0, 1),
        (0, 0, 20 * us, 60 * us, 1, 3, 0, 0),
    ]
    s = timeline.summarize(_records(rows, disp=[(0, 5 * us)]), bins=4)
    assert s["span_us"] == 80.0 and s["tasks"] == 3 and s["leader_sms"] == 2
    assert s["per_kind"]["routed_up"]["tasks"] == 2
    assert s["per_kind"]["routed_up"]["tile_us_mean"] == 30.0
    assert s["per_kind"]["routed_up"]["dep_wait_us_mean"] == 5.5
    assert s["per_kind"]["routed_down"]["tile_us_mean"] == 40.0
    lt = s["leader_time"]
    total = 2 * 80
    assert lt["busy"] == pytest.approx((60 + 40) / total, abs=1e-4)
    assert lt["between"] == pytest.approx(10 / total, abs=1e-4)
    assert lt["between_waiting_for_deps"] == pytest.approx(6 / total, abs=1e-4)
    assert lt["head"] == pytest.approx((10 + 20) / total, abs=1e-4)
    assert lt["tail"] == pytest.approx(20 / total, abs=1e-4)
    assert sum(lt[k] for k in ("busy", "between", "head", "tail")) == pytest.approx(1.0, abs=1e-3)
    assert s["dispatch"] == {"ctas": 1, "first_start_us": 0.0, "last_end_us": 5.0, "mean_us": 5.0}
    # bin 0 (0-20 us): SM 0 busy 10 of 20 us in routed_up -> 10 / (20 * 2 SMs)
    assert s["busy_by_bin"]["routed_up"][0] == 0.25
    assert s["busy_by_bin"]["routed_down"][1] == 0.5


def test_bad_records_are_named():
    with pytest.raises(ValueError, match="int64"):
        timeline.summarize(torch.zeros((3, 8), dtype=torch.int64))
    with pytest.raises(ValueError, match="no task was recorded"):
        timeline.summarize(timeline.new_records(4, "cpu"))
    full = timeline.new_records(2, "cpu")
    full[:2, :4] = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="timeline records full"):
        timeline.summarize(full)
