"""The line `make test` ends its test output with, before pytest's own summary: what was skipped, in ctest and in
pytest, and why, built from the runs' results (ctest's --output-junit file, pytest's skip reports). CTest's "100%
tests passed" counts a skipped GPU test as passed; this line says it was not run:

    skipped: 28 C++ tests (built without the cuda backend), 5 C++ tests (needs 2 GPUs, found 0), 7 python tests (...)
"""

from __future__ import annotations

import collections
import os
import re
import xml.etree.ElementTree as ElementTree


def ctest_skip_reasons(junit_path: str) -> list[str]:
    """One reason per skipped ctest test: the gtest skip message (the line after "file:line: Skipped"), else
    ctest's own."""
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


def summary_line(ctest_reasons: list[str], pytest_reasons: list[str]) -> str:
    parts = []
    for kind, reasons in (("C++", ctest_reasons), ("python", pytest_reasons)):
        for reason, count in collections.Counter(reasons).most_common():
            parts.append(f"{count} {kind} test{'s' if count != 1 else ''} ({reason})")
    return "skipped: " + (", ".join(parts) if parts else "none")


def terminal_summary(terminalreporter) -> None:
    """pytest_terminal_summary of conftest.py: only under `make test` (FERRY_CTEST_JUNIT names ctest's results)."""
    junit = os.environ.get("FERRY_CTEST_JUNIT")
    if not junit:
        return
    ctest = ctest_skip_reasons(junit) if os.path.exists(junit) else []
    pytest = [pytest_skip_reason(report) for report in terminalreporter.stats.get("skipped", [])]
    terminalreporter.write_line(summary_line(ctest, pytest))
