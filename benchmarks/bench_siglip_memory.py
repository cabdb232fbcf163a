"""Peak memory of the sigmoid loss step against world size, for each `loss.dist_impl`.

    OMP_NUM_THREADS=1 python benchmarks/bench_siglip_memory.py                   # 1, 2, 4, 8 ranks
    OMP_NUM_THREADS=1 python benchmarks/bench_siglip_memory.py --worlds 1,2 --per-rank 64   # quick

One gloo spawn per world size; every rank runs each form in turn on the same raw features
(per-rank batch b, dim D, fp32): SigLIPLoss with 'bidir', 'shift', 'reduce' (local_loss=True, open_clip's
form), 'gather' with local_loss=True (this rank's rows against the gathered texts) and with
local_loss=False (the whole B x B matrix on every rank, the form siglip runs trained with before
loss.dist_impl), and open_clip's own SigLipLoss 'bidir' and 'gather' as the peer. What the step is: the loss's
forward and backward on given features (no towers), after one untimed warm-up step.

What is measured, per process (the table shows the largest rank; ranks differ by bytes):
- peak_mib: the peak of torch's CPU allocator accounting during the step -- every tensor the step
  allocates (received or gathered features, prepared features, logits, what autograd saves, the
  gradients, the features' .grad), counted from the profiler's allocation events
  (`total_allocated`, which counts only allocations made while profiling). Not counted: the input
  features that existed before the step, malloc's own overhead, gloo's internal buffers. Process
  RSS is not used: glibc keeps freed memory, so an RSS peak mixes in the forms measured before.
- saved_mib: the distinct storages autograd holds for backward at the end of the forward (saved
  tensors hooks), i.e. what the forward keeps alive until the backward runs.
Writes benchmarks/results/siglip_memory.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, machine_info, table, write_json

FORMS = ("bidir", "shift", "reduce", "gather (local)", "gather (global)", "open_clip bidir", "open_clip gather")
MIB = 2 ** 20


def make_loss(form: str, mode: str, rank: int, world: int) -> Callable:
    """loss(images, texts, scale, bias) -> scalar, for one form."""
    from magclip.losses import SigLIPLoss

    if form.startswith("open_clip"):
        ref = _open_clip_loss_module().SigLipLoss(rank=rank, world_size=world, dist_impl=form.split()[1])
        normalize = torch.nn.functional.normalize
        return lambda i, t, s, b: ref(normalize(i, dim=-1), normalize(t, dim=-1), s, b)
    impl, local = (form.split()[0], form != "gather (global)")
    loss = SigLIPLoss(mode, local_loss=local, dist_impl=impl)
    return lambda i, t, s, b: loss(i, t, s, b)["loss"]


def _open_clip_loss_module():
    """open_clip's loss.py alone (only torch imports): spares each rank the open_clip package import."""
    folder = importlib.util.find_spec("open_clip").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("open_clip_loss_alone", Path(folder) / "loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def features(b: int, dim: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(b, dim, generator=g), torch.randn(b, dim, generator=g)
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    return [x.requires_grad_() for x in (img, txt, scale, bias)]


def loss_step(loss_fn: Callable, inputs: list[torch.Tensor]) -> int:
    """Forward + backward; returns the bytes of distinct storages saved for backward."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(*inputs)
    loss.backward()
    return sum(saved.values())


def peak_allocated(step: Callable[[], Any]) -> int:
    """The peak of torch's CPU allocator accounting while `step` runs (bytes allocated during it)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocations = sorted((n for n in walk(tree) if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    if not allocations:
        return 0
    # the count carries what earlier profiled windows allocated and freed unprofiled: start from its value here
    first = allocations[0].extra_fields
    return max(n.extra_fields.total_allocated for n in allocations) - (first.total_allocated - first.alloc_size)


def measure(form: str, mode: str, b: int, dim: int, rank: int, world: int) -> dict[str, float]:
    loss_fn = make_loss(form, mode, rank, world)
    loss_step(loss_fn, features(4, 8, seed=rank))  # warm-up: lazy initialisation, first collectives
    inputs = features(b, dim, seed=rank)
    box: dict[str, int] = {}
    peak = peak_allocated(lambda: box.update(saved=loss_step(loss_fn, inputs)))
    return {"peak_mib": peak / MIB, "saved_mib": box["saved"] / MIB}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        assert dist.get_world_size() == world
    out = {form: measure(form, args.mode, args.per_rank, args.dim, rank, world) for form in FORMS}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="siglip_mem_") as tmp:
        mp.start_processes(_worker, args=(world, _free_port(), args, tmp), nprocs=world, join=True,
                           start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="1,2,4,8", help="comma-separated world sizes")
    parser.add_argument("--per-rank", type=int, default=256, help="per-rank batch b")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--mode", default="cosine", help="scoring mode of magclip's forms")
    parser.add_argument("--out", default=str(RESULTS_DIR / "siglip_memory.json"))
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]

    results: dict[str, Any] = {}
    for world in worlds:
        per_rank = run_world(world, args)
        results[str(world)] = {form: {**{key: max(r[form][key] for r in per_rank) for key in ("peak_mib", "saved_mib")},
                                      "peak_mib_per_rank": [r[form]["peak_mib"] for r in per_rank]}
                               for form in FORMS}
        print(f"world {world}: done", flush=True)

    b, d = args.per_rank, args.dim
    rows = [[form, *[results[str(w)][form][k] for w in worlds for k in ("peak_mib", "saved_mib")]] for form in FORMS]
    header = ["form", *[f"{k} W={w}" for w in worlds for k in ("peak", "saved")]]
    print(f"\nper-rank batch {b}, dim {d}, fp32, mode {args.mode}; MiB per process (largest rank)")
    print(f"for scale: one b x D feature block = {b * d * 4 / MIB:.2f} MiB, one b x b logit block = "
          f"{b * b * 4 / MIB:.2f} MiB")
    print(table(rows, header))
    write_json(args.out, {"machine": machine_info(1), "per_rank": b, "dim": d, "mode": args.mode, "dtype": "fp32",
                          "measures": {"peak_mib": "peak of torch CPU allocations made during the loss step "
                                                   "(forward + backward), profiler allocation events",
                                       "saved_mib": "distinct storages saved for backward at the end of forward"},
                          "worlds": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
