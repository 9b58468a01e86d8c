"""A ferry bootstrap over an existing torch.distributed process group (ferry.init(group=...)).

Ferry's communicator needs a few small host exchanges while it sets up (segment names, addresses, versions). This
object provides them through torch.distributed's object collectives on a CPU (gloo) group, so a job that already
has a process group needs no second rendezvous. The C++ side calls it back (with the GIL) and turns any exception
into ferry.BootstrapError. Every wait is bounded by the group's own timeout (init_process_group(timeout=...)).

The protocol (any object with these members can be passed as ferry.init(bootstrap=...)):
    rank, world, local_rank, local_world: int
    allgather(data: bytes) -> list[bytes]     # one block per rank, in rank order
    broadcast(data: bytes, root: int) -> bytes  # root's data (root is a rank of this group)
    barrier() -> None
"""

from __future__ import annotations

import socket


class TorchGroupBootstrap:
    """Bootstrap over a torch.distributed group.

    group: a process group (or None for the default group). When its backend is not gloo (e.g. nccl), a gloo group
    with the same ranks is created with torch.distributed.new_group, which torch requires every rank of the default
    group to enter: call ferry.init(group=...) on every rank at the same point then.
    local_rank / local_world: ranks of this group on this host, ordered by rank (found by exchanging host names).
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ferry.init(group=...) needs torch.distributed initialised (init_process_group)")
        self._dist = dist
        group = group if group is not None else dist.group.WORLD
        if dist.get_backend(group) != "gloo":
            group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")
        self._group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        hosts = self.allgather(socket.gethostname().encode())
        mine = hosts[self.rank]
        self.local_rank = sum(1 for r in range(self.rank) if hosts[r] == mine)
        self.local_world = sum(1 for host in hosts if host == mine)

    def allgather(self, data: bytes) -> list[bytes]:
        blocks: list = [None] * self.world
        self._dist.all_gather_object(blocks, bytes(data), group=self._group)
        return blocks

    def broadcast(self, data: bytes, root: int) -> bytes:
        holder = [bytes(data)]
        src = self._dist.get_global_rank(self._group, root)
        self._dist.broadcast_object_list(holder, src=src, group=self._group)
        return holder[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)
