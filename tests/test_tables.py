"""The text table reports print: aligned columns, floats to 3 decimals; bench uses the same."""
from __future__ import annotations

from tinyserve.tables import table


def test_table_aligns_columns_and_rounds_floats() -> None:
    out = table(["name", "ms"], [["prefill", 1.23456], ["decode", 12.0]])
    assert out.splitlines() == ["   name      ms",
                                "-------  ------",
                                "prefill   1.235",
                                " decode  12.000"]


def test_table_with_no_rows_prints_the_header() -> None:
    assert table(["rate"], []).splitlines() == ["rate", "----"]


def test_bench_prints_with_the_same_table() -> None:
    import bench.common
    assert bench.common.table is table
