"""Shared setup of the Python tests: single-threaded BLAS (rank processes are forked from this one) and the path of
the helpers next to this file."""

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_terminal_summary(terminalreporter):
    from skip_summary import terminal_summary

    terminal_summary(terminalreporter)
