#!/usr/bin/env python3
"""Fails when a document or a comment names a file of this repository that does not exist.

Reads README.md, CHANGELOG.md, docs/*.md and every tracked source, script and build file, and checks two kinds of
names:
  - a repository path: a word that starts with one of the top-level folders below (src/comm/network.cpp,
    scripts/python-tests.sh, tests/unit/*.cpp, src/{core,comm}/, tools/ferry/bench.cpp:120), not preceded by another
    path piece (BUILD/python/ferry and /usr/local/cuda/include are not names of this repository). Globs (*, ?) and
    brace lists are expanded; a name ending in / must be a folder;
  - a relative Markdown link in a .md file ([design.md](design.md), [x](../src/core/)), resolved from the file.
A moved or renamed file then fails here, in CI, with the file and line that still name it.

usage: scripts/check-doc-paths.py [REPOSITORY_ROOT]     exit status 0: every name exists; 1: some do not (listed)
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

ROOTS = ("src", "tools", "scripts", "tests", "python", "include", "docs", "examples", "bench", "workloads", "cmake")
# A path word: a root folder, then path characters; not preceded by a path character (that would make it part of a
# longer path, e.g. /usr/local/cuda/include or BUILD/python/ferry, or a word such as "subtests/").
PATH_WORD = re.compile(
    r"(?<![\w./<>{}$@-])((?:%s)/[\w.*?{},/-]*)" % "|".join(ROOTS)
)
# Names that look like this repository's but are not: other projects' files, and build outputs (relative to a build
# folder). Each with whose it is.
NOT_OURS = {
    "include/nccl.h": "NCCL's install prefix (FERRY_NCCL_ROOT)",
    "src/dev_runtime.cc": "NCCL's source tree",
    "tests/legacy/": "DeepEP's repository",
    "tests/elastic/": "DeepEP's repository",
    "tests/elastic/test_ep.py": "DeepEP's repository",
    "tests/legacy/test_intranode.py": "DeepEP's repository",
    "tests/legacy/test_low_latency.py": "DeepEP's repository",
    "bench/*.log": "gpu-check.sh's output folder",
    "python/build.log": "gpu-check.sh's output folder",
    "python/configure.log": "gpu-check.sh's output folder",
    "tests/test_intranode.py": "DeepEP's repository",
    "tests/test_low_latency.py": "DeepEP's repository",
    "tests/utils.py": "DeepEP's repository",
    "tests/ferry_gpu_tests": "a build folder's GPU test binary",
    "tests/ferry_unit_tests": "a build folder's unit test binary",
}
# Files whose names are those of another commit (none today: the history is git's).
HISTORY: set[str] = set()
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
TEXT_SUFFIXES = (".md", ".cpp", ".hpp", ".cu", ".cuh", ".c", ".h", ".py", ".sh", ".cmake", ".in", ".toml", ".txt",
                 ".json")
TEXT_NAMES = ("Makefile", "CMakeLists.txt", "run")


def tracked_files(root: str) -> list[str]:
    """The files git tracks (a fresh clone: what CI sees); without git, every file outside build folders."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
        return [name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith((".", "build"))]
            names += [os.path.relpath(os.path.join(folder, f), root) for f in files]
        return names


def expand_braces(word: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", word)
    if not match:
        return [word]
    out = []
    for choice in match.group(1).split(","):
        out += expand_braces(word[: match.start()] + choice + word[match.end() :])
    return out


def exists(root: str, name: str) -> bool:
    """name (relative to root) names something here: a file, a folder (trailing /), or a glob with a match. A name
    with a placeholder ({name} without a comma: a format string's field) cannot be checked and counts as existing."""
    if re.search(r"\{[^{},]*\}", name):
        return True
    for candidate in expand_braces(name):
        if any(c in candidate for c in "*?"):
            if not glob.glob(os.path.join(root, candidate)):
                return False
        elif candidate.endswith("/"):
            if not os.path.isdir(os.path.join(root, candidate)):
                return False
        elif not os.path.exists(os.path.join(root, candidate)):
            return False
    return True


def clean(word: str) -> str:
    word = re.sub(r":\d+(-\d+)?$", "", word)  # file:line
    word = word.rstrip(".,;:")
    if word.count("{") != word.count("}"):  # a brace list cut by the line's end, or code ({ ... }) after a path
        word = word[: word.find("{")] if word.count("{") > word.count("}") else word.rstrip("}")
    return word


def check_file(root: str, name: str) -> list[str]:
    path = os.path.join(root, name)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (UnicodeDecodeError, OSError):
        return []
    problems = []
    for number, line in enumerate(lines, 1):
        words = {clean(m.group(1)) for m in PATH_WORD.finditer(line)}
        for word in sorted(words):
            if word in NOT_OURS or word == word.split("/", 1)[0] + "/":
                continue
            # a path relative to the file's own folder also counts (python/CMakeLists.txt names its sources so)
            if not exists(root, word) and not exists(os.path.join(root, os.path.dirname(name)), word):
                problems.append(f"{name}:{number}: {word} does not exist")
        if name.endswith(".md"):
            for target in MARKDOWN_LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL, or an anchor of this page
                file_part = target.split("#", 1)[0]
                resolved = os.path.normpath(os.path.join(os.path.dirname(name), file_part))
                if not os.path.exists(os.path.join(root, resolved)):
                    problems.append(f"{name}:{number}: link ({target}) does not resolve ({resolved} does not exist)")
    return problems


def main() -> int:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    names = [n for n in tracked_files(root)
             if n.endswith(TEXT_SUFFIXES) or os.path.basename(n) in TEXT_NAMES]
    names = [n for n in names if os.path.isfile(os.path.join(root, n)) and n not in HISTORY]
    problems = []
    for name in sorted(names):
        problems += check_file(root, name)
    for problem in problems:
        print(f"check-doc-paths: {problem}")
    print(f"check-doc-paths: {len(names)} files read, {len(problems)} names of missing paths")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
