"""Per-call host overhead of ferry.deep_ep (DeepEP's API) over Ferry's native API: the same work, timed both ways.

    python -m ferry.launch --nproc 1 python/bench_deep_ep_overhead.py --tokens 1     # cpu backend, torch CPU tensors
    torchrun --nproc-per-node 1 python/bench_deep_ep_overhead.py --tokens 128         # GPU: torch CUDA tensors
    python -m ferry.launch --nproc 1 python/bench_deep_ep_overhead.py --tokens 1 --stub  # the layer's Python alone

Pairs of calls, in loops of --iters, layer and native loops interleaved, the median over --repeats loops of each after
--warmup (the overhead: the median of the loop-by-loop differences):
  normal   deep_ep: dispatch (bf16, topk) + combine(handle)        native: EpBuffer.dispatch (eager) + combine("rank")
           (the same layer pair)                                   "vs owned": the same work natively, fresh outputs
                                                                   and a saved layout (EpBuffer.dispatch_owned, the
                                                                   call the layer makes) + combine(handle=)
  ll       deep_ep: low_latency_dispatch + low_latency_combine     native: EpBuffer.dispatch + combine("expert") of an
           (bf16, no hook, out given)                              LL EpBuffer of topk K (lazy, out given)
  elastic  deep_ep V2: ElasticBuffer.dispatch + combine(handle)    native: EpBuffer.dispatch_owned(with_src=True,
           (bf16, cpu sync, not expanded)                          save_handle) + combine(handle=)
           "elastic no copy": the same with do_handle_copy=False (DeepEP's default True copies topk_idx into the
           handle, in DeepEP too)
           --graph: the same ll pairs captured in CUDA graphs, a replay's host time each
The difference is what the layer adds per pair: its argument checks, pool and handle bookkeeping, and (normal) the
copies of the outputs (DeepEP returns fresh tensors). On GPUs calls are lazy where the layer's are (normal dispatch is
eager in both: it returns the count on the host, as DeepEP's). Every rank prints its own line.

--stub times the layer's own Python without the noise of the native calls: every EpBuffer (the layer's and the
native side's) answers each of its calls after the first with that first call's result, at once (StubEpBuffer), so
both sides of a pair are Python only and the difference is the layer's Python, torch ops it makes included (no
--graph then). --paths picks the pairs by name (default all).
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

import ferry  # noqa: E402
import ferry.deep_ep as deep_ep  # noqa: E402


class StubEpBuffer:
    """An EpBuffer (made by the real constructor: collective, as every rank's) whose calls, once armed, return the
    result of the first armed call of the same method at once, whatever the arguments: one call variant per method
    per buffer, as this benchmark makes. The result is the same object each time (a layer that writes into its
    outputs writes into the same tensors). Before arming (the set-up calls, a low-latency pool's empty dispatch
    among them) every call is real; attributes other than the calls are always the real buffer's."""

    native = None  # the real ferry.EpBuffer, set where --stub installs this class
    armed = False
    _CALLS = ("dispatch", "dispatch_owned", "combine", "complete_dispatch", "complete_combine", "dispatch_backward")

    def __init__(self, *args, **kwargs):
        self._real = StubEpBuffer.native(*args, **kwargs)

    @staticmethod
    def footprint(*args, **kwargs):
        return StubEpBuffer.native.footprint(*args, **kwargs)

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if name not in StubEpBuffer._CALLS or not StubEpBuffer.armed:
            return value

        def first(*args, **kwargs):
            result = value(*args, **kwargs)
            setattr(self, name, lambda *a, **k: result)  # found before __getattr__ from now on
            return result

        return first


def timed_pair(layer, native, iters: int, repeats: int, warmup: int, sync) -> tuple:
    """Host time per call of layer and of native (us): loops of iters calls, the two interleaved loop by loop (in
    turn first), so a drift of the machine moves both alike; one list of repeats loop times each."""
    for _ in range(warmup):
        layer()
        native()
    times = ([], [])
    for r in range(repeats):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn = (layer, native)[which]
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times[which].append((time.perf_counter() - start) / iters * 1e6)
    sync()
    return times


def summary(layer_times: list, native_times: list) -> tuple:
    """(layer median, native median, median of the loop-by-loop differences, their p10, their p90), us."""
    diffs = sorted(a - b for a, b in zip(layer_times, native_times))
    return (statistics.median(layer_times), statistics.median(native_times), statistics.median(diffs),
            diffs[len(diffs) // 10], diffs[-1 - len(diffs) // 10])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts-per-rank", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--graph", action="store_true", help="GPU: also time CUDA-graph replays of the ll pairs")
    parser.add_argument("--stub", action="store_true",
                        help="the layer's Python alone: EpBuffers answer with their first call's result")
    parser.add_argument("--paths", default="normal,normal vs owned,ll,elastic vs owned,elastic no copy",
                        help="comma-separated pairs to time (default: all)")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if args.stub:
        StubEpBuffer.native = ferry.EpBuffer
        ferry.EpBuffer = StubEpBuffer

    cuda = torch.cuda.is_available() and ferry.cuda_available()
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
    native = ferry.EpBuffer(comm, hidden=H, num_experts=E, topk=K,
                                    max_tokens_per_rank=buffer._normal_pool(H, E, K, False, 0).max_tokens)

    def layer_normal():
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                     num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
        buffer.combine(recv_x, handle)

    def native_normal():
        got = native.dispatch(x, idx, w)
        native.combine(got.recv_x, "rank", eager=False)

    # the same work as the layer's normal pair, natively: fresh outputs and a saved layout (EpBuffer.dispatch_owned,
    # which the layer calls), combined by that layout
    def native_owned():
        got = native.dispatch_owned(x, idx, w, save_handle=True)
        native.combine(got[0], "rank", eager=False, handle=got[5])

    # low-latency mode: the layer against the native calls a Ferry user makes for the same work (one EpBuffer of
    # topk K: the weights go with the dispatch and the combine applies them)
    native_ll = ferry.EpBuffer(comm, hidden=H, num_experts=E, topk=K, max_tokens_per_rank=ll_max, mode="ll")
    y = torch.empty((T, H), dtype=torch.bfloat16, device=device)

    def layer_ll():
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, ll_max, E, use_fp8=False)
        buffer.low_latency_combine(recv_x, idx, w, handle, out=y)

    def native_ll_pair():
        got = native_ll.dispatch(x, idx, w, eager=False)
        native_ll.combine(got.expert_x, "expert", out=y, eager=False)

    # what DeepEP's fresh normal-mode outputs cost by themselves: the torch.empty calls the layer's dispatch makes
    # (recv_x, recv_topk_idx, recv_topk_weights, and the storage of the handle's layout), none of which Ferry's
    # native dispatch needs (it returns views of its buffers)
    handle_bytes = native.handle_bytes

    def fresh_outputs():
        torch.empty((T, H), dtype=torch.bfloat16, device=device)
        torch.empty((T, K), dtype=torch.int64, device=device)
        torch.empty((T, K), dtype=torch.float32, device=device)
        torch.empty((max(handle_bytes, 1),), dtype=torch.uint8, device=device)

    # V2: ElasticBuffer.dispatch (cpu sync, not expanded) + combine against the native calls it makes: a fresh-output
    # dispatch with its sources (dispatch_owned(with_src=True)) and the combine of its saved layout
    elastic = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K) \
        if any(p.startswith("elastic") for p in paths) else None
    native_v2 = ferry.EpBuffer(comm, hidden=H, num_experts=E, topk=K, max_tokens_per_rank=T)

    def layer_elastic(do_handle_copy: bool = True):
        recv_x, _, _, handle, _ = elastic.dispatch(x, idx, w, num_experts=E, do_handle_copy=do_handle_copy)
        elastic.combine(recv_x, handle)

    def native_elastic():
        got = native_v2.dispatch_owned(x, idx, w, save_handle=True, with_src=True)
        native_v2.combine(got[0], "rank", eager=False, handle=got[5])

    pairs = [(name, layer_fn, native_fn) for name, layer_fn, native_fn in (
        ("normal", layer_normal, native_normal), ("normal vs owned", layer_normal, native_owned),
        ("ll", layer_ll, native_ll_pair), ("elastic vs owned", layer_elastic, native_elastic),
        ("elastic no copy", lambda: layer_elastic(False), native_elastic)) if name in paths]
    if args.stub:  # every buffer made and called for real once; the next call of each method is the one kept
        for _, layer_fn, native_fn in pairs:
            layer_fn()
            native_fn()
        StubEpBuffer.armed = True
    results = {}
    for name, layer_fn, native_fn in pairs:
        results[name] = summary(*timed_pair(layer_fn, native_fn, args.iters, args.repeats, args.warmup, sync))
    ft, nt = timed_pair(fresh_outputs, lambda: None, args.iters, args.repeats, args.warmup, sync)
    fresh = statistics.median(ft) - statistics.median(nt)
    if cuda and args.graph and not args.stub:
        # the same pairs captured in CUDA graphs (as a decode step is): a replay's host time, layer against native
        graphs = {}
        for name, fn in (("layer", layer_ll), ("native", native_ll_pair)):
            fn()  # every buffer made and every kernel loaded before the capture
            torch.cuda.synchronize(device)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        results["ll graph"] = summary(*timed_pair(graphs["layer"].replay, graphs["native"].replay, args.iters,
                                                  args.repeats, args.warmup, sync))
    text = "; ".join(f"{n}: layer {v[0]:.1f} us, native {v[1]:.1f} us per dispatch+combine pair, overhead "
                     f"{v[2]:.1f} us per pair ({v[2] / 2:.1f} us per call; p10..p90 {v[3]:.1f}..{v[4]:.1f})"
                     for n, v in results.items())
    text += f"; normal's fresh outputs alone (4 torch.empty): {fresh:.1f} us per dispatch"
    where = ("cuda" if cuda else "cpu") + (", stub" if args.stub else "")
    sys.stdout.write(f"rank {rank}/{world} [{where}, {T} tokens, hidden {H}, topk {K}]: {text}\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
