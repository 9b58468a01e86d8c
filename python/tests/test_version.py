"""One version, written once (CMakeLists.txt's project(ferry VERSION ...)), reported alike by ferry.__version__, the
ferry CLI (`ferry --version`), the CMake package (FerryConfigVersion.cmake) and the wheel (pyproject.toml reads it
from CMakeLists.txt with a regex; an installed wheel's metadata)."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ferry
from ferry import _ext

REPO = Path(__file__).resolve().parents[2]


def _cmake_version() -> str:
    found = re.search(r"project\(ferry VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    assert found, "CMakeLists.txt has no project(ferry VERSION ...)"
    return found.group(1)


def _wheel_version() -> str:
    """What scikit-build-core's regex provider reads, with pyproject.toml's own input and regex."""
    text = (REPO / "pyproject.toml").read_text()
    section = text[text.index("[tool.scikit-build.metadata.version]"):]
    source = re.search(r'^input = "([^"]+)"', section, re.M).group(1)
    regex = re.search(r"^regex = '([^']+)'", section, re.M).group(1)
    return re.search(regex, (REPO / source).read_text()).group("value")


def test_module_wheel_and_cmake_agree():
    version = _cmake_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert ferry.__version__ == version
    assert _wheel_version() == version


def test_build_tree_cli_and_cmake_package_agree():
    build = Path(_ext.__file__).resolve().parents[2]  # BUILD/python/ferry/_ext*.so
    config = build / "FerryConfigVersion.cmake"
    cli = build / "ferry"
    if not config.exists() or not cli.exists():
        pytest.skip(f"ferry is not imported from a CMake build folder ({build})")
    assert re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', config.read_text()).group(1) == ferry.__version__
    for flag in ("--version", "version"):
        out = subprocess.run([str(cli), flag], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"ferry {ferry.__version__} ("), out.stdout


def test_installed_wheel_agrees():
    try:
        dist = importlib.metadata.distribution("ferry")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ferry is not installed from a wheel here (imported from a build folder)")
    if Path(dist.locate_file("ferry/__init__.py")).resolve() != Path(ferry.__file__).resolve():
        pytest.skip("the installed ferry is not the one imported")
    assert dist.version == ferry.__version__
    cli = shutil.which("ferry", path=str(Path(sys.executable).parent))
    assert cli, "the wheel installs the ferry CLI into the environment's scripts folder"
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith(f"ferry {ferry.__version__} ("), out.stdout + out.stderr
