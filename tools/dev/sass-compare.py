#!/usr/bin/env python3
"""Compares the machine code (SASS, sm_90a) of the cuda backend's kernels between a base tree and this one, on a
machine without a GPU: for a change meant to leave the kernels' work as it was (a refactor, a seam), or to see what
a change did to a hot kernel before its A/B is run on a GPU machine.

    tools/dev/sass-compare.py BASE [FILE.cu ...] [--build DIR] [--kernel REGEX] [--rename PATTERN REPL]
                            [--require-same] [--show N]

  BASE       a commit (read with `git archive`) or a tarball of the base tree (as `scripts/gpu-check.sh ab` takes)
  FILE.cu    sources of libferry to compile in both trees (default: every src/ep/cuda/*.cu that both have)
  --build    the configured build of this tree whose compile_commands.json gives the flags (default build)
  --kernel   only the kernels whose demangled name matches REGEX
  --rename   rewrite B's kernel names with this regex before pairing them with A's (repeatable), for a change
             that added template arguments: e.g. --rename ', OneNode, false>' '>'
  --require-same   exit 1 unless every kernel's code is the same up to register names and addresses
  --show N   print the first N differing instruction runs of each kernel that differs (default 0)

Each source is compiled in both trees with the same nvcc command (this tree's, for sm_90a only) and disassembled.
For each kernel, one line: registers, stack, local and shared bytes, parameter bytes, the number of instructions in
A and B, and how the code compares:
  identical     the same instructions (immediates and addresses included) in the same order
  renamed       the same instruction sequence once register and predicate names and hex numbers (branch
                targets, parameter offsets, most immediates) are masked
  reordered     the same multiset of opcodes in another order
  differs       the opcodes that B has more (+) or fewer (-) of than A, most changed first
Kernels are paired by their demangled names without the parameter list; kernels of one tree only are listed as such.

cuobjdump and nvdisasm come with a full CUDA toolkit; where nvcc's directory lacks them (a slim image), they are
installed once from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into BUILD/sass-tools.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tools/dev/ of the source tree


def die(message: str) -> None:
    sys.stderr.write(f"sass-compare: {message}\n")
    sys.exit(2)


def find_tools(build: Path, nvcc: str) -> dict[str, str]:
    """cuobjdump and nvdisasm: beside nvcc, on PATH, or installed from PyPI into BUILD/sass-tools."""
    target = build / "sass-tools"

    def search() -> dict[str, str]:
        dirs = [str(Path(nvcc).parent)] + os.environ.get("PATH", "").split(os.pathsep)
        dirs += [str(p.parent) for p in target.glob("nvidia/*/bin/cuobjdump")]
        return {t: shutil.which(t, path=os.pathsep.join(dirs)) for t in ("cuobjdump", "nvdisasm")}

    found = search()
    if all(found.values()):
        return found
    sys.stderr.write(f"sass-compare: cuobjdump/nvdisasm not found; installing them from PyPI into {target}\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target),
                    "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"], check=True)
    for p in target.glob("nvidia/*/bin/*"):
        p.chmod(0o755)
    found = search()
    if not all(found.values()):
        die(f"no cuobjdump/nvdisasm after installing them into {target}")
    return found


def compile_command(build: Path, source: Path) -> list[str]:
    """This tree's nvcc command of `source` in libferry (compile_commands.json), for sm_90a machine code only."""
    db = build / "compile_commands.json"
    if not db.is_file():
        die(f"{db} is missing: configure this tree first (`make configure` or cmake -B {build})")
    for entry in json.loads(db.read_text()):
        if Path(entry["file"]).resolve() == source.resolve() and "/ferry.dir/" in entry.get("command", "") + \
                entry.get("output", ""):
            args = shlex.split(entry["command"])
            # drop the output and the source; keep the flags
            out = args.index("-o")
            del args[out:out + 2]
            args = [a for a in args if Path(a).name != source.name or not a.endswith(".cu")]
            args = [re.sub(r"code=\[[^\]]*\]", "code=[sm_90a]", a) for a in args]
            return args
    die(f"no compile command of {source} in libferry's target in {db}")
    return []


def compile_tree(tree: Path, source_rel: str, command: list[str], out: Path) -> None:
    # the include paths name this tree: point them at `tree`
    args = [a.replace(str(ROOT), str(tree)) for a in command]
    result = subprocess.run(args + [str(tree / source_rel), "-o", str(out)], cwd=tree, capture_output=True, text=True)
    if result.returncode != 0:
        die(f"compiling {source_rel} in {tree} failed:\n{result.stderr[-3000:]}")


INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"Function : (\S+)")
RESOURCES = re.compile(r"Function ([^\s:]+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_sass(text: str) -> dict[str, list[str]]:
    """Kernel (mangled) -> its instructions, without addresses and encodings."""
    kernels: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = FUNCTION.search(line)
        if m:
            current = m.group(1)
            kernels[current] = []
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            kernels[current].append(m.group(1))
    return kernels


def parse_resources(text: str) -> dict[str, tuple[int, int, int, int]]:
    """Kernel (mangled) -> (registers, stack, shared, local) from cuobjdump -res-usage."""
    return {m.group(1): tuple(int(m.group(i)) for i in range(2, 6)) for m in RESOURCES.finditer(text)}


def parse_param_bytes(text: str) -> dict[str, int]:
    """Kernel (mangled) -> its parameter bytes (EIATTR_PARAM_CBANK of cuobjdump -elf)."""
    sizes: dict[str, int] = {}
    sections = re.split(r"\n(?=\.nv\.info\.)", text)
    for section in sections:
        m = re.match(r"\.nv\.info\.(\S+)", section)
        if not m:
            continue
        size = re.search(r"EIATTR_PARAM_CBANK\s*\n(?:\s*Format:.*\n)?\s*Value:\s*\S+\s+(0x[0-9a-f]+)", section)
        if size:
            sizes[m.group(1)] = int(size.group(1), 16) >> 16
    return sizes


def masked(instruction: str) -> str:
    """An instruction with register and predicate names and hex numbers (addresses, offsets, immediates) masked."""
    s = re.sub(r"0x[0-9a-f]+", "#", instruction)
    s = re.sub(r"\bU?R\d+\b", "R", s)
    return re.sub(r"\bU?P\d\b", "P", s)


def opcode(instruction: str) -> str:
    parts = instruction.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def compare(a: list[str], b: list[str]) -> tuple[str, str]:
    if a == b:
        return "identical", ""
    if [masked(x) for x in a] == [masked(x) for x in b]:
        return "renamed", ""
    ca, cb = collections.Counter(map(opcode, a)), collections.Counter(map(opcode, b))
    if ca == cb:
        return "reordered", ""
    delta = sorted(((cb[k] - ca[k], k) for k in set(ca) | set(cb) if cb[k] != ca[k]), key=lambda d: (-abs(d[0]), d[1]))
    return "differs", " ".join(f"{k} {n:+d}" for n, k in delta[:6]) + (" ..." if len(delta) > 6 else "")


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    short = [re.sub(r"\bferry::(cuda_ep::|cuda_ll::|transport::)?", "", s) for s in out]
    return dict(zip(names, short))


def pair_key(demangled: str, renames: list[list[str]] = ()) -> str:
    """A kernel's demangled name without its parameter list (and the return type), after `renames`."""
    name = demangled
    depth = 0
    for i, c in enumerate(name):  # cut at the '(' that opens the parameter list (outside template brackets)
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0 and i > 0 and name[i - 1] != " ":
            name = name[:i]
            break
    name = re.sub(r"^void ", "", name)
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


def first_differences(a: list[str], b: list[str], count: int) -> list[str]:
    lines = []
    matcher = difflib.SequenceMatcher(None, [masked(x) for x in a], [masked(x) for x in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if len(lines) >= count:
            break
        lines.append(f"    @{i1}/{j1} {tag}: - " + " | ".join(a[i1:min(i2, i1 + 4)]) + (" ..." if i2 - i1 > 4 else ""))
        lines.append("              + " + " | ".join(b[j1:min(j2, j1 + 4)]) + (" ..." if j2 - j1 > 4 else ""))
    return lines


def base_tree(base: str, into: Path) -> Path:
    tree = into / "base"
    tree.mkdir()

    def extract(tar: tarfile.TarFile) -> None:
        try:
            tar.extractall(tree, filter="data")
        except TypeError:  # a Python without extraction filters (before 3.11.4): a tree we made or were given
            tar.extractall(tree)

    if Path(base).is_file():
        with tarfile.open(base) as tar:
            extract(tar)
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", base], capture_output=True)
        if archive.returncode != 0:
            die(f"'{base}' is neither a tarball nor a commit: {archive.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            extract(tar)
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=__doc__.split("\n\n")[1])
    parser.add_argument("base")
    parser.add_argument("sources", nargs="*")
    parser.add_argument("--build", default="build")
    parser.add_argument("--kernel", default="")
    parser.add_argument("--rename", nargs=2, action="append", default=[], metavar=("PATTERN", "REPL"))
    parser.add_argument("--require-same", action="store_true")
    parser.add_argument("--show", type=int, default=0)
    args = parser.parse_args()
    build = (ROOT / args.build).resolve()
    kernel_filter = re.compile(args.kernel) if args.kernel else None

    with tempfile.TemporaryDirectory(prefix="sass-compare-") as tmp:
        tmp_path = Path(tmp)
        base = base_tree(args.base, tmp_path)
        sources = args.sources or sorted(
            str(p.relative_to(ROOT)) for p in (ROOT / "src/ep/cuda").glob("*.cu")
            if (base / p.relative_to(ROOT)).is_file())
        tools = None
        dump_env = None  # cuobjdump runs nvdisasm, which it finds on PATH
        different = 0
        for source in sources:
            if not (ROOT / source).is_file() or not (base / source).is_file():
                print(f"{source}: not in both trees, skipped")
                continue
            command = compile_command(build, ROOT / source)
            if tools is None:
                tools = find_tools(build, command[0])
                dump_env = {**os.environ,
                            "PATH": os.pathsep.join([str(Path(tools["nvdisasm"]).parent), os.environ.get("PATH", "")])}
            sides = {}
            for side, tree in (("A", base), ("B", ROOT)):
                obj = tmp_path / f"{side}-{Path(source).stem}.o"
                compile_tree(tree, source, command, obj)
                dump = lambda *flags: subprocess.run([tools["cuobjdump"], *flags, str(obj)], capture_output=True,
                                                     text=True, env=dump_env).stdout
                sides[side] = (parse_sass(dump("-sass")), parse_resources(dump("-res-usage")),
                               parse_param_bytes(dump("-elf")))
            (sass_a, res_a, par_a), (sass_b, res_b, par_b) = sides["A"], sides["B"]
            short = demangle(sorted(set(sass_a) | set(sass_b)))
            key_a = {pair_key(short[n]): n for n in sass_a}
            key_b = {pair_key(short[n], args.rename): n for n in sass_b}
            print(f"{source}:")
            for key in sorted(set(key_a) | set(key_b)):
                if kernel_filter and not kernel_filter.search(key):
                    continue
                name_a, name_b = key_a.get(key), key_b.get(key)
                if name_a is None or name_b is None:
                    print(f"  {key}: only in {'B' if name_a is None else 'A'}")
                    different += 1
                    continue
                verdict, detail = compare(sass_a[name_a], sass_b[name_b])
                different += verdict not in ("identical", "renamed")
                ra, rb = res_a.get(name_a, (0, 0, 0, 0)), res_b.get(name_b, (0, 0, 0, 0))
                pair = lambda x, y: f"{x}" if x == y else f"{x}->{y}"
                print(f"  {key}: {verdict}  reg {pair(ra[0], rb[0])} stack {pair(ra[1], rb[1])} "
                      f"local {pair(ra[3], rb[3])} shared {pair(ra[2], rb[2])} "
                      f"params {pair(par_a.get(name_a, 0), par_b.get(name_b, 0))} "
                      f"instr {pair(len(sass_a[name_a]), len(sass_b[name_b]))}" + (f"  [{detail}]" if detail else ""))
                if verdict != "identical" and args.show:
                    print("\n".join(first_differences(sass_a[name_a], sass_b[name_b], args.show)))
        if args.require_same and different:
            print(f"sass-compare: {different} kernel(s) differ beyond register names and addresses")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
