"""Trains an MoE layer (ferry.autograd.MoE) with Adam to imitate a fixed random teacher MoE; checks its gradients once
against a dense single-process model. Needs torch (`pip install .[torch]`).

    python -m ferry.launch --nproc 2 examples/train_moe.py                   # cpu backend, 2 processes
    python -m ferry.launch --nproc 4 examples/train_moe.py --layout rank     # rank-major layout
    torchrun --nproc-per-node 1 examples/train_moe.py                        # cuda backend, one GPU (or more)
    ... --check-determinism      # train twice in this process: the two loss curves must be equal bit for bit
    ... --losses-file F          # write the loss curve to F, or, when F exists, compare with it bit for bit

Each rank draws `tokens` fresh tokens per step from (seed, step, rank); the target is a teacher MoE of the same shape
with other random weights, computed densely. The loss is the mean squared error over every rank's tokens. The router
is replicated (its gradient is summed over ranks with torch.distributed); the experts are split over the ranks, and
their gradients come from every rank's tokens through Ferry's backward passes. Prints the loss at steps 0, 50 and
`steps` (repr: every digit; and float.hex).

Gradient check (at the initial weights, before training): the same weights in a dense model (every expert local,
pure torch, every rank's tokens, routed per rank exactly as the layer routes them) and the gradient of a linear loss
sum(c * y) with a fixed bf16 direction c (y's gradient is then c exactly on both sides, whatever the forward
roundings). Per parameter element the bound is |g - g_dense| <= n * 2^-8 * M + 2^-12 * M, where M is the magnitude of
the sum the gradient is, the same gradient computed with every factor replaced by its absolute value (M >= |g|; the
error of a sum of terms is bounded by the error of each term relative to |term|):
  - n counts the bf16 roundings on the path of a token's gradient that can differ between the two models. The slot
    gradient bf16(w * c) is rounded from identical values on both sides (same routing, same weights): 0. The expert
    output bf16(expert(x)) can round the other way by one ulp (2 * 2^-8 relative), since the fp32 matmuls run over
    other batch shapes (another summation order); it enters the router's gradient through grad_w = <c, out>: n = 2
    for the router, n = 0 for the expert weights (their gradient does not read the rounded output).
  - 2^-12 * M covers the fp32 reorderings (sums over at most a few hundred terms in another order: ~2^-16).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as missing:  # one line from rank 0, not a traceback per rank
    if missing.name != "torch":
        raise
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write("examples/train_moe.py needs torch: pip install torch (or, from the repository, "
                         "pip install .[torch])\n")
    sys.exit(1)

import ferry
from ferry import autograd as fa


def rng(*key: int) -> torch.Generator:
    g = torch.Generator()
    seed = 0
    for k in key:
        seed = (seed * 1000003 + k) % (1 << 62)
    return g.manual_seed(seed)


def tokens(seed: int, step: int, rank: int, count: int, hidden: int) -> torch.Tensor:
    return torch.randn((count, hidden), generator=rng(seed, 1, step, rank)).to(torch.bfloat16)


class Dense:
    """A dense MoE over all experts (pure torch; the teacher, and the reference of the gradient check)."""

    def __init__(self, weights: dict):
        self.p = {k: v.detach().clone().requires_grad_(True) for k, v in weights.items()}

    def route(self, x: torch.Tensor, topk: int):
        logits = x.float() @ self.p["router"].t()
        chosen, idx = torch.topk(logits, topk, dim=1)
        return idx, torch.softmax(chosen, dim=1)

    def forward(self, xs: list, topk: int) -> torch.Tensor:
        """y (fp32, not rounded) of every rank's tokens (xs: one bf16 batch per rank, routed per batch as the layer
        does: same shapes, the same fp32 logits)."""
        routes = [self.route(x, topk) for x in xs]
        x = torch.cat(xs)
        idx = torch.cat([r[0] for r in routes])
        w = torch.cat([r[1] for r in routes])
        y = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(self.p["w1"].shape[0]):
            n, k = torch.nonzero(idx == e, as_tuple=True)
            if n.numel():
                out = fa.swiglu_experts(x[n].unsqueeze(0), self.p["w1"][e:e + 1], self.p["w3"][e:e + 1],
                                        self.p["w2"][e:e + 1])[0]
                y = y.index_add(0, n, w[n, k].unsqueeze(1) * out.float())
        return y

    def magnitudes(self, xs: list, topk: int, c: torch.Tensor) -> dict:
        """M of the module docstring for the gradient of sum(c * y): the backward with every factor in abs."""
        with torch.no_grad():
            p = {k: v.detach() for k, v in self.p.items()}
            routes = [self.route(x, topk) for x in xs]
            x = torch.cat(xs).float()
            idx = torch.cat([r[0] for r in routes])
            w = torch.cat([r[1] for r in routes]).detach()
            m = {k: torch.zeros_like(v) for k, v in p.items()}
            gw_abs = torch.zeros(w.shape)
            for e in range(p["w1"].shape[0]):
                n, k = torch.nonzero(idx == e, as_tuple=True)
                if not n.numel():
                    continue
                a = x[n]
                gate, up = a @ p["w1"][e], a @ p["w3"][e]
                s = torch.nn.functional.silu(gate)
                h = s * up
                out = (h @ p["w2"][e]).to(torch.bfloat16).float()
                g = (w[n, k].unsqueeze(1) * c[n]).abs()  # |slot gradient|
                gw_abs[n, k] = (c[n].abs() * out.abs()).sum(1)
                m["w2"][e] += h.abs().t() @ g
                g_h = g @ p["w2"][e].abs().t()
                sig = torch.sigmoid(gate)
                dsilu = (sig * (1 + gate * (1 - sig))).abs()
                m["w1"][e] += a.abs().t() @ (g_h * up.abs() * dsilu)
                m["w3"][e] += a.abs().t() @ (g_h * s.abs())
            # softmax backward: |J| = |diag(w) - w w^T|, then the router's linear backward
            jac = (torch.diag_embed(w) - w.unsqueeze(2) * w.unsqueeze(1)).abs()
            glogit = (jac @ gw_abs.unsqueeze(2)).squeeze(2)
            for kk in range(topk):
                m["router"].index_add_(0, idx[:, kk], glogit[:, kk:kk + 1] * x.abs())
        return m


def make_weights(hidden: int, ffn: int, num_experts: int, seed: int) -> dict:
    return fa._init_weights(hidden, ffn, num_experts, rng(seed, 7))


def build(comm, args, seed: int, device) -> fa.MoE:
    num_experts = args.experts_per_rank * comm.world
    return fa.MoE(comm, hidden=args.hidden, ffn=args.ffn, num_experts=num_experts, topk=args.topk,
                  max_tokens_per_rank=args.tokens, layout=args.layout, device=device, generator=rng(seed, 7))


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def train(comm, args, device) -> tuple[list, float]:
    """The loss (a float, every rank's tokens) at every step 0..steps, and the loss of step 0's tokens after the
    last step (the same batch as the first loss: the per-step losses of fresh tokens are noisy)."""
    torch.manual_seed(args.seed)
    model = build(comm, args, args.seed, device)
    num_experts = args.experts_per_rank * comm.world
    teacher = Dense(make_weights(args.hidden, args.ffn, num_experts, args.seed + 1))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    count = args.tokens * comm.world * args.hidden
    losses = []

    def batch(step: int):
        x = tokens(args.seed, step, comm.rank, args.tokens, args.hidden)
        with torch.no_grad():
            target = teacher.forward([x], args.topk).to(device)
        return x.to(device), target

    for step in range(args.steps + 1):
        x, target = batch(step)
        y = model(x)
        local = ((y.float() - target) ** 2).sum()
        (local / count).backward()
        sum_over_ranks(model.router.grad)  # replicated parameter: the sum of every rank's part
        loss = sum_over_ranks(local.detach().reshape(1).double()) / count
        losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    x, target = batch(0)
    local = ((model(x).detach().float() - target) ** 2).sum()
    return losses, float(sum_over_ranks(local.reshape(1).double()) / count)


def grad_check(comm, args, device) -> tuple[bool, str]:
    """The layer's gradients at the initial weights against the dense model's, within the docstring's bound."""
    model = build(comm, args, args.seed, device)
    num_experts = args.experts_per_rank * comm.world
    dense = Dense(make_weights(args.hidden, args.ffn, num_experts, args.seed))
    xs = [tokens(args.seed, 10_000, r, args.tokens, args.hidden) for r in range(comm.world)]
    # the direction: bf16-exact values (multiples of 2^-4 in [-1, 1])
    cs = [torch.randint(-16, 17, (args.tokens, args.hidden), generator=rng(args.seed, 2, r)).float() / 16
          for r in range(comm.world)]
    y = model(xs[comm.rank].to(device))
    (y.float() * cs[comm.rank].to(device)).sum().backward()
    sum_over_ranks(model.router.grad)
    c = torch.cat(cs)
    (dense.forward(xs, args.topk) * c).sum().backward()
    mags = dense.magnitudes(xs, args.topk, c)
    local = slice(model.first, model.first + model.num_local)
    rounds = {"router": 2, "w1": 0, "w2": 0, "w3": 0}  # the n of the docstring
    worst, lines, ok = 0.0, [], True
    for name in ("router", "w1", "w3", "w2"):
        got = getattr(model, name).grad.cpu()
        want = dense.p[name].grad if name == "router" else dense.p[name].grad[local]
        m = mags[name] if name == "router" else mags[name][local]
        bound = (rounds[name] * 2.0 ** -8 + 2.0 ** -12) * m
        err = (got - want).abs()
        ratio = float((err / bound.clamp(min=1e-30)).max())
        exact_zero = bool((err[bound == 0] == 0).all())
        good = bool((err <= bound).all()) and exact_zero
        ok &= good
        worst = max(worst, ratio)
        lines.append(f"{name} {ratio:.2g}")
    return ok, f"worst |g - g_dense| / bound: {', '.join(lines)} ({'OK' if ok else 'FAILED'})"


def time_clones(comm, args, device, iters: int = 20) -> str:
    """Host time of the clones ferry.autograd makes, against the step they are part of (measured, not assumed)."""
    model = build(comm, args, args.seed, device)
    x = tokens(args.seed, 0, comm.rank, args.tokens, args.hidden).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_s, clone_s = [], []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        model(x).float().sum().backward()
        sync()
        step_s.append(time.perf_counter() - t0)
        got = model.buf.dispatch(x, *[t.detach().contiguous() for t in model.route(x)],
                                 expand=args.layout == "expert")
        view = got.expert_x if args.layout == "expert" else got.recv_x
        sync()
        t0 = time.perf_counter()
        view.clone()  # the forward's clone; the backward clones a view of the same shape once more
        view.clone()
        sync()
        clone_s.append(time.perf_counter() - t0)
    step_s.sort()
    clone_s.sort()
    return (f"clones {clone_s[iters // 2] * 1e6:.0f} us of a {step_s[iters // 2] * 1e6:.0f} us forward + backward "
            f"(medians of {iters}; rows {tuple(view.shape)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per rank and step")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=32)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--layout", choices=["expert", "rank"], default="expert")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--check-determinism", action="store_true", help="train twice; the curves must be equal")
    parser.add_argument("--losses-file", help="write the curve here, or compare with it when it exists")
    parser.add_argument("--no-grad-check", action="store_true")
    parser.add_argument("--time-clones", action="store_true", help="also time the clones ferry.autograd makes")
    args = parser.parse_args()

    backend = args.backend if args.backend != "auto" else ("cuda" if ferry.cuda_available() else "cpu")
    device = torch.device("cpu")
    if backend == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl" if backend == "cuda" else "gloo")
    comm = ferry.init(backend=backend, group=dist.group.WORLD)
    rank, world = comm.rank, comm.world
    status = 0

    def say(line: str) -> None:
        if rank == 0:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    say(f"train_moe: world {world} [{backend}], layout {args.layout}, {args.tokens} tokens/rank, hidden "
        f"{args.hidden}, ffn {args.ffn}, {args.experts_per_rank * world} experts, top-{args.topk}, seed {args.seed}")
    if not args.no_grad_check:
        ok, text = grad_check(comm, args, device)
        flags = [torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)]
        sum_over_ranks(flags[0])
        say(f"gradient check (rank 0; {int(flags[0])} rank(s) failed): {text}")
        status |= int(flags[0]) != 0
    t0 = time.perf_counter()
    losses, final = train(comm, args, device)
    seconds = time.perf_counter() - t0
    for step in sorted({0, min(50, args.steps), args.steps}):
        say(f"step {step:4d}: loss {losses[step]!r} ({losses[step].hex()})")
    fell = final < losses[0]
    say(f"{args.steps + 1} steps in {seconds:.1f} s; the loss of step 0's tokens {'fell' if fell else 'DID NOT FALL'}: "
        f"{losses[0]!r} -> {final!r}")
    status |= not fell
    if args.check_determinism:
        again, again_final = train(comm, args, device)
        same = again == losses and again_final == final
        say(f"determinism: a second run {'gives the same curve bit for bit' if same else 'DIFFERS'}")
        status |= not same
    if args.losses_file and rank == 0:
        if os.path.exists(args.losses_file):
            with open(args.losses_file) as f:
                saved = [float.fromhex(line.split()[1]) for line in f if line.strip()]
            same = saved == losses
            say(f"determinism: the curve {'equals' if same else 'DIFFERS from'} {args.losses_file}")
            status |= not same
        else:
            with open(args.losses_file, "w") as f:
                f.writelines(f"{i} {v.hex()}\n" for i, v in enumerate(losses))
            say(f"wrote the curve to {args.losses_file}")
    if args.time_clones:
        say(time_clones(comm, args, device))
    dist.destroy_process_group()
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
