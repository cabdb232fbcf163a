"""Rank/world helpers that work without a process group, an all-gather that keeps autograd, and
what a multi-node run needs to fail clearly: who the ranks are and which one was lost.

The contrastive loss needs every rank's features as negatives *with* gradient, so that the
features of rank r receive the gradient of the scores other ranks computed with them.
accelerate's `gather` detaches; the loss must use `all_gather_with_grad` instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("magclip.distributed")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate `x` from every rank along dim 0; gradients flow back to each rank's slice.

    The backward sums the gradients that every rank computed for a slice (reduce-scatter, or
    all-to-all + sum on gloo), so with the loss replicated on W ranks each local slice receives
    W x its true gradient, which DDP's gradient averaging divides back out. Every rank must pass
    the same shape.
    """
    if not is_distributed():
        return x
    import torch.distributed.nn.functional as dist_fn

    with warnings.catch_warnings():
        # torch marks torch.distributed.nn as deprecated in favour of functional collectives, whose
        # autograd backward needs reduce_scatter, which gloo (CPU) lacks; this one works on both.
        warnings.simplefilter("ignore")
        return torch.cat(dist_fn.all_gather(x), dim=0)


def all_gather_no_grad(x: torch.Tensor, keep_local_grad: bool = True) -> torch.Tensor:
    """Concatenate `x` from every rank without autograd, optionally keeping the local slice's graph.

    With `keep_local_grad`, the local slice is the input tensor itself (open_clip's
    `gather_with_grad=False` behaviour): gradients reach local features only.
    """
    if not is_distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    with torch.no_grad():
        dist.all_gather(parts, x.contiguous())
    if keep_local_grad:
        parts[rank()] = x
    return torch.cat(parts, dim=0)


EXCHANGES = ("bidir", "shift", "reduce")  # open_clip's SigLipLoss(dist_impl=...) forms without an all-gather


def exchanged_blocks(x: torch.Tensor, how: str = "bidir") -> Iterator[tuple[int, torch.Tensor]]:
    """(source rank, that rank's `x`) for every rank, this rank's own included, one block at a time.

    open_clip's SigLipLoss exchanges instead of gathering, so that a consumer scoring each block as it
    arrives holds one or two neighbours' features at a time rather than all of them (what autograd
    saves for backward is the consumer's affair). Every block is differentiable: gradients travel
    back to the rank that sent it. 'bidir' passes blocks both ways round the ring, 'shift' one way,
    'reduce' broadcasts each rank's block by an all-reduce; every rank must use every block in its
    loss, since the backward exchanges are collectives that all ranks must join. Blocks need equal
    shapes on every rank.
    """
    if how not in EXCHANGES:
        raise ValueError(f"unknown exchange {how!r}; allowed: {', '.join(EXCHANGES)}")
    if not is_distributed() or world_size() == 1:
        yield rank(), x
        return
    if how == "reduce":
        yield from _blocks_by_reduce(x)
        return
    yield rank(), x
    yield from (_blocks_by_bidir(x) if how == "bidir" else _blocks_by_shift(x))


def _blocks_by_shift(x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """W-1 hops to the right: after hop k this rank holds the block of rank - k."""
    me, w = rank(), world_size()
    left, right = (me - 1) % w, (me + 1) % w
    block = x
    for hop in range(1, w):
        block = _ShiftRight.apply(left, right, block)
        yield (me - hop) % w, block


def _blocks_by_bidir(x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Hops both ways at once (half the hops of 'shift'); an even world ends with one hop to the right.
    open_clip's order: the right neighbour's block, then the left one's."""
    me, w = rank(), world_size()
    left, right = (me - 1) % w, (me + 1) % w
    to_left = to_right = x
    both_ways, one_more = divmod(w - 1, 2)
    for hop in range(1, both_ways + 1):  # only for w >= 3, so left != right
        from_left, from_right = _Swap.apply(left, right, to_left, to_right)
        yield (me + hop) % w, from_right
        yield (me - hop) % w, from_left
        to_left, to_right = from_right, from_left
    if one_more:
        yield (me - both_ways - 1) % w, _ShiftRight.apply(left, right, to_right)


def _blocks_by_reduce(x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Rank order; block r is the sum over ranks of x masked to rank r (exact: the others add zeros).

    The mask multiplies rather than replaces, so every rank's copy stays in the graph and every rank
    joins every backward all-reduce; this rank's own block is the all-reduced copy for the same reason."""
    import torch.distributed.nn.functional as dist_fn

    me = rank()
    for source in range(world_size()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.distributed.nn is deprecated; see all_gather_with_grad
            block = dist_fn.all_reduce(x * (me == source))
        yield source, block


def _send_receive(sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """Point-to-point: each (tensor, peer) of `sends` to its peer; one tensor shaped like the given one from
    each peer of `receives`, in that order."""
    out = [torch.empty_like(like, memory_format=torch.contiguous_format) for like, _ in receives]
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer) for buf, (_, peer) in zip(out, receives)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


class _ShiftRight(torch.autograd.Function):
    """x to the right neighbour, the left neighbour's x back; the gradient goes back the way it came
    (open_clip's NeighbourExchange)."""

    @staticmethod
    def forward(ctx, left: int, right: int, x: torch.Tensor) -> torch.Tensor:
        ctx.left, ctx.right = left, right
        return _send_receive([(x, right)], [(x, left)])[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        return None, None, _send_receive([(grad, ctx.left)], [(grad, ctx.right)])[0]


class _Swap(torch.autograd.Function):
    """One block to each neighbour, one from each, at once (open_clip's NeighbourExchangeBidir); needs
    left != right. Returns (from the left, from the right); backward is the same swap of the gradients."""

    @staticmethod
    def forward(ctx, left: int, right: int, to_left: torch.Tensor,
                to_right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.left, ctx.right = left, right
        return tuple(_send_receive([(to_left, left), (to_right, right)], [(to_right, left), (to_left, right)]))

    @staticmethod
    def backward(ctx, grad_from_left: torch.Tensor,
                 grad_from_right: torch.Tensor) -> tuple[None, None, torch.Tensor, torch.Tensor]:
        to_left, to_right = _send_receive([(grad_from_left, ctx.left), (grad_from_right, ctx.right)],
                                          [(grad_from_left, ctx.left), (grad_from_right, ctx.right)])
        return None, None, to_left, to_right


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The mean of `x` over ranks, without gradient (`x` itself without a process group)."""
    if not is_distributed():
        return x.detach()
    total = x.detach().clone()
    dist.all_reduce(total)
    return total / world_size()


@dataclass(frozen=True)
class Share:
    """Who encodes which batch of an evaluation that every rank runs (a sharded model cannot run on one
    process: `train.sharding=fsdp`). Every rank walks the same batches in the same order; rank r encodes
    batch i where i % world == r, and pads with repeated forwards to `forwards(n)`, the most any rank runs,
    since a sharded model's all-gathers are collectives every rank must join. `gather_rows` puts the
    encoded rows back in batch order on rank 0, where the metrics are computed once. One process
    (`Share()`) owns every batch."""

    rank: int = 0
    world: int = 1

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def leads(self) -> bool:
        """The process that gathers the embeddings and computes the metrics."""
        return self.rank == 0

    def owns(self, batch: int) -> bool:
        return batch % self.world == self.rank

    def forwards(self, batches: int) -> int:
        """The forwards every rank runs over `batches` batches: the largest share, ceil(batches / world)."""
        return -(-batches // self.world)

    def padding(self, batches: int) -> int:
        """How many repeated forwards this rank adds after its own batches, to reach `forwards(batches)`."""
        return self.forwards(batches) - len(range(self.rank, batches, self.world))

    def gather_rows(self, rows: dict[int, torch.Tensor]) -> list[torch.Tensor] | None:
        """Every rank's {batch index: encoded rows}, on the leading rank as one list in batch order (every batch
        once), None on the others; a collective."""
        if not self.sharded:
            return [rows[i] for i in sorted(rows)]
        parts: list[Any] | None = [None] * self.world if self.leads else None
        dist.gather_object(rows, parts, dst=0)
        if parts is None:
            return None
        merged: dict[int, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        if sorted(merged) != list(range(len(merged))) or sum(map(len, parts)) != len(merged):
            raise RuntimeError(f"the ranks encoded batches {[sorted(p) for p in parts]}: not each batch once")
        return [merged[i] for i in range(len(merged))]

    def broadcast(self, obj: Any = None) -> Any:
        """The leading rank's `obj` on every rank (`obj` itself on one process); a collective."""
        if not self.sharded:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


ONE_PROCESS = Share()  # the share of an evaluation on one process: every batch


# ---------------------------------------------------------------------------- the ranks of a run, and losing one
#
# A multi-node run fails as a whole when one rank is lost (killed, frozen, cut off): the others'
# next collective errors out at once (the peer's connection was reset) or after the process group's
# timeout (`train.collective_timeout_s`). Either way the error should say *which* rank was lost, and
# gloo/NCCL messages name at most an address. So every rank, at the start of a run, tells the others
# its host and addresses (`introduce`) and bumps a counter in the launcher's rendezvous store once a
# second (`Heartbeat`); after a failed collective, the ranks whose counter stood still are the lost
# ones (`naming_lost_ranks`).

HEARTBEAT_INTERVAL_S = 1.0
STORE_TIMEOUT_S = 5.0  # a store operation of the heartbeat or the loss check waits at most this long
_COMMUNICATION = re.compile(r"gloo|nccl|connection (reset|closed|refused)|timed out|timeout|pair closure|"
                            r"broken pipe|socket|no route to host|store", re.IGNORECASE)
_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")


class PeerLostError(RuntimeError):
    """A collective failed because another rank died, froze or became unreachable; the message names it."""


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    addresses: tuple[str, ...]

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.host}{', ' + self.addresses[0] if self.addresses else ''})"


_peers: list[Peer] = []
_heartbeat: Heartbeat | None = None


def local_addresses() -> tuple[str, ...]:
    """This host's IP addresses, non-loopback first (what another rank's connection error names)."""
    try:
        import psutil  # an accelerate dependency

        found = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family in (socket.AF_INET, socket.AF_INET6)]
    except Exception:  # pragma: no cover - psutil missing or refusing: the host name still identifies
        found = []
    return tuple(sorted(set(found), key=lambda a: (a.startswith(("127.", "::1")), ":" in a, a)))


def parameters_digest(module: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, by name: equal on two ranks iff their weights are bit-identical.

    Buffers are left out on purpose: DDP broadcasts them from rank 0 at each forward, so after the
    last step a rank's BatchNorm running statistics hold its own last batch (checkpoints take rank 0's)."""
    return _digest(sorted(module.named_parameters(), key=lambda item: item[0]))


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order (unnamed: `parameters_digest` for a module)."""
    return _digest([(str(i), t) for i, t in enumerate(tensors)])


def digest_of(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of (name, tensor) pairs in the given order, taken one at a time (they may be made as it goes)."""
    return _digest(named)


def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, p in named:
        h.update(name.encode())
        h.update(p.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gather_objects(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order ([obj] without a process group)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def introduce(payload: Any = None, heartbeat: bool = True) -> list[tuple[Peer, Any]]:
    """Exchange (host, addresses, `payload`) between all ranks -- the run's first collective -- and
    remember the peers, so that a lost one can be named later; start this rank's heartbeat."""
    global _peers, _heartbeat
    me = (socket.gethostname(), local_addresses(), payload)
    everyone = gather_objects(me)
    _peers = [Peer(r, host, tuple(addrs)) for r, (host, addrs, _) in enumerate(everyone)]
    if heartbeat and is_distributed() and _heartbeat is None:
        _heartbeat = Heartbeat.start()
    return [(peer, p) for peer, (_, _, p) in zip(_peers, everyone)]


def stop_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() in a daemon thread: its result, or None if it raised or took longer. A store client can
    wait with no timeout (on a frozen store host, or a port held by something else): that must not
    hang a rank that is failing anyway."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception as exn:
            log.debug("store: %s", exn)

    worker = threading.Thread(target=run, name="magclip store", daemon=True)
    worker.start()
    worker.join(seconds)
    return box[0] if box else None


class Heartbeat:
    """This rank's counter in the launcher's rendezvous store (MASTER_ADDR:MASTER_PORT), bumped
    every HEARTBEAT_INTERVAL_S by a daemon thread over its own store connection."""

    def __init__(self, store: Any, prefix: str):
        self.store, self.prefix = store, prefix
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="magclip heartbeat", daemon=True)

    @staticmethod
    def _connect() -> Any:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))

    @classmethod
    def start(cls) -> Heartbeat | None:
        """None when no store answers: a lost rank is then named by its address only."""
        store = _within(2 * STORE_TIMEOUT_S, cls._connect)
        if store is None:
            return None
        # one namespace per launch and restart: the launcher's store outlives a restart of the workers
        prefix = (f"magclip/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
        beat = cls(store, prefix)
        beat._thread.start()
        return beat

    def _beat(self) -> None:
        key = f"{self.prefix}{rank()}"
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # the store's host is gone: the run is ending anyway
                return
            self._stop.wait(HEARTBEAT_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()

    def silent_ranks(self, ranks: list[int]) -> list[int] | None:
        """The ranks among `ranks` whose counter did not move over 3 intervals (None: no store answered)."""
        def probe() -> list[int]:
            reader = self._connect()  # a second connection: the beating thread keeps its own
            counts = [reader.add(f"{self.prefix}{r}", 0) for r in ranks]
            time.sleep(3 * HEARTBEAT_INTERVAL_S)
            later = [reader.add(f"{self.prefix}{r}", 0) for r in ranks]
            return [r for r, a, b in zip(ranks, counts, later) if a == b]

        return _within(3 * HEARTBEAT_INTERVAL_S + 3 * STORE_TIMEOUT_S, probe)


def _lost_ranks(message: str) -> tuple[list[Peer], str]:
    """The peers that are gone and how that was found out; ([], why not) when none could be named."""
    me = rank()
    others = [p for p in _peers if p.rank != me]
    silent = _heartbeat.silent_ranks([p.rank for p in others]) if _heartbeat is not None else None
    if silent:
        return [p for p in others if p.rank in silent], "its heartbeat stopped"
    named = set(_ADDRESS.findall(message))
    own = set(_peers[me].addresses) if me < len(_peers) else set()
    by_address = [p for p in others if named & set(p.addresses) and set(p.addresses) != own]
    if by_address:
        return by_address, "the connection error names its host"
    if silent is not None:
        return [], "every rank's heartbeat still beats: one is stuck rather than gone, or the network between hosts is cut"
    return [], "no heartbeat could be read: the launcher's store, on the main node, may be what was lost"


@contextmanager
def naming_lost_ranks(where: Callable[[], str] | str) -> Iterator[None]:
    """A communication error inside becomes a PeerLostError naming the lost rank(s), this rank,
    where it happened and what to do; other errors pass unchanged."""
    try:
        yield
    except PeerLostError:
        raise
    except Exception as exn:
        text = str(exn)
        communication = isinstance(exn, getattr(dist, "DistError", ())) or (
            isinstance(exn, RuntimeError) and _COMMUNICATION.search(text) is not None)
        if not communication or not is_distributed():
            raise
        place = where() if callable(where) else where
        first = re.sub(r"\. This is typically caused.*", "", " ".join(text.strip().splitlines()[:1]))[:400]
        me = _peers[rank()] if rank() < len(_peers) else Peer(rank(), socket.gethostname(), ())
        lost, how = _lost_ranks(text)
        stop_heartbeat()
        if lost:
            msg = (f"{me} lost {', '.join(map(str, lost))} during {place}: {how}; the collective failed with: "
                   f"{first or type(exn).__name__}. A multi-node run cannot go on without it: restart every node "
                   "with train.resume=latest")
        else:
            msg = f"{me}: a collective failed during {place} ({how}; see the other nodes' logs): {first}"
        raise PeerLostError(msg) from exn
