"""DeepEP's `deep_ep.Buffer` (deep_ep/buffers/legacy.py) over Ferry: the same argument names, shapes, dtypes and
return tuples. docs/deep_ep.md lists every function and argument with its status: supported, mapped (how), or refused
(the message). What differs from DeepEP and how it is mapped, in short:

- Ferry buffers are shaped (ferry.EpBuffer: hidden, num_experts, topk, max_tokens_per_rank, mode, formats), DeepEP's
  are byte budgets that learn shapes per call. A Buffer creates Ferry buffers lazily, one pool per (leg kind, shape,
  format), at the first call that needs it (every rank makes the same calls, so every rank creates it at the same
  call: EpBuffer construction is collective). Each pool holds two EpBuffers used in turn, as DeepEP's low-latency
  mode double-buffers: in low-latency mode a dispatch's layout stays valid for its combine while one more dispatch
  of the same shape runs, and a handle from an older dispatch of that pool is refused, never combined. Normal-mode
  handles carry their layout (a Ferry DispatchHandle) and stay valid.
- Normal mode: `num_nvl_bytes` sizes each EpBuffer's receive rows. The outputs are copies (DeepEP's are fresh
  tensors). A cached dispatch (`handle=`) is Ferry's cached dispatch, in the handle's format or another (the layout
  does not depend on the format); combine reads the handle's layout. A dispatch by rank membership alone
  (is_token_in_rank, no topk_idx) routes through Ferry's one mechanism: a synthesized routing of one id per
  destination rank. combine(topk_weights=...) sends each received row's fp32 weights back bit for bit (ferry._exact)
  and sums them over the ranks in ascending order, in fp32, as DeepEP's intranode combine does; a bias is added in
  fp32 before the one rounding.
- Low-latency mode: DeepEP's combine takes the weights, its dispatch does not, while Ferry's combine applies the
  weights its dispatch carried. The layer therefore dispatches each (token, k) pair as its own row (topk = 1 in the
  EpBuffer, as DeepEP's low-latency kernels send one message per selected expert), and the combine sums each
  token's entries with combine's topk_weights in fp32, rounded once to bf16, as DeepEP does.
- Streams: Ferry runs on the caller's current stream; DeepEP's comm stream, `previous_event`, `async_finish` and
  `allocate_on_comm_stream` map onto it (utils/event.py).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

import ferry

from .._common import (MAX_TOPK, POOL_SIZE, Pool, PoolOwner, check_weights, combine_weights, combine_with_bias,
                       fitting_max_tokens, footprint_bytes, hint_bytes, max_tokens_cap, refuse, refused_call,
                       shape_text)
from ..utils.event import EmptyEventOverlap, EventHandle, EventOverlap, wait_event

__all__ = ["Buffer", "Config", "topk_idx_t"]

topk_idx_t = torch.int64  # DeepEP's index dtype (int32 is taken too: Ferry reads either)
_FLOAT32 = torch.float32
_DEFAULT_HINT_TOKENS = 4096  # tokens per rank Config.get_nvl_buffer_size_hint sizes for (EpConfig's default)
_MAX_LL_ROWS = 1024  # ferry::kMaxLowLatencyTokens


class Config:
    """DeepEP's performance Config (SMs and chunk sizes of its ring buffers). Ferry picks its launch geometry from
    its tuning tables (docs/tuning.md), so a Config never changes what a call computes, in DeepEP or here: it is
    validated as DeepEP validates it and otherwise only carried. get_nvl_buffer_size_hint is Ferry's: the
    num_nvl_bytes that takes 4096 tokens per rank (Buffer's sizing rule)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        if num_sms < 0:
            raise ferry.ConfigError(f"ferry.deep_ep: Config(num_sms={num_sms}) must be >= 0")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ferry.ConfigError(
                f"ferry.deep_ep: Config needs 0 < num_max_nvl_chunked_send_tokens ({num_max_nvl_chunked_send_tokens})"
                f" < num_max_nvl_chunked_recv_tokens ({num_max_nvl_chunked_recv_tokens})")
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise ferry.ConfigError("ferry.deep_ep: Config's rdma chunk sizes must be > 0")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        # bf16 rows of at least hidden_bytes (a hidden EpConfig takes: a multiple of 128)
        hidden = max(128, -(-hidden_bytes // 256) * 128)
        return hint_bytes(num_ranks, 1, hidden=hidden, topk=MAX_TOPK, max_tokens_per_rank=_DEFAULT_HINT_TOKENS)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # Ferry's normal mode takes its network rows from the same budget (num_nvl_bytes)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens="
                f"{self.num_max_nvl_chunked_send_tokens}, num_max_nvl_chunked_recv_tokens="
                f"{self.num_max_nvl_chunked_recv_tokens}, ...)")


# ---- handles -----------------------------------------------------------------------------------------------------

# DeepEP's normal-mode handle tuples, and what each position is here (the others are DeepEP's channel bookkeeping,
# which Ferry's layout does not have: reading them raises).
_INTRANODE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                     "is_token_in_rank", "send_head")
_INTERNODE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                     "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                     "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


class _DispatchHandle:
    """Normal mode's handle, indexable as DeepEP's tuple where Ferry has the field (docs/deep_ep.md): intranode
    handle[0] rank_prefix_matrix [W, W] int32 (entry [i, j]: rows ranks 0..i sent to rank j, the prefix sum of the
    handle's count matrix) and handle[4] is_token_in_rank; across nodes handle[0] is_token_in_rank and handle[6]
    (handle[-4]) recv_gbl_rank_prefix_sum [W] int32 (the rows this rank received from ranks 0..i). Computed when
    first read (local: no communication). Holds the Ferry DispatchHandle the dispatch saved its layout into (it fits
    every EpBuffer of the pool's layout shape), the pool and the slot of the EpBuffer that ran it."""

    __slots__ = ("pool", "slot", "x_kind", "ferry_handle", "num_tokens", "lazy", "is_token_in_rank", "_counts")

    def __init__(self, pool: Pool, slot: int, x_kind, ferry_handle, num_tokens: int, lazy: bool, is_token_in_rank):
        self.pool, self.slot, self.x_kind, self.ferry_handle = pool, slot, x_kind, ferry_handle
        self.num_tokens, self.lazy, self.is_token_in_rank = num_tokens, lazy, is_token_in_rank
        self._counts = None

    def _fields(self):
        return _INTERNODE_FIELDS if self.pool.internode else _INTRANODE_FIELDS

    def __len__(self) -> int:
        return len(self._fields())

    def _rank_counts(self) -> torch.Tensor:
        if self._counts is None:
            self._counts = self.pool.buffers[self.slot].rank_counts(self.ferry_handle)
        return self._counts

    def __getitem__(self, i):
        fields = self._fields()
        if not isinstance(i, int) or not -len(fields) <= i < len(fields):
            raise IndexError(f"ferry.deep_ep: handle index {i!r} is outside the {len(fields)} fields of DeepEP's "
                             "handle")
        name = fields[i % len(fields)]
        if name == "is_token_in_rank" and self.is_token_in_rank is not None:
            return self.is_token_in_rank
        if name == "rank_prefix_matrix":
            return self._rank_counts().cumsum(0, dtype=torch.int32)
        if name == "recv_gbl_rank_prefix_sum":
            return self._rank_counts()[:, self.pool.rank].cumsum(0, dtype=torch.int32)
        raise ferry.InputError(
            f"ferry.deep_ep: handle[{i}] ({name}) is not supported: Ferry's layout has no such field (DeepEP's "
            "channel and send-head bookkeeping); the handle provides " + ", ".join(
                f"[{j}] {f}" for j, f in enumerate(fields)
                if f in ("rank_prefix_matrix", "recv_gbl_rank_prefix_sum", "is_token_in_rank")))


class _LowLatencyHandle:
    """Low-latency mode's handle, indexable as DeepEP's (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts). src_info [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank] int32 (the
    source token of each slot) and layout_range [num_local_experts, num_ranks] int64 ((first slot << 32) | count, per
    source rank) are computed from Ferry's layout when first read (device ops, no synchronisation). The shapes live in
    the pool (one per shape): a handle holds what differs per call."""

    __slots__ = ("pool", "slot", "generation", "num_tokens", "topk", "topk_idx", "_src_info", "_layout_range")

    def __init__(self, pool, slot, num_tokens, topk, topk_idx):
        self.pool, self.slot, self.num_tokens, self.topk = pool, slot, num_tokens, topk
        self.generation = pool.generation[slot]
        self.topk_idx = topk_idx  # the dispatch's ids (a combine given other ids masks its weights by them)
        self._src_info = self._layout_range = None

    got = property(lambda self: self.pool.views[self.slot])  # the EpBuffer's cached views (a DispatchResult)
    rank = property(lambda self: self.pool.rank)
    world = property(lambda self: self.pool.world)
    max_tokens = property(lambda self: self.pool.max_tokens)
    hidden = property(lambda self: self.pool.hidden)
    num_experts = property(lambda self: self.pool.num_experts)

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return (self[i] for i in range(5))

    def __getitem__(self, i):
        if i == 0 or i == -5:
            if self._src_info is None:
                self._src_info = _ll_src_info(self)
            return self._src_info
        if i == 1 or i == -4:
            if self._layout_range is None:
                self._layout_range = _ll_layout_range(self)
            return self._layout_range
        return (None, None, self.max_tokens, self.hidden, self.num_experts)[i]


# ---- the buffer --------------------------------------------------------------------------------------------------


class Buffer(PoolOwner):
    """DeepEP's Buffer over Ferry. Normal mode: get_dispatch_layout, dispatch, combine; low-latency mode (with
    low_latency_mode=True): low_latency_dispatch, low_latency_combine, get_next_low_latency_combine_buffer. See the
    module's docstring and docs/deep_ep.md."""

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, *, use_fabric: bool = False) -> None:
        # NOTE: the positional order is DeepEP's newest (v2's legacy Buffer); use_fabric, which DeepEP before v2 had
        # between allow_mnnvl and explicitly_destroy, is taken by name only
        refuse_config = lambda what, why, instead: refuse(what, why, instead, ferry.ConfigError)  # noqa: E731
        if comm is not None:
            refuse_config("comm= (an mpi4py communicator)", "Ferry's layer finds its ranks through torch.distributed",
                          "pass group= (a torch.distributed process group)")
        if group is None:
            raise ValueError("ferry.deep_ep: Buffer needs group= (a torch.distributed process group)")
        if not allow_nvlink_for_low_latency_mode:
            refuse_config("allow_nvlink_for_low_latency_mode=False", "Ferry's low-latency mode moves rows over NVLink "
                          "(load/store) within a node", "leave it True")
        if allow_mnnvl:
            refuse_config("allow_mnnvl=True", "Ferry's NVLink team is one node (multi-node NVLink is not used)",
                          "leave it False")
        if use_fabric:
            refuse_config("use_fabric=True", "Ferry allocates its windows through NCCL (ncclMemAlloc)",
                          "leave it False")
        if enable_shrink:
            refuse_config("enable_shrink=True", "this layer does not wire Ferry's rank masking (ferry.EpBuffer("
                          "rank_masking=True, mode='ll'), cpu backend only in this version) to DeepEP's shrink API",
                          "leave it False, or use ferry.EpBuffer directly")
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise ferry.ConfigError(f"ferry.deep_ep: num_nvl_bytes={num_nvl_bytes} and num_rdma_bytes="
                                    f"{num_rdma_bytes} must be >= 0")
        if low_latency_mode and num_qps_per_rank <= 0:
            raise ferry.ConfigError(f"ferry.deep_ep: num_qps_per_rank={num_qps_per_rank} must be > 0 in "
                                    "low-latency mode (as DeepEP)")
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank  # NOTE: Ferry sets up no queue pairs of its own: carried only
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        backend = "cuda" if ferry.cuda_available() else "cpu"
        device = torch.cuda.current_device() if backend == "cuda" else -1
        self.comm = ferry.init(group=group, backend=backend, device=device)
        self._nodes = self.comm.topology[0]
        self._pools: dict = {}

    # ---- static API
    @staticmethod
    def is_sm90_compiled() -> bool:
        return True  # what DeepEP's tests read it for: fp8 rows are supported (on every Ferry backend)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2 != 0:
            raise ferry.ConfigError(f"ferry.deep_ep: set_num_sms({new_num_sms}): the SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """num_rdma_bytes a low-latency Buffer needs for these shapes (bf16, the largest topk a call of them can use:
        up to 16, at most 1024 (token, k) rows per rank): the footprint of the POOL_SIZE low-latency EpBuffers of one
        shape (ferry.EpBuffer.footprint, the formula their constructor checks) on whichever backend and split into
        nodes (one, or nodes of 8, 4, 2 or 1 ranks) needs most, as a hint knows no communicator."""
        if num_experts % num_ranks:
            raise ferry.ConfigError(f"ferry.deep_ep: num_experts={num_experts} is not a multiple of num_ranks="
                                    f"{num_ranks}")
        topk = min(MAX_TOPK, _MAX_LL_ROWS // max(num_max_dispatch_tokens_per_rank, 1))
        if topk < 1:
            refuse(f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}",
                   f"the layer sends each (token, k) pair as a row and Ferry's low-latency mode takes at most "
                   f"{_MAX_LL_ROWS} rows per rank", f"use num_max_dispatch_tokens_per_rank <= {_MAX_LL_ROWS}",
                   ferry.ConfigError)
        config = _ll_config(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, topk, "bf16")
        splits = {1} | {num_ranks // local for local in (8, 4, 2, 1) if num_ranks % local == 0}
        return max(_ll_bytes(num_ranks, nodes, backend, config) for nodes in splits for backend in ("cpu", "cuda"))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    # ---- refused parts of DeepEP's surface (get_comm_stream: PoolOwner)
    get_local_buffer_tensor = refused_call(
        "get_local_buffer_tensor()", "Ferry's windows are not one raw byte buffer",
        "use the tensors the calls return (get_next_low_latency_combine_buffer for zero-copy combine input)")
    internode_dispatch = refused_call("internode_dispatch()", "it is DeepEP's internal entry point (dispatch() "
                                      "chooses it when the ranks span nodes)",
                                      "call dispatch(): Ferry's normal mode crosses nodes by itself (hierarchical)")
    internode_combine = refused_call("internode_combine()", "it is DeepEP's internal entry point (combine() chooses "
                                     "it when the ranks span nodes)", "call combine()")
    _NO_MASKING = ("this layer does not wire Ferry's rank masking",
                   "use ferry.EpBuffer(rank_masking=True): mask_ranks(), mask_status(), clear_mask()")
    low_latency_update_mask_buffer = refused_call("low_latency_update_mask_buffer()", *_NO_MASKING)
    low_latency_query_mask_buffer = refused_call("low_latency_query_mask_buffer()", *_NO_MASKING)
    low_latency_clean_mask_buffer = refused_call("low_latency_clean_mask_buffer()", *_NO_MASKING)

    # ---- helpers
    def _pool(self, key, make) -> Pool:
        pool = self._pools.get(key)
        if pool is None:
            self._alive("a call")
            pool = self._pools[key] = Pool(key, self, make)
            pool.rank, pool.world, pool.internode = self.rank, self.group_size, self._nodes > 1
        return pool

    @staticmethod
    def _check_config(config) -> None:
        if config is not None and not isinstance(config, Config):
            raise ferry.InputError(f"ferry.deep_ep: config must be a ferry.deep_ep.Config, not {type(config).__name__}")

    @staticmethod
    def _event(async_finish: bool, tensors=None) -> EventOverlap:
        return EventOverlap(EventHandle(), tensors) if async_finish else EmptyEventOverlap()

    @staticmethod
    def _check_stream_args(previous_event, allocate_on_comm_stream) -> None:
        if allocate_on_comm_stream and previous_event is None:
            raise ferry.InputError("ferry.deep_ep: allocate_on_comm_stream=True needs previous_event (as DeepEP)")

    def _check_handle(self, handle, kind, call: str) -> None:
        """A handle of this Buffer's live pools (another Buffer's, or one kept past a destroy(), named)."""
        self._alive(call)
        if not isinstance(handle, kind):
            what = "dispatch()" if kind is _DispatchHandle else "low_latency_dispatch()"
            raise ferry.InputError(f"ferry.deep_ep: {call} needs handle= a handle of this layer's {what}, got "
                                   f"{type(handle).__name__}")
        pool = handle.pool
        if pool.destroyed:
            raise ferry.InputError(f"ferry.deep_ep: {call} got a handle kept past its Buffer's destroy(): its layout "
                                   "is gone with that Buffer; pass the handle of a dispatch of this Buffer")
        if pool.owner is not self or self._pools.get(pool.key) is not pool:
            raise ferry.InputError(f"ferry.deep_ep: {call} got a handle of another Buffer's dispatch; pass the handle "
                                   "of a dispatch of this Buffer")

    # ---- normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank [nodes] int32 or None on one node,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool, event), computed with torch ops on topk_idx's
        device (no synchronisation, graph-capturable)."""
        self._check_stream_args(previous_event, allocate_on_comm_stream)
        wait_event(previous_event)
        world = self.group_size
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or \
                topk_idx.dtype not in (torch.int64, torch.int32):
            raise ferry.InputError(f"ferry.deep_ep: topk_idx must be [num_tokens, num_topk] int64 (or int32), got "
                                   f"{shape_text(topk_idx)}")
        if num_experts % world:
            raise ferry.InputError(f"ferry.deep_ep: num_experts={num_experts} is not a multiple of the {world} ranks")
        idx = topk_idx.to(torch.int64)
        valid = idx >= 0
        per_rank = num_experts // world
        rank_of = torch.where(valid, idx // per_rank, world)
        in_rank = torch.zeros((idx.size(0), world + 1), dtype=torch.bool, device=idx.device)
        in_rank.scatter_(1, rank_of, True)
        is_token_in_rank = in_rank[:, :world].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
        num_tokens_per_rdma_rank = None
        if self._nodes > 1:  # a token counts once per node it goes to
            in_node = is_token_in_rank.view(idx.size(0), self._nodes, world // self._nodes).any(dim=2)
            num_tokens_per_rdma_rank = in_node.sum(dim=0, dtype=torch.int32)
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=idx.device)
        counts.scatter_add_(0, torch.where(valid, idx, num_experts).view(-1),
                            torch.ones(idx.numel(), dtype=torch.int32, device=idx.device))
        num_tokens_per_expert = counts[:num_experts]
        return (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
                self._event(async_finish, (topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)))

    def _normal_pool(self, hidden: int, num_experts: int, topk: int, fp8: bool, num_worst_tokens: int,
                     max_tokens: Optional[int] = None) -> Pool:
        """The pool of this shape: max_tokens_per_rank from num_nvl_bytes, or (a cached dispatch in another format
        or hidden size) the handle's, so that its layout fits."""
        key = ("normal", hidden, num_experts, topk, fp8, num_worst_tokens) + (() if max_tokens is None else
                                                                              (max_tokens,))
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        world = self.group_size
        shape = dict(hidden=hidden, num_experts=num_experts, topk=topk, dispatch_format="fp8" if fp8 else "bf16")
        if num_worst_tokens:
            shape["max_recv_tokens"] = num_worst_tokens
        nodes, backend = self._nodes, self.comm.backend

        def bytes_for(tokens: int) -> int:  # one EpBuffer's whole footprint, the budget of num_nvl_bytes
            return footprint_bytes(world, nodes, backend, max_tokens_per_rank=tokens, **shape)

        if max_tokens is None:
            max_tokens = fitting_max_tokens(self.num_nvl_bytes, max_tokens_cap(world, topk), bytes_for)
            if max_tokens < 1:
                refuse(f"num_nvl_bytes={self.num_nvl_bytes} for normal-mode dispatch of hidden={hidden}",
                       f"one token per rank needs {bytes_for(1)} bytes (a Ferry EpBuffer of this shape)",
                       "create the Buffer with num_nvl_bytes = Config().get_nvl_buffer_size_hint(hidden * 2, "
                       "num_ranks) or more", ferry.ConfigError)
        kwargs = dict(shape, max_tokens_per_rank=max_tokens)
        pool = self._pool(key, lambda: (ferry.EpBuffer(self.comm, **kwargs), None))
        pool.max_tokens, pool.topk, pool.num_experts, pool.worst = max_tokens, topk, num_experts, num_worst_tokens
        pool.bytes_for = bytes_for
        return pool

    @staticmethod
    def _split_x(x):
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if x_scales is not None:
            if x_scales.dtype != torch.float32 or x_scales.dim() != 2:
                refuse(f"x_scales of dtype {x_scales.dtype} and shape {tuple(x_scales.shape)}",
                       "Ferry's fp8 input takes one float32 scale per 128 elements",
                       "pass (x [T, hidden] float8_e4m3fn, scales [T, hidden // 128] float32)")
            x_scales = x_scales.contiguous()  # DeepEP takes column-major scales too; Ferry reads row-major
        return x, x_scales

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle=None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Normal-mode dispatch. Returns (recv_x or (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event) as DeepEP: rows ordered by (source rank, source token);
        recv_topk_idx local expert ids (-1 elsewhere), recv_topk_weights float32 (0 where -1)."""
        if config is not None:
            self._check_config(config)
        if allocate_on_comm_stream:
            self._check_stream_args(previous_event, allocate_on_comm_stream)
        if expert_alignment < 1:
            raise ferry.InputError(f"ferry.deep_ep: expert_alignment={expert_alignment} must be >= 1")
        x_scales = None
        if isinstance(x, tuple):
            x, x_scales = self._split_x(x)
        if handle is not None:
            return self._cached_dispatch(x, x_scales, handle, topk_idx, topk_weights, num_worst_tokens,
                                         expert_alignment, previous_event, async_finish)
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ferry.InputError("ferry.deep_ep: dispatch needs num_tokens_per_rank, is_token_in_rank and "
                                   "num_tokens_per_expert from get_dispatch_layout (as DeepEP)")
        if topk_idx is None and topk_weights is None:
            return self._rank_dispatch(x, x_scales, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                       num_tokens_per_expert, expert_alignment, num_worst_tokens, previous_event,
                                       async_finish)
        if topk_idx is None or topk_weights is None:
            raise ferry.InputError("ferry.deep_ep: dispatch takes topk_idx and topk_weights together (or neither, "
                                   "to route by is_token_in_rank alone)")
        try:
            num_tokens, hidden = x.shape
            _, topk = topk_idx.shape
        except (AttributeError, ValueError):
            raise ferry.InputError(f"ferry.deep_ep: x must be [num_tokens, hidden] and topk_idx [num_tokens, num_topk],"
                                   f" got x {shape_text(x)} and topk_idx {shape_text(topk_idx)}") from None
        num_experts = num_tokens_per_expert.numel()
        # NOTE: the layout tensors are what get_dispatch_layout derives from topk_idx; Ferry derives the same layout
        # itself (its count exchange), so only their shapes are checked here: num_tokens_per_expert gives num_experts.
        # The binding checks x, topk_idx and topk_weights (shapes, dtypes, placement), collectively. The checking
        # methods run only where a check fails (a call per check would be host time on every dispatch).
        world = self.group_size
        if num_tokens_per_rank.shape != (world,) or is_token_in_rank.shape != (num_tokens, world) or \
                (num_tokens_per_rdma_rank is not None and self._nodes > 1):
            self._check_layout_shapes(num_tokens, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank)
        fp8 = x_scales is not None
        pool = self._pools.get(("normal", hidden, num_experts, topk, fp8, num_worst_tokens))
        if pool is None:
            pool = self._normal_pool(hidden, num_experts, topk, fp8, num_worst_tokens)
        if num_tokens > pool.max_tokens:
            self._check_budget(pool, num_tokens, hidden, topk, fp8)
        if previous_event is not None:
            wait_event(previous_event)
        slot = pool.take()
        lazy = num_worst_tokens > 0
        # NOTE: the binding copies the rows, ids (int64 when topk_idx is) and weights into fresh tensors (DeepEP's
        # outputs are the caller's) and reads the counts, with no torch op here
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, saved, num_recv, _ = pool.buffers[
            slot].dispatch_owned(x, topk_idx, topk_weights, x_scales=x_scales, eager=not lazy, save_handle=True)
        handle = _DispatchHandle(pool, slot, (hidden, fp8), saved, num_tokens, lazy, is_token_in_rank)
        if lazy:
            # rows past the count: -1 ids (as DeepEP), found on the device (no synchronisation)
            rows = pool.row_index
            if rows is None:
                rows = pool.row_index = torch.arange(recv_topk_idx.size(0), device=recv_topk_idx.device).unsqueeze(1)
            recv_topk_idx.masked_fill_(rows >= num_recv, -1)
            counts = []
        elif expert_alignment != 1:
            counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        event = EmptyEventOverlap() if not async_finish else self._event(True, (x,))
        return (recv_x, recv_scales) if fp8 else recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event

    def _check_layout_shapes(self, num_tokens, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank):
        world = self.group_size
        if tuple(num_tokens_per_rank.shape) != (world,) or tuple(is_token_in_rank.shape) != (num_tokens, world):
            raise ferry.InputError(
                f"ferry.deep_ep: num_tokens_per_rank {tuple(num_tokens_per_rank.shape)} / is_token_in_rank "
                f"{tuple(is_token_in_rank.shape)} must be [{world}] / [{num_tokens}, {world}] (get_dispatch_layout)")
        # NOTE: within a node DeepEP does not read num_tokens_per_rdma_rank either; across nodes its shape is checked
        if self._nodes > 1 and num_tokens_per_rdma_rank is not None and \
                tuple(num_tokens_per_rdma_rank.shape) != (self._nodes,):
            raise ferry.InputError(f"ferry.deep_ep: num_tokens_per_rdma_rank {tuple(num_tokens_per_rdma_rank.shape)} "
                                   f"must be [{self._nodes}] (one count per node, get_dispatch_layout)")

    def _check_budget(self, pool: Pool, num_tokens: int, hidden: int, topk: int, fp8: bool) -> None:
        if num_tokens > pool.max_tokens:
            need = pool.bytes_for(num_tokens)
            refuse(f"dispatch of {num_tokens} tokens with num_nvl_bytes={self.num_nvl_bytes}",
                   f"that budget holds {pool.max_tokens} tokens per rank at hidden={hidden}, topk={topk}",
                   f"create the Buffer with num_nvl_bytes >= {need}")

    def _rank_dispatch(self, x, x_scales, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                       num_tokens_per_expert, expert_alignment, num_worst_tokens, previous_event, async_finish):
        """Dispatch by rank membership alone (is_token_in_rank, no topk_idx): Ferry's dispatch of a synthesized
        routing, one column per rank, naming that rank's first expert where the token goes there (-1 elsewhere), so
        the wire carries each token once per marked rank, exactly as routed rows. recv_topk_idx / recv_topk_weights
        are None (as DeepEP); the per-expert counts are the sums over the ranks of num_tokens_per_expert of this
        rank's experts (one all_reduce of the group, eager calls only)."""
        world = self.group_size
        if world > MAX_TOPK:
            refuse(f"dispatch by is_token_in_rank alone at {world} ranks", f"Ferry's routing carries at most "
                   f"{MAX_TOPK} destinations per token (one synthesized id per rank)",
                   "pass topk_idx and topk_weights (the routing by expert takes any world)")
        try:
            num_tokens, hidden = x.shape
        except (AttributeError, ValueError):
            raise ferry.InputError(f"ferry.deep_ep: x must be [num_tokens, hidden], got {shape_text(x)}") from None
        self._check_layout_shapes(num_tokens, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank)
        num_experts = num_tokens_per_expert.numel()
        if is_token_in_rank.dtype != torch.bool or num_experts % world:
            raise ferry.InputError(f"ferry.deep_ep: is_token_in_rank must be bool and num_tokens_per_expert hold a "
                                   f"multiple of {world} experts, got {shape_text(is_token_in_rank)} and "
                                   f"{shape_text(num_tokens_per_expert)}")
        fp8 = x_scales is not None
        pool = self._normal_pool(hidden, num_experts, world, fp8, num_worst_tokens)
        self._check_budget(pool, num_tokens, hidden, world, fp8)
        firsts = pool.extras[0].get("rank_firsts")
        if firsts is None or firsts.device != is_token_in_rank.device:
            firsts = torch.arange(world, dtype=torch.int64, device=is_token_in_rank.device) * (num_experts // world)
            ones = torch.ones((pool.max_tokens * world,), dtype=torch.float32, device=is_token_in_rank.device)
            pool.extras[0].update(rank_firsts=firsts, ones=ones)
        topk_idx = torch.where(is_token_in_rank, firsts, -1)
        weights = pool.extras[0]["ones"][:num_tokens * world].view(num_tokens, world)
        wait_event(previous_event)
        slot = pool.take()
        lazy = num_worst_tokens > 0
        recv_x, recv_scales, _, _, _, saved, _, _ = pool.buffers[slot].dispatch_owned(
            x, topk_idx, weights, x_scales=x_scales, eager=not lazy, save_handle=True)
        handle = _DispatchHandle(pool, slot, (hidden, fp8), saved, num_tokens, lazy, is_token_in_rank)
        counts = []
        if not lazy:
            total = num_tokens_per_expert.to(torch.int32, copy=True)
            dist.all_reduce(total, group=self.group)
            counts = [-(-c // expert_alignment) * expert_alignment for c in total.view(world, -1)[self.rank].tolist()]
        event = self._event(async_finish, (x,))
        return (recv_x, recv_scales) if fp8 else recv_x, None, None, counts, handle, event

    def _cached_dispatch(self, x, x_scales, handle, topk_idx, topk_weights, num_worst_tokens, expert_alignment,
                         previous_event, async_finish):
        """Ferry's cached dispatch (DispatchArgs::handle): the same rows in the same order, routed by the layout the
        handle keeps where the buffers live (no host copies, no synchronisation). x may be in another format or of
        another hidden size than the handle's dispatch (the layout does not depend on either): its EpBuffer is then
        one of the handle's layout shape in that format."""
        if topk_idx is not None or topk_weights is not None:
            raise ferry.InputError("ferry.deep_ep: dispatch(handle=...) takes no topk_idx / topk_weights (as DeepEP: "
                                   "the handle holds the routing)")
        if type(handle) is not _DispatchHandle or handle.pool.owner is not self or handle.pool.destroyed:
            self._check_handle(handle, _DispatchHandle, "dispatch(handle=...)")
        if num_worst_tokens or expert_alignment != 1:
            raise ferry.InputError("ferry.deep_ep: dispatch(handle=...) takes the num_worst_tokens and "
                                   "expert_alignment of the handle's dispatch; leave them at their defaults")
        fp8 = x_scales is not None
        try:
            num_tokens, hidden = x.shape
        except (AttributeError, ValueError):
            raise ferry.InputError(f"ferry.deep_ep: x must be [num_tokens, hidden], got {shape_text(x)}") from None
        if num_tokens != handle.num_tokens:
            raise ferry.InputError(f"ferry.deep_ep: dispatch(handle=...) got x of {num_tokens} tokens; the handle's "
                                   f"dispatch had {handle.num_tokens}, and a cached dispatch sends the same tokens")
        pool = handle.pool
        buf = pool.buffers[handle.slot]
        if handle.x_kind != (hidden, fp8):
            pool = self._normal_pool(hidden, pool.num_experts, pool.topk, fp8, pool.worst, max_tokens=pool.max_tokens)
            if pool.buffers[0] is None:
                pool.fill()
            buf = pool.buffers[0]
        wait_event(previous_event)
        recv_x, recv_scales = buf.dispatch_owned(x, x_scales=x_scales, eager=not handle.lazy,
                                                 handle=handle.ferry_handle)[:2]
        event = self._event(async_finish, (x,))
        return (recv_x, recv_scales) if fp8 else recv_x, None, None, None, None, event

    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Normal-mode combine of the handle's dispatch: the sum of each token's rows over the ranks it went to (no
        weights), accumulated in fp32 and rounded once, with the bias (one tensor or two) added in fp32 before the
        rounding. With topk_weights [rows of x, topk] float32 (the backward of dispatch) also combined_topk_weights
        [T, topk] float32, the fp32 sum of each token's topk_weights rows over the ranks it went to, in ascending
        rank order (DeepEP's intranode combine), bit for bit. Returns (combined_x [T, hidden] bf16,
        combined_topk_weights or None, event)."""
        if config is not None:
            self._check_config(config)
        if allocate_on_comm_stream:
            self._check_stream_args(previous_event, allocate_on_comm_stream)
        if type(handle) is not _DispatchHandle or handle.pool.owner is not self or handle.pool.destroyed or \
                self.comm is None:
            self._check_handle(handle, _DispatchHandle, "combine()")
        pool = handle.pool
        buf = pool.buffers[handle.slot]
        if topk_weights is not None:
            check_weights(topk_weights, x.size(0), x.device, "combine")
        if previous_event is not None:
            wait_event(previous_event)
        if bias is None:
            y = buf.combine(x, "rank", eager=False, handle=handle.ferry_handle)
        else:
            y = combine_with_bias(buf, handle.ferry_handle, x, bias, handle.num_tokens, x.size(1))
        if topk_weights is None:
            return y, None, EmptyEventOverlap() if not async_finish else self._event(True, (x, y))
        combined_w = combine_weights(self.comm, pool, handle.ferry_handle, topk_weights, self.group_size, self.rank)
        return y, combined_w, self._event(async_finish, (x, y, combined_w))

    # ---- low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean in Ferry: every call carries a sequence number, so its buffers never need zeroing between
        normal and low-latency calls. Checks the arguments as a low-latency call of these shapes would."""
        self._alive("clean_low_latency_buffer()")
        self._ll_check(num_max_dispatch_tokens_per_rank, hidden, num_experts, 1, "bf16")

    def _ll_check(self, max_tokens: int, hidden: int, num_experts: int, topk: int, fmt: str) -> None:
        if not self.low_latency_mode:
            refuse("a low-latency call on a Buffer(low_latency_mode=False)", "its buffers are sized for normal mode",
                    "create the Buffer with low_latency_mode=True and num_rdma_bytes from "
                    "get_low_latency_rdma_size_hint", ferry.ConfigError)
        if num_experts % self.group_size:
            raise ferry.InputError(f"ferry.deep_ep: num_experts={num_experts} is not a multiple of the "
                                   f"{self.group_size} ranks")
        if max_tokens * topk > _MAX_LL_ROWS:
            refuse(f"num_max_dispatch_tokens_per_rank={max_tokens} with num_topk={topk}",
                    f"the layer sends each (token, k) pair as a row and Ferry's low-latency mode takes at most "
                    f"{_MAX_LL_ROWS} rows per rank", f"use num_max_dispatch_tokens_per_rank <= {_MAX_LL_ROWS // topk}")
        need = _ll_bytes(self.group_size, self._nodes, self.comm.backend,
                         _ll_config(max_tokens, hidden, self.group_size, num_experts, topk, fmt))
        if self.num_rdma_bytes < need:
            refuse(f"num_rdma_bytes={self.num_rdma_bytes} for low-latency calls of "
                    f"num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, num_experts={num_experts}",
                    f"they need {need} bytes", "size it with Buffer.get_low_latency_rdma_size_hint", ferry.ConfigError)

    def _ll_pool(self, max_tokens, hidden, num_experts, topk, fmt) -> Pool:
        key = ("ll", max_tokens, hidden, num_experts, topk, fmt)
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        self._ll_check(max_tokens, hidden, num_experts, topk, fmt)
        kwargs = _ll_config(max_tokens, hidden, self.group_size, num_experts, topk, fmt)

        def make():
            # NOTE: a hooked dispatch returns its views only from the receive half, while DeepEP returns the tensors
            # at once: an empty dispatch (collective, as the creation) gets the EpBuffer's views, which every later
            # call reuses (checked in _ll_views).
            buf = ferry.EpBuffer(self.comm, **kwargs)
            empty = buf.dispatch(torch.empty((0, hidden), dtype=torch.bfloat16, device=device),
                                 torch.empty((0, 1), dtype=torch.int64, device=device),
                                 torch.empty((0, 1), dtype=torch.float32, device=device), eager=False)
            return buf, empty

        device = torch.device("cuda", self.comm.device) if self.comm.backend == "cuda" else torch.device("cpu")
        pool = self._pool(key, make)
        pool.max_tokens, pool.hidden, pool.num_experts = max_tokens, hidden, num_experts
        # the entries' weights (1), made with the pool (outside any capture), and their [T, topk] views per T
        pool.ones_base = torch.ones((max_tokens * topk,), dtype=torch.float32, device=device)
        pool.ones = {}
        pool.fill()  # (collective; if it raises, the pool's next call makes them again: take())
        return pool

    def _current(self, handle, call: str):
        """The EpBuffer of a low-latency handle of this Buffer whose layout is still held (the reasons named)."""
        self._check_handle(handle, _LowLatencyHandle, call)
        if handle.pool.generation[handle.slot] != handle.generation:
            raise ferry.InputError(
                f"ferry.deep_ep: {call}: this handle's low_latency_dispatch was overwritten by later calls of the same "
                f"shape: a Buffer keeps the layouts of the last {POOL_SIZE} dispatches per shape (as DeepEP's "
                "low-latency double buffer); combine before that, or use another Buffer for more micro-batches in "
                "flight")
        return handle.pool.buffers[handle.slot]

    @staticmethod
    def _ll_views(views, got):
        if got.expert_x is not views.expert_x or got.expert_counts is not views.expert_counts:
            raise ferry.Error("ferry.deep_ep: internal error: a low-latency dispatch returned views other than the "
                              "EpBuffer's cached ones, so the tensors returned before the hook would be stale")

    # NOTE on the low-latency calls' host time (decode without graphs is bound by it, docs/python.md): the binding
    # checks x, the ids, the weights and out itself, collectively (a refusal there raises on every rank); the layer
    # checks only what the binding cannot name in DeepEP's terms, and makes no torch op.
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Returns (recv_x, recv_count, handle, event, hook) as DeepEP: recv_x [num_local_experts, num_ranks *
        num_max_dispatch_tokens_per_rank, hidden] bf16, or with use_fp8 (float8_e4m3fn rows, scales [E_local, rows,
        hidden // 128] float32, or with use_ue8m0 [E_local, rows, hidden // 512] int32 packed exponents; the scales'
        last two dimensions column-major). Valid until the second next low-latency dispatch of the same shape."""
        if self.comm is None:
            self._alive("low_latency_dispatch()")
        if dispatch_wait_recv_cost_stats is not None:
            refuse("dispatch_wait_recv_cost_stats", "Ferry records no per-rank receive wait times",
                    "pass None (ferry trace records per-phase times: docs/design.md)")
        if async_finish and return_recv_hook:
            raise ferry.InputError("ferry.deep_ep: async_finish and return_recv_hook cannot both be set (as DeepEP)")
        if use_fp8:
            if use_ue8m0 and not round_scale:
                raise ferry.InputError("ferry.deep_ep: use_ue8m0=True needs round_scale=True (as DeepEP)")
            fmt = "fp8" if not round_scale else ("fp8_ue8m0" if use_ue8m0 else "fp8_round")
        elif round_scale or use_ue8m0:
            raise ferry.InputError("ferry.deep_ep: round_scale / use_ue8m0 need use_fp8=True")
        else:
            fmt = "bf16"
        try:
            num_tokens, hidden = x.shape
            idx_tokens, topk = topk_idx.shape
        except (AttributeError, ValueError):
            num_tokens = idx_tokens = None
        if idx_tokens is None or idx_tokens != num_tokens:
            raise ferry.InputError(
                f"ferry.deep_ep: x must be [num_tokens, hidden] bfloat16 and topk_idx [num_tokens, num_topk], got x "
                f"{shape_text(x)} and topk_idx {shape_text(topk_idx)}")
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ferry.InputError(f"ferry.deep_ep: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank="
                                   f"{num_max_dispatch_tokens_per_rank}")
        pool = self._pools.get(("ll", num_max_dispatch_tokens_per_rank, hidden, num_experts, topk, fmt))
        if pool is None:
            pool = self._ll_pool(num_max_dispatch_tokens_per_rank, hidden, num_experts, topk, fmt)
        slot = pool.take()
        buf = pool.buffers[slot]
        # one row per (token, k): entry t * topk + k is a token of its own that goes to expert topk_idx[t, k] alone,
        # and sends row t of x (x_repeat: no expanded copy of x); its weight travels as 1 (the combine's weights are
        # applied when the entries are summed back into their tokens, low_latency_combine). The binding takes the
        # entries' ids and weights as [T, topk] (x_repeat=topk): no view is made here.
        ones = pool.ones.get(num_tokens)
        if ones is None:  # a view (no kernel: also right when first made inside a graph capture)
            ones = pool.ones[num_tokens] = pool.ones_base[:num_tokens * topk].view(num_tokens, topk)
        sent = buf.dispatch(x, topk_idx, ones, eager=False, return_recv_hook=return_recv_hook, x_repeat=topk)
        got = pool.views[slot]
        handle = _LowLatencyHandle(pool, slot, num_tokens, topk, topk_idx)
        hook = None
        if fmt == "bf16" and cumulative_local_expert_recv_stats is None:
            if return_recv_hook:
                def hook():
                    self._ll_views(got, buf.complete_dispatch())
            else:
                self._ll_views(got, sent)
            return (got.expert_x, got.expert_counts, handle,
                    EmptyEventOverlap() if not async_finish else self._event(True, (x, topk_idx)), hook)
        if not return_recv_hook:
            self._ll_views(got, sent)
        rows = got.expert_slots
        scales = None
        if fmt == "fp8" or fmt == "fp8_ue8m0":
            scales = got.expert_scales.transpose(1, 2)[:, :rows, :]
        elif fmt == "fp8_round":
            extras = pool.extras[slot]
            words = extras.get("scale_words")
            if words is None:
                words = extras["scale_words"] = torch.empty(got.expert_scales.shape, dtype=torch.int32,
                                                            device=x.device)
            scales = words.view(torch.float32).transpose(1, 2)[:, :rows, :]

        def finish():
            if fmt == "fp8_round":  # UE8M0 exponent bytes -> the float32 powers of two DeepEP returns
                words.copy_(got.expert_scales)
                words.bitwise_left_shift_(23)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(got.expert_counts)

        if return_recv_hook:
            def hook():
                self._ll_views(got, buf.complete_dispatch())
                finish()
        elif fmt == "fp8_round" or cumulative_local_expert_recv_stats is not None:
            finish()
        recv_x = (got.expert_x, scales) if use_fp8 else got.expert_x
        return recv_x, got.expert_counts, handle, self._event(async_finish, (x, topk_idx)), hook

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden] bf16 tensor that
        low_latency_combine(..., zero_copy=True) combines from (instead of x) for this handle's combine."""
        self._current(handle, "get_next_low_latency_combine_buffer()")
        extras = handle.pool.extras[handle.slot]
        staged = extras.get("combine_input")
        if staged is None:
            local = handle.num_experts // self.group_size
            staged = extras["combine_input"] = torch.empty(
                (local, self.group_size * handle.max_tokens, handle.hidden), dtype=torch.bfloat16,
                device=handle.got.expert_counts.device)
        return staged

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """y[t] = sum_k topk_weights[t, k] * x(t, k) over the k with topk_idx[t, k] >= 0, in fp32, rounded once to
        bf16. Returns (combined_x [num_tokens, hidden] bf16 (out when given), event, hook)."""
        if use_logfmt:
            refuse("use_logfmt=True", "Ferry has no LogFMT wire format (its combine formats are bf16, fp8 and fp4: "
                    "docs/quant.md)", "pass use_logfmt=False")
        if combine_wait_recv_cost_stats is not None:
            refuse("combine_wait_recv_cost_stats", "Ferry records no per-rank receive wait times", "pass None")
        if async_finish and return_recv_hook:
            raise ferry.InputError("ferry.deep_ep: async_finish and return_recv_hook cannot both be set (as DeepEP)")
        if type(handle) is not _LowLatencyHandle or handle.pool.owner is not self or handle.pool.destroyed or \
                handle.pool.generation[handle.slot] != handle.generation or self.comm is None:
            self._current(handle, "low_latency_combine()")  # raises
        buf = handle.pool.buffers[handle.slot]
        num_tokens, topk = handle.num_tokens, handle.topk
        if topk_idx is handle.topk_idx:
            # the dispatch's own -1 entries went nowhere and add nothing in Ferry's sum, whatever their weight
            weights = topk_weights
            shapes_ok = getattr(topk_weights, "shape", None) == topk_idx.shape
        else:
            shapes_ok = (getattr(topk_idx, "shape", None) == (num_tokens, topk) and
                         getattr(topk_weights, "shape", None) == (num_tokens, topk))
            # other ids than the dispatch's: an entry they mark -1 adds nothing (its weight 0)
            weights = topk_weights.masked_fill(topk_idx < 0, 0.0) if shapes_ok else None
        if not shapes_ok:
            raise ferry.InputError(
                f"ferry.deep_ep: topk_idx {shape_text(topk_idx)} and topk_weights {shape_text(topk_weights)} must "
                f"be [{num_tokens}, {topk}], those of the handle's dispatch")
        if weights.dtype is not _FLOAT32:
            weights = weights.float()
        weights = weights.contiguous()  # (no copy when it is: DeepEP's weights usually are)
        source = self.get_next_low_latency_combine_buffer(handle) if zero_copy else x
        # the entries come back and Ferry sums each token's topk of them with these weights, in fp32, rounded once
        # (CombineArgs::group), into out; the binding checks x, out and the weights' dtype and layout
        out = buf.combine(source, "expert", out=out, eager=False, return_recv_hook=return_recv_hook, group=topk,
                          group_weights=weights)
        return (out, EmptyEventOverlap() if not async_finish else self._event(True, (x, topk_idx, topk_weights, out)),
                buf.complete_combine if return_recv_hook else None)


def _ll_config(max_tokens: int, hidden: int, world: int, num_experts: int, topk: int, fmt: str) -> dict:
    """The EpBuffer keyword arguments of a low-latency pool: each (token, k) entry a token of a topk-1 EpBuffer
    (x_repeat), every rank's entries for an expert in its slots (at most max_tokens per rank: a token names an expert
    once)."""
    fmt_name, layout = {"bf16": ("bf16", "row_major"), "fp8": ("fp8", "mn_major_tma"),
                        "fp8_round": ("fp8_ue8m0", "mn_major_tma"),
                        "fp8_ue8m0": ("fp8_ue8m0", "mn_major_tma_packed_ue8m0")}[fmt]
    return dict(hidden=hidden, num_experts=num_experts, topk=1, max_tokens_per_rank=max_tokens * topk,
                expert_capacity=world * max_tokens, mode="ll", dispatch_format=fmt_name, recv_scale_layout=layout)


def _ll_bytes(world: int, nodes: int, backend: str, config: dict) -> int:
    """Bytes the POOL_SIZE low-latency EpBuffers of one pool hold on each rank (their whole footprint)."""
    return POOL_SIZE * footprint_bytes(world, nodes, backend, **config)


def _ll_src_info(handle: _LowLatencyHandle) -> torch.Tensor:
    got = handle.got
    rows = got.expert_src_row.to(torch.int64).clamp_(min=0)
    token = got.recv_src[:, 1].to(torch.int64)[rows] // handle.topk
    slots = torch.arange(rows.size(1), device=rows.device).unsqueeze(0)
    return torch.where(slots < got.expert_counts.unsqueeze(1), token, -1).to(torch.int32)

def _ll_layout_range(handle: _LowLatencyHandle) -> torch.Tensor:
    got, world, rank = handle.got, handle.world, handle.rank
    rows = got.expert_src_row.to(torch.int64).clamp_(min=0)
    source = got.recv_src[:, 0].to(torch.int64)[rows]
    slots = torch.arange(rows.size(1), device=rows.device).unsqueeze(0)
    source = torch.where(slots < got.expert_counts.unsqueeze(1), source, world)
    count = torch.zeros((rows.size(0), world + 1), dtype=torch.int64, device=rows.device)
    count.scatter_add_(1, source, torch.ones_like(source))
    count = count[:, :world]
    # an expert's slots hold this rank's rows first, then rank + 1, ..., rank - 1 (Ferry's expert-major order)
    order = (torch.arange(world, device=rows.device) + rank) % world
    begin_rotated = torch.cumsum(count[:, order], dim=1) - count[:, order]
    begin = torch.empty_like(count)
    begin[:, order] = begin_rotated
    return (begin << 32) | count
