"""One rank of the torch GPU tests (started by test_gpu_torch.py through ferry.launch, one process per GPU).

Checks, on the cuda backend with torch CUDA tensors, against the NumPy reference (bit for bit, bf16 transport):
dispatch (rank-major and expand) and combine (expert and rank layouts), eager and lazy, on the current torch stream
(a side stream) and on an explicit one; zero-copy views; a CPU tensor refused as InputError; and the bootstrap from
a torch.distributed gloo group when --torch-group is given. With --quant, the fp8 wire format instead: the delivered
payload (torch.float8_e4m3fn) and scales (row_major and mn_major_tma, rank- and expert-major) bit for bit with the
NumPy quantizer of quant_reference.py (which test_quant.py holds equal to the cpu backend), dispatch_dequantize
bit for bit with decoding them, pre-quantized torch fp8 input giving the same outputs, and an fp8 combine within
docs/quant.md's combine bound. Exits 0 when everything matched.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ferry  # noqa: E402
import quant_reference as q  # noqa: E402
import reference as ref  # noqa: E402


def to_torch(bits: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).to(device)


def to_bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().view(torch.int16).numpy().view(np.uint16)


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want) if got.shape == want.shape else None
        raise AssertionError(f"{name}: mismatch (shapes {got.shape} vs {want.shape}; first bad {bad[:3] if bad is not None else '-'})")


def case_inputs(comm, device, seed: int):
    """The shape both cases run: the reference's config and inputs, what every rank receives (received[rank]: this
    rank), and this rank's inputs and dispatch arguments as torch CUDA tensors (x, topk_idx, topk_weights)."""
    world, rank = comm.world, comm.rank
    config = ref.Config(hidden=512, num_experts=4 * world, topk=3, max_tokens_per_rank=64, expert_capacity=96)
    num_tokens = [64 - 9 * r for r in range(world)]
    inputs = ref.make_inputs(config, num_tokens, seed, mask_rate=0.1)
    received = [ref.dispatch(config, world, d, inputs) for d in range(world)]
    mine = inputs[rank]
    x = to_torch(mine.x, device)
    idx = torch.from_numpy(mine.topk_idx).to(device)
    w = torch.from_numpy(mine.topk_weights).to(device)
    return config, inputs, received, mine, (x, idx, w)


def run_case(comm, device, seed: int, eager: bool, layout: str, stream_mode: str) -> None:
    world, rank = comm.world, comm.rank
    config, inputs, received, mine, (x, idx, w) = case_inputs(comm, device, seed)
    want = received[rank]
    buf = ferry.EpBuffer(comm, **config.kwargs())

    side = torch.cuda.Stream(device)
    kwargs = {}
    if stream_mode == "explicit":
        kwargs["stream"] = side
    ctx = torch.cuda.stream(side) if stream_mode == "current" else torch.cuda.stream(torch.cuda.current_stream())
    side.wait_stream(torch.cuda.current_stream())
    with ctx:
        got = buf.dispatch(x, idx, w, expand=True, eager=eager, **kwargs)
        if not eager:
            comm.check_errors(side if stream_mode != "default" else torch.cuda.current_stream())
        assert isinstance(got.recv_x, torch.Tensor) and got.recv_x.dtype == torch.bfloat16
        assert got.recv_x.device == device
        n = want.num_recv
        assert int(got.num_recv.item()) == n
        if eager:
            assert got.num_recv_host == n and got.recv_x.shape[0] == n
        else:
            assert got.recv_x.shape[0] == config.recv_capacity(world)
        check("recv_x", to_bits(got.recv_x[:n]), want.recv_x)
        check("recv_topk_idx", got.recv_topk_idx[:n].cpu().numpy(), want.recv_topk_idx)
        check("recv_topk_weights", got.recv_topk_weights[:n].cpu().numpy(), want.recv_topk_weights)
        check("recv_src", got.recv_src[:n].cpu().numpy(), want.recv_src)
        check("expert_counts", got.expert_counts.cpu().numpy(), want.expert_counts)
        expanded = ref.expand(config, world, want)
        for e, count in enumerate(np.minimum(want.expert_counts, config.slots())):
            check(f"expert_x[{e}]", to_bits(got.expert_x[e, :count]), expanded[e, :count])
        again = buf.dispatch(x, idx, w, expand=True, eager=eager, **kwargs)
        assert again.recv_x.data_ptr() == got.recv_x.data_ptr(), "views are not reused"
        assert again.expert_x.data_ptr() == got.expert_x.data_ptr()

        if layout == "expert":
            combine_x = to_torch(ref.expert_outputs(config, world, rank, seed), device)
            rows = [ref.reduce_local_experts(config, received[d], ref.expert_outputs(config, world, d, seed))
                    for d in range(world)]
        else:
            all_rows = [ref.float_to_bf16(np.random.default_rng([seed, 3000 + d]).standard_normal(
                (config.recv_capacity(world), config.hidden), dtype=np.float32)) for d in range(world)]
            combine_x = to_torch(all_rows[rank], device)
            rows = [all_rows[d][: received[d].num_recv] for d in range(world)]
        y = buf.combine(combine_x, layout, eager=eager, **kwargs)
        if not eager:
            comm.check_errors(side if stream_mode != "default" else torch.cuda.current_stream())
    torch.cuda.synchronize(device)
    check(f"y ({layout}, eager={eager}, stream={stream_mode})", to_bits(y), ref.combine(config, world, rank, inputs,
                                                                                      received, rows))

    try:
        buf.dispatch(x.cpu(), idx, w)
    except ferry.InputError as error:
        assert "x is on cpu" in str(error), str(error)
    else:
        raise AssertionError("a CPU tensor on the cuda backend was accepted")


def to_bytes(tensor: torch.Tensor) -> np.ndarray:
    """Any tensor's memory as a NumPy array of its own shape: uint8 for one-byte dtypes (fp8), else its dtype."""
    tensor = tensor.detach().cpu()
    if tensor.element_size() == 1:
        tensor = tensor.view(torch.uint8)
    return tensor.numpy()


def run_quant_case(comm, device, seed: int) -> None:
    world, rank = comm.world, comm.rank
    config, inputs, received, mine, (x, idx, w) = case_inputs(comm, device, seed)
    want = received[rank]
    n = want.num_recv
    payload, scales = q.quantize_fp8(want.recv_x)  # bit for bit what the sender's quantizer writes
    filled = np.minimum(want.expert_counts, config.slots())

    for layout in ("row_major", "mn_major_tma"):
        buf = ferry.EpBuffer(comm, dispatch_format="fp8", combine_format="fp8", recv_scale_layout=layout,
                             **config.kwargs())
        got = buf.dispatch(x, idx, w, expand=True)
        assert got.recv_x.dtype == torch.float8_e4m3fn and tuple(got.recv_x.shape) == (n, config.hidden)
        assert got.recv_x.device == device and got.recv_scales.dtype == torch.float32
        assert got.recv_token_scales is None and got.expert_token_scales is None
        cap = buf.recv_capacity
        check(f"fp8 recv_x ({layout})", to_bytes(got.recv_x), payload)
        check(f"fp8 recv_scales ({layout})",
              q.to_row_major("fp8", layout, to_bytes(got.recv_scales), cap, config.hidden)[:n].view(np.uint32),
              scales.view(np.uint32))
        check("fp8 recv_src", got.recv_src.cpu().numpy(), want.recv_src)
        expert_x, expert_scales = to_bytes(got.expert_x), to_bytes(got.expert_scales)
        for e, count in enumerate(filled):
            rows = want.expert_src_row[e, :count]
            check(f"fp8 expert_x[{e}] ({layout})", expert_x[e, :count], payload[rows])
            check(f"fp8 expert_scales[{e}] ({layout})",
                  q.to_row_major("fp8", layout, expert_scales[e], config.slots(), config.hidden)[:count], scales[rows])
        # pre-quantized input: this rank's rows quantized in NumPy, as a torch.float8_e4m3fn payload and float32
        # scales: dispatch forwards them, and the same bytes arrive
        own_payload, own_scales = q.quantize_fp8(mine.x)
        xq = torch.from_numpy(own_payload).to(device).view(torch.float8_e4m3fn)
        again = buf.dispatch(xq, idx, w, x_scales=torch.from_numpy(own_scales).to(device), expand=True)
        check(f"fp8 pre-quantized recv_x ({layout})", to_bytes(again.recv_x), payload)
        check(f"fp8 pre-quantized recv_scales ({layout})",
              q.to_row_major("fp8", layout, to_bytes(again.recv_scales), cap, config.hidden)[:n], scales)
        # lazy: full-capacity views, nothing synchronised
        lazy = buf.dispatch(x, idx, w, expand=True, eager=False)
        comm.check_errors(torch.cuda.current_stream(device))
        assert tuple(lazy.recv_x.shape) == (cap, config.hidden)
        # fp8 combine: within docs/quant.md's bound of the exact sum of the rows the ranks send back
        buf.dispatch(x, idx, w, expand=True)
        y = to_bits(buf.combine(to_torch(ref.expert_outputs(config, world, rank, seed), device), "expert"))
        torch.cuda.synchronize(device)
        rows = [ref.reduce_local_experts(config, received[d], ref.expert_outputs(config, world, d, seed))
                for d in range(world)]
        terms = []
        for d in range(world):
            term = np.zeros((len(mine.x), config.hidden), np.float64)
            for t in range(len(mine.x)):
                i = received[d].row_of.get((rank, t))
                if i is not None:
                    term[t] = ref.bf16_to_float(rows[d][i])
            terms.append(term)
        err = np.abs(ref.bf16_to_float(y).astype(np.float64) - sum(terms))
        bound = q.combine_bound("fp8", terms)
        if not np.all(err <= bound):
            raise AssertionError(f"fp8 combine ({layout}): error {float((err / bound).max()):.3f} x the bound")

    deq = ferry.EpBuffer(comm, dispatch_format="fp8", dispatch_dequantize=True, **config.kwargs())
    got = deq.dispatch(x, idx, w, expand=True)
    assert got.recv_x.dtype == torch.bfloat16 and got.recv_scales is None
    check("fp8 dispatch_dequantize recv_x", to_bits(got.recv_x),
          ref.float_to_bf16(q.dequantize("fp8", payload, scales)))


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if "--torch-group" in sys.argv:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        comm = ferry.init(backend="cuda", group=dist.group.WORLD)
    else:
        comm = ferry.init(backend="cuda")
    seed = int(os.environ.get("FERRY_TEST_SEED", "5"))
    if "--quant" in sys.argv:
        run_quant_case(comm, device, seed)
        print(f"rank {comm.rank}: gpu torch checks passed (fp8)", flush=True)
        return 0
    for eager in (True, False):
        for layout in ("expert", "rank"):
            for stream_mode in ("current", "explicit", "default"):
                run_case(comm, device, seed, eager, layout, stream_mode)
    print(f"rank {comm.rank}: gpu torch checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
