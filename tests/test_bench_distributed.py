"""The distributed benchmark's pure parts (its spawned runs are exercised by running it)."""

import pytest

from lcckpt.bench.distributed import _summary, bench_state, run
from lcckpt.errors import InvalidArgumentError


def test_bench_state_is_dominated_by_one_tensor():
    s = bench_state(total_mb=8, dominant=0.8, n_small=20)
    sizes = sorted((v.numel() * 4 for v in s.values() if hasattr(v, "numel")), reverse=True)
    assert len(sizes) == 21
    assert 7.5e6 < sum(sizes) <= 8e6
    assert sizes[0] / sum(sizes) == pytest.approx(0.8, abs=0.01)


def test_summary_medians_and_imbalance():
    rows = [{"save_s": t, "load_s": 2 * t,
             "ranks": [{"bytes": 300, "raw_bytes": 400, "seconds": t, "cpu_seconds": t},
                       {"bytes": 100, "raw_bytes": 130, "seconds": t / 2, "cpu_seconds": t}]}
            for t in (1.0, 3.0, 2.0)]
    s = _summary("dcp-default", 2, rows)
    assert s["save_s"] == 2.0 and s["load_s"] == 4.0
    assert s["rank_bytes"] == [300, 100] and s["imbalance_bytes"] == 1.5
    assert s["imbalance_time"] == pytest.approx(2.0 / 1.5)


def test_bad_arguments_are_named():
    with pytest.raises(InvalidArgumentError):
        run(total_mb=1, repeats=0)
