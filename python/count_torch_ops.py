"""Counts the torch (aten) ops one call makes, through a TorchDispatchMode: the per-call torch work of ferry.deep_ep
(DeepEP's API) and of the native calls the same work takes. On a GPU each op costs some microseconds of host time
(the dispatcher, the caching allocator, a kernel launch); views cost less, so they are listed apart.

    python -m ferry.launch --nproc 1 python/count_torch_ops.py --tokens 1       # cpu backend, torch CPU tensors
    torchrun --nproc-per-node 1 python/count_torch_ops.py --tokens 1            # GPU
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

# NOTE: python/ferry (sources without the compiled module) sits next to this script: drop this folder from the path
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import ferry  # noqa: E402
import ferry.deep_ep as deep_ep  # noqa: E402

# ops that make no kernel and allocate nothing (metadata only)
_VIEWS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "transpose", "t", "permute",
          "as_strided", "alias", "reshape", "detach", "lift_fresh", "view_as", "_reshape_alias", "unbind", "split"}


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(fn, calls: int) -> dict:
    fn()  # warm: pools, cached views
    with Counter() as c:
        for _ in range(calls):
            fn()
    return {name: n / calls for name, n in c.ops.items()}


def describe(name: str, ops: dict) -> str:
    views = sum(n for op, n in ops.items() if op in _VIEWS)
    work = {op: n for op, n in ops.items() if op not in _VIEWS}
    text = ", ".join(f"{op} {n:g}" for op, n in sorted(work.items()))
    return f"{name}: {sum(work.values()):g} ops ({text or 'none'}) + {views:g} views"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts-per-rank", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and ferry.cuda_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    T, H, K = args.tokens, args.hidden, args.topk
    E = args.experts_per_rank * world
    buffer = deep_ep.Buffer(dist.group.WORLD, deep_ep.Config().get_nvl_buffer_size_hint(H * 2, world),
                            deep_ep.Buffer.get_low_latency_rdma_size_hint(max(T, 1), H, world, E),
                            low_latency_mode=True, num_qps_per_rank=E // world)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
    w = torch.rand((T, K), generator=gen).to(device)
    layout = buffer.get_dispatch_layout(idx, E)
    y = torch.empty((T, H), dtype=torch.bfloat16, device=device)
    state = {}

    def dispatch():
        state["n"] = buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                     num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)

    def combine():
        buffer.combine(state["n"][0], state["n"][4])

    def ll_dispatch():
        state["l"] = buffer.low_latency_dispatch(x, idx, max(T, 1), E, use_fp8=False)

    def ll_combine():
        buffer.low_latency_combine(state["l"][0], idx, w, state["l"][2], out=y)

    lines = [describe(n, count(f, args.calls)) for n, f in (("dispatch", dispatch), ("combine", combine),
                                                            ("low_latency_dispatch", ll_dispatch),
                                                            ("low_latency_combine", ll_combine))]
    sys.stdout.write(f"rank {rank}/{world} [{'cuda' if cuda else 'cpu'}, {T} tokens, hidden {H}, topk {K}] torch ops "
                     "per call:\n  " + "\n  ".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
