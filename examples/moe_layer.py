"""A complete Mixture-of-Experts layer forward with Ferry, checked against a dense single-process computation.

    torchrun --nproc-per-node 2 examples/moe_layer.py              # GPUs: torch CUDA tensors, cuda backend
    python -m ferry.launch --nproc 2 examples/moe_layer.py         # anywhere: NumPy arrays, cpu backend

Each rank holds `tokens` tokens and the experts [r*E/W, (r+1)*E/W). The layer:
  1. router: logits = x @ W_router, top-k experts per token, softmax over the k chosen logits (the weights);
  2. dispatch(expand=True): each token goes once to every rank holding one of its experts and lands in the
     expert-major layout expert_x[local expert, slot, hidden];
  3. experts: a SwiGLU MLP per local expert over its filled slots, out = (silu(x W1) * (x W3)) W2, in fp32 from the
     bf16 rows, rounded to bf16 (what a grouped GEMM would write);
  4. combine(layout="expert"): the weighted sum of each token's expert outputs, back on its own rank.

The check recomputes every rank's tokens densely in this process (all weights are drawn from one seed, every rank's
tokens from (seed, rank)): y_ref[t] = sum_k w[t,k] * bf16(expert_k(x[t])) in float64, and compares this rank's rows.

Tolerance (bf16): |y - y_ref| <= 2^-6 * sum_k |w[t,k] * bf16(expert_k(x[t]))| + 1e-6, elementwise. Ferry
accumulates in fp32 but rounds to bf16 twice: each destination rank's partial sum of the token's experts (the row it
sends back) and the final sum over ranks, each within half a bf16 ulp, 2^-8 relative (bf16 keeps 8 significant bits),
of a value bounded by that sum of magnitudes. The expert output itself may differ by one bf16 ulp (at most 2^-7
relative) from the dense one, because the fp32 matmuls see other batch shapes (other summation orders) and a value
near a rounding boundary can round the other way. 2^-8 + 2^-8 + 2^-7 = 2^-6. Routing and transport are exact.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import ferry


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def bf16_float(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


class Model:
    """Router and expert weights, drawn from one seed: every rank (and the check) builds the same model."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, seed: int):
        rng = np.random.default_rng([seed, 7])
        self.router = (rng.standard_normal((hidden, num_experts), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)
        scale_in, scale_out = 1.0 / np.sqrt(hidden), 1.0 / np.sqrt(ffn)
        self.w1 = (rng.standard_normal((num_experts, hidden, ffn), dtype=np.float32) * scale_in).astype(np.float32)
        self.w3 = (rng.standard_normal((num_experts, hidden, ffn), dtype=np.float32) * scale_in).astype(np.float32)
        self.w2 = (rng.standard_normal((num_experts, ffn, hidden), dtype=np.float32) * scale_out).astype(np.float32)


def tokens_of(rank: int, count: int, hidden: int, seed: int) -> np.ndarray:
    """A rank's input rows as bf16 bits."""
    rng = np.random.default_rng([seed, 100 + rank])
    return bf16_bits(rng.standard_normal((count, hidden), dtype=np.float32))


def route_numpy(model: Model, x: np.ndarray, topk: int):
    """Top-k experts by router logit, softmax over the chosen k (float32)."""
    logits = bf16_float(x) @ model.router
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :topk]
    chosen = np.take_along_axis(logits, idx, axis=1)
    weights = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return idx.astype(np.int64), weights.astype(np.float32)


def swiglu_numpy(model: Model, expert: int, rows: np.ndarray) -> np.ndarray:
    """bf16 rows -> bf16 expert output (fp32 inside)."""
    x = bf16_float(rows)
    gate = x @ model.w1[expert]
    h = gate / (1.0 + np.exp(-gate)) * (x @ model.w3[expert])
    return bf16_bits(h @ model.w2[expert])


# ---- the layer on NumPy (cpu backend) --------------------------------------------------------------------------

def forward_numpy(buf: ferry.EpBuffer, model: Model, x: np.ndarray, topk: int, rank: int):
    idx, weights = route_numpy(model, x, topk)
    got = buf.dispatch(x, idx, weights, expand=True)
    expert_out = np.zeros_like(got.expert_x)  # [local experts, capacity, hidden] bf16 bits
    first = rank * buf.num_local_experts
    for e, count in enumerate(got.expert_counts.tolist()):
        filled = min(count, got.expert_slots)
        if filled:
            expert_out[e, :filled] = swiglu_numpy(model, first + e, got.expert_x[e, :filled])
    return buf.combine(expert_out, "expert"), idx, weights


# ---- the layer on torch (cuda backend; also torch CPU tensors on the cpu backend) ------------------------------

def forward_torch(buf: ferry.EpBuffer, model: Model, x_bits: np.ndarray, topk: int, rank: int, device):
    import torch

    def to_bf16(bits: np.ndarray):
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(device)

    router = torch.from_numpy(model.router).to(device)
    first = rank * buf.num_local_experts
    local = range(first, first + buf.num_local_experts)
    w1 = {e: torch.from_numpy(model.w1[e]).to(device) for e in local}
    w3 = {e: torch.from_numpy(model.w3[e]).to(device) for e in local}
    w2 = {e: torch.from_numpy(model.w2[e]).to(device) for e in local}

    x = to_bf16(x_bits)
    with torch.no_grad():
        logits = x.float() @ router
        chosen, idx = torch.topk(logits, topk, dim=1)
        weights = torch.softmax(chosen, dim=1)
        got = buf.dispatch(x, idx.to(torch.int64).contiguous(), weights.contiguous(), expand=True)
        expert_out = torch.zeros_like(got.expert_x)
        counts = got.expert_counts.tolist()  # host copy for this loop; a grouped GEMM would read them on the device
        for e, count in enumerate(counts):
            filled = min(count, got.expert_slots)
            if filled:
                rows = got.expert_x[e, :filled].float()
                gate = rows @ w1[first + e]
                expert_out[e, :filled] = ((torch.nn.functional.silu(gate) * (rows @ w3[first + e])) @ w2[first + e]).to(
                    torch.bfloat16)
        y = buf.combine(expert_out, "expert")
    y_bits = y.cpu().view(torch.int16).numpy().view(np.uint16)
    return y_bits, idx.cpu().numpy().astype(np.int64), weights.cpu().numpy()


# ---- the dense check -------------------------------------------------------------------------------------------

def dense_reference(model: Model, xs: list[np.ndarray], routes: list, rank: int):
    """y_ref and the elementwise tolerance scale for rank's tokens, from every rank's tokens."""
    hidden = xs[0].shape[1]
    num_experts = model.router.shape[1]
    # every rank's tokens through the experts they chose, one dense batch per expert (all ranks together)
    all_x = np.concatenate(xs)
    all_idx = np.concatenate([r[0] for r in routes])
    all_w = np.concatenate([r[1] for r in routes]).astype(np.float64)
    out = np.zeros(all_idx.shape + (hidden,), np.float64)  # [tokens, topk, hidden] bf16 expert outputs
    for e in range(num_experts):
        t, k = np.nonzero(all_idx == e)
        if len(t):
            out[t, k] = bf16_float(swiglu_numpy(model, e, all_x[t]))
    terms = all_w[:, :, None] * out
    offset = sum(len(x) for x in xs[:rank])
    mine = slice(offset, offset + len(xs[rank]))
    return terms.sum(axis=1)[mine], np.abs(terms).sum(axis=1)[mine]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96, help="tokens on rank 0 (rank r has tokens - 8 r)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--framework", choices=["auto", "numpy", "torch"], default="auto",
                        help="auto: torch on the cuda backend, NumPy on the cpu backend")
    parser.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--torch-group", action="store_true",
                        help="bootstrap from a torch.distributed (gloo) process group instead of the env")
    args = parser.parse_args()

    backend = args.backend
    if backend == "auto":
        backend = "cuda" if ferry.cuda_available() else "cpu"
    framework = args.framework
    if framework == "auto":
        framework = "torch" if backend == "cuda" else "numpy"

    device = "cpu"
    if framework == "torch":
        import torch

        if backend == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    if args.torch_group:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        comm = ferry.init(backend=backend, group=dist.group.WORLD)
    else:
        comm = ferry.init(backend=backend)
    rank, world = comm.rank, comm.world

    num_experts = args.experts_per_rank * world
    counts = [max(0, args.tokens - 8 * r) for r in range(world)]
    buf = ferry.EpBuffer(comm, hidden=args.hidden, num_experts=num_experts, topk=args.topk,
                         max_tokens_per_rank=max(counts),
                         # NOTE: the worst case (every token of every rank on one expert): nothing can be dropped
                         expert_capacity=world * max(counts))
    model = Model(args.hidden, args.ffn, num_experts, args.seed)
    xs = [tokens_of(r, counts[r], args.hidden, args.seed) for r in range(world)]

    if framework == "torch":
        y, idx, weights = forward_torch(buf, model, xs[rank], args.topk, rank, device)
    else:
        y, idx, weights = forward_numpy(buf, model, xs[rank], args.topk, rank)
        y = np.asarray(y)

    # The check routes every rank's tokens again on the host. Our own routing came from the layer; a rank's routing
    # on another backend could differ in a near-tie of router logits, so each rank's own routing is the one used.
    routes = [route_numpy(model, xs[r], args.topk) for r in range(world)]
    routes[rank] = (idx, weights)
    y_ref, scale = dense_reference(model, xs, routes, rank)
    err = np.abs(bf16_float(y).astype(np.float64) - y_ref)
    bound = 2.0 ** -6 * scale + 1e-6
    worst = float((err / bound).max()) if err.size else 0.0
    ok = bool((err <= bound).all())
    # one write per line: ranks share the terminal (or pipe), and a whole line in one write() stays whole
    sys.stdout.write(f"rank {rank}/{world} [{backend}, {framework}]: {counts[rank]} tokens, hidden {args.hidden}, "
                     f"{num_experts} experts, top-{args.topk}: max |y - y_ref| = "
                     f"{float(err.max()) if err.size else 0.0:.3g}, {worst:.2f} of the bf16 tolerance: "
                     f"{'OK' if ok else 'FAILED'}\n")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
