"""Ferry bootstraps over torch.distributed: an existing process group (ferry.init(group=...)), or torchrun's own store
(what ferry.init() uses under torchrun).

Ferry's communicator needs a few small host exchanges while it sets up (segment names, addresses, versions). These
objects provide them through torch, so a job that already has a process group, or runs under torchrun, needs no
second rendezvous. The C++ side calls them back (with the GIL) and turns any exception into ferry.BootstrapError.
Every wait is bounded (the group's timeout, init_process_group(timeout=...); the store's timeout).

The protocol (any object with these members can be passed as ferry.init(bootstrap=...)):
    rank, world, local_rank, local_world: int
    allgather(data: bytes) -> list[bytes]     # one block per rank, in rank order
    broadcast(data: bytes, root: int) -> bytes  # root's data (root is a rank of this group)
    barrier() -> None
"""

from __future__ import annotations

import datetime
import os
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


def torchrun_agent_store() -> bool:
    """True in a worker that torchrun started with its agent holding the store on MASTER_ADDR:MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")


class TorchStoreBootstrap:
    """Bootstrap over torchrun's store: ferry.init() under torchrun.

    torchrun's agent process holds a TCPStore on MASTER_ADDR:MASTER_PORT (its workers see
    TORCHELASTIC_USE_AGENT_STORE=True), so Ferry's own socket rendezvous, whose rank 0 listens on MASTER_PORT, cannot
    start there; the workers reach that store as clients instead, as init_process_group does. RANK, WORLD_SIZE,
    LOCAL_RANK and LOCAL_WORLD_SIZE come from the environment. Each collective writes this rank's block under a key
    of its own (ferry/<bootstrap>/<call>/<rank>) and reads the others' (store.get waits for them, up to timeout_s).
    <bootstrap> counts the bootstraps this process made: communicators are created collectively, in the same order
    on every rank.
    """

    _made = 0

    def __init__(self, timeout_s: float = 60.0, store=None):
        env = os.environ
        self.rank = int(env["RANK"])
        self.world = int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", self.rank))
        self.local_world = int(env.get("LOCAL_WORLD_SIZE", self.world))
        if store is None:
            import torch.distributed as dist

            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        self._store = store
        TorchStoreBootstrap._made += 1
        self._prefix = f"ferry/{TorchStoreBootstrap._made}/"
        self._calls = 0

    def allgather(self, data: bytes) -> list[bytes]:
        self._calls += 1
        key = f"{self._prefix}{self._calls}/"
        self._store.set(key + str(self.rank), bytes(data))
        return [bytes(self._store.get(key + str(r))) for r in range(self.world)]

    def broadcast(self, data: bytes, root: int) -> bytes:
        self._calls += 1
        key = f"{self._prefix}{self._calls}/{root}"
        if self.rank == root:
            self._store.set(key, bytes(data))
        return bytes(self._store.get(key))

    def barrier(self) -> None:
        self.allgather(b"")
