"""DeepEP V2's `deep_ep.ElasticBuffer` (deep_ep/buffers/elastic.py) over Ferry: its expert-parallel surface
(dispatch, combine, EPHandle, capture, barrier, destroy, the domain sizes and the size hints) with the same argument
names, shapes, dtypes and return tuples. What Ferry does not do (Engram, pipeline send/recv, all-gather
reduce-scatter, the CPU buffer of num_cpu_bytes) is refused with a message saying so. docs/deep_ep.md has every
argument.

How it maps onto Ferry:
- A dispatch is Ferry's normal-mode dispatch on an EpBuffer of the call's shape (hidden, num_experts, topk,
  num_max_tokens_per_rank, bf16 or fp8), from a pool of two made at the first call of that shape (collective: every
  rank makes the same calls). Its rows come in Ferry's order, (source rank, source token), which is the order
  DeepEP's deterministic mode sorts into: the outputs are always deterministic, and deterministic=True costs nothing.
- do_cpu_sync=True (DeepEP's default) is Ferry's eager dispatch: exactly the received rows; False is the lazy one
  (graph-capturable, no host synchronisation): outputs of the worst-case size, the counts on the device.
- The expanded layout (do_expand: one row per (token, local expert), experts contiguous, each starting at a multiple of
  expert_alignment) is built on the receiver from the rank-major rows, tokens in (source rank, source token) order
  within an expert; the reduced combine of such rows sums each token's rows in top-k order in fp32, rounds once, and
  sends one row per (token, rank) back, as DeepEP's multiple reduction does.
- A cached dispatch (handle=) is Ferry's cached dispatch of the handle's layout, in the handle's format or another;
  with topk_weights (a backward pass) it is a dispatch of the handle's ids with those weights, which lands in the
  same places (Ferry's layout is a function of the ids).
- combine is Ferry's rank-major combine of the handle's layout (each token's rows summed over the ranks in ascending
  order, fp32, rounded once); a bias is added in fp32 before that one rounding; topk_weights come back bit for bit,
  each from the rank that holds the expert (ferry._exact).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Tuple

import torch

import ferry

from .._common import (MAX_TOPK, Pool, PoolOwner, check_weights, combine_weights, combine_with_bias,
                       footprint_bytes, hint_bytes, refuse, refused_call, shape_text)
from ..utils.envs import check_torch_deterministic
from ..utils.event import EmptyEventOverlap, EventHandle, EventOverlap, wait_event

__all__ = ["ElasticBuffer", "EPHandle"]

_ALIGNMENT = 2 << 20  # DeepEP's buffer sizes are multiples of 2 MiB
_SF_ALIGN = 4  # rows of a TMA-aligned column-major scale tensor are padded to a multiple of this


def _align(x: int, y: int) -> int:
    return -(-x // y) * y


class EPHandle:
    """The layout of one ElasticBuffer.dispatch, for a cached dispatch and the combine (DeepEP's EPHandle): its
    public fields hold DeepEP's meaning where Ferry has the data (docs/deep_ep.md):

    do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx (a copy with
    do_handle_copy), num_recv_tokens (exact with do_cpu_sync, else the worst case), num_expanded_tokens,
    num_recv_tokens_per_expert_list (aligned; empty without do_cpu_sync), psum_num_recv_tokens_per_scaleup_rank
    [scaleup ranks] int32 (inclusive prefix sum of the rows received from each scale-up index),
    psum_num_recv_tokens_per_expert [local experts] int32 (DeepEP's two definitions, expanded or not),
    num_unaligned_recv_tokens_per_expert [local experts] int32, recv_src_metadata [rows, 2 + topk] int32 (column 0
    the source's global token index, source rank * num_max_tokens_per_rank + token; column 1 source rank * topk +
    the first top-k entry local to this rank; columns 2.. the expanded row of each entry, -1 where none or not
    expanded), dst_buffer_slot_idx [num_tokens, topk] int32 (Ferry has no per-entry buffer slots: the destination
    rank of each entry, -1 for none). token_metadata_at_forward and channel_linked_list (DeepEP's hybrid kernels'
    bookkeeping) are None."""

    # NOTE: the fields that follow from the layout (_Layout) are made when first read: on the device (torch ops) or
    # from the counts on the host, so a dispatch followed by its combine makes none of them, and a dispatch sets
    # only what it was given. Assigning one (DeepEP's test slices recv_src_metadata) replaces it as any attribute.
    _DERIVED = {
        "num_recv_tokens": lambda h: h._layout.rows,
        "num_expanded_tokens": lambda h: h._layout.num_expanded(),
        "num_recv_tokens_per_expert_list": lambda h: h._layout.aligned_list(),
        "psum_num_recv_tokens_per_scaleup_rank": lambda h: h._layout.psum_per_scaleup(),
        "psum_num_recv_tokens_per_expert": lambda h: h._layout.psum_per_expert(h.do_expand),
        "num_unaligned_recv_tokens_per_expert": lambda h: h._layout.counts().to(torch.int32),
        "recv_src_metadata": lambda h: h._layout.metadata(),
        "dst_buffer_slot_idx": lambda h: h._layout.destinations(h.topk_idx),
    }
    # DeepEP's hybrid kernels' bookkeeping, which Ferry does not have
    token_metadata_at_forward = None
    channel_linked_list = None
    cached_recv_src_metadata_before_sort = None

    def __init__(self, layout: "_Layout", pool: Pool, slot: int, ferry_handle, recv_topk_idx, topk_idx: torch.Tensor,
                 do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int):
        # the layout, the pool and slot of the EpBuffer that ran the dispatch, the Ferry DispatchHandle it saved, and
        # the recv_topk_idx it returned (a cached dispatch returns it again)
        self._layout, self._pool, self._slot, self._ferry, self._recv_topk_idx = (layout, pool, slot, ferry_handle,
                                                                                  recv_topk_idx)
        self.topk_idx, self.do_expand, self.num_experts, self.expert_alignment = (topk_idx, do_expand, num_experts,
                                                                                  expert_alignment)
        self.num_max_tokens_per_rank, self.num_sms = num_max_tokens_per_rank, num_sms

    def __getattr__(self, name):
        make = EPHandle._DERIVED.get(name)
        if make is None or "_layout" not in self.__dict__:
            raise AttributeError(f"'EPHandle' object has no attribute {name!r}")
        value = make(self)
        setattr(self, name, value)
        return value

    def deterministic_sort(self, *args, **kwargs) -> None:
        """Nothing to sort: Ferry's rows always come in (source rank, source token) order, the order DeepEP's
        deterministic mode sorts into."""


class ElasticBuffer(PoolOwner):
    """DeepEP V2's ElasticBuffer over Ferry (see the module's docstring and docs/deep_ep.md)."""

    def __init__(self, group, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False):
        refuse_config = lambda what, why, instead: refuse(what, why, instead, ferry.ConfigError)  # noqa: E731
        if group is None:
            raise ValueError("ferry.deep_ep: ElasticBuffer needs a torch.distributed process group")
        if num_cpu_bytes:
            refuse_config(f"num_cpu_bytes={num_cpu_bytes} (Engram's CPU storage)", "Ferry has no Engram",
                          "pass num_cpu_bytes=0")
        if not allow_multiple_reduction:
            refuse_config("allow_multiple_reduction=False", "Ferry's combine always reduces a token's rows on the "
                          "rank that holds them before sending one row per (token, rank)", "leave it True")
        if num_bytes is not None and num_bytes < 0:
            raise ferry.ConfigError(f"ferry.deep_ep: num_bytes={num_bytes} must be >= 0")
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk)):
            if value < 0:
                raise ferry.ConfigError(f"ferry.deep_ep: {name}={value} must be >= 0")
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic  # Ferry's outputs are always in the deterministic order
        self.explicitly_destroy = explicitly_destroy
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden, self.num_topk, self.use_fp8_dispatch = hidden, num_topk, use_fp8_dispatch
        # NOTE: carried only: Ferry sets up no RDMA queue pairs or service levels of its own (NCCL's GIN does), and
        # its bounded waits use FERRY_TIMEOUT_S (docs/errors.md)
        self.sl_idx, self.num_allocated_qps = sl_idx, num_allocated_qps
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        backend = "cuda" if ferry.cuda_available() else "cpu"
        device = torch.cuda.current_device() if backend == "cuda" else -1
        self.comm = ferry.init(group=group, backend=backend, device=device)
        nodes, local = self.comm.topology
        if nodes > 1 and not allow_hybrid_mode:
            refuse_config("allow_hybrid_mode=False across nodes", "Ferry's normal mode crosses nodes hierarchically "
                          "(a token once per node, then over NVLink)", "leave it True")
        self.num_rdma_ranks, self.num_nvlink_ranks = nodes, local
        self.num_scaleout_ranks, self.num_scaleup_ranks = (nodes, local) if allow_hybrid_mode else (1, self.num_ranks)
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                                  allow_hybrid_mode, allow_multiple_reduction)
        self.num_bytes = num_bytes
        self._device = torch.device("cuda", device) if backend == "cuda" else torch.device("cpu")
        self._pools: dict = {}
        self.comm.barrier()

    # ---- sizes, domains, lifetime
    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """The num_bytes that holds a dispatch of these shapes: one Ferry EpBuffer's footprint
        (ferry.EpBuffer.footprint, the larger of the two backends) for num_max_tokens_per_rank tokens, at topk up to 16
        when num_topk is 0; a multiple of 2 MiB."""
        need = hint_bytes(group.size(), 1, hidden=hidden, topk=num_topk or MAX_TOPK,
                          max_tokens_per_rank=num_max_tokens_per_rank,
                          dispatch_format="fp8" if use_fp8_dispatch else "bf16")
        return _align(max(need, 1), _ALIGNMENT)

    def get_physical_domain_size(self) -> Tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank waits for every rank (Ferry's communicator barrier, on the current stream: Ferry has no
        communication stream); with_cpu_sync also synchronises the device before and after."""
        self._alive("barrier()")
        cuda = self.comm.backend == "cuda"
        if with_cpu_sync and cuda:
            torch.cuda.synchronize()
        self.comm.barrier(torch.cuda.current_stream() if cuda else None)
        if with_cpu_sync and cuda:
            torch.cuda.synchronize()

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The CTAs Ferry's normal-mode dispatch launches for this buffer's shape at num_max_tokens_per_rank tokens,
        from Ferry's own tuning (FERRY_DISPATCH_BLOCKS, then the tuning table of this GPU, world, hidden, topk and
        format; docs/tuning.md), else its default of one CTA per SM. The bandwidth arguments of DeepEP's model are
        not used. The cpu backend runs no kernels: 1."""
        if self.comm is None or self.comm.backend != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(self._device).multi_processor_count
        blocks, _ = ferry._ext._tuned_blocks("dispatch", torch.cuda.get_device_name(self._device), self.num_ranks,
                                             self.hidden, num_topk, "fp8" if self.use_fp8_dispatch else "bf16",
                                             "normal", max(1, self.num_max_tokens_per_rank))
        return min(blocks, sms) if blocks > 0 else sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """0: Ferry sets up no queue pairs of its own (across nodes NCCL's GIN does); num_qps arguments are
        carried only."""
        return 0

    # ---- refused: what Ferry does not do (it moves MoE tokens only)
    _ENGRAM, _PP, _AGRS = "keep DeepEP for Engram", "use torch.distributed send/recv", \
        "use torch.distributed all_gather / reduce_scatter"
    _WHY = "Ferry moves MoE tokens only"
    get_engram_storage_size_hint = refused_call("Engram (get_engram_storage_size_hint)", _WHY, _ENGRAM, static=True)
    get_pp_buffer_size_hint = refused_call("pipeline-parallel send/recv (get_pp_buffer_size_hint)", _WHY, _PP,
                                           static=True)
    get_agrs_num_max_session_bytes = refused_call("all-gather reduce-scatter (get_agrs_num_max_session_bytes)", _WHY,
                                                  _AGRS, static=True)
    get_agrs_buffer_size_hint = refused_call("all-gather reduce-scatter (get_agrs_buffer_size_hint)", _WHY, _AGRS,
                                             static=True)
    engram_write = refused_call("Engram (engram_write)", _WHY, _ENGRAM)
    engram_fetch = refused_call("Engram (engram_fetch)", _WHY, _ENGRAM)
    pp_set_config = refused_call("pipeline-parallel send/recv (pp_set_config)", _WHY, _PP)
    pp_send = refused_call("pipeline-parallel send/recv (pp_send)", _WHY, _PP)
    pp_recv = refused_call("pipeline-parallel send/recv (pp_recv)", _WHY, _PP)
    create_agrs_session = refused_call("all-gather reduce-scatter (create_agrs_session)", _WHY, _AGRS)
    destroy_agrs_session = refused_call("all-gather reduce-scatter (destroy_agrs_session)", _WHY, _AGRS)
    agrs_set_config = refused_call("all-gather reduce-scatter (agrs_set_config)", _WHY, _AGRS)
    agrs_get_inplace_tensor = refused_call("all-gather reduce-scatter (agrs_get_inplace_tensor)", _WHY, _AGRS)
    all_gather = refused_call("all-gather reduce-scatter (all_gather)", _WHY, _AGRS)

    @contextmanager
    def agrs_new_session(self, enabled: bool = True):
        if enabled:
            refuse("all-gather reduce-scatter (agrs_new_session)", self._WHY, self._AGRS)
        yield

    # ---- dispatch
    def _pool(self, hidden: int, num_experts: int, topk: int, kind: str, max_tokens: int) -> Pool:
        """The pool of EpBuffers of one shape; kind: 'bf16', 'fp8' (float32 scales) or 'ue8m0' (packed UE8M0)."""
        key = ("elastic", hidden, num_experts, topk, kind, max_tokens)
        pool = self._pools.get(key)
        if pool is not None:
            return pool
        fmt = {"bf16": "bf16", "fp8": "fp8", "ue8m0": "fp8_ue8m0"}[kind]
        kwargs = dict(hidden=hidden, num_experts=num_experts, topk=topk, max_tokens_per_rank=max_tokens,
                      dispatch_format=fmt)
        need = footprint_bytes(self.num_ranks, self.num_rdma_ranks, self.comm.backend, **kwargs)
        if need > self.num_bytes:
            refuse(f"a dispatch of hidden={hidden}, topk={topk}, num_max_tokens_per_rank={max_tokens} with "
                   f"num_bytes={self.num_bytes}", f"its Ferry EpBuffer takes {need} bytes",
                   f"create the ElasticBuffer with num_bytes >= {_align(need, _ALIGNMENT)} "
                   "(ElasticBuffer.get_buffer_size_hint)", ferry.ConfigError)
        pool = self._pools[key] = Pool(key, self, lambda: (ferry.EpBuffer(self.comm, **kwargs), None))
        pool.hidden, pool.num_experts, pool.topk = hidden, num_experts, topk
        pool.kind, pool.max_tokens = kind, max_tokens
        # what a layout of this pool's dispatches derives its fields with (_Layout)
        pool.world, pool.scaleup, pool.local = self.num_ranks, self.num_scaleup_ranks, num_experts // self.num_ranks
        pool.zeros = torch.zeros((max_tokens * topk,), dtype=torch.float32, device=self._device)
        return pool

    def _check_handle(self, handle, call: str) -> None:
        self._alive(call)
        if not isinstance(handle, EPHandle):
            raise ferry.InputError(f"ferry.deep_ep: ElasticBuffer.{call} needs handle= an EPHandle of this buffer's "
                                   f"dispatch, got {type(handle).__name__}")
        pool = handle._pool
        if pool.destroyed:
            raise ferry.InputError(f"ferry.deep_ep: ElasticBuffer.{call} got an EPHandle kept past its buffer's "
                                   "destroy(): its layout is gone with that buffer; dispatch again")
        if pool.owner is not self:
            raise ferry.InputError(f"ferry.deep_ep: ElasticBuffer.{call} got an EPHandle of another ElasticBuffer; "
                                   "pass the handle of a dispatch of this buffer")

    @staticmethod
    def _split_x(x):
        """(x, Ferry's row-major scales or None, kind); DeepEP's scales are float32 [T, hidden / 128] or packed UE8M0
        int32 [T, hidden / 512], in any strides."""
        x, sf = x if isinstance(x, tuple) else (x, None)
        if sf is None:
            return x, None, "bf16"
        if not isinstance(sf, torch.Tensor) or sf.dim() != 2 or sf.dtype not in (torch.float32, torch.int32):
            raise ferry.InputError(f"ferry.deep_ep: the scale factors of fp8 x must be [num_tokens, hidden / 128] "
                                   f"float32 or [num_tokens, hidden / 512] int32 (packed UE8M0), got {shape_text(sf)}")
        if sf.dtype == torch.float32:
            return x, sf.contiguous(), "fp8"
        return x, sf.contiguous().view(torch.uint8), "ue8m0"  # four exponent bytes per int32, in block order

    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Returns (recv_x or (recv_x, recv_sf), recv_topk_idx (None when expanded), recv_topk_weights (None without
        topk_weights), handle, event), as DeepEP V2 (see the module's docstring)."""
        if self.comm is None:
            self._alive("dispatch()")
        check_torch_deterministic()
        # NOTE: DeepEP's test programs pass their flags as ints (argparse); the binding and the handle take bools
        do_expand = bool(do_expand)
        if do_zero_padding and not do_expand:
            raise ferry.InputError("ferry.deep_ep: do_zero_padding=True needs do_expand=True (as DeepEP)")
        if previous_event is not None and not allocate_on_comm_stream:
            raise ferry.InputError("ferry.deep_ep: previous_event needs allocate_on_comm_stream=True (as DeepEP)")
        if num_sms < 0 or num_qps < 0:
            raise ferry.InputError(f"ferry.deep_ep: num_sms={num_sms} and num_qps={num_qps} must be >= 0")
        if isinstance(x, tuple):
            x, sf, kind = self._split_x(x)
        else:
            sf, kind = None, "bf16"
        if handle is not None:
            return self._cached_dispatch(x, sf, kind, handle, topk_idx, topk_weights, num_experts,
                                         num_max_tokens_per_rank, expert_alignment, do_cpu_sync, do_expand,
                                         do_zero_padding, use_tma_aligned_col_major_sf, previous_event,
                                         previous_event_before_epilogue, async_with_compute_stream)
        max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        alignment = 1 if expert_alignment is None else expert_alignment
        eager = True if do_cpu_sync is None else bool(do_cpu_sync)
        try:
            num_tokens, hidden = x.shape
            idx_tokens, topk = topk_idx.shape
        except (AttributeError, ValueError):
            raise ferry.InputError(f"ferry.deep_ep: x must be [num_tokens, hidden] and topk_idx [num_tokens, num_topk],"
                                   f" got x {shape_text(x)} and topk_idx {shape_text(topk_idx)}") from None
        if num_experts is None or num_experts <= 0 or num_experts % self.num_ranks:
            raise ferry.InputError(f"ferry.deep_ep: num_experts={num_experts} must be given, a positive multiple of "
                                   f"the {self.num_ranks} ranks")
        if idx_tokens != num_tokens or num_tokens > max_tokens:
            raise ferry.InputError(f"ferry.deep_ep: x has {num_tokens} tokens and topk_idx {idx_tokens}; both must "
                                   f"match and be at most num_max_tokens_per_rank={max_tokens}")
        if alignment < 1:
            raise ferry.InputError(f"ferry.deep_ep: expert_alignment={alignment} must be >= 1")
        pool = self._pools.get(("elastic", hidden, num_experts, topk, kind, max_tokens))
        if pool is None:
            pool = self._pool(hidden, num_experts, topk, kind, max_tokens)
        weights = topk_weights
        if weights is None:  # DeepEP's weights are optional (a backward pass): Ferry carries zeros, none returned
            weights = pool.zeros[:num_tokens * topk].view(num_tokens, topk)
        if previous_event is not None:
            wait_event(previous_event)
        if previous_event_before_epilogue is not None:
            wait_event(previous_event_before_epilogue)
        slot = pool.take()
        recv_x, recv_sf, recv_idx, recv_w, counts, saved, num_recv, src = pool.buffers[slot].dispatch_owned(
            x, topk_idx, weights, x_scales=sf, eager=eager, save_handle=True, with_src=True)
        valid = None
        if not eager:  # rows at or past num_recv hold nothing: their ids -1
            valid = torch.arange(recv_idx.size(0), device=recv_idx.device) < num_recv.to(recv_idx.device)
            recv_idx.masked_fill_(~valid.unsqueeze(1), -1)
        # NOTE: the layout keeps its own ids: the caller owns recv_topk_idx and may change it before the handle's
        # derived fields are first read (an expanded dispatch returns no recv_topk_idx). The second copy per call
        # is do_handle_copy's, DeepEP's own: the caller may change topk_idx after the call.
        layout = _Layout(pool, recv_idx if do_expand else recv_idx.clone(), src, valid, counts, alignment, max_tokens)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(layout.counts().to(cumulative_local_expert_recv_stats.dtype))
        handle = EPHandle(layout, pool, slot, saved, recv_idx, topk_idx.clone() if do_handle_copy else topk_idx,
                          do_expand, num_experts, alignment, max_tokens, num_sms)
        if do_expand:
            recv_x, recv_sf, recv_w = layout.expand(recv_x, recv_sf, recv_w if topk_weights is not None else None,
                                                    do_zero_padding)
            recv_idx = None
        elif topk_weights is None:
            recv_w = None
        if recv_sf is not None:
            recv_x = self._with_sf(recv_x, recv_sf, kind, use_tma_aligned_col_major_sf)
        event = EventOverlap(EventHandle(), (x, topk_idx)) if async_with_compute_stream else EmptyEventOverlap()
        return recv_x, recv_idx, recv_w, handle, event

    @staticmethod
    def _with_sf(recv_x, recv_sf, kind: str, tma_col_major: bool):
        """recv_x, or (recv_x, scales) in DeepEP's dtypes (float32, or packed UE8M0 int32) and layout (row-major, or
        column-major with the rows padded to a multiple of 4 for TMA)."""
        if recv_sf is None:
            return recv_x
        if kind == "ue8m0":
            recv_sf = recv_sf.view(torch.int32)
        if tma_col_major:
            rows, n = recv_sf.shape
            out = torch.empty_strided((rows, n), (1, _align(max(rows, 1), _SF_ALIGN)), dtype=recv_sf.dtype,
                                      device=recv_sf.device)
            out.copy_(recv_sf)
            recv_sf = out
        return recv_x, recv_sf

    def _cached_dispatch(self, x, sf, kind, handle, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                         expert_alignment, do_cpu_sync, do_expand, do_zero_padding, tma_col_major, previous_event,
                         previous_event_before_epilogue, async_with_compute_stream):
        """DeepEP's cached dispatch: the handle's layout, no host synchronisation. Without topk_weights Ferry's
        cached dispatch (the handle's saved routing); with them a dispatch of the handle's ids and those weights,
        which Ferry lays out in the same places. x may be in another format than the handle's dispatch."""
        self._check_handle(handle, "dispatch(handle=...)")
        if topk_idx is not None:
            raise ferry.InputError("ferry.deep_ep: dispatch(handle=...) takes no topk_idx (the handle's are used, as "
                                   "DeepEP)")
        if do_cpu_sync:
            raise ferry.InputError("ferry.deep_ep: dispatch(handle=...) cannot do_cpu_sync (as DeepEP): the handle "
                                   "knows its counts already")
        for name, given, held in (("num_experts", num_experts, handle.num_experts),
                                  ("expert_alignment", expert_alignment, handle.expert_alignment),
                                  ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                   handle.num_max_tokens_per_rank)):
            if given is not None and given != held:
                raise ferry.InputError(f"ferry.deep_ep: dispatch(handle=...) got {name}={given}; the handle's "
                                       f"dispatch had {held}, which a cached dispatch keeps")
        if do_expand != handle.do_expand:
            raise ferry.InputError(f"ferry.deep_ep: dispatch(handle=...) with do_expand={do_expand}, but the handle's "
                                   f"dispatch had do_expand={handle.do_expand}; pass the same")
        hidden = x.size(1) if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
        base = handle._pool
        pool = base if hidden == base.hidden and kind == base.kind else self._pool(hidden, base.num_experts, base.topk,
                                                                                   kind, base.max_tokens)
        if pool.buffers[0] is None:
            pool.fill()
        buf = pool.buffers[handle._slot] if pool is base else pool.buffers[0]
        wait_event(previous_event)
        wait_event(previous_event_before_epilogue)
        if topk_weights is None:
            recv_x, recv_sf = buf.dispatch_owned(x, x_scales=sf, eager=False, handle=handle._ferry)[:2]
            recv_w = None
        else:
            recv_x, recv_sf, _, recv_w = buf.dispatch_owned(x, handle.topk_idx, topk_weights, x_scales=sf,
                                                            eager=False)[:4]
        rows = handle._layout.rows
        recv_x, recv_sf = recv_x[:rows], None if recv_sf is None else recv_sf[:rows]
        recv_w = None if recv_w is None else recv_w[:rows]
        if do_expand:
            recv_x, recv_sf, recv_w = handle._layout.expand(recv_x, recv_sf, recv_w, do_zero_padding)
            recv_idx = None
        else:
            recv_idx = handle._recv_topk_idx
        event = EventOverlap(EventHandle(), (x,)) if async_with_compute_stream else EmptyEventOverlap()
        return self._with_sf(recv_x, recv_sf, kind, tma_col_major), recv_idx, recv_w, handle, event

    # ---- combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Returns (combined_x [num_tokens, hidden] bf16, combined_topk_weights [num_tokens, topk] float32 or None,
        event). x: one row per received token (rank-major, already reduced over this rank's experts), or, for a
        handle of an expanded dispatch, one row per expanded slot (reduced here, in top-k order). topk_weights:
        [rows, topk] (or [expanded rows] for an expanded handle) float32; each token's weight of entry k comes back
        from the rank that holds expert k."""
        if type(handle) is not EPHandle or handle._pool.owner is not self or handle._pool.destroyed or \
                self.comm is None:
            self._check_handle(handle, "combine()")  # raises
        check_torch_deterministic()
        if previous_event is not None and not allocate_on_comm_stream:
            raise ferry.InputError("ferry.deep_ep: previous_event needs allocate_on_comm_stream=True (as DeepEP)")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ferry.InputError(f"ferry.deep_ep: combine x must be [rows, hidden] bfloat16, got {shape_text(x)}")
        pool = handle._pool
        buf = pool.buffers[handle._slot]
        layout = handle._layout
        if previous_event is not None:
            wait_event(previous_event)
        if previous_event_before_epilogue is not None:
            wait_event(previous_event_before_epilogue)
        weights = None
        if handle.do_expand:
            if topk_weights is not None:
                if not isinstance(topk_weights, torch.Tensor) or topk_weights.dim() != 1 or \
                        topk_weights.dtype != torch.float32 or topk_weights.size(0) != x.size(0):
                    raise ferry.InputError(f"ferry.deep_ep: combine(topk_weights=...) of an expanded handle must be "
                                           f"[{x.size(0)}] float32 (one weight per expanded row), got "
                                           f"{shape_text(topk_weights)}")
                weights = layout.fold_weights(topk_weights)
            x = layout.reduce_expanded(x)
        elif topk_weights is not None:
            check_weights(topk_weights, x.size(0), x.device, "combine")
            weights = topk_weights[:layout.rows].masked_fill(layout.recv_idx < 0, 0.0)
        if bias is None:
            y = buf.combine(x, "rank", eager=False, handle=handle._ferry)
        else:
            y = combine_with_bias(buf, handle._ferry, x, bias, handle.topk_idx.size(0), x.size(1))
        combined_w = None
        if weights is not None:
            combined_w = combine_weights(self.comm, pool, handle._ferry, weights, self.num_ranks, self.rank_idx)
        event = EventOverlap(EventHandle(), (x, y)) if async_with_compute_stream else EmptyEventOverlap()
        return y, combined_w, event


class _Layout:
    """A dispatch's received layout in DeepEP V2's terms, derived on the device from Ferry's rank-major outputs when
    first asked for (no host synchronisation unless the dispatch was eager, whose counts are on the host already):
    the per-expert counts, the expanded row of each (row, k) entry, the metadata and the prefix sums."""

    # NOTE: made per dispatch, so it only keeps what it is given; the shape's constants are the pool's, and
    # everything else is derived when first asked for
    def __init__(self, pool: Pool, recv_idx, src, valid, counts, alignment: int, max_tokens: int):
        self.pool, self.recv_idx, self.src = pool, recv_idx, src
        self.valid = valid  # lazy dispatches: the rows below num_recv (the others' ids are -1, their source nothing)
        self.host_counts = counts  # eager dispatches: the received entries per local expert (a list)
        self.alignment, self.max_tokens = alignment, max_tokens
        self._cache: dict = {}

    world = property(lambda self: self.pool.world)
    scaleup = property(lambda self: self.pool.scaleup)
    local = property(lambda self: self.pool.local)
    topk = property(lambda self: self.pool.topk)
    rows = property(lambda self: self.recv_idx.shape[0])

    def aligned_list(self) -> list:
        """Each local expert's received entries rounded up to the alignment (empty without the counts on the
        host)."""
        if self.valid is not None:
            return []
        return self._once("aligned_list", lambda: [-(-c // self.alignment) * self.alignment for c in self.host_counts])

    def num_expanded(self) -> int:
        """The expanded layout's rows: exact with the counts on the host, else the worst case."""
        if self.valid is None:
            return self._once("num_expanded", lambda: sum(self.aligned_list()))
        worst = self.world * self.max_tokens * min(self.topk, self.local) + (self.alignment - 1) * self.local
        return _align(worst, self.alignment)

    def _once(self, name: str, make):
        value = self._cache.get(name)
        if value is None:
            value = self._cache[name] = make()
        return value

    def _flat(self) -> torch.Tensor:
        """Each (row, k) entry's local expert, num_local where none."""
        return self._once("flat", lambda: torch.where(self.recv_idx >= 0, self.recv_idx.long(), self.local).view(-1))

    def counts(self) -> torch.Tensor:
        return self._once("counts", lambda: torch.bincount(self._flat(), minlength=self.local + 1)[:self.local])

    def _starts(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(each expert's aligned count, its first expanded row)."""
        def make():
            aligned = (self.counts() + self.alignment - 1) // self.alignment * self.alignment
            return aligned, aligned.cumsum(0) - aligned
        return self._once("starts", make)

    def psum_per_expert(self, expanded: bool) -> torch.Tensor:
        """DeepEP's two definitions: inclusive sums of the aligned counts; expanded: each expert's aligned start
        plus its count."""
        aligned, start = self._starts()
        return (start + self.counts() if expanded else aligned.cumsum(0)).to(torch.int32)

    def psum_per_scaleup(self) -> torch.Tensor:
        """Inclusive sums of the rows received from each scale-up index (the sources of every node folded)."""
        source = self.src[:, 0].long()
        if self.valid is not None:
            source = torch.where(self.valid, source, self.world)
        per_source = torch.bincount(source, minlength=self.world + 1)[:self.world]
        return per_source.view(-1, self.scaleup).sum(0).cumsum(0).to(torch.int32)

    def slots(self) -> torch.Tensor:
        """[rows, topk] the expanded row of each entry (-1: none): entries grouped by local expert from its aligned
        start, in (row, k) order within one."""
        def make():
            flat = self._flat()
            order = torch.argsort(flat, stable=True)
            first = self.counts().cumsum(0) - self.counts()
            sorted_e = flat[order]
            expert = sorted_e.clamp(max=self.local - 1)
            position = torch.arange(flat.numel(), device=flat.device) - first[expert]
            dst = torch.where(sorted_e < self.local, self._starts()[1][expert] + position, -1)
            slots = torch.empty_like(flat)
            slots[order] = dst
            return slots.view(self.rows, self.topk)
        return self._once("slots", make)

    def metadata(self) -> torch.Tensor:
        """recv_src_metadata [rows, 2 + topk] int32 (EPHandle)."""
        meta = torch.empty((self.rows, 2 + self.topk), dtype=torch.int32, device=self.src.device)
        meta[:, 0] = self.src[:, 0] * self.max_tokens + self.src[:, 1]
        meta[:, 1] = self.src[:, 0] * self.topk + (self.recv_idx >= 0).to(torch.int32).argmax(dim=1).to(torch.int32)
        meta[:, 2:] = self.slots().to(torch.int32)
        return meta

    def destinations(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """The destination rank of each (token, k) (-1: none): Ferry's counterpart of DeepEP's slot table."""
        return torch.where(topk_idx >= 0, topk_idx // self.local, -1).to(torch.int32)

    def expand(self, recv_x, recv_sf, recv_w, zero_padding: bool):
        """The rank-major rows copied into the expanded layout: one row per (token, local expert) entry at its
        slot (DeepEP's do_expand), padding rows zeroed with zero_padding; the weights one per slot."""
        flat = self.slots().view(-1)
        expanded = self.num_expanded()
        target = torch.where(flat >= 0, flat, expanded)  # one row past the end takes the entries without one
        row_of = torch.arange(flat.numel(), device=flat.device) // self.topk
        fill = torch.zeros if zero_padding else torch.empty

        def scatter(rows):
            if rows is None:
                return None
            raw = rows.view(torch.uint8) if rows.element_size() == 1 else rows  # (fp8: moved as bytes)
            out = fill((expanded + 1,) + tuple(raw.shape[1:]), dtype=raw.dtype, device=raw.device)
            out[target] = raw[row_of]
            out = out[:expanded]
            return out.view(rows.dtype) if raw is not rows else out

        weights = None
        if recv_w is not None:
            weights = fill((expanded + 1,), dtype=torch.float32, device=recv_w.device)
            weights[target] = recv_w.reshape(-1)
            weights = weights[:expanded]
        return scatter(recv_x), scatter(recv_sf), weights

    def reduce_expanded(self, x: torch.Tensor) -> torch.Tensor:
        """One row per received token from the expanded rows: the sum of its entries' rows in top-k order, in fp32
        from +0.0, rounded once (what a rank-major combine takes)."""
        if x.size(0) < self.num_expanded():
            raise ferry.InputError(f"ferry.deep_ep: combine x has {x.size(0)} rows; the handle's expanded layout has "
                                   f"{self.num_expanded()}")
        slots = self.slots()
        acc = torch.zeros((self.rows, x.size(1)), dtype=torch.float32, device=x.device)
        for k in range(self.topk):  # NOTE: one add per entry, in top-k order (a torch.sum could reorder)
            s = slots[:, k]
            acc = acc + torch.where((s >= 0).unsqueeze(1), x.index_select(0, s.clamp(min=0)).float(), 0.0)
        return acc.to(torch.bfloat16)

    def fold_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """[rows, topk] from one weight per expanded row (0 where an entry has no row here)."""
        slots = self.slots()
        return torch.where(slots >= 0, weights.index_select(0, slots.clamp(min=0).view(-1)).view(slots.shape), 0.0)
