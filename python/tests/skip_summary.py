"""The lines `make test` ends its test output with, before pytest's own summary: what was skipped, in ctest and in
pytest, and why, built from the runs' results (ctest's --output-junit file, pytest's skip reports). CTest's "100%
tests passed" counts a skipped GPU test as passed; these lines say it was not run, one line per reason (the most
frequent first), long reasons wrapped. Printed by pytest's terminal summary where FERRY_CTEST_JUNIT names ctest's
results, or by `python3 skip_summary.py CTEST_JUNIT PYTEST_JUNIT...` (scripts/run-tests.sh, after all ran):

    skipped: 40 tests (33 C++, 7 python), by reason:
      28 C++     built without the cuda backend
       5 C++     needs 2 GPUs, found 0
       7 python  ...
"""

from __future__ import annotations

import collections
import os
import re
import textwrap
import xml.etree.ElementTree as ElementTree


def junit_skip_reasons(junit_path: str) -> list[str]:
    """One reason per skipped test of a junit file: the gtest skip message (the line after "file:line: Skipped" in
    ctest's captured output), else the file's own message (ctest's, or pytest's reason)."""
    reasons = []
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None:
            continue
        out = case.findtext("system-out") or ""
        found = re.search(r": Skipped\n(.+)", out)
        reasons.append(found.group(1).strip() if found else skipped.get("message", "skipped"))
    return reasons


def pytest_skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ").strip()


def summary_lines(ctest_reasons: list[str], pytest_reasons: list[str], width: int = 120) -> list[str]:
    if not ctest_reasons and not pytest_reasons:
        return ["skipped: none"]
    total = len(ctest_reasons) + len(pytest_reasons)
    kinds = [(kind, reasons) for kind, reasons in (("C++", ctest_reasons), ("python", pytest_reasons)) if reasons]
    lines = [f"skipped: {total} test{'s' if total != 1 else ''} ("
             + ", ".join(f"{len(reasons)} {kind}" for kind, reasons in kinds) + "), by reason:"]
    count_width = len(str(max(collections.Counter(r).most_common(1)[0][1] for _, r in kinds)))
    for kind, reasons in kinds:
        for reason, count in collections.Counter(reasons).most_common():
            head = f"  {count:>{count_width}} {kind:<7} "
            lines += textwrap.wrap(reason, width=width, initial_indent=head, subsequent_indent=" " * len(head),
                                   break_on_hyphens=False) or [head.rstrip()]
    return lines


def terminal_summary(terminalreporter) -> None:
    """pytest_terminal_summary of conftest.py: only under `make test` (FERRY_CTEST_JUNIT names ctest's results)."""
    junit = os.environ.get("FERRY_CTEST_JUNIT")
    if not junit:
        return
    ctest = junit_skip_reasons(junit) if os.path.exists(junit) else []
    pytest = [pytest_skip_reason(report) for report in terminalreporter.stats.get("skipped", [])]
    for line in summary_lines(ctest, pytest):
        terminalreporter.write_line(line)


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 3:
        sys.exit("usage: skip_summary.py CTEST_JUNIT PYTEST_JUNIT... (a missing file: that run's skips are unknown)")
    ctest_path, pytest_paths = sys.argv[1], sys.argv[2:]
    print("\n".join(summary_lines(junit_skip_reasons(ctest_path) if os.path.exists(ctest_path) else [],
                                  [reason for path in pytest_paths if os.path.exists(path)
                                   for reason in junit_skip_reasons(path)])))
