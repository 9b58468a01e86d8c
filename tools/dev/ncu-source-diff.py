#!/usr/bin/env python3
"""Compares where one kernel spends its instructions and its stalls in two builds (A: a base tree, B: this one), from
the per-instruction source counters Nsight Compute exports: for a change that leaves a kernel's code nearly the same
but its time not (sass-compare.py says what changed in the code; this says where the time went).

    tools/dev/ncu-source-diff.py A.csv B.csv [--region N] [--top N]

  A.csv, B.csv  `ncu -i REPORT --page source --csv --print-source sass` of a report taken with
                `--section SourceCounters` (`scripts/gpu-check.sh ab --source-counters` makes both); a report of several
                launches of the kernel is summed over them
  --region N    instructions of A per region of the stall table (default 150)
  --top N       rows of each table (default 20)

It prints:
  - each side's warp instructions executed, warp stall samples and executed code footprint (128-byte lines);
  - the instructions by how many times each was executed (e.g. 2112 = every warp of 132 CTAs x 16 warps runs it;
    132 = once per CTA; larger counts are loops and polls), A against B: which paths grew;
  - the stall samples of A and B by region, A and B aligned by their opcode sequences (the two builds schedule the
    same source differently, so addresses do not pair), with `*` where the difference is beyond sampling noise (more
    than twice the standard deviation of a difference of two Poisson counts).
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import math
import re
import sys
from dataclasses import dataclass


@dataclass
class Instruction:
    offset: int  # from the kernel's first instruction
    source: str
    executed: float  # warp-level instructions executed
    samples: float  # warp stall samples (all)


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[str, list[Instruction]]:
    """The kernel's instructions, summed over every launch in the export (one block per launch)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    if not starts:
        sys.exit(f"ncu-source-diff: {path} holds no kernel (is it ncu --page source --csv --print-source sass?)")
    name = next(csv.reader([lines[starts[0]]]))[1]
    total: dict[int, Instruction] = {}
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        block_name = next(csv.reader([lines[start]]))[1]
        if block_name != name:
            sys.exit(f"ncu-source-diff: {path} holds two kernels ({name} and {block_name}); profile one (-k)")
        rows = csv.DictReader(lines[start + 1:end])
        base = None
        for row in rows:
            address = int(row["Address"], 16)
            base = address if base is None else base
            offset = address - base
            executed = number(row.get("Instructions Executed", "0"))
            samples = number(row.get("Warp Stall Sampling (All Samples)", "0"))
            if offset in total:
                total[offset].executed += executed
                total[offset].samples += samples
            else:
                total[offset] = Instruction(offset, row["Source"].strip(), executed, samples)
    return name, [total[o] for o in sorted(total)]


def opcode(source: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", source).split(" ")[0]


def summary(label: str, code: list[Instruction]) -> None:
    executed = sum(i.executed for i in code)
    samples = sum(i.samples for i in code)
    lines = len({i.offset // 128 for i in code if i.executed > 0})
    print(f"  {label}: {executed:14,.0f} warp instructions  {samples:8,.0f} stall samples  "
          f"{lines:5d} code lines executed")


def by_count(a: list[Instruction], b: list[Instruction], top: int) -> None:
    def buckets(code: list[Instruction]) -> dict[float, tuple[int, float]]:
        out: dict[float, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for i in code:
            if i.executed > 0:
                out[i.executed][0] += 1
                out[i.executed][1] += i.executed
        return {k: (int(v[0]), v[1]) for k, v in out.items()}

    ba, bb = buckets(a), buckets(b)
    keys = sorted(set(ba) | set(bb), key=lambda k: -max(ba.get(k, (0, 0))[1], bb.get(k, (0, 0))[1]))
    print("\ninstructions by times executed (A | B): instructions at that count, and the warp instructions they make")
    print(f"  {'times':>10} {'A instr':>8} {'B instr':>8} {'A warp instr':>14} {'B warp instr':>14}")
    for k in keys[:top]:
        na, wa = ba.get(k, (0, 0.0))
        nb, wb = bb.get(k, (0, 0.0))
        mark = "" if na == nb else "  <-"
        print(f"  {k:>10,.0f} {na:>8} {nb:>8} {wa:>14,.0f} {wb:>14,.0f}{mark}")


def by_region(a: list[Instruction], b: list[Instruction], region: int, top: int) -> None:
    matcher = difflib.SequenceMatcher(None, [opcode(i.source) for i in a], [opcode(i.source) for i in b],
                                      autojunk=False)
    regions: dict[int, list] = {}
    for _, i1, i2, j1, j2 in matcher.get_opcodes():
        key = i1 // region
        r = regions.setdefault(key, [i1, j1, 0.0, 0.0, 0.0, 0.0])
        r[2] += sum(i.samples for i in a[i1:i2])
        r[3] += sum(i.samples for i in b[j1:j2])
        r[4] += sum(i.executed for i in a[i1:i2])
        r[5] += sum(i.executed for i in b[j1:j2])
    rows = sorted(regions.values(), key=lambda r: -abs(r[3] - r[2]))
    print(f"\nstall samples by region ({region} instructions of A each, aligned to B), largest difference first")
    print(f"  {'A at':>6} {'B at':>6} {'A samples':>10} {'B samples':>10} {'A warp instr':>14} {'B warp instr':>14}  "
          "first instruction of A's region")
    for i1, j1, sa, sb, ea, eb in rows[:top]:
        noise = "*" if abs(sb - sa) > 2 * math.sqrt(max(sa + sb, 1.0)) else " "
        print(f"  {i1:>6} {j1:>6} {sa:>10,.0f} {sb:>9,.0f}{noise} {ea:>14,.0f} {eb:>14,.0f}  {a[i1].source[:48]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--region", type=int, default=150)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    name_a, a = load(args.a)
    name_b, b = load(args.b)
    print(f"A: {name_a}\nB: {name_b}")
    if name_a != name_b:
        print("(the names differ: a renamed instance, or two kernels)")
    summary("A", a)
    summary("B", b)
    by_count(a, b, args.top)
    by_region(a, b, args.region, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
