"""The reference semantics of dispatch and combine (docs/design.md "Semantics", src/ep/reference.hpp) in NumPy, bit for
bit: bf16 rounding to nearest even, the receiver's fmaf chain over k ascending, the source's fp32 sum over
destination ranks ascending starting from +0.0f, expert slots that take the own rank's rows first, capacities that drop
rows and slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


# ---- bf16 -------------------------------------------------------------------------------------------------------

def float_to_bf16(values) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; every NaN becomes 0x7fff (as __float2bfloat16_rn)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    out[(bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)] = 0x7FFF
    return out


def bf16_to_float(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) on float32 arrays, rounded once (as C's fmaf). a*b is exact in float64 (24 + 24 bits); the sum
    is made exact with TwoSum, and the one case where rounding float64 -> float32 would round twice (an exact
    float32 midpoint with a nonzero remainder) is decided by the remainder's sign."""
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    p = a64 * b64
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    r = s.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        toward = np.nextafter(r, np.where(err > 0, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
        midpoint = (r.astype(np.float64) + toward.astype(np.float64)) * 0.5
    fix = (err != 0) & (midpoint == s) & np.isfinite(s)
    return np.where(fix, toward, r).astype(np.float32)


# ---- inputs -----------------------------------------------------------------------------------------------------

@dataclass
class Config:
    hidden: int
    num_experts: int
    topk: int
    max_tokens_per_rank: int
    expert_capacity: int | None = None
    max_recv_tokens: int | None = None

    def kwargs(self) -> dict:
        return dict(hidden=self.hidden, num_experts=self.num_experts, topk=self.topk,
                    max_tokens_per_rank=self.max_tokens_per_rank, expert_capacity=self.expert_capacity,
                    max_recv_tokens=self.max_recv_tokens)

    def num_local(self, world: int) -> int:
        return self.num_experts // world

    def recv_capacity(self, world: int) -> int:
        worst = world * self.max_tokens_per_rank
        return worst if self.max_recv_tokens is None else min(self.max_recv_tokens, worst)

    def slots(self) -> int:
        return self.expert_capacity or 0


@dataclass
class RankInput:
    x: np.ndarray             # [T, hidden] uint16 (bf16 bits)
    topk_idx: np.ndarray      # [T, topk] int64 (or int32)
    topk_weights: np.ndarray  # [T, topk] float32


def make_inputs(config: Config, num_tokens: list[int], seed: int, mask_rate: float = 0.0,
                idx_dtype=np.int64) -> list[RankInput]:
    """Every rank's input from one seed: distinct experts per token, some entries masked to -1."""
    out = []
    for rank, tokens in enumerate(num_tokens):
        rng = np.random.default_rng([seed, rank])
        x = float_to_bf16(rng.standard_normal((tokens, config.hidden), dtype=np.float32))
        idx = np.stack([rng.permutation(config.num_experts)[: config.topk] for _ in range(tokens)]) if tokens else \
            np.zeros((0, config.topk), np.int64)
        idx = idx.astype(np.int64)
        if mask_rate > 0 and tokens:
            idx[rng.random(idx.shape) < mask_rate] = -1
        weights = rng.random((tokens, config.topk), dtype=np.float32)
        weights[idx < 0] = 0.0
        out.append(RankInput(x, np.ascontiguousarray(idx.astype(idx_dtype)), weights))
    return out


def expert_outputs(config: Config, world: int, rank: int, seed: int) -> np.ndarray:
    """What a rank's experts 'computed': random bf16 [num_local, slots, hidden], from (seed, rank)."""
    rng = np.random.default_rng([seed, 1000 + rank])
    shape = (config.num_local(world), config.slots(), config.hidden)
    return float_to_bf16(rng.standard_normal(shape, dtype=np.float32))


# ---- dispatch ---------------------------------------------------------------------------------------------------

@dataclass
class RankDispatch:
    num_recv: int
    recv_x: np.ndarray             # [num_recv, hidden] uint16
    recv_topk_idx: np.ndarray      # [num_recv, topk] int32, local expert or -1
    recv_topk_weights: np.ndarray  # [num_recv, topk] float32, 0 where -1
    recv_src: np.ndarray           # [num_recv, 2] int32
    expert_counts: np.ndarray      # [num_local] int32
    recv_slot: np.ndarray          # [num_recv, topk] int32, -1 where not local or past the capacity
    expert_src_row: np.ndarray     # [num_local, slots] int32, -1 unused
    dropped_rows: int = 0
    dropped_slots: int = 0
    # (source rank, token) -> row on this rank, for delivered rows
    row_of: dict = field(default_factory=dict)


def dispatch(config: Config, world: int, rank: int, inputs: list[RankInput]) -> RankDispatch:
    nl = config.num_local(world)
    lo = rank * nl
    capacity = config.recv_capacity(world)
    rows = []
    for s, inp in enumerate(inputs):
        idx = inp.topk_idx.astype(np.int64)
        here = ((idx >= lo) & (idx < lo + nl)).any(axis=1) if len(idx) else np.zeros(0, bool)
        rows.extend((s, int(t)) for t in np.nonzero(here)[0])
    delivered = rows[:capacity]
    n = len(delivered)
    recv_x = np.zeros((n, config.hidden), np.uint16)
    recv_idx = np.full((n, config.topk), -1, np.int32)
    recv_w = np.zeros((n, config.topk), np.float32)
    recv_src = np.zeros((n, 2), np.int32)
    for i, (s, t) in enumerate(delivered):
        ids = inputs[s].topk_idx[t].astype(np.int64)
        local = (ids >= lo) & (ids < lo + nl)
        recv_x[i] = inputs[s].x[t]
        recv_idx[i] = np.where(local, ids - lo, -1)
        recv_w[i] = np.where(local, inputs[s].topk_weights[t], 0.0)
        recv_src[i] = (s, t)
    slots = config.slots()
    counts = np.zeros(nl, np.int32)
    recv_slot = np.full((n, config.topk), -1, np.int32)
    src_row = np.full((nl, slots), -1, np.int32)
    dropped_slots = 0
    # an expert's slots take the rows from this rank's own first row on, then wrap around (own tokens first)
    own_first = next((i for i, (s, _) in enumerate(delivered) if s >= rank), n)
    for q in range(n):
        i = (own_first + q) % n
        for k in range(config.topk):
            e = recv_idx[i, k]
            if e < 0:
                continue
            c = counts[e]
            counts[e] += 1
            if slots == 0:
                continue
            if c < slots:
                recv_slot[i, k] = c
                src_row[e, c] = i
            else:
                dropped_slots += 1
    return RankDispatch(n, recv_x, recv_idx, recv_w, recv_src, counts, recv_slot, src_row,
                        dropped_rows=len(rows) - n, dropped_slots=dropped_slots,
                        row_of={key: i for i, key in enumerate(delivered)})


def expand(config: Config, world: int, got: RankDispatch) -> np.ndarray:
    """expert_x [num_local, slots, hidden]; slots past min(count, slots) are zero."""
    out = np.zeros((config.num_local(world), config.slots(), config.hidden), np.uint16)
    for e in range(out.shape[0]):
        for s in range(min(int(got.expert_counts[e]), config.slots())):
            out[e, s] = got.recv_x[got.expert_src_row[e, s]]
    return out


# ---- combine ----------------------------------------------------------------------------------------------------

def reduce_local_experts(config: Config, got: RankDispatch, expert_out: np.ndarray) -> np.ndarray:
    """The bf16 row each received row sends back in an expert-major combine."""
    acc = np.zeros((got.num_recv, config.hidden), np.float32)
    for k in range(config.topk):
        e = got.recv_topk_idx[:, k]
        s = got.recv_slot[:, k]
        use = (e >= 0) & (s >= 0)
        if not use.any():
            continue
        vals = np.zeros((got.num_recv, config.hidden), np.float32)
        vals[use] = bf16_to_float(expert_out[e[use], s[use]])
        w = np.where(use, got.recv_topk_weights[:, k], np.float32(0))[:, None]
        acc = np.where(use[:, None], fma32(np.broadcast_to(w, acc.shape), vals, acc), acc)
    return float_to_bf16(acc)


def combine(config: Config, world: int, rank: int, inputs: list[RankInput], received: list[RankDispatch],
            rows: list[np.ndarray], local: int | None = None) -> np.ndarray:
    """y [T, hidden] of `rank` from every rank's send-back rows ([num_recv, hidden] bf16 each).

    local: ranks per node (None: one node). Across nodes (docs/internode.md) the sum runs over the nodes ascending:
    the own node's rows one by one, every other node's rows first summed in fp32 and rounded to bf16 (one row).
    """
    local = world if local is None else local
    tokens = len(inputs[rank].x)
    y = np.zeros((tokens, config.hidden), np.float32)
    for t in range(tokens):
        for n in range(world // local):
            partial, reached = np.zeros(config.hidden, np.float32), False
            for d in range(n * local, (n + 1) * local):
                i = received[d].row_of.get((rank, t))
                if i is None:
                    continue
                if n == rank // local:
                    y[t] = y[t] + bf16_to_float(rows[d][i])
                else:
                    partial, reached = partial + bf16_to_float(rows[d][i]), True
            if reached:
                y[t] = y[t] + bf16_to_float(float_to_bf16(partial))
    return float_to_bf16(y)
