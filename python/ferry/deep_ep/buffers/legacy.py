"""DeepEP's `deep_ep.Buffer` API over Ferry: an engine written against DeepEP switches with one import,

    import ferry.deep_ep as deep_ep

and keeps its calls (`Buffer(group, num_nvl_bytes, num_rdma_bytes, ...)`, `get_dispatch_layout`, `dispatch`,
`combine`, `low_latency_dispatch`, `low_latency_combine`, ...): the same argument names, shapes, dtypes and return
tuples. docs/deep_ep.md lists every function and argument with its status: supported, mapped (how), or refused (the
message). What differs from DeepEP and how it is mapped, in short:

- Ferry buffers are shaped (ferry.EpBuffer: hidden, num_experts, topk, max_tokens_per_rank, mode, formats), DeepEP's
  are byte budgets that learn shapes per call. A Buffer creates Ferry buffers lazily, one pool per (leg kind, shape,
  format), at the first call that needs it (every rank makes the same calls, so every rank creates it at the same
  call: EpBuffer construction is collective). Each pool holds two EpBuffers used in turn, as DeepEP's low-latency
  mode double-buffers: in low-latency mode a dispatch's layout stays valid for its combine while one more dispatch
  of the same shape runs (two micro-batches in flight), and a handle from an older dispatch of that pool is
  refused, never combined. Normal-mode handles carry their layout (below) and stay valid.
- Normal mode: `num_nvl_bytes` sizes each EpBuffer's receive rows: max_tokens_per_rank = num_nvl_bytes // (world *
  bytes of one received row); a call with more tokens is refused with the size that would take it. The outputs are
  copies (DeepEP's are fresh tensors). Each dispatch saves its layout into a Ferry DispatchHandle of its own (the
  layer's handle holds it), so a handle never goes stale, as DeepEP's: a cached dispatch (`handle=`) is Ferry's
  cached dispatch (DispatchArgs::handle: the same rows in the same order, routed by the ids and weights the handle
  keeps where the buffers live) and combine reads the handle's layout (CombineArgs::handle), whatever dispatches ran
  in between. combine(topk_weights=...) (the backward of dispatch) sends each received row's fp32 weights back to
  the source bit for bit (ferry._exact, through a small EpBuffer of the same layout shape) and sums them there over
  the ranks in ascending order, in fp32, as DeepEP's intranode combine does.
- Low-latency mode: DeepEP's combine takes the weights, its dispatch does not, while Ferry's combine applies the
  weights its dispatch carried. The layer therefore dispatches each (token, k) pair as its own row (topk = 1 in the
  EpBuffer, as DeepEP's low-latency kernels send one message per selected expert), combines the expert outputs back
  unweighted (exact: one term each) and reduces them on the source with combine's topk_weights in fp32, rounded once
  to bf16, as DeepEP does.
- Streams: Ferry runs on the caller's current stream; DeepEP's comm stream, `previous_event`, `async_finish` and
  `allocate_on_comm_stream` map onto it (see EventOverlap).

Needs torch (tensors in and out, a torch.distributed group for the ranks). The cuda backend is used when
ferry.cuda_available(), else the cpu backend with torch CPU tensors.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch

import ferry
from ferry import _exact

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]

topk_idx_t = torch.int64  # DeepEP's index dtype (int32 is taken too: Ferry reads either)
_FLOAT32 = torch.float32

_POOL_SIZE = 2  # EpBuffers per (kind, shape, format): DeepEP's low-latency double buffering
_DEFAULT_HINT_TOKENS = 4096  # tokens per rank Config.get_nvl_buffer_size_hint sizes for (EpConfig's default)


def _refuse(what: str, why: str, instead: str, error=ferry.InputError):
    raise error(f"ferry.deep_ep: {what} is not supported: {why}; {instead}")


# ---- events and configs ----------------------------------------------------------------------------------------


class EventHandle:
    """A point on the current stream (DeepEP's EventHandle): a CUDA event recorded on torch's current stream when
    CUDA is available; on the cpu backend every call has completed when it returns, so the handle is already
    complete and waiting on it does nothing."""

    def __init__(self) -> None:
        self._event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)


class EventOverlap:
    """DeepEP's EventOverlap: an optional EventHandle and the tensors to keep alive until it completes.

    Ferry enqueues every call on the caller's current stream (DeepEP: on its comm stream), so the work an event
    stands for is already ordered before whatever the current stream runs next: current_stream_wait() and the `with`
    form are correct and cost one event wait. `event` is None unless the call had async_finish=True (as in DeepEP).
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise ferry.InputError("ferry.deep_ep: EventOverlap.current_stream_wait() on an empty event; the call "
                                   "returns an event only with async_finish=True (as DeepEP)")
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


# what a call without async_finish returns (DeepEP: an EventOverlap holding no event); one object, none made per call
_NO_EVENT = EventOverlap(None)


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
        return _normal_bytes(hidden_bytes, _MAX_TOPK, num_ranks, _DEFAULT_HINT_TOKENS)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # within one node, as DeepEP's for num_ranks <= 8: Ferry's normal mode uses no RDMA buffer

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens="
                f"{self.num_max_nvl_chunked_send_tokens}, num_max_nvl_chunked_recv_tokens="
                f"{self.num_max_nvl_chunked_recv_tokens}, ...)")


_MAX_TOPK = 16  # ferry::kMaxTopk: the topk a size hint plans for
_ROW_META_BYTES = 8  # recv_src (source rank, source token) per received row


def _normal_bytes(payload_bytes: int, topk: int, world: int, tokens_per_rank: int) -> int:
    """Bytes of one normal-mode EpBuffer's receive rows for tokens_per_rank tokens from each of world ranks."""
    return world * tokens_per_rank * (payload_bytes + topk * 8 + _ROW_META_BYTES)


def _fp8_payload_bytes(hidden: int) -> int:
    return hidden + hidden // 128 * 4  # e4m3 elements + one float32 scale per 128


# ---- handles -----------------------------------------------------------------------------------------------------


class _Pool:
    """_POOL_SIZE EpBuffers of one shape, used in turn; low-latency: each counts the dispatches it ran, so a handle
    knows whether its dispatch's layout is still the one its EpBuffer holds."""

    def __init__(self, make: Callable[[], tuple]):
        self.make = make
        self.buffers: list = [None] * _POOL_SIZE
        self.views: list = [None] * _POOL_SIZE  # low-latency: each buffer's cached views
        # low-latency: the number of the dispatch each buffer holds (a handle keeps the number of its own)
        self.generation: list = [0] * _POOL_SIZE
        self.extras: list = [dict() for _ in range(_POOL_SIZE)]
        self.next = 0
        self.value_buffer = None  # normal mode: the EpBuffer combine(topk_weights=...) sends the weights back through
        self.row_index = None  # normal mode, num_worst_tokens: [rows, 1] int64 row numbers (the -1 fill past the count)

    def fill(self) -> None:
        # NOTE: all at once, at the pool's first call: a CUDA graph captured after one eager call (an engine's
        # warm-up) then never creates a buffer (collective, allocating) inside the capture
        for j in range(_POOL_SIZE):
            self.buffers[j], self.views[j] = self.make()

    def take(self) -> int:
        i = self.next
        self.next = (i + 1) % _POOL_SIZE
        if self.buffers[i] is None:
            self.fill()
        self.generation[i] += 1
        return i


class _DispatchHandle:
    """Normal mode's handle: opaque. Holds the Ferry DispatchHandle the dispatch saved its layout into (it fits every
    EpBuffer of the pool: same layout shape), the pool and the slot of the EpBuffer that ran it."""

    __slots__ = ("pool", "slot", "x_kind", "ferry_handle", "num_tokens", "lazy")

    def __init__(self, pool: _Pool, slot: int, x_kind, ferry_handle, num_tokens: int, lazy: bool):
        self.pool, self.slot, self.x_kind, self.ferry_handle = pool, slot, x_kind, ferry_handle
        self.num_tokens, self.lazy = num_tokens, lazy

    def __getitem__(self, i):
        raise ferry.InputError(
            f"ferry.deep_ep: handle[{i}] is not supported: a Ferry dispatch handle is opaque (DeepEP's prefix matrices "
            "and send heads do not exist in Ferry, whose layout is a DispatchHandle); pass the handle to combine() or "
            "dispatch(handle=...) only")


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


class Buffer:
    """DeepEP's Buffer over Ferry. Normal mode: get_dispatch_layout, dispatch, combine; low-latency mode (with
    low_latency_mode=True): low_latency_dispatch, low_latency_combine, get_next_low_latency_combine_buffer. See the
    module's docstring and docs/deep_ep.md."""

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None) -> None:
        refuse = lambda what, why, instead: _refuse(what, why, instead, ferry.ConfigError)  # noqa: E731
        if comm is not None:
            refuse("comm= (an mpi4py communicator)", "Ferry's layer finds its ranks through torch.distributed",
                   "pass group= (a torch.distributed process group)")
        if group is None:
            raise ValueError("ferry.deep_ep: Buffer needs group= (a torch.distributed process group)")
        if not allow_nvlink_for_low_latency_mode:
            refuse("allow_nvlink_for_low_latency_mode=False", "Ferry's low-latency mode moves rows over NVLink "
                   "(load/store) within a node", "leave it True")
        if allow_mnnvl:
            refuse("allow_mnnvl=True", "Ferry runs within one node's NVLink domain", "leave it False")
        if use_fabric:
            refuse("use_fabric=True", "Ferry allocates its windows through NCCL (ncclMemAlloc)", "leave it False")
        if enable_shrink:
            refuse("enable_shrink=True", "this layer does not wire Ferry's rank masking (ferry.EpBuffer("
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
        self.num_qps_per_rank = num_qps_per_rank  # NOTE: no queue pairs in Ferry (NVLink within a node): carried only
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        backend = "cuda" if ferry.cuda_available() else "cpu"
        device = torch.cuda.current_device() if backend == "cuda" else -1
        self.comm = ferry.init(group=group, backend=backend, device=device)
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
        """num_rdma_bytes a low-latency Buffer needs for these shapes (bf16, topk up to 16): Ferry's low-latency
        EpBuffers hold, for each of the two of a pool, every rank's tokens for every local expert (rows and scales)
        and the per-(token, k) rows that come back."""
        if num_experts % num_ranks:
            raise ferry.ConfigError(f"ferry.deep_ep: num_experts={num_experts} is not a multiple of num_ranks="
                                    f"{num_ranks}")
        return _ll_bytes(num_max_dispatch_tokens_per_rank, hidden * 2, num_ranks, num_experts, _MAX_TOPK)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    # ---- refused parts of DeepEP's surface
    def get_comm_stream(self):
        _refuse("get_comm_stream()", "Ferry has no communication stream of its own: every call runs on the caller's "
                "current stream", "order work with the current stream (torch.cuda.current_stream())")

    def get_local_buffer_tensor(self, *args, **kwargs):
        _refuse("get_local_buffer_tensor()", "Ferry's windows are not one raw byte buffer",
                "use the tensors the calls return (get_next_low_latency_combine_buffer for zero-copy combine input)")

    def internode_dispatch(self, *args, **kwargs):
        _refuse("internode_dispatch()", "this layer runs within one node", "call dispatch() within a node")

    def internode_combine(self, *args, **kwargs):
        _refuse("internode_combine()", "this layer runs within one node", "call combine() within a node")

    def low_latency_update_mask_buffer(self, *args, **kwargs):
        _refuse("low_latency_update_mask_buffer()", "this layer does not wire Ferry's rank masking",
                "use ferry.EpBuffer(rank_masking=True): mask_ranks(), mask_status(), clear_mask()")

    def low_latency_query_mask_buffer(self, *args, **kwargs):
        _refuse("low_latency_query_mask_buffer()", "this layer does not wire Ferry's rank masking",
                "use ferry.EpBuffer(rank_masking=True): mask_ranks(), mask_status(), clear_mask()")

    def low_latency_clean_mask_buffer(self, *args, **kwargs):
        _refuse("low_latency_clean_mask_buffer()", "this layer does not wire Ferry's rank masking",
                "use ferry.EpBuffer(rank_masking=True): mask_ranks(), mask_status(), clear_mask()")

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise ferry.InputError("ferry.deep_ep: destroy() needs Buffer(explicitly_destroy=True) (as DeepEP)")
        self._pools = {}
        self.comm = None

    # ---- helpers
    def _pool(self, key, make) -> _Pool:
        pool = self._pools.get(key)
        if pool is None:
            if self.comm is None:
                raise ferry.InputError("ferry.deep_ep: the Buffer was destroyed")
            pool = self._pools[key] = _Pool(make)
            pool.key = key
        return pool

    @staticmethod
    def _wait_previous(previous_event: Optional[EventOverlap]) -> None:
        if previous_event is not None:
            previous_event.current_stream_wait()

    @staticmethod
    def _check_config(config) -> None:
        if config is not None and not isinstance(config, Config):
            raise ferry.InputError(f"ferry.deep_ep: config must be a ferry.deep_ep.Config, not {type(config).__name__}")

    @staticmethod
    def _event(async_finish: bool, tensors=None) -> EventOverlap:
        return EventOverlap(EventHandle(), tensors) if async_finish else _NO_EVENT

    def _check_stream_args(self, previous_event, allocate_on_comm_stream) -> None:
        if allocate_on_comm_stream and previous_event is None:
            raise ferry.InputError("ferry.deep_ep: allocate_on_comm_stream=True needs previous_event (as DeepEP)")

    # ---- normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool,
        event), computed with torch ops on topk_idx's device (no synchronisation, graph-capturable)."""
        self._check_stream_args(previous_event, allocate_on_comm_stream)
        self._wait_previous(previous_event)
        world = self.group_size
        if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int64, torch.int32):
            raise ferry.InputError(f"ferry.deep_ep: topk_idx must be [num_tokens, num_topk] int64 (or int32), got "
                                   f"{tuple(topk_idx.shape)} {topk_idx.dtype}")
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
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=idx.device)
        counts.scatter_add_(0, torch.where(valid, idx, num_experts).view(-1),
                            torch.ones(idx.numel(), dtype=torch.int32, device=idx.device))
        num_tokens_per_expert = counts[:num_experts]
        return (num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank,
                self._event(async_finish, (topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)))

    def _normal_pool(self, hidden: int, num_experts: int, topk: int, fp8: bool, num_worst_tokens: int) -> _Pool:
        key = ("normal", hidden, num_experts, topk, fp8, num_worst_tokens)
        if key in self._pools:
            return self._pools[key]
        world = self.group_size
        payload = _fp8_payload_bytes(hidden) if fp8 else hidden * 2
        per_token = _normal_bytes(payload, topk, world, 1)
        max_tokens = self.num_nvl_bytes // per_token
        if max_tokens < 1:
            _refuse(f"num_nvl_bytes={self.num_nvl_bytes} for normal-mode dispatch of hidden={hidden}",
                    f"one token per rank needs {per_token} bytes (world {world} x {payload} payload + topk "
                    f"{topk} x 8 + 8 bytes per received row)",
                    "create the Buffer with num_nvl_bytes = Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks) "
                    "or more", ferry.ConfigError)
        kwargs = dict(hidden=hidden, num_experts=num_experts, topk=topk, max_tokens_per_rank=max_tokens,
                      dispatch_format="fp8" if fp8 else "bf16")
        if num_worst_tokens:
            kwargs["max_recv_tokens"] = num_worst_tokens
        pool = self._pool(key, lambda: (ferry.EpBuffer(self.comm, **kwargs), None))
        pool.max_tokens, pool.topk = max_tokens, topk
        return pool

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
        recv_topk_idx int64 local expert ids (-1 elsewhere), recv_topk_weights float32 (0 where -1)."""
        if config is not None:
            self._check_config(config)
        if allocate_on_comm_stream:
            self._check_stream_args(previous_event, allocate_on_comm_stream)
        if num_tokens_per_rdma_rank is not None:
            _refuse("num_tokens_per_rdma_rank", "this layer runs within one node (get_dispatch_layout returns None "
                    "for it)", "pass None")
        if expert_alignment < 1:
            raise ferry.InputError(f"ferry.deep_ep: expert_alignment={expert_alignment} must be >= 1")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        fp8 = x_scales is not None
        if fp8:
            if x_scales.dtype != torch.float32 or x_scales.dim() != 2:
                _refuse(f"x_scales of dtype {x_scales.dtype} and shape {tuple(x_scales.shape)}",
                        "Ferry's fp8 input takes one float32 scale per 128 elements",
                        "pass (x [T, hidden] float8_e4m3fn, scales [T, hidden // 128] float32)")
            x_scales = x_scales.contiguous()  # DeepEP takes column-major scales too; Ferry reads row-major
        if handle is not None:
            # cached dispatch: Ferry's, by the handle's saved layout (the same rows, same order; no routing inputs)
            if topk_idx is not None or topk_weights is not None:
                raise ferry.InputError("ferry.deep_ep: dispatch(handle=...) takes no topk_idx / topk_weights (as "
                                       "DeepEP: the handle holds the routing)")
            self._normal_handle(handle, "dispatch(handle=...)")
            if x.size(0) != handle.num_tokens or handle.x_kind != (x.size(1), fp8):
                # NOTE: a Ferry handle fits any EpBuffer of its layout shape, but the pool of another hidden size or
                # input format has another max_tokens_per_rank (num_nvl_bytes // its row bytes), so it does not fit
                raise ferry.InputError(
                    f"ferry.deep_ep: dispatch(handle=...) got x of {tuple(x.shape)} ({'fp8' if fp8 else 'bf16'}); the "
                    f"handle's dispatch had {handle.num_tokens} tokens of hidden={handle.x_kind[0]} "
                    f"({'fp8' if handle.x_kind[1] else 'bf16'}); a cached dispatch takes x of that shape and format")
            if num_worst_tokens or expert_alignment != 1:
                raise ferry.InputError("ferry.deep_ep: dispatch(handle=...) takes the num_worst_tokens and "
                                       "expert_alignment of the handle's dispatch; leave them at their defaults")
            self._wait_previous(previous_event)
            buf = handle.pool.buffers[handle.slot]
            recv_x, recv_scales = buf.dispatch_owned(x, x_scales=x_scales, eager=not handle.lazy,
                                                     handle=handle.ferry_handle)[:2]
            event = self._event(async_finish, (x,))
            return (recv_x, recv_scales) if fp8 else recv_x, None, None, None, None, event
        if topk_idx is None or topk_weights is None:
            _refuse("dispatch without topk_idx / topk_weights (routing by is_token_in_rank alone)",
                    "Ferry routes by expert id", "pass topk_idx and topk_weights (or handle= for a cached dispatch)")
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ferry.InputError("ferry.deep_ep: dispatch needs num_tokens_per_rank, is_token_in_rank and "
                                   "num_tokens_per_expert from get_dispatch_layout (as DeepEP)")
        world = self.group_size
        try:
            num_tokens, hidden = x.shape
            _, topk = topk_idx.shape
        except (AttributeError, ValueError):
            raise ferry.InputError(f"ferry.deep_ep: x must be [num_tokens, hidden] and topk_idx [num_tokens, num_topk],"
                                   f" got x {_shape_text(x)} and topk_idx {_shape_text(topk_idx)}") from None
        num_experts = num_tokens_per_expert.numel()
        # NOTE: the layout tensors are what get_dispatch_layout derives from topk_idx; Ferry derives the same layout
        # itself (its count exchange), so only their shapes are checked here: num_tokens_per_expert gives num_experts.
        # The binding checks x, topk_idx and topk_weights (shapes, dtypes, placement), collectively.
        if num_tokens_per_rank.shape != (world,) or is_token_in_rank.shape != (num_tokens, world):
            raise ferry.InputError(
                f"ferry.deep_ep: num_tokens_per_rank {tuple(num_tokens_per_rank.shape)} / is_token_in_rank "
                f"{tuple(is_token_in_rank.shape)} must be [{world}] / [{num_tokens}, {world}] (get_dispatch_layout)")
        pool = self._pools.get(("normal", hidden, num_experts, topk, fp8, num_worst_tokens))
        if pool is None:
            pool = self._normal_pool(hidden, num_experts, topk, fp8, num_worst_tokens)
        if num_tokens > pool.max_tokens:
            need = _normal_bytes(_fp8_payload_bytes(hidden) if fp8 else hidden * 2, topk, world, num_tokens)
            _refuse(f"dispatch of {num_tokens} tokens with num_nvl_bytes={self.num_nvl_bytes}",
                    f"that budget holds {pool.max_tokens} tokens per rank at hidden={hidden}, topk={topk}",
                    f"create the Buffer with num_nvl_bytes >= {need}")
        if previous_event is not None:
            previous_event.current_stream_wait()
        slot = pool.take()
        lazy = num_worst_tokens > 0
        # NOTE: the binding copies the rows, ids (int64 when topk_idx is) and weights into fresh tensors (DeepEP's
        # outputs are the caller's) and reads the counts, with no torch op here
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, saved, num_recv = pool.buffers[
            slot].dispatch_owned(x, topk_idx, topk_weights, x_scales=x_scales, eager=not lazy, save_handle=True)
        handle = _DispatchHandle(pool, slot, (hidden, fp8), saved, num_tokens, lazy)
        if lazy:
            # rows past the count: -1 ids (as DeepEP), found on the device (no synchronisation)
            rows = pool.row_index
            if rows is None:
                rows = pool.row_index = torch.arange(recv_topk_idx.size(0), device=recv_topk_idx.device).unsqueeze(1)
            recv_topk_idx.masked_fill_(rows >= num_recv, -1)
            counts = []
        elif expert_alignment != 1:
            counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        event = _NO_EVENT if not async_finish else self._event(True, (x,))
        return (recv_x, recv_scales) if fp8 else recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event

    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Normal-mode combine of the handle's dispatch: the sum of each token's rows over the ranks it went to (no
        weights), bf16 accumulated in fp32 and rounded once. With topk_weights [num_recv_rows, topk] float32 (the
        backward of dispatch: the gradient of recv_topk_weights) also combined_topk_weights [T, topk] float32, the
        fp32 sum of each token's topk_weights rows over the ranks it went to, in ascending rank order (DeepEP's
        intranode combine), bit for bit. Returns (combined_x [T, hidden] bf16, combined_topk_weights or None,
        event)."""
        if config is not None:
            self._check_config(config)
        if allocate_on_comm_stream:
            self._check_stream_args(previous_event, allocate_on_comm_stream)
        if bias is not None:
            _refuse("combine(bias=...)", "Ferry's combine fuses no bias (adding it afterwards rounds twice, which "
                    "DeepEP does not)", "add the bias to combined_x yourself")
        if type(handle) is not _DispatchHandle or self._pools.get(handle.pool.key) is not handle.pool:
            self._normal_handle(handle, "combine()")  # raises
        pool = handle.pool
        if topk_weights is not None:
            if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 or \
                    tuple(topk_weights.shape) != (x.size(0), pool.topk):
                got = (f"{tuple(topk_weights.shape)} {topk_weights.dtype}" if isinstance(topk_weights, torch.Tensor)
                       else type(topk_weights).__name__)
                raise ferry.InputError(
                    f"ferry.deep_ep: combine(topk_weights=...) must be [{x.size(0)}, {pool.topk}] float32 (a row of "
                    f"top-k weights per row of x, as DeepEP), got {got}")
            if topk_weights.device != x.device:
                raise ferry.InputError(f"ferry.deep_ep: combine(topk_weights=...) is on {topk_weights.device}, x on "
                                       f"{x.device}; pass both on the same device")
        if previous_event is not None:
            previous_event.current_stream_wait()
        y = pool.buffers[handle.slot].combine(x, "rank", eager=False, handle=handle.ferry_handle)
        if topk_weights is None:
            return y, None, _NO_EVENT if not async_finish else self._event(True, (x, y))
        combined_w = self._combine_weights(pool, handle, topk_weights)
        return y, combined_w, self._event(async_finish, (x, y, combined_w))

    def _combine_weights(self, pool: _Pool, handle: _DispatchHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """combined[t, k] = fp32 sum over r ascending of rank r's topk_weights row of token t (0 where r did not
        receive t): each rank's rows travel back in their own columns (rank r's in columns r * topk.., so each column
        has one sender: ferry._exact's contract), and the source adds the ranks in order, as DeepEP's kernel does."""
        world, rank, topk = self.group_size, self.rank, pool.topk
        if pool.value_buffer is None:
            # NOTE: collective, at the pool's first combine with topk_weights (every rank makes the same calls)
            pool.value_buffer = _exact.value_buffer(self.comm, pool.buffers[0], world * topk)
        rows = topk_weights.size(0)
        values = torch.zeros((rows, world, topk), dtype=torch.float32, device=topk_weights.device)
        values[:, rank] = topk_weights
        per_rank = _exact.send_back(pool.value_buffer, handle.ferry_handle, values.view(rows, world * topk),
                                    eager=False).view(-1, world, topk)
        combined = torch.zeros((per_rank.size(0), topk), dtype=torch.float32, device=per_rank.device)
        for r in range(world):  # NOTE: one fp32 add per rank, in rank order (a torch.sum could reorder)
            combined = combined + per_rank[:, r]
        return combined

    def _normal_handle(self, handle, call: str) -> None:
        if not isinstance(handle, _DispatchHandle):
            raise ferry.InputError(f"ferry.deep_ep: {call} needs handle= a handle of this layer's dispatch(), got "
                                   f"{type(handle).__name__}")
        if self._pools.get(handle.pool.key) is not handle.pool:
            raise ferry.InputError(f"ferry.deep_ep: {call} got a handle of another Buffer's dispatch (or of this "
                                   "Buffer before destroy()); pass the handle of this Buffer's dispatch")

    def _current(self, handle, kind, call: str):
        if not isinstance(handle, kind):
            raise ferry.InputError(f"ferry.deep_ep: handle is not a handle of this layer's {call}()")
        if handle.pool.generation[handle.slot] != handle.generation:
            raise ferry.InputError(
                f"ferry.deep_ep: this handle's {call} was overwritten by later calls of the same shape: a Buffer keeps "
                f"the layouts of the last {_POOL_SIZE} dispatches per shape (as DeepEP's low-latency double buffer); "
                "combine before that, or use another Buffer for more micro-batches in flight")
        return handle.pool.buffers[handle.slot]

    # ---- low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean in Ferry: every call carries a sequence number, so its buffers never need zeroing between
        normal and low-latency calls. Checks the arguments as a low-latency call of these shapes would."""
        self._ll_check(num_max_dispatch_tokens_per_rank, hidden, num_experts, 1)

    def _ll_check(self, max_tokens: int, hidden: int, num_experts: int, topk: int) -> None:
        if not self.low_latency_mode:
            _refuse("a low-latency call on a Buffer(low_latency_mode=False)", "its buffers are sized for normal mode",
                    "create the Buffer with low_latency_mode=True and num_rdma_bytes from "
                    "get_low_latency_rdma_size_hint", ferry.ConfigError)
        if num_experts % self.group_size:
            raise ferry.InputError(f"ferry.deep_ep: num_experts={num_experts} is not a multiple of the "
                                   f"{self.group_size} ranks")
        if max_tokens * topk > _MAX_LL_ROWS:
            _refuse(f"num_max_dispatch_tokens_per_rank={max_tokens} with num_topk={topk}",
                    f"the layer sends each (token, k) pair as a row and Ferry's low-latency mode takes at most "
                    f"{_MAX_LL_ROWS} rows per rank", f"use num_max_dispatch_tokens_per_rank <= {_MAX_LL_ROWS // topk}")
        need = _ll_bytes(max_tokens, hidden * 2, self.group_size, num_experts, topk)
        if self.num_rdma_bytes < need:
            _refuse(f"num_rdma_bytes={self.num_rdma_bytes} for low-latency calls of "
                    f"num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, num_experts={num_experts}",
                    f"they need {need} bytes", "size it with Buffer.get_low_latency_rdma_size_hint", ferry.ConfigError)

    def _ll_pool(self, max_tokens, hidden, num_experts, topk, fmt) -> _Pool:
        key = ("ll", max_tokens, hidden, num_experts, topk, fmt)
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        self._ll_check(max_tokens, hidden, num_experts, topk)
        world = self.group_size
        fmt_name, layout = {"bf16": ("bf16", "row_major"), "fp8": ("fp8", "mn_major_tma"),
                            "fp8_round": ("fp8_ue8m0", "mn_major_tma"),
                            "fp8_ue8m0": ("fp8_ue8m0", "mn_major_tma_packed_ue8m0")}[fmt]
        kwargs = dict(hidden=hidden, num_experts=num_experts, topk=1, max_tokens_per_rank=max_tokens * topk,
                      expert_capacity=world * max_tokens, mode="ll", dispatch_format=fmt_name,
                      recv_scale_layout=layout)

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
        pool.rank, pool.world, pool.max_tokens, pool.hidden, pool.num_experts = (self.rank, world, max_tokens, hidden,
                                                                                 num_experts)
        # the entries' weights (1), made with the pool (outside any capture), and their [T, topk] views per T
        pool.ones_base = torch.ones((max_tokens * topk,), dtype=torch.float32, device=device)
        pool.ones = {}
        pool.fill()  # (collective; if it raises, the pool's next call makes them again: take())
        return pool

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
        if dispatch_wait_recv_cost_stats is not None:
            _refuse("dispatch_wait_recv_cost_stats", "Ferry records no per-rank receive wait times",
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
                f"{_shape_text(x)} and topk_idx {_shape_text(topk_idx)}")
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
                    _NO_EVENT if not async_finish else self._event(True, (x, topk_idx)), hook)
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
        self._current(handle, _LowLatencyHandle, "low_latency_dispatch")
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
            _refuse("use_logfmt=True", "Ferry has no LogFMT wire format (its combine formats are bf16, fp8 and fp4: "
                    "docs/quant.md)", "pass use_logfmt=False")
        if combine_wait_recv_cost_stats is not None:
            _refuse("combine_wait_recv_cost_stats", "Ferry records no per-rank receive wait times", "pass None")
        if async_finish and return_recv_hook:
            raise ferry.InputError("ferry.deep_ep: async_finish and return_recv_hook cannot both be set (as DeepEP)")
        if type(handle) is not _LowLatencyHandle or handle.pool.generation[handle.slot] != handle.generation:
            self._current(handle, _LowLatencyHandle, "low_latency_dispatch")  # raises
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
                f"ferry.deep_ep: topk_idx {_shape_text(topk_idx)} and topk_weights {_shape_text(topk_weights)} must "
                f"be [{num_tokens}, {topk}], those of the handle's dispatch")
        if weights.dtype is not _FLOAT32:
            weights = weights.float()
        weights = weights.contiguous()  # (no copy when it is: DeepEP's weights usually are)
        source = self.get_next_low_latency_combine_buffer(handle) if zero_copy else x
        # the entries come back and Ferry sums each token's topk of them with these weights, in fp32, rounded once
        # (CombineArgs::group), into out; the binding checks x, out and the weights' dtype and layout
        out = buf.combine(source, "expert", out=out, eager=False, return_recv_hook=return_recv_hook, group=topk,
                          group_weights=weights)
        return (out, _NO_EVENT if not async_finish else self._event(True, (x, topk_idx, topk_weights, out)),
                buf.complete_combine if return_recv_hook else None)


def _shape_text(t) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


_MAX_LL_ROWS = 1024  # ferry::kMaxLowLatencyTokens


def _ll_bytes(max_tokens: int, row_bytes: int, world: int, num_experts: int, topk: int) -> int:
    """Bytes the two low-latency EpBuffers of one pool hold: every rank's tokens for every local expert, each
    rank's (token, k) rows in flight (sent and combined back)."""
    local = num_experts // world
    expert_rows = local * world * max_tokens * row_bytes
    pair_rows = world * max_tokens * topk * (row_bytes + 16)
    return _POOL_SIZE * 2 * (expert_rows + pair_rows)


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
