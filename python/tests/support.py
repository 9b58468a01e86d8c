"""Runs a test body as N ranks (forked processes, one communicator each, cpu backend) and brings their results back.

run_ranks(body, world, *args) calls body(ctx, *args) in every rank, where ctx.rank / ctx.world are the rank's place
and ctx.init(**kw) creates its communicator (a TCP rendezvous on a port picked here). It returns the bodies' return
values in rank order, or fails with every failing rank's traceback. A rank that does not finish within `timeout`
seconds is killed and reported: a test never hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass

import ferry


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankContext:
    rank: int
    world: int
    port: int

    def init(self, **kwargs) -> ferry.Communicator:
        kwargs.setdefault("backend", "cpu")
        kwargs.setdefault("timeout_s", 30.0)
        return ferry.init(rank=self.rank, world=self.world, master_port=self.port, **kwargs)


def _child(body, ctx: RankContext, conn, env: dict, args: tuple) -> None:
    code = 0
    try:
        os.environ.update(env)
        conn.send((True, body(ctx, *args)))
    except BaseException:  # noqa: BLE001  (everything goes back to the parent)
        code = 1
        try:
            conn.send((False, traceback.format_exc()))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        conn.close()
        os._exit(code)  # NOTE: skip the parent's (pytest's) exit handlers, inherited through fork


def run_ranks(body, world: int, *args, timeout: float = 60.0, env: dict | None = None) -> list:
    ctx = mp.get_context("fork")
    port = free_port()
    pipes, procs = [], []
    for rank in range(world):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(body, RankContext(rank, world, port), child_end, env or {}, args))
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
    deadline = time.monotonic() + timeout
    results: list = [None] * world
    failures = []
    for rank, (pipe, proc) in enumerate(zip(pipes, procs)):
        left = max(0.0, deadline - time.monotonic())
        if pipe.poll(left):
            try:
                ok, value = pipe.recv()
            except EOFError:
                ok, value = False, "rank exited without a result"
        else:
            ok, value = False, f"no result within {timeout} s (killed)"
        if ok:
            results[rank] = value
        else:
            failures.append(f"--- rank {rank}:\n{value}")
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    if failures:
        raise AssertionError("rank failures:\n" + "\n".join(failures))
    return results


def torch_cuda_backend() -> bool:
    """Whether the torch tests run on the cuda backend: ferry has it compiled and torch sees a GPU.

    NOTE: counted through NVML (torch.cuda.device_count creates no CUDA context): pytest's process, whose tests fork
    rank processes, must never initialise CUDA (a forked child of a process with a context cannot use CUDA)."""
    import torch

    return ferry.cuda_backend_compiled and torch.cuda.device_count() > 0


def _on_host(ctx: RankContext, body, *args):
    """body's result with every tensor in it moved to host memory: a CUDA tensor sent back to pytest's process would
    initialise CUDA there."""
    import torch

    return torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, body(ctx, *args))


def run_torch_ranks(body, world: int, *args, timeout: float = 240):
    """run_ranks for bodies that use torch: their results come back in host memory, and on the cuda backend
    (torch_cuda_backend) world 1 runs on the GPU in one forked rank while larger worlds skip (one process per GPU)."""
    import pytest

    if world > 1 and torch_cuda_backend():
        pytest.skip(f"cuda backend: world {world} needs one process per GPU; this file runs world 1 on a GPU")
    return run_ranks(_on_host, world, body, *args, timeout=timeout)

