"""Ferry: Mixture-of-Experts dispatch and combine between GPUs (and, on the cpu backend, between processes).

A thin layer over the C++ API (include/ferry/): arrays go in and out through DLPack (torch CUDA tensors on the cuda
backend; NumPy arrays or torch CPU tensors on the cpu backend), outputs are zero-copy views of the library's
buffers, and errors are the C++ error family with the same messages.

    comm = ferry.init()                      # torchrun environment (or ferry.init(group=...) from torch.distributed)
    buf = ferry.EpBuffer(comm, hidden=7168, num_experts=256, topk=8, max_tokens_per_rank=4096, expert_capacity=1024)
    got = buf.dispatch(x, topk_idx, topk_weights, expand=True)
    y = buf.combine(run_experts(got.expert_x, got.expert_counts), layout="expert")

Training: ferry.autograd (torch.autograd Functions for dispatch and combine, an MoE layer; `from ferry import
autograd`). See docs/python.md.
"""

from __future__ import annotations

import importlib.util as _importlib_util
import sys as _sys

from . import _build_config


def _load_torch_cuda_libraries() -> None:
    """Loads the CUDA runtime and NCCL of the installed torch wheel (process-wide, RTLD_GLOBAL), without importing
    torch, before the compiled module loads its own.

    NOTE: the first libnccl.so.2 (and libcudart.so.N) a process loads serves it whole: a library loaded later that
    needs one by that name gets the one already there. torch's libraries need the NCCL they ship with (after an older
    one, `import torch` fails with an undefined symbol), so where torch is installed its copies come first, as if torch
    had been imported first; Ferry's cuda communicator checks the loaded NCCL's version itself and, on a mismatch, says
    which one to build against. torch finds them through its RPATH, $ORIGIN/../../nvidia/*/lib from torch/lib, the
    folders searched here. A module built without the cuda backend links neither: nothing to do then.
    """
    torch = _importlib_util.find_spec("torch")
    if torch is None or not torch.submodule_search_locations:
        return
    import ctypes
    import glob
    import os

    nvidia = os.path.join(os.path.dirname(list(torch.submodule_search_locations)[0]), "nvidia")
    for soname in (f"libcudart.so.{_build_config.CUDA_MAJOR}", "libnccl.so.2"):
        found = sorted(glob.glob(os.path.join(nvidia, "*", "lib", soname)))
        if found:
            ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)


if _build_config.CUDA_BACKEND and "torch" not in _sys.modules:
    _load_torch_cuda_libraries()

from ._ext import (  # noqa: F401  (the public names)
    BootstrapError,
    Communicator,
    ConfigError,
    CudaError,
    DispatchHandle,
    DispatchResult,
    EpBuffer,
    EpConfig,
    Error,
    InputError,
    NcclError,
    TimeoutError,
    __version__,
    cuda_available,
    cuda_backend_compiled,
    cuda_device_count,
    env_params,
    scale_layout_supported,
    scale_tensor_bytes,
    wire_payload_bytes,
)
from . import _ext

__all__ = [
    "BootstrapError",
    "Communicator",
    "ConfigError",
    "CudaError",
    "DispatchHandle",
    "DispatchResult",
    "EpBuffer",
    "EpConfig",
    "Error",
    "InputError",
    "NcclError",
    "TimeoutError",
    "cuda_available",
    "cuda_backend_compiled",
    "cuda_device_count",
    "env_params",
    "init",
    "scale_layout_supported",
    "scale_tensor_bytes",
    "wire_payload_bytes",
]


def init(
    *,
    backend: str | None = None,
    group=None,
    bootstrap=None,
    device: int = -1,
    rank: int | None = None,
    world: int | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    local_rank: int | None = None,
    local_world: int | None = None,
    timeout_s: float = 60.0,
    topology: str | None = None,
) -> Communicator:
    """Creates this rank's communicator. Collective: every rank calls it with the same backend.

    How the ranks find each other (the first that applies):
      group=G        a torch.distributed process group (ferry exchanges its setup messages over a gloo group with
                     the same ranks; see ferry.torch_bootstrap.TorchGroupBootstrap)
      bootstrap=B    any object with rank, world, local_rank, local_world and allgather / broadcast / barrier
                     (the protocol of ferry.torch_bootstrap.TorchGroupBootstrap)
      rank=, world=  a TCP rendezvous on master_addr:master_port (rank 0 listens), without the environment
      (none)         the torchrun environment: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (what torchrun
                     and python -m ferry.launch set); under torchrun, whose agent holds a store on MASTER_PORT, through
                     that store (ferry.torch_bootstrap.TorchStoreBootstrap), else a TCP rendezvous on MASTER_PORT

    backend: "cuda" or "cpu"; default "cuda" when ferry.cuda_available(), else "cpu".
    device: cuda only, the GPU of this rank; -1 means the local rank.
    topology: "NxM" emulates N nodes of M ranks on this host (overrides FERRY_TOPOLOGY; docs/internode.md).
    Raises BootstrapError (rendezvous), ConfigError (backend or options), CudaError / NcclError (transport setup).
    """
    if backend is None:
        backend = "cuda" if cuda_available() else "cpu"
    if group is not None and bootstrap is not None:
        raise ConfigError("config error: pass group= or bootstrap=, not both")
    if group is not None:
        from .torch_bootstrap import TorchGroupBootstrap

        bootstrap = TorchGroupBootstrap(group)
    if bootstrap is not None:
        return _ext._init_python(bootstrap, backend, device, topology or "")
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ConfigError("config error: ferry.init needs both rank= and world= (or neither, to read the env)")
        return _ext._init_socket(
            backend,
            device,
            master_addr,
            master_port,
            rank,
            world,
            rank if local_rank is None else local_rank,
            world if local_world is None else local_world,
            timeout_s,
            topology or "",
        )
    from .torch_bootstrap import TorchStoreBootstrap, torchrun_agent_store

    if torchrun_agent_store():
        return _ext._init_python(TorchStoreBootstrap(timeout_s=timeout_s), backend, device, topology or "")
    return _ext._init_env(backend, device, topology or "")

