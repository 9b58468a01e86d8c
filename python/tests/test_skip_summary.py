"""The "skipped:" lines of `make test` (skip_summary.py): one line per reason, counted, long reasons wrapped, so that
the summary reads at a glance (it was one line of about 1,500 characters)."""

from __future__ import annotations

from skip_summary import summary_lines


def test_one_line_per_reason_counted_and_wrapped():
    ctest = ["built without the cuda backend"] * 28 + ["needs 2 GPUs, found 0"] * 5 + ["needs 1 GPU, found 0"]
    pytest_reasons = ["needs torch " + "and a very long explanation " * 10] * 7
    lines = summary_lines(ctest, pytest_reasons, width=100)
    assert lines[0] == "skipped: 41 tests (34 C++, 7 python), by reason:"
    assert lines[1] == "  28 C++     built without the cuda backend"
    assert lines[2] == "   5 C++     needs 2 GPUs, found 0"
    assert lines[3] == "   1 C++     needs 1 GPU, found 0"
    assert lines[4].startswith("   7 python  needs torch and a very long explanation")
    assert len(lines) > 5 and all(line.startswith(" " * 13) for line in lines[5:]), lines
    assert all(len(line) <= 100 for line in lines), [len(line) for line in lines]


def test_nothing_skipped():
    assert summary_lines([], []) == ["skipped: none"]
