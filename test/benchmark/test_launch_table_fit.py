"""benchmark/kernels/launch_table_fit.py: one rule per matrix point, the fastest wave target
where it beats the config's by the margin, shapes with one key decided by summed times."""

import json

import pytest

from benchmark.kernels import launch_table_fit
from granikv.attention.decode.launch_table import LaunchTable


def _row(d, rows, prefix, base_us, variants, suffix=64):
    return dict(d=d, rows_per_kv_head=rows, prefix=prefix, suffix=suffix, gkv_cascade_us=base_us, prefix_waves=1.5,
                variant_cascade_us={f"pw{w}": us for w, us in variants.items()},
                variant_prefix_waves={f"pw{w}": w for w in variants})


ROWS = [
    _row(128, 64, 4096, 20.0, {1.0: 15.0, 2.0: 25.0}),  # 1.0 wins by 25%
    _row(128, 64, 16384, 40.0, {1.0: 39.0, 2.0: 41.0}),  # 1.0 by 2.5%: below the margin, the config's
    _row(128, 64, 16384, 40.0, {1.0: 30.0, 2.0: 41.0}, suffix=256),  # the same shape, longer suffixes: 1.0
    _row(128, 256, 16384, 50.0, {1.0: 60.0, 2.0: 45.0}),  # GQA 4 at 64 sharers: 2.0 wins alone ...
    _row(128, 256, 16384, 30.0, {1.0: 30.0, 2.0: 40.0}),  # ... MHA at 256 sharers, same key: summed, 1.5 wins
    _row(64, 64, 4096, 10.0, {1.0: 11.0, 2.0: 9.0}),
    dict(d=64, rows_per_kv_head=32, prefix=4096, suffix=64, prefix_waves=1.5),  # a point that failed: ignored
]


def test_fit_rules():
    table, report = launch_table_fit.fit_rules(ROWS, min_gain=0.03)
    assert [(r.head_dim, r.max_rows, r.max_prefix, r.max_suffix, r.prefix_waves) for r in table.rules] == [
        (64, 64, 4096, 64, 2.0), (128, 64, 4096, 64, 1.0), (128, 64, 16384, 64, 1.5), (128, 64, 16384, 256, 1.0),
        (128, 256, 16384, 64, 1.5)]
    assert report[1]["gain"] == 1.333 and report[4]["points"] == 2
    assert table.waves_for(128, 64, 8000, 64) == 1.5  # between points: the next larger point's rule
    assert table.waves_for(128, 64, 8000, 100) == 1.0
    assert table.waves_for(128, 48, 4000, 10) == 1.0


def test_main_writes_a_loadable_table(tmp_path):
    src, out = tmp_path / "m.json", tmp_path / "t.json"
    src.write_text(json.dumps(dict(gpu="NVIDIA H200", rows=ROWS)))
    assert launch_table_fit.main([str(src), "--out", str(out)]) == 0
    t = LaunchTable.load(str(out))
    assert t.gpu == "NVIDIA H200" and len(t.rules) == 5
    src.write_text(json.dumps(dict(gpu="x", rows=[ROWS[-1]])))
    with pytest.raises(SystemExit, match="no point has variant timings"):
        launch_table_fit.main([str(src), "--out", str(out)])
