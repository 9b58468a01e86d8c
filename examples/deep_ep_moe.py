"""An MoE layer written the way an engine writes it against DeepEP's Buffer, running on Ferry through ferry.deep_ep.
Needs torch (`pip install .[torch]`).

    python -m ferry.launch --nproc 2 examples/deep_ep_moe.py     # anywhere: cpu backend, torch CPU tensors
    torchrun --nproc-per-node 2 examples/deep_ep_moe.py          # GPUs: cuda backend, the decode step in a CUDA graph

The engine code below only knows DeepEP's API; the one line that picks the library is the import (with DeepEP
installed, `import deep_ep` runs the same code). Each rank holds `tokens` tokens and the experts [r*E/W, (r+1)*E/W).

  prefill (normal mode): router (top-k of x @ W_router, softmax over the k), get_dispatch_layout, dispatch (keeping the
      handle), a cached dispatch of the same tokens through the handle (as an engine does for a second tensor with the
      same routing), the experts over the received rows grouped by local expert (each row's weighted sum over its
      local experts, since normal-mode combine adds rows without weights), combine;
  decode (low-latency mode): low_latency_dispatch with the receive hook, a grouped expert GEMM over the
      [local experts, slots, hidden] layout (batched over every slot: no host sync, graph-capturable),
      low_latency_combine (weights applied there) with its hook. On GPUs the decode step is captured in a CUDA graph
      and replayed on new inputs; on the cpu backend it runs eagerly (no graphs).

The check recomputes every rank's tokens densely in this process (weights from one seed, tokens from (seed, rank)):
y_ref[t] = sum_k w[t,k] * bf16(expert_k(x[t])) in float64, compared with this rank's rows of both steps.

Tolerance (bf16): |y - y_ref| <= 2^-6 * sum_k |w[t,k] * bf16(expert_k(x[t]))| + 1e-6 elementwise. The expert output
may differ from the dense one by one bf16 ulp (at most 2^-7 relative: the fp32 matmuls see other batch shapes, hence
other summation orders, and a value near a rounding boundary can round the other way). Prefill rounds to bf16 twice
more, each within half an ulp (2^-8 relative) of a value bounded by that sum of magnitudes: the row each rank sends
back (its local experts' weighted sum) and combine's sum over ranks (fp32, rounded once). Decode rounds once (the
source's fp32 weighted sum over k). 2^-7 + 2^-8 + 2^-8 = 2^-6 covers both. Routing and transport are exact.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as missing:  # one line from rank 0, not a traceback per rank
    if missing.name != "torch":
        raise
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write("examples/deep_ep_moe.py needs torch: pip install torch (or, from the repository, "
                         "pip install .[torch])\n")
    sys.exit(1)

import ferry.deep_ep as deep_ep  # the engine's `import deep_ep`


class Experts:
    """Router and expert weights (w1 [E, H, F], w2 [E, F, H]: out = silu(x w1) w2), drawn from one seed."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, seed: int, device):
        gen = torch.Generator().manual_seed(seed)
        self.router = (torch.randn((hidden, num_experts), generator=gen) / hidden**0.5).to(device)
        self.w1 = (torch.randn((num_experts, hidden, ffn), generator=gen) / hidden**0.5).to(device)
        self.w2 = (torch.randn((num_experts, ffn, hidden), generator=gen) / ffn**0.5).to(device)

    def route(self, x, topk: int):
        logits = x.float() @ self.router
        chosen, idx = torch.topk(logits, topk, dim=-1)
        return idx.to(deep_ep.topk_idx_t), torch.softmax(chosen, dim=-1)

    def apply(self, e, rows):
        """bf16 rows through expert(s) e (an int, or a [n] tensor for batched slots), fp32 inside, bf16 out."""
        h = torch.nn.functional.silu(rows.float() @ self.w1[e])
        return (h @ self.w2[e]).to(torch.bfloat16)


class MoELayer:
    """The engine's MoE layer: one deep_ep.Buffer for both modes."""

    def __init__(self, group, experts: Experts, hidden: int, num_experts: int, topk: int, max_decode_tokens: int):
        self.world, self.rank = group.size(), group.rank()
        self.experts, self.hidden, self.num_experts, self.topk = experts, hidden, num_experts, topk
        self.num_local = num_experts // self.world
        self.max_decode_tokens = max_decode_tokens
        num_nvl_bytes = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, self.world)
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_decode_tokens, hidden, self.world,
                                                                       num_experts)
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                                     num_qps_per_rank=self.num_local)

    def prefill(self, x):
        topk_idx, topk_weights = self.experts.route(x, self.topk)
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
            self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
            topk_weights=topk_weights, config=deep_ep.Buffer.get_dispatch_config(self.world))
        again, *_ = self.buffer.dispatch(x, handle=handle)  # cached dispatch: the same layout
        assert torch.equal(again, recv_x), "cached dispatch delivered other rows"
        # grouped expert GEMM: each local expert over the rows that chose it, weighted, summed per row in fp32
        acc = torch.zeros((recv_x.size(0), self.hidden), dtype=torch.float32, device=x.device)
        first = self.rank * self.num_local
        for e, count in enumerate(num_recv_per_expert):
            if count == 0:
                continue
            rows, k = torch.nonzero(recv_topk_idx == e, as_tuple=True)
            out = self.experts.apply(first + e, recv_x[rows])
            acc.index_add_(0, rows, out.float() * recv_topk_weights[rows, k].unsqueeze(1))
        combined_x, _, _ = self.buffer.combine(acc.to(torch.bfloat16), handle,
                                               config=deep_ep.Buffer.get_combine_config(self.world))
        return combined_x, topk_idx, topk_weights

    def decode(self, x, topk_idx, topk_weights, out):
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, self.max_decode_tokens, self.num_experts, use_fp8=False, return_recv_hook=True)
        hook()  # the rows have arrived (an engine overlaps other work before this)
        local = torch.arange(self.rank * self.num_local, (self.rank + 1) * self.num_local, device=x.device)
        # batched over every slot (slots past recv_count hold stale rows that combine never reads)
        expert_out = self.experts.apply(local, recv_x)
        _, _, hook = self.buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                     return_recv_hook=True, out=out)
        hook()
        return out


def tokens_of(rank: int, count: int, hidden: int, seed: int, device):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn((count, hidden), generator=gen).to(torch.bfloat16).to(device)


def check(name: str, experts: Experts, x, topk_idx, topk_weights, y) -> float:
    """Worst |y - y_ref| / bound over this rank's rows (<= 1 passes)."""
    x, idx, w, y = x.cpu(), topk_idx.cpu(), topk_weights.cpu().double(), y.cpu().double()
    cpu = Experts.__new__(Experts)
    cpu.w1, cpu.w2 = experts.w1.cpu(), experts.w2.cpu()
    outs = torch.stack([cpu.apply(int(e), x[t:t + 1])[0] for t in range(x.size(0)) for e in idx[t]])
    outs = outs.view(x.size(0), idx.size(1), -1).double() * w.unsqueeze(2)
    ref, bound = outs.sum(dim=1), 2.0**-6 * outs.abs().sum(dim=1) + 1e-6
    worst = float(((y - ref).abs() / bound).max()) if y.numel() else 0.0
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="prefill tokens per rank")
    parser.add_argument("--decode-tokens", type=int, default=8, help="decode tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    num_experts = args.experts_per_rank * world
    experts = Experts(args.hidden, args.ffn, num_experts, args.seed, device)
    layer = MoELayer(group, experts, args.hidden, num_experts, args.topk, max_decode_tokens=16)

    with torch.no_grad():
        x = tokens_of(rank, args.tokens, args.hidden, args.seed, device)
        y, idx, w = layer.prefill(x)
        worst = {"prefill": check("prefill", experts, x, idx, w, y)}

        # decode: static tensors (what a CUDA graph replays), filled with new tokens each step
        xs = tokens_of(rank + 100, args.decode_tokens, args.hidden, args.seed, device)
        idx_s, w_s = experts.route(xs, args.topk)
        out = torch.empty_like(xs)
        layer.decode(xs, idx_s, w_s, out)  # eager (also the warm-up before a capture)
        worst["decode"] = check("decode", experts, xs, idx_s, w_s, out)
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer.decode(xs, idx_s, w_s, out)
            for step in range(3):
                new = tokens_of(rank + 200 + step, args.decode_tokens, args.hidden, args.seed, device)
                new_idx, new_w = experts.route(new, args.topk)
                xs.copy_(new), idx_s.copy_(new_idx), w_s.copy_(new_w)
                graph.replay()
                torch.cuda.synchronize()
                worst[f"decode graph replay {step}"] = check("graph", experts, new, new_idx, new_w, out)

    ok = all(v <= 1.0 for v in worst.values())
    summary = ", ".join(f"{k} {v:.2f}" for k, v in worst.items())
    sys.stdout.write(f"rank {rank}/{world} [{'cuda' if cuda else 'cpu'}]: worst error / bf16 bound: {summary} "
                     f"({'ok' if ok else 'FAILED'})\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
