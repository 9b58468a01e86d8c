"""What ferry.deep_ep's two buffers (legacy Buffer, V2 ElasticBuffer) share: refusals, sizes, pools of EpBuffers,
and the two combine steps DeepEP has and Ferry's combine does not (the bias, and the top-k weights sent back)."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

import ferry
from ferry import _exact

MAX_TOPK = 16  # ferry::kMaxTopk: the topk a size hint plans for
POOL_SIZE = 2  # EpBuffers per (kind, shape, format): DeepEP's low-latency double buffering


def refuse(what: str, why: str, instead: str, error=ferry.InputError):
    raise error(f"ferry.deep_ep: {what} is not supported: {why}; {instead}")


def refused_call(what: str, why: str, instead: str, static: bool = False):
    """A method that refuses itself (a part of DeepEP's surface Ferry does not have), whatever its arguments."""

    def call(*args, **kwargs):
        refuse(what, why, instead)

    call.__doc__ = f"Refused: {why}; {instead}."
    return staticmethod(call) if static else call


class PoolOwner:
    """What both buffers share: their pools of EpBuffers (Pool) and their lifetime. destroy() releases the pools
    and the communicator; the handles of its dispatches are refused from then on, on this buffer and any other."""

    comm = None
    explicitly_destroy = False
    _pools: dict

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise ferry.InputError(f"ferry.deep_ep: destroy() needs {type(self).__name__}(explicitly_destroy=True) "
                                   "(as DeepEP)")
        for pool in self._pools.values():
            pool.destroyed = True
        self._pools = {}
        self.comm = None

    def _alive(self, call: str) -> None:
        if self.comm is None:
            raise ferry.InputError(f"ferry.deep_ep: {type(self).__name__}.{call} after destroy(); create a new "
                                   f"{type(self).__name__}")

    get_comm_stream = refused_call("get_comm_stream()", "Ferry has no communication stream of its own: every call "
                                   "runs on the caller's current stream",
                                   "order work with the current stream (torch.cuda.current_stream())")


def shape_text(t) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def footprint_bytes(world: int, nodes: int, backend: str, **config) -> int:
    """Bytes one EpBuffer of `config` (EpBuffer's keyword arguments) holds on each rank: ferry.EpBuffer.footprint,
    the formula its constructor checks. What a DeepEP byte budget (num_nvl_bytes, num_bytes) pays for, per EpBuffer."""
    return ferry.EpBuffer.footprint(world, nodes=nodes, backend=backend, **config)["total"]


def hint_bytes(world: int, nodes: int, **config) -> int:
    """footprint_bytes on whichever backend needs more (a size hint knows no communicator); its num_experts is the
    smallest the world takes (the expert count moves no area of a normal-mode EpBuffer)."""
    config.setdefault("num_experts", world * -(-max(config.get("topk", 1), 1) // world))
    return max(footprint_bytes(world, nodes, backend, **config) for backend in ("cpu", "cuda"))


def fitting_max_tokens(budget: int, cap: int, bytes_for: Callable[[int], int]) -> int:
    """The largest max_tokens_per_rank in [1, cap] whose EpBuffer, bytes_for(tokens), fits in budget (0: none does).
    Binary search: an EpBuffer's bytes grow with its tokens."""
    low, high = 0, cap
    while low < high:
        middle = (low + high + 1) // 2
        if bytes_for(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def max_tokens_cap(world: int, topk: int) -> int:
    """The most max_tokens_per_rank an EpBuffer takes at this world and topk (EpConfig::validate: a rank's rows of
    topk entries, and two source words each, are indexed with int32; at most 2^20 tokens)."""
    return min(1 << 20, (2**31 - 1) // (world * max(topk, 2)))


class Pool:
    """POOL_SIZE EpBuffers of one shape, used in turn, made at the pool's first call (collective: every rank makes the
    same calls). Low-latency: each buffer counts the dispatches it ran, so a handle knows whether its dispatch's layout
    is still the one its EpBuffer holds. owner: the Buffer whose pool it is; destroyed once that Buffer's destroy()
    ran (its handles are refused from then on, on that Buffer and on any other)."""

    def __init__(self, key, owner, make: Callable[[], tuple]):
        self.key = key
        self.owner = owner
        self.destroyed = False
        self.make = make
        self.buffers: list = [None] * POOL_SIZE
        self.views: list = [None] * POOL_SIZE  # low-latency: each buffer's cached views
        self.generation: list = [0] * POOL_SIZE
        self.extras: list = [dict() for _ in range(POOL_SIZE)]
        self.next = 0
        self.value_buffers: dict = {}  # normal mode: values per row -> EpBuffer sending fp32 values back (_exact)
        self.row_index = None  # normal mode, num_worst_tokens: [rows, 1] int64 row numbers (the -1 fill past the count)

    def fill(self) -> None:
        # NOTE: all at once, at the pool's first call: a CUDA graph captured after one eager call (an engine's
        # warm-up) then never creates a buffer (collective, allocating) inside the capture
        for j in range(POOL_SIZE):
            self.buffers[j], self.views[j] = self.make()

    def take(self) -> int:
        i = self.next
        self.next = (i + 1) % POOL_SIZE
        if self.buffers[i] is None:
            self.fill()
        self.generation[i] += 1
        return i


def unpack_bias(bias) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """DeepEP's bias argument: None, one tensor, or a pair."""
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, (tuple, list)) and len(bias) == 2:
        return bias[0], bias[1]
    raise ferry.InputError(f"ferry.deep_ep: bias must be None, a [num_tokens, hidden] bfloat16 tensor or a pair of "
                           f"them, got {type(bias).__name__}")


def combine_with_bias(buf, ferry_handle, x: torch.Tensor, bias, num_tokens: int, hidden: int):
    """combined_x = bf16((b0 + b1) + S), in fp32, rounded once, as DeepEP adds its bias inside the combine: S is
    Ferry's unweighted combine of the handle's layout with an fp32 result (EpBuffer.dispatch_backward(fp32=True): the
    same sum as combine, ranks ascending, not rounded). DeepEP's reference adds the rows onto the bias one by one:
    the same at one rank, possibly another last bit elsewhere (docs/deep_ep.md)."""
    b0, b1 = unpack_bias(bias)
    for name, b in (("bias[0]", b0), ("bias[1]", b1)):
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (num_tokens, hidden) or
                              b.dtype != torch.bfloat16):
            raise ferry.InputError(f"ferry.deep_ep: {name} must be [{num_tokens}, {hidden}] bfloat16 (one row per "
                                   f"token of the handle's dispatch), got {shape_text(b)}")
    summed = buf.dispatch_backward(x, ferry_handle, "rank", fp32=True, eager=False)
    acc = b0.float()
    if b1 is not None:
        acc = acc + b1.float()
    return (acc + summed).to(torch.bfloat16)


def combine_weights(comm, pool: Pool, ferry_handle, topk_weights: torch.Tensor, world: int,
                    rank: int) -> torch.Tensor:
    """combined[t, k] = fp32 sum over ranks r ascending, from +0.0, of rank r's topk_weights row of token t (+0.0
    where r did not receive t). Each rank's rows travel back in their own columns (rank r's in columns r * topk..,
    one sender per column: ferry._exact's contract, exact for every bit pattern), and the source adds the ranks in
    order. The value buffer (an EpBuffer of the pool's layout shape) is made at the pool's first such call with this
    topk (collective, as every call)."""
    rows, topk = topk_weights.shape
    vbuf = pool.value_buffers.get(topk)
    if vbuf is None:
        vbuf = pool.value_buffers[topk] = _exact.value_buffer(comm, pool.buffers[0], world * topk)
    values = torch.zeros((rows, world, topk), dtype=torch.float32, device=topk_weights.device)
    values[:, rank] = topk_weights
    per_rank = _exact.send_back(vbuf, ferry_handle, values.view(rows, world * topk), eager=False)
    per_rank = per_rank.view(-1, world, topk)
    combined = torch.zeros((per_rank.size(0), topk), dtype=torch.float32, device=per_rank.device)
    for r in range(world):  # NOTE: one fp32 add per rank, in rank order (a torch.sum could reorder)
        combined = combined + per_rank[:, r]
    return combined


def check_weights(topk_weights, rows: int, device, call: str) -> int:
    """A [rows, topk] float32 tensor on device (topk <= 16); returns topk."""
    ok = isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32 and \
        topk_weights.dim() == 2 and topk_weights.size(0) == rows and 0 < topk_weights.size(1) <= MAX_TOPK
    if not ok:
        raise ferry.InputError(f"ferry.deep_ep: {call}(topk_weights=...) must be [{rows}, topk <= {MAX_TOPK}] float32 "
                               f"(a row of top-k weights per row of x, as DeepEP), got {shape_text(topk_weights)}")
    if topk_weights.device != device:
        raise ferry.InputError(f"ferry.deep_ep: {call}(topk_weights=...) is on {topk_weights.device}, x on {device}; "
                               "pass both on the same device")
    return topk_weights.size(1)

