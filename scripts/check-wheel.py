#!/usr/bin/env python3
"""Checks what the Python wheel holds and that what it installs runs: the package ferry (its .py files, the module
ferry._ext, _build_config.py), the `ferry` CLI as a script (so on the PATH of the environment it is installed into),
the licence in the metadata, one version everywhere.

  scripts/check-wheel.py --wheel FILE.whl    a wheel pip built (make wheel-check): its file list and METADATA, then
                                             installed into a scratch virtual environment, where `ferry --version`
                                             and `import ferry` must report the wheel's version
  scripts/check-wheel.py --build-tree BUILD  (run by the module's python; CMAKE names cmake) what CMake contributes to the wheel, without building one (a CTest, so
                                             CI checks it in seconds): `cmake --install BUILD --component python`
                                             (the install pip runs) into a scratch prefix, the package's .py files
                                             beside it as pyproject's wheel.packages puts them, pyproject.toml's
                                             licence declaration; then the installed CLI and `import ferry` run

Exit status 0 when everything holds; 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def cmake_version() -> str:
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        return re.search(r"project\(ferry VERSION ([0-9.]+)", f.read()).group(1)


def pyproject_license() -> tuple[str, list[str]]:
    """(project.license, project.license-files) as pyproject.toml declares them (read as text: Python 3.9 has no
    tomllib)."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        text = f.read()
    project = text[text.index("[project]"):]
    project = project[: project.index("\n[", 1)]
    license_match = re.search(r'^license = "([^"]+)"', project, re.M)
    files_match = re.search(r"^license-files = \[(.*)\]", project, re.M)
    return (license_match.group(1) if license_match else "",
            re.findall(r'"([^"]+)"', files_match.group(1)) if files_match else [])


def run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def check_runs(python: str, cli: str, version: str, env: dict, problems: list[str]) -> None:
    """The installed CLI and package report `version`; importing the package imports no torch."""
    out = run([cli, "--version"], env)
    if out.returncode != 0 or not out.stdout.startswith(f"ferry {version} ("):
        problems.append(f"{cli} --version: exit {out.returncode}, printed {out.stdout.strip()!r} {out.stderr.strip()!r}")
    code = "import sys, ferry; print(ferry.__version__, 'torch' in sys.modules)"
    out = run([python, "-c", code], env)
    if out.returncode != 0 or out.stdout.split() != [version, "False"]:
        problems.append(f"import ferry: exit {out.returncode}, printed {out.stdout.strip()!r} {out.stderr.strip()[-500:]!r}")


def check_wheel(path: str) -> list[str]:
    problems = []
    version = cmake_version()
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        dist_info = f"ferry-{version}.dist-info"
        metadata = wheel.read(f"{dist_info}/METADATA").decode() if f"{dist_info}/METADATA" in names else ""
    license_name, license_files = pyproject_license()
    wanted = [f"ferry-{version}.data/scripts/ferry", "ferry/__init__.py", "ferry/launch.py", "ferry/_build_config.py"]
    wanted += [f"{dist_info}/licenses/{name}" for name in license_files]
    for name in wanted:
        if name not in names:
            problems.append(f"{os.path.basename(path)} holds no {name}")
    if not any(re.fullmatch(r"ferry/_ext\..*\.so", n) for n in names):
        problems.append(f"{os.path.basename(path)} holds no ferry/_ext.*.so")
    for line in (f"Version: {version}", f"License-Expression: {license_name}", "Author: The Ferry developers",
                 'Requires-Dist: torch; extra == "torch"'):
        if line not in metadata.splitlines():
            problems.append(f"{os.path.basename(path)}'s METADATA has no line '{line}'")
    if problems:
        return problems
    with tempfile.TemporaryDirectory(prefix="ferry-wheel-") as scratch:
        venv = os.path.join(scratch, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
        python = os.path.join(venv, "bin", "python")
        out = run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check", path])
        if out.returncode != 0:
            return [f"pip install {path}: {out.stderr.strip()[-500:]}"]
        cli = os.path.join(venv, "bin", "ferry")
        if not os.access(cli, os.X_OK):
            return [f"installing the wheel put no executable ferry in {os.path.dirname(cli)}"]
        env = dict(os.environ, PATH=os.path.dirname(cli) + os.pathsep + os.environ.get("PATH", ""))
        env.pop("PYTHONPATH", None)
        check_runs(python, cli, version, env, problems)
    return problems


def check_build_tree(build: str) -> list[str]:
    problems = []
    version = cmake_version()
    license_name, license_files = pyproject_license()
    if license_name != "MIT" or not license_files:
        problems.append(f"pyproject.toml declares license={license_name!r}, license-files={license_files}")
    for name in license_files:
        if not os.path.isfile(os.path.join(REPO, name)):
            problems.append(f"pyproject.toml's license file {name} does not exist")
    with tempfile.TemporaryDirectory(prefix="ferry-wheel-layout-") as prefix:
        out = run([os.environ.get("CMAKE", "cmake"), "--install", build, "--component", "python", "--prefix", prefix])
        if out.returncode != 0:
            return problems + [f"cmake --install {build} --component python: {out.stderr.strip()[-500:]}"]
        for source in glob.glob(os.path.join(REPO, "python", "ferry", "*.py")):  # pyproject's wheel.packages
            shutil.copy(source, os.path.join(prefix, "ferry"))
        cli = os.path.join(prefix, "bin", "ferry")
        for path in (cli, os.path.join(prefix, "ferry", "_build_config.py")):
            if not os.path.isfile(path):
                problems.append(f"the component python installs no {os.path.relpath(path, prefix)}")
        if not glob.glob(os.path.join(prefix, "ferry", "_ext.*.so")):
            problems.append("the component python installs no ferry/_ext.*.so")
        if problems:
            return problems
        env = dict(os.environ, PYTHONPATH=prefix)
        check_runs(sys.executable, cli, version, env, problems)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--wheel", help="a wheel file pip built")
    which.add_argument("--build-tree", help="a CMake build folder configured with FERRY_BUILD_PYTHON=ON")
    opts = parser.parse_args()
    problems = check_wheel(opts.wheel) if opts.wheel else check_build_tree(opts.build_tree)
    for problem in problems:
        print(f"check-wheel: {problem}")
    print(f"check-wheel: {'FAIL' if problems else 'OK'} ({opts.wheel or opts.build_tree})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
