"""Per-call host overhead of ferry.deep_ep (DeepEP's API) over Ferry's native API: the same work, timed both ways.

    python -m ferry.launch --nproc 1 python/bench_deep_ep_overhead.py --tokens 1     # cpu backend, torch CPU tensors
    torchrun --nproc-per-node 1 python/bench_deep_ep_overhead.py --tokens 128         # GPU: torch CUDA tensors

Pairs of calls, in loops of --iters, the median over --repeats loops after --warmup:
  normal   deep_ep: dispatch (bf16, topk) + combine(handle)        native: EpBuffer.dispatch (eager) + combine("rank")
  ll       deep_ep: low_latency_dispatch + low_latency_combine     native: the EpBuffer calls the layer makes (a
           (bf16, no hook)                                         (token, k) pair per row, topk 1, lazy) + the
                                                                   same expand of x and weighted sum in torch
The difference is what the layer adds per pair: its argument checks, pool and handle bookkeeping, and (normal) the
copies of the outputs (DeepEP returns fresh tensors); the ll native side already includes the torch ops the
mapping needs, so its difference is the layer's Python alone. On GPUs calls are lazy where the layer's are (normal
dispatch is eager in both: it returns the count on the host, as DeepEP's). Every rank prints its own line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# NOTE: python/ferry (sources without the compiled module) sits next to this script: drop this folder from the path
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ferry.deep_ep as deep_ep  # noqa: E402


def timed(fn, iters: int, repeats: int, warmup: int, sync) -> list:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters * 1e6)
    sync()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts-per-rank", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and deep_ep.ferry.cuda_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    T, H, K = args.tokens, args.hidden, args.topk
    E = args.experts_per_rank * world
    ll_max = max(T, 1)
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(H * 2, world),
                            deep_ep.Buffer.get_low_latency_rdma_size_hint(ll_max, H, world, E), low_latency_mode=True,
                            num_qps_per_rank=E // world)
    comm = buffer.comm
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
    w = torch.rand((T, K), generator=gen).to(device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
        comm.barrier()

    # normal mode
    layout = buffer.get_dispatch_layout(idx, E)
    native = deep_ep.ferry.EpBuffer(comm, hidden=H, num_experts=E, topk=K,
                                    max_tokens_per_rank=buffer._normal_pool(H, E, K, False, 0).max_tokens)

    def layer_normal():
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                     num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
        buffer.combine(recv_x, handle)

    def native_normal():
        got = native.dispatch(x, idx, w)
        native.combine(got.recv_x, "rank", eager=False)

    # low-latency mode: the layer against the native calls it makes
    native_ll = deep_ep.ferry.EpBuffer(comm, hidden=H, num_experts=E, topk=1, max_tokens_per_rank=ll_max * K,
                                       expert_capacity=world * ll_max, mode="ll")
    ones = torch.ones((T * K, 1), device=device)
    pairs_in = torch.empty((T * K, H), dtype=torch.bfloat16, device=device)
    pairs_in3 = pairs_in.view(T, K, H)
    pairs_out = torch.empty((T * K, H), dtype=torch.bfloat16, device=device)
    pairs_out3 = pairs_out.view(T, K, H)
    y = torch.empty((T, H), dtype=torch.bfloat16, device=device)

    def layer_ll():
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, ll_max, E, use_fp8=False)
        buffer.low_latency_combine(recv_x, idx, w, handle, out=y)

    def native_ll_pair():  # the torch ops of the layer's mapping, on tensors made once
        pairs_in3.copy_(x.unsqueeze(1))
        got = native_ll.dispatch(pairs_in, idx.reshape(T * K, 1), ones, eager=False)
        native_ll.combine(got.expert_x, "expert", out=pairs_out, eager=False)
        y.copy_(torch.mul(pairs_out3, w.masked_fill(idx < 0, 0.0).unsqueeze(2)).sum(dim=1))

    results = {}
    for name, layer_fn, native_fn in (("normal", layer_normal, native_normal), ("ll", layer_ll, native_ll_pair)):
        lt = timed(layer_fn, args.iters, args.repeats, args.warmup, sync)
        nt = timed(native_fn, args.iters, args.repeats, args.warmup, sync)
        diffs = sorted(a - b for a, b in zip(lt, nt))
        results[name] = (statistics.median(lt), statistics.median(nt), statistics.median(diffs),
                         diffs[len(diffs) // 10], diffs[-1 - len(diffs) // 10])
    text = "; ".join(f"{n}: layer {v[0]:.1f} us, native {v[1]:.1f} us per dispatch+combine pair, overhead "
                     f"{v[2]:.1f} us per pair ({v[2] / 2:.1f} us per call; p10..p90 {v[3]:.1f}..{v[4]:.1f})"
                     for n, v in results.items())
    sys.stdout.write(f"rank {rank}/{world} [{'cuda' if cuda else 'cpu'}, {T} tokens, hidden {H}, topk {K}]: {text}\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
