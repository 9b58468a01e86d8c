"""fp32 values sent back to their source rows bit for bit, through a dispatch_backward (a bf16 combine leg).

Used by ferry.autograd (the gradients of recv_topk_weights in the rank layout) and ferry.deep_ep (combine with
topk_weights): each received row carries a few fp32 values per token, and the source needs them exactly.

How: every fp32 value travels as its 4 bytes, each byte an integer 0..255 held as a bf16 (exact: bf16 holds every
integer up to 256), in the rows of a small EpBuffer of the forward buffer's layout shape (value_buffer: a handle fits
every buffer of its shape, whatever the hidden size). dispatch_backward(fp32=True) adds the rows of the ranks that
hold a token in fp32: as long as **at most one rank sends a nonzero byte in each column** (the caller's contract), the
sums are those integers again, and the source rejoins the bytes. Exact for every bit pattern (-0.0, subnormals,
infinities and NaN payloads included) and deterministic, on every backend.
"""

from __future__ import annotations

import torch

from ._ext import EpBuffer

_BYTES = 4  # bytes of one fp32 value, one bf16 column each


def columns(num_values: int) -> int:
    """bf16 columns (the value buffer's hidden) for num_values fp32 values per row: 4 each, padded to a multiple of
    8 (16 bytes, the rows' alignment)."""
    return -(-_BYTES * num_values // 8) * 8


def value_buffer(comm, buf: EpBuffer, num_values: int) -> EpBuffer:
    """A small EpBuffer of buf's layout shape whose rows carry num_values fp32 values (collective: every rank calls it
    with the same arguments). A handle of buf fits it: same num_experts, topk, max_tokens_per_rank, receive capacity
    and expert capacity; bf16 on the wire (the bytes must arrive as they were sent)."""
    if num_values < 1:
        raise ValueError(f"num_values={num_values} must be >= 1")
    c = buf.config
    return EpBuffer(comm, hidden=columns(num_values), num_experts=c.num_experts, topk=c.topk,
                    max_tokens_per_rank=c.max_tokens_per_rank, expert_capacity=c.expert_capacity,
                    max_recv_tokens=c.max_recv_tokens)


def send_back(vbuf: EpBuffer, handle, values: torch.Tensor, *, eager: bool) -> torch.Tensor:
    """values [rows, n] fp32, one row per received row of the dispatch that saved handle (rank-major: [>= num_recv,
    n]) -> [num_tokens, n] fp32 at the source: per (token, column), the value of the one rank that sent a nonzero bit
    pattern there (+0.0 where none did). Collective, like the dispatch_backward it runs."""
    rows, n = values.shape
    if values.dtype != torch.float32:
        raise ValueError(f"values must be float32, got {values.dtype}")
    width = vbuf.config.hidden
    if _BYTES * n > width:
        raise ValueError(f"{n} values per row need {columns(n)} columns; the value buffer has hidden={width} "
                         f"(value_buffer(comm, buf, {n}))")
    packed = torch.zeros((rows, width), dtype=torch.bfloat16, device=values.device)
    packed[:, :_BYTES * n] = values.contiguous().view(torch.uint8).view(rows, _BYTES * n).to(torch.bfloat16)
    summed = vbuf.dispatch_backward(packed, handle, "rank", fp32=True, eager=eager)
    # the sums are the bytes (integers 0..255, exact in fp32); any other value breaks the one-sender contract
    return summed[:, :_BYTES * n].to(torch.uint8).contiguous().view(torch.float32)
