"""`import ferry` imports no torch (1.7-1.9 s where torch is installed, for nothing the core API needs), and keeps the
order of the CUDA libraries safe without it: where the module has the cuda backend and torch is installed, torch's
libnccl.so.2 and libcudart are loaded first (ferry/__init__.py), so a later `import torch` finds the NCCL it needs
(after an older NCCL, `import torch` fails with an undefined symbol: ncclCommResume with NCCL 2.28 against torch's
2.30). Each case runs in a fresh interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ferry
from ferry import _build_config


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    package_root = str(Path(ferry.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_import_ferry_leaves_torch_unimported():
    done = _python("import sys, ferry, ferry.launch\n"
                   "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
                   "print(len(torch), torch[:3])")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 []", done.stdout


def test_torch_imports_after_ferry():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    done = _python("import ferry, torch\nprint('torch', torch.__version__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("torch "), done.stdout


def test_cuda_module_loads_torchs_nccl_first():
    # The NCCL this process has loaded after `import ferry` is torch's (the one next to torch's package), not the one
    # the module was built against: what `import torch` first used to ensure.
    if not _build_config.CUDA_BACKEND:
        pytest.skip("built without the cuda backend: the module links no NCCL, nothing to order")
    spec = importlib.util.find_spec("torch")
    if spec is None:
        pytest.skip("torch is not installed")
    nvidia = Path(list(spec.submodule_search_locations)[0]).parent / "nvidia"
    if not list(nvidia.glob("*/lib/libnccl.so.2")):
        pytest.skip(f"this torch ships no NCCL under {nvidia}")
    done = _python("import ferry\n"
                   "print('\\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libnccl.so' in l})))")
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    assert len(loaded) == 1 and Path(loaded[0]).resolve().parent.parent.parent == nvidia.resolve(), done.stdout
