"""One rank of the torch GPU tests (started by test_gpu_torch.py through ferry.launch, one process per GPU).

Checks, on the cuda backend with torch CUDA tensors, against the NumPy reference (bit for bit, bf16 transport):
dispatch (rank-major and expand) and combine (expert and rank layouts), eager and lazy, on the current torch stream
(a side stream) and on an explicit one; zero-copy views; a CPU tensor refused as InputError; and the bootstrap from
a torch.distributed gloo group when --torch-group is given. Exits 0 when everything matched.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ferry  # noqa: E402
import reference as ref  # noqa: E402


def to_torch(bits: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).to(device)


def to_bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().view(torch.int16).numpy().view(np.uint16)


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want) if got.shape == want.shape else None
        raise AssertionError(f"{name}: mismatch (shapes {got.shape} vs {want.shape}; first bad {bad[:3] if bad is not None else '-'})")


def run_case(comm, device, seed: int, eager: bool, layout: str, stream_mode: str) -> None:
    world, rank = comm.world, comm.rank
    config = ref.Config(hidden=512, num_experts=4 * world, topk=3, max_tokens_per_rank=64, expert_capacity=96)
    num_tokens = [64 - 9 * r for r in range(world)]
    inputs = ref.make_inputs(config, num_tokens, seed, mask_rate=0.1)
    received = [ref.dispatch(config, world, d, inputs) for d in range(world)]
    want = received[rank]
    buf = ferry.EpBuffer(comm, **config.kwargs())
    mine = inputs[rank]
    x = to_torch(mine.x, device)
    idx = torch.from_numpy(mine.topk_idx).to(device)
    w = torch.from_numpy(mine.topk_weights).to(device)

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
    for eager in (True, False):
        for layout in ("expert", "rank"):
            for stream_mode in ("current", "explicit", "default"):
                run_case(comm, device, seed, eager, layout, stream_mode)
    print(f"rank {comm.rank}: gpu torch checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
