"""deep_ep.utils.envs over Ferry: the domain sizes of a group, and the small process helpers DeepEP's programs start
with (a process group per rank from the environment, per-rank seeds, a print on every rank).

Ferry's world is N nodes of M ranks (docs/internode.md): a node is DeepEP's scale-up (NVLink) domain, the nodes its
scale-out (RDMA) ranks.
"""

from __future__ import annotations

import inspect
import os
import random
from typing import Tuple

import torch
import torch.distributed as dist

import ferry

_local_rank = None
_local_seed = 0
_global_seed = 0


def _nodes_and_local(group) -> Tuple[int, int]:
    """(nodes, ranks per node) of the group, as Ferry's communicator finds them: FERRY_TOPOLOGY=NxM, else
    torchrun's LOCAL_WORLD_SIZE, else one node."""
    world = group.size() if group is not None else dist.get_world_size()
    forced = os.environ.get("FERRY_TOPOLOGY", "")
    if forced:
        nodes, _, local = forced.lower().partition("x")
        try:
            nodes, local = int(nodes), int(local)
        except ValueError:
            raise ferry.ConfigError(f"ferry.deep_ep: FERRY_TOPOLOGY={forced!r} is not NxM (N nodes of M "
                                    "ranks)") from None
        if nodes * local != world:
            raise ferry.ConfigError(f"ferry.deep_ep: FERRY_TOPOLOGY={forced} has {nodes * local} ranks but the group "
                                    f"has {world}")
        return nodes, local
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if 0 < local < world and world % local == 0:
        return world // local, local
    return 1, world


def get_physical_domain_size(group) -> Tuple[int, int]:
    """(num_rdma_ranks, num_nvlink_ranks): the nodes, and the ranks of one node (Ferry's topology of the group)."""
    return _nodes_and_local(group)


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """(num_scaleout_ranks, num_scaleup_ranks): the nodes and the ranks per node when the hierarchy is used
    (allow_hybrid_mode, as Ferry's normal mode always does across nodes), else (1, world)."""
    nodes, local = _nodes_and_local(group)
    return (nodes, local) if allow_hybrid_mode else (1, nodes * local)


def check_nvlink_connections(group) -> None:
    """Nothing to check here: Ferry's communicator checks that the ranks of a node reach each other (load/store) when
    it is created, and refuses a topology wider than the NVLink team (ferry.ConfigError)."""


def check_torch_deterministic() -> None:
    """Refuses torch's deterministic mode with fill_uninitialized_memory (torch.empty then launches a fill that can
    race with communication on another stream), as DeepEP does."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        raise ferry.ConfigError("ferry.deep_ep: torch.use_deterministic_algorithms(True) with "
                                "torch.utils.deterministic.fill_uninitialized_memory=True is not supported: set "
                                "fill_uninitialized_memory=False")


def init_seed(global_seed: int) -> None:
    """Seeds torch and random with global_seed + this rank (this rank's seed: get_local_seed)."""
    global _local_seed, _global_seed
    _global_seed = global_seed
    _local_seed = global_seed + dist.get_rank()
    torch.manual_seed(_local_seed)
    random.seed(_local_seed)


def get_local_seed() -> int:
    return _local_seed


def get_global_seed() -> int:
    return _global_seed


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Prints s on every rank (once_in_node: on local rank 0 only), then waits for every rank."""
    if _local_rank is None:
        raise ferry.InputError("ferry.deep_ep: dist_print needs init_dist first (it knows the local rank from there)")
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
    """Joins this process (local rank local_rank of num_local_ranks on its node) to a torch.distributed world as
    DeepEP's test programs do: MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default 8361) name the rendezvous,
    WORLD_SIZE the nodes and RANK this node. NCCL and this process's GPU when CUDA is available (bfloat16 and the GPU
    become torch's defaults), else gloo on the cpu. Returns (rank, world, a group of every rank)."""
    global _local_rank
    nodes = int(os.environ.get("WORLD_SIZE", "1"))
    node = int(os.environ.get("RANK", "0"))
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "8361"))
    _local_rank = local_rank
    cuda = torch.cuda.is_available()
    params = dict(backend="nccl" if cuda else "gloo", init_method=f"tcp://{address}:{port}",
                  world_size=nodes * num_local_ranks, rank=node * num_local_ranks + local_rank)
    if cuda and "device_id" in inspect.signature(dist.init_process_group).parameters:
        params["device_id"] = torch.device("cuda", local_rank)
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(**params)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda" if cuda else "cpu")
    init_seed(seed)
    world = dist.get_world_size()
    return dist.get_rank(), world, dist.new_group(list(range(world)))
