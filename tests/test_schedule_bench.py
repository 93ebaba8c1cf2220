"""The schedule benchmark runs end to end on a given loss curve and reports every cell."""

import json

import numpy as np
import pytest

from lcckpt.bench import schedule as bench
from lcckpt.errors import InvalidArgumentError


def test_run_reports_every_cell(tmp_path):
    k = np.arange(0, 401, 5)
    losses = (2.2 * np.exp(-k / 40.0) + 0.12).tolist()
    doc = bench.run(trials=200, losses=(k.tolist(), losses))
    cells = doc["cells"]
    names = {(c["scenario"], c["accounting"], c["method"]) for c in cells}
    assert len(names) == len(cells) == len(bench.scenarios(400)) * len(bench.ACCOUNTINGS) * len(bench.METHODS)
    for c in cells:
        assert np.isfinite(c["simulated"]) and c["se"] >= 0 and np.isfinite(c["predicted"])
        assert c["iterations"] == sorted(c["iterations"])
    json.dumps(doc)                                        # JSON-able as promised
    text = bench.format_report(doc)
    assert "progress+termination" in text and "coci_code[s]" in text
    pytest.importorskip("matplotlib")
    bench.plot(doc, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
    with pytest.raises(InvalidArgumentError):
        bench.run(trials=10, losses=(k.tolist(), losses))
