"""Per-call host overhead of the Python binding: dispatch + combine called from Python, minus the same calls made in
a C++ loop by the binding (EpBuffer._time_cpp_loop: the same arguments, converted once, the GIL released).

    torchrun --nproc-per-node 2 python/bench_overhead.py            # GPUs: torch CUDA tensors (cuda backend)
    python -m ferry.launch --nproc 2 python/bench_overhead.py       # anywhere: NumPy arrays (cpu backend)
    python -m ferry.launch --nproc 1 python/bench_overhead.py --backend cpu --torch    # torch CPU tensors

--mode ll runs low-latency mode (the decode path: expert-major, always lazy on the device) instead of normal mode.

Lazy calls (the default, --eager to change) never synchronise on the cuda backend, so a loop measures what the host
spends to enqueue them; each timed loop starts from a synchronised stream and stays short (--iters) so the launch
queue never fills and the GPU never paces the host. Eager calls include the device time in both loops, which then
cancels in the difference (noisier). Every rank prints its own line; a leg is collective, so all ranks run the same
sequence of calls.

What the difference holds: the Python frames of the calls, importing the arrays (a DLPack capsule or the buffer
protocol per argument), reading the current torch stream when none is given, slicing the cached views (eager), the
result object, and releasing / taking the GIL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

# NOTE: python/ferry (the package's sources, without the compiled module) sits next to this script and would shadow
# the installed package (or BUILD/python on PYTHONPATH): drop this script's folder from the import path.
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

import ferry  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden (default 2048)")
    parser.add_argument("--experts-per-rank", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--layout", choices=["expert", "rank"], default="expert", help="combine layout")
    parser.add_argument("--eager", action="store_true", help="eager calls (default lazy)")
    parser.add_argument("--explicit-stream", action="store_true",
                        help="pass the stream to every call (default: the current torch stream is looked up)")
    parser.add_argument("--iters", type=int, default=50, help="dispatch + combine pairs per timed loop (default 50)")
    parser.add_argument("--repeats", type=int, default=21, help="timed loops; the median is reported (default 21)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--mode", choices=["normal", "ll"], default="normal",
                        help="EpBuffer mode (default normal; ll: low-latency, the decode path)")
    parser.add_argument("--torch", action="store_true",
                        help="cpu backend: torch CPU tensors instead of NumPy arrays (the cuda backend always uses torch)")
    args = parser.parse_args()

    backend = args.backend if args.backend != "auto" else ("cuda" if ferry.cuda_available() else "cpu")
    torch = None
    device = None
    if backend == "cuda" or args.torch:
        import torch

    if backend == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    elif args.torch:
        device = torch.device("cpu")
    if args.mode == "ll" and args.layout != "expert":
        parser.error("--mode ll combines from the expert-major layout only (--layout expert)")
    comm = ferry.init(backend=backend)
    world, rank = comm.world, comm.rank
    num_experts = args.experts_per_rank * world
    capacity = world * args.tokens  # nothing dropped
    buf = ferry.EpBuffer(comm, hidden=args.hidden, num_experts=num_experts, topk=args.topk,
                         max_tokens_per_rank=args.tokens, expert_capacity=capacity, mode=args.mode)

    rng = np.random.default_rng([7, rank])
    x = rng.integers(0, 0x3F80, (args.tokens, args.hidden), dtype=np.uint16)
    idx = np.stack([rng.permutation(num_experts)[: args.topk] for _ in range(args.tokens)]).astype(np.int64)
    w = rng.random((args.tokens, args.topk), dtype=np.float32)
    if args.layout == "expert":
        combine_x = np.zeros((buf.num_local_experts, capacity, args.hidden), np.uint16)
    else:
        combine_x = np.zeros((buf.recv_capacity, args.hidden), np.uint16)
    out = np.zeros((args.tokens, args.hidden), np.uint16)
    stream = None
    sync = comm.barrier
    if torch is not None:
        def to_dev(a):
            t = torch.from_numpy(a)
            return (t.view(torch.int16).view(torch.bfloat16) if a.dtype == np.uint16 else t).to(device)

        x, idx, w, combine_x, out = (to_dev(a) for a in (x, idx, w, combine_x, out))
        if args.explicit_stream and backend == "cuda":
            stream = torch.cuda.current_stream(device).cuda_stream

        def sync():
            if backend == "cuda":
                torch.cuda.synchronize(device)
            comm.barrier()

    expand = args.layout == "expert"
    kwargs = dict(expand=expand, eager=args.eager, stream=stream)

    def python_loop(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            buf.dispatch(x, idx, w, **kwargs)
            buf.combine(combine_x, args.layout, out=out, eager=args.eager, stream=stream)
        return time.perf_counter() - start

    python_loop(args.warmup)
    buf._time_cpp_loop(args.warmup, x, idx, w, expand, combine_x, args.layout, out, args.eager, stream)
    python_times, cpp_times = [], []
    for _ in range(args.repeats):
        sync()
        python_times.append(python_loop(args.iters))
        sync()
        cpp_times.append(buf._time_cpp_loop(args.iters, x, idx, w, expand, combine_x, args.layout, out, args.eager,
                                            stream))
    sync()
    if not args.eager:
        comm.check_errors(stream if backend != "cuda" else torch.cuda.current_stream(device))

    us = 1e6 / args.iters
    py = statistics.median(python_times) * us
    cpp = statistics.median(cpp_times) * us
    diffs = sorted((p - c) * us for p, c in zip(python_times, cpp_times))
    overhead = statistics.median(diffs)
    spread = (diffs[len(diffs) // 10], diffs[-1 - len(diffs) // 10])
    arrays = "numpy" if torch is None else "torch"
    sys.stdout.write(
        f"rank {rank}/{world} [{backend}, {arrays}, mode={args.mode}, {'eager' if args.eager else 'lazy'}, "
        f"layout={args.layout}, "
        f"{'explicit' if stream is not None else 'current'} stream]: dispatch+combine from Python {py:.1f} us, "
        f"in C++ {cpp:.1f} us; Python overhead {overhead:.1f} us per pair ({overhead / 2:.1f} us per call; "
        f"p10..p90 {spread[0]:.1f}..{spread[1]:.1f} us per pair)\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
