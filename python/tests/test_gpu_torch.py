"""The torch path on GPUs: 2 ranks (one process per GPU, through ferry.launch) run gpu_worker.py, which compares the
cuda backend with the NumPy reference bit for bit (bf16; with --quant the fp8 wire format, see gpu_worker.py). Skips
without torch, without the cuda backend or below 2 GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ferry

HERE = Path(__file__).resolve().parent


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return -1
    # NOTE: torch counts through NVML without creating a CUDA context. This runs in pytest's own process, whose other
    # tests fork rank processes: CUDA initialised here (ferry.cuda_available() would do it) breaks every forked child.
    return torch.cuda.device_count()


pytestmark = [
    pytest.mark.skipif(_gpus() < 0, reason="torch is not installed"),
    pytest.mark.skipif(not ferry.cuda_backend_compiled, reason="no cuda backend in this build"),
    pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs"),
]


def _launch(*worker_args):
    env = dict(os.environ)
    package_root = str(Path(ferry.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        env[name] = value
    done = subprocess.run([sys.executable, "-m", "ferry.launch", "--nproc", "2", "--timeout", "240",
                           str(HERE / "gpu_worker.py"), *worker_args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("gpu torch checks passed") == 2, done.stdout


def test_torch_cuda_tensors_match_the_reference():
    _launch()


def test_bootstrap_from_a_torch_gloo_group():
    _launch("--torch-group")


def test_fp8_wire_format_matches_the_numpy_quantizer():
    _launch("--quant")


def test_moe_layer_example_on_gpus():
    env = dict(os.environ)
    package_root = str(Path(ferry.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-m", "ferry.launch", "--nproc", "2", "--timeout", "240",
                           str(HERE.parents[1] / "examples" / "moe_layer.py"), "--backend", "cuda"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": OK") == 2, done.stdout
