"""Training with Ferry: torch.autograd Functions for dispatch and combine, and an MoE layer built on them.

    from ferry import autograd as fa

    d = fa.dispatch(buf, x, topk_idx, topk_weights, layout="expert")   # d.rows: [num_local_experts, slots, hidden]
    y = fa.combine(buf, run_experts(d.rows), d.handle, topk_weights, layout="expert")
    loss(y).backward()     # combine_backward, then dispatch_backward, over the handle of this forward

Every forward call makes its own DispatchHandle (EpBuffer.make_handle: on the cuda backend a torch uint8 tensor from
the caching allocator, so one per call is cheap) and saves the dispatch's routing into it; the backward passes read
that handle, whatever the buffer did in between (other layers, other micro-batches). Backward calls are collective
like the forward: every rank must run the same backward in the same order (the usual expert-parallel rule).

Where the weights get their gradient:
  - layout="expert": combine applies the weights (the ones the handle saved, i.e. the dispatch's topk_weights), so
    the combine Function takes topk_weights as an input and returns their gradient (combine_backward's
    grad_topk_weights). Pass it the same tensor you dispatched with. Dispatch gives them none (it does not use them).
  - layout="rank": the caller applies the weights to the received rows (d.recv_topk_weights, a differentiable output
    of the dispatch), so their gradient is sent back by the dispatch Function's backward: the fp32 gradients of
    recv_topk_weights, each sent as its 4 bytes (integers in bf16) through a dispatch_backward on a small EpBuffer
    of the same layout shape (weight_buffer(); a handle fits every buffer of its shape whatever the hidden size)
    and rejoined at the source: bit-exact for every fp32 value, since every (t, k) entry has exactly one rank that
    holds its expert and the others send 0 for it (ferry._exact).

What is cloned, and why (the rest is used as it is):
  - the rows a dispatch returns (expert_x / recv_x) and its metadata: views of the EpBuffer, overwritten by the next
    dispatch on it, and combine_backward *is* a dispatch (it delivers grad_y into the same views). The expert MLP
    saves its input rows for its own backward, which runs after combine_backward: without the clone it would
    differentiate against the gradient rows. The clone also zeroes unfilled expert slots and rows past num_recv
    (the buffer leaves them unspecified, and a NaN there would reach the weight gradients through 0 * NaN).
  - the gradient rows combine_backward returns: the same views, handed to autograd, which may keep them past the
    next dispatch on the buffer (accumulated with another gradient, hooks, retain_graph).
  - not cloned: the combine's output y and dispatch_backward's grad_x (fresh tensors of torch's allocator), the
    expert outputs the combine Function saves for grad_topk_weights (the caller's tensor, not a view of the buffer),
    the handle (its own storage).
The cost of the clones is measured by examples/train_moe.py --time-clones (docs/python.md, "Training").
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _exact
from ._ext import EpBuffer

__all__ = ["Dispatched", "dispatch", "combine", "weight_buffer", "MoE", "swiglu_experts"]

_LAYOUTS = ("expert", "rank")


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a layout; use 'expert' (expert-major rows, weights applied by "
                         "combine) or 'rank' (rank-major rows, weights applied by the caller)")


class Dispatched(NamedTuple):
    """What dispatch returns (torch tensors owned by torch, not views of the buffer).

    rows: layout "expert": [num_local_experts, expert_capacity, hidden] bf16, unfilled slots 0; layout "rank":
        [num_recv, hidden] bf16 (eager) or [recv_capacity, hidden] with the rows past num_recv 0 (eager=False).
        Differentiable (its gradient goes back through dispatch_backward).
    handle: the DispatchHandle of this dispatch; pass it to combine.
    expert_counts: [num_local_experts] int32 (entries per expert; more than expert_capacity were dropped).
    recv_topk_idx: layout "rank": [rows, topk] int32 local expert or -1 (-1 past num_recv); else None.
    recv_topk_weights: layout "rank": [rows, topk] float32, differentiable when the dispatch was given a
        weight_buffer (0 past num_recv); else None.
    recv_src: layout "rank": [rows, 2] int32 (source rank, source token); else None.
    num_recv: [1] int32 rows received, where the buffers live.
    """

    rows: torch.Tensor
    handle: object
    expert_counts: torch.Tensor
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    recv_src: Optional[torch.Tensor]
    num_recv: torch.Tensor


def _slot_mask(counts: torch.Tensor, slots: int) -> torch.Tensor:
    """[num_local_experts, slots, 1] bool: the slots an expert-major dispatch filled."""
    filled = counts.to(torch.int64).clamp(max=slots)
    return (torch.arange(slots, device=counts.device)[None, :] < filled[:, None]).unsqueeze(2)


def _row_mask(num_recv: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1] bool: the rows a rank-major dispatch filled (num_recv: the [1] int32 count, where it lives)."""
    return (torch.arange(rows, device=num_recv.device) < num_recv.to(torch.int64)).unsqueeze(1)


def weight_buffer(comm, buf: EpBuffer) -> EpBuffer:
    """A small EpBuffer of buf's layout shape for the rank-major weight gradients (collective: every rank calls it).

    Its rows carry topk fp32 values (4 bf16 columns each, padded to a multiple of 8: ferry._exact); a handle of buf
    fits it (same num_experts, topk, max_tokens_per_rank, receive capacity and expert capacity)."""
    return _exact.value_buffer(comm, buf, buf.config.topk)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buf, handle, topk_idx, layout, eager, wbuf):
        expert = layout == "expert"
        got = buf.dispatch(x.detach(), topk_idx, topk_weights.detach(), expand=expert, eager=eager,
                           save_handle=handle)
        ctx.buf, ctx.handle, ctx.layout, ctx.eager, ctx.wbuf = buf, handle, layout, eager, wbuf
        ctx.num_tokens = x.shape[0]
        # NOTE: the clones (torch.where and .clone make new tensors): see the module docstring
        counts = got.expert_counts.clone()
        num_recv = got.num_recv.clone()
        if expert:
            rows = torch.where(_slot_mask(got.expert_counts, got.expert_slots), got.expert_x, 0)
            ctx.mark_non_differentiable(counts, num_recv)
            return rows, counts, num_recv
        rows_n = got.recv_x.shape[0]
        valid = (torch.ones((rows_n, 1), dtype=torch.bool, device=x.device) if got.num_recv_host is not None
                 else _row_mask(got.num_recv, rows_n))
        rows = torch.where(valid, got.recv_x, 0)
        idx = torch.where(valid, got.recv_topk_idx, -1)
        weights = torch.where(valid, got.recv_topk_weights, 0)
        src = got.recv_src.clone()
        ctx.save_for_backward(idx)
        ctx.mark_non_differentiable(counts, num_recv, idx, src)
        if wbuf is None:
            ctx.mark_non_differentiable(weights)
        return rows, counts, num_recv, idx, weights, src

    @staticmethod
    def backward(ctx, grad_rows, *grads):
        grad_rows = grad_rows.to(torch.bfloat16).contiguous()
        grad_x = ctx.buf.dispatch_backward(grad_rows, ctx.handle, ctx.layout, eager=ctx.eager)
        grad_w = None
        if ctx.layout == "rank" and ctx.wbuf is not None:
            (idx,) = ctx.saved_tensors
            grad_recv_w = grads[3]
            # NOTE: collective: every rank with a weight_buffer runs it, whether or not its weights need a gradient
            g = torch.where(idx >= 0, grad_recv_w.float(), 0)  # an entry of an expert elsewhere sends 0
            grad_w = _exact.send_back(ctx.wbuf, ctx.handle, g, eager=ctx.eager)
        return grad_x, grad_w, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, topk_weights, buf, handle, layout, eager, num_recv):
        rows = rows.detach().contiguous()
        ctx.num_recv = num_recv if handle.num_recv_host is None else None
        y = buf.combine(rows, layout, handle=handle, eager=eager)
        ctx.buf, ctx.handle, ctx.layout, ctx.eager = buf, handle, layout, eager
        ctx.rows_shape = rows.shape
        ctx.want_w = layout == "expert" and topk_weights is not None
        if ctx.want_w:
            ctx.save_for_backward(rows)  # the caller's tensor (not a buffer view): no clone
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_y = grad_y.to(torch.bfloat16).contiguous()
        if ctx.layout == "expert":
            x = ctx.saved_tensors[0] if ctx.want_w else None
            rows, grad_w = ctx.buf.combine_backward(grad_y, ctx.handle, "expert", x=x, want_grad_weights=ctx.want_w,
                                                    eager=ctx.eager)
            return rows.clone(), grad_w, None, None, None, None, None  # NOTE: a view of the buffer: see the module docstring
        rows, _ = ctx.buf.combine_backward(grad_y, ctx.handle, "rank", eager=ctx.eager)
        # the copy out of the buffer (NOTE: see the module docstring), shaped as the forward's rows; rows past
        # num_recv (lazy calls: the buffer leaves them unspecified) get 0
        grad = torch.zeros(ctx.rows_shape, dtype=torch.bfloat16, device=grad_y.device)
        n = min(rows.shape[0], ctx.rows_shape[0])
        grad[:n] = rows[:n] if ctx.num_recv is None else torch.where(_row_mask(ctx.num_recv, n), rows[:n], 0)
        return grad, None, None, None, None, None, None


def dispatch(buf: EpBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
             layout: str = "expert", eager: bool = True, weight_buf: EpBuffer | None = None) -> Dispatched:
    """Differentiable dispatch of x [T, hidden] bf16 (topk_idx [T, topk] int32/int64, topk_weights [T, topk] fp32).

    Makes a DispatchHandle, saves the routing into it and returns Dispatched (rows and metadata, cloned out of the
    buffer). layout "expert" needs an EpBuffer with expert_capacity. layout "rank" with topk_weights that need a
    gradient needs weight_buf (weight_buffer(comm, buf)): their gradient comes through recv_topk_weights."""
    _check_layout(layout)
    if layout == "rank" and weight_buf is None and topk_weights.requires_grad:
        raise ValueError("layout='rank' with topk_weights that require grad needs weight_buf=weight_buffer(comm, buf): "
                         "the caller applies the received weights, and their gradient travels back through it")
    handle = buf.make_handle()
    wbuf = weight_buf if layout == "rank" else None
    out = _Dispatch.apply(x, topk_weights, buf, handle, topk_idx, layout, eager, wbuf)
    if layout == "expert":
        rows, counts, num_recv = out
        return Dispatched(rows, handle, counts, None, None, None, num_recv)
    rows, counts, num_recv, idx, weights, src = out
    return Dispatched(rows, handle, counts, idx, weights, src, num_recv)


def combine(buf: EpBuffer, rows: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, *,
            layout: str = "expert", eager: bool = True, num_recv: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable combine of the dispatch that filled handle; returns y [T, hidden] bf16.

    layout "expert": rows are the expert outputs [num_local_experts, expert_capacity, hidden] bf16 and combine applies
    the handle's weights; topk_weights must be the tensor that dispatch got (its values are what combine uses), given
    here so that it gets its gradient (None: no weight gradient). layout "rank": rows [num_recv, hidden] already
    reduced with the weights applied by the caller; topk_weights must be None; num_recv (Dispatched.num_recv) is
    needed only after a lazy dispatch (eager=False on cuda), so that rows past it get the gradient 0."""
    _check_layout(layout)
    if layout == "rank" and topk_weights is not None:
        raise ValueError("layout='rank' does not apply weights (the caller did, with Dispatched.recv_topk_weights); "
                         "pass topk_weights=None")
    return _Combine.apply(rows, topk_weights, buf, handle, layout, eager, num_recv)


def swiglu_experts(rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU MLP per expert as grouped matmuls: rows [E, S, hidden] bf16 -> [E, S, hidden] bf16.

    fp32 inside (w1, w3 [E, hidden, ffn], w2 [E, ffn, hidden]), rounded to bf16 once at the end (what a grouped GEMM
    writes). Zero rows give zero outputs."""
    a = rows.float()
    h = torch.nn.functional.silu(torch.bmm(a, w1)) * torch.bmm(a, w3)
    return torch.bmm(h, w2).to(torch.bfloat16)


class MoE(torch.nn.Module):
    """An MoE layer over Ferry: router (linear, top-k of the logits, softmax over the chosen k), one SwiGLU expert per
    local expert, dispatch and combine through ferry.autograd.

    Collective: every rank creates it (the EpBuffers) with the same arguments. Parameters are fp32: router
    [num_experts, hidden] (replicated: average its gradient over ranks, as a data-parallel parameter), w1 / w3
    [num_local_experts, hidden, ffn] and w2 [num_local_experts, ffn, hidden] (this rank's experts, global ids
    rank * num_local_experts + e). forward(x [T, hidden]) -> y [T, hidden] bf16.

    layout "expert": the experts run as three torch.bmm over [num_local_experts, expert_capacity, hidden] (capacity
    default world * max_tokens_per_rank: nothing is dropped); "rank": per local expert over its received rows, the
    weights applied here (a second small EpBuffer carries their gradient back)."""

    def __init__(self, comm, *, hidden: int, ffn: int, num_experts: int, topk: int, max_tokens_per_rank: int,
                 layout: str = "expert", expert_capacity: int | None = None, device=None, eager: bool = True,
                 generator: torch.Generator | None = None):
        super().__init__()
        _check_layout(layout)
        world, rank = comm.world, comm.rank
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} is not a multiple of world={world}")
        self.layout, self.eager, self.topk = layout, eager, topk
        self.num_local = num_experts // world
        self.first = rank * self.num_local
        capacity = expert_capacity if expert_capacity is not None else world * max_tokens_per_rank
        self.buf = EpBuffer(comm, hidden=hidden, num_experts=num_experts, topk=topk,
                            max_tokens_per_rank=max_tokens_per_rank,
                            expert_capacity=capacity if layout == "expert" else None)
        self.wbuf = weight_buffer(comm, self.buf) if layout == "rank" else None
        full = _init_weights(hidden, ffn, num_experts, generator)
        local = slice(self.first, self.first + self.num_local)
        self.router = torch.nn.Parameter(full["router"].to(device))
        self.w1 = torch.nn.Parameter(full["w1"][local].contiguous().to(device))
        self.w3 = torch.nn.Parameter(full["w3"][local].contiguous().to(device))
        self.w2 = torch.nn.Parameter(full["w2"][local].contiguous().to(device))

    def route(self, x: torch.Tensor):
        logits = x.float() @ self.router.t()
        chosen, idx = torch.topk(logits, self.topk, dim=1)
        return idx, torch.softmax(chosen, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()
        idx, weights = self.route(xb)
        weights = weights.contiguous()
        if self.layout == "expert":
            d = dispatch(self.buf, xb, idx, weights, layout="expert", eager=self.eager)
            out = swiglu_experts(d.rows, self.w1, self.w3, self.w2)
            return combine(self.buf, out, d.handle, weights, layout="expert", eager=self.eager)
        d = dispatch(self.buf, xb, idx, weights, layout="rank", eager=self.eager, weight_buf=self.wbuf)
        reduced = torch.zeros(d.rows.shape, dtype=torch.float32, device=xb.device)
        for e in range(self.num_local):
            n, k = torch.nonzero(d.recv_topk_idx == e, as_tuple=True)
            if n.numel() == 0:
                continue
            out = swiglu_experts(d.rows[n].unsqueeze(0), self.w1[e:e + 1], self.w3[e:e + 1], self.w2[e:e + 1])[0]
            reduced = reduced.index_add(0, n, d.recv_topk_weights[n, k].unsqueeze(1) * out.float())
        return combine(self.buf, reduced.to(torch.bfloat16), d.handle, layout="rank", eager=self.eager,
                       num_recv=d.num_recv)


def _init_weights(hidden: int, ffn: int, num_experts: int, generator: torch.Generator | None) -> dict:
    """Every expert's weights drawn in one order, so each rank (and a dense check) builds the same model."""
    def draw(*shape, scale):
        return torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    return {
        "router": draw(num_experts, hidden, scale=hidden ** -0.5),
        "w1": draw(num_experts, hidden, ffn, scale=hidden ** -0.5),
        "w3": draw(num_experts, hidden, ffn, scale=hidden ** -0.5),
        "w2": draw(num_experts, ffn, hidden, scale=ffn ** -0.5),
    }
