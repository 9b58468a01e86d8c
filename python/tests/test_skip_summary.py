"""The "skipped:" lines of `make test` (skip_summary.py): one line per reason, counted, long reasons wrapped, so that
the summary reads at a glance (it was one line of about 1,500 characters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from skip_summary import junit_skip_reasons, summary_lines


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


def test_the_two_junit_files_of_make_test(tmp_path):
    """make test's closing lines (scripts/run-tests.sh): ctest's skips (the gtest message) and pytest's (its junit
    file's skip messages), read after both ran; a missing file counts no skips."""
    ctest = tmp_path / "ctest.xml"
    ctest.write_text('<testsuite><testcase name="A"><skipped message="ctest says"/><system-out>x.cpp:3: Skipped\n'
                     'needs 2 GPUs, found 0\n</system-out></testcase><testcase name="B"/></testsuite>')
    pytest_junit = tmp_path / "pytest.xml"
    pytest_junit.write_text('<testsuites><testsuite><testcase name="c"><skipped type="pytest.skip" '
                            'message="needs torch">t.py:1: needs torch</skipped></testcase><testcase name="d"/>'
                            '</testsuite></testsuites>')
    assert junit_skip_reasons(str(pytest_junit)) == ["needs torch"]
    script = Path(__file__).with_name("skip_summary.py")
    out = subprocess.run([sys.executable, str(script), str(ctest), str(pytest_junit)], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out == ["skipped: 2 tests (1 C++, 1 python), by reason:", "  1 C++     needs 2 GPUs, found 0",
                   "  1 python  needs torch"], out
    missing = subprocess.run([sys.executable, str(script), str(tmp_path / "none.xml"), str(pytest_junit)],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert missing[0] == "skipped: 1 test (1 python), by reason:", missing
