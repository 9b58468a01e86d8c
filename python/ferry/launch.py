"""Starts N ranks of a Python program on this host, torchrun-style, without torch:

    python -m ferry.launch --nproc 2 examples/moe_layer.py [args...]
    python -m ferry.launch --nproc 2 -m some.module [args...]
    python -m ferry.launch --nproc 2 --no-python ./engine [args...]      (any executable; `ferry launch` does the same)

Each rank gets MASTER_ADDR, MASTER_PORT (a free port unless given), RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
the NVLink-multicast safety variables and, when it is unset and there is more than one rank, OMP_NUM_THREADS=1 (as
torchrun does: N ranks of torch on the cpu, each with a thread per core, oversubscribe the host many times over; a
one-line notice says so); ferry.init() reads them. It is Ferry's C++ launcher (the one `ferry launch`
uses, with the same rules): the first rank that fails ends the others after a grace period (default FERRY_TIMEOUT_S
+ 5 s, time for them to report their own TimeoutError naming the rank that died; their output goes where this
process's goes), ranks die with the launcher, and an optional deadline kills everything, so a launch never hangs.
The exit status is 0 when every rank exited 0, else the exit status of the rank that failed first (128 + signal when
it was killed), and the last lines on stderr say which rank that was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from . import _ext


def launch(
    argv: list[str],
    nproc: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    env: dict[str, str] | None = None,
    timeout_s: float = 0.0,
    grace_s: float | None = None,
) -> tuple[bool, str, list[int], int]:
    """Runs argv as nproc ranks. grace_s None: FERRY_TIMEOUT_S + 5 (read as the library reads it). Returns (ok, one
    line per failed rank, each rank's exit code or -signal, the exit status of the rank that failed first)."""
    pairs = sorted((env or {}).items())
    return _ext._launch_ranks(list(argv), nproc, master_addr, master_port, pairs, timeout_s, grace_s)


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ferry.launch",
        description="Start N ranks of a Python program on this host with the torchrun environment.",
    )
    parser.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=0.0, help="kill every rank after this many seconds (0: none)")
    parser.add_argument("--grace", type=float, default=None,
                        help="seconds the others may run after one rank failed, to report their own error "
                             "(default FERRY_TIMEOUT_S + 5)")
    parser.add_argument("-m", dest="module", action="store_true", help="run the program as a module (python -m)")
    parser.add_argument("--no-python", dest="no_python", action="store_true",
                        help="run the program as an executable (a path, or a name on PATH), not a Python script")
    parser.add_argument("program", help="script path (or module name with -m)")
    parser.add_argument("program_args", nargs=argparse.REMAINDER, help="arguments passed to every rank")
    opts = parser.parse_args(args)
    if opts.nproc < 1:
        parser.error(f"--nproc={opts.nproc} must be at least 1")
    if opts.no_python:
        if opts.module:
            parser.error("-m and --no-python exclude each other")
        program = shutil.which(opts.program) if os.sep not in opts.program else opts.program
        if program is None or not os.path.isfile(program) or not os.access(program, os.X_OK):
            parser.error(f"--no-python: '{opts.program}' is not an executable file (nor one on PATH)")
        argv = [program] + opts.program_args  # as named: a symlink stays one (a venv's bin/python must)
    else:
        argv = [sys.executable] + (["-m", opts.program] if opts.module else [opts.program]) + opts.program_args
    if opts.grace is not None and opts.grace < 0:
        parser.error(f"--grace={opts.grace} must be 0 or more (leave it out for FERRY_TIMEOUT_S + 5)")
    if opts.nproc > 1 and not os.environ.get("OMP_NUM_THREADS"):  # the launcher's rule (omp_threads_defaulted)
        sys.stderr.write("ferry.launch: OMP_NUM_THREADS=1 for each rank (it was unset): each rank's OpenMP pool would "
                         "otherwise start a thread per core; set OMP_NUM_THREADS to choose another count\n")
    try:
        ok, description, _, status = launch(
            argv, opts.nproc, master_addr=opts.master_addr, master_port=opts.master_port,
            timeout_s=opts.timeout, grace_s=opts.grace,
        )
    except _ext.Error as error:  # a refused setting (FERRY_TIMEOUT_S=abc), a fork that failed: the message says it
        sys.stderr.write(f"ferry.launch: {error}\n")
        return 2
    if ok:
        return 0
    for line in description.strip().splitlines():
        sys.stderr.write(f"ferry.launch: {line}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
