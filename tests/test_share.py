"""magclip.distributed.Share: the batches of an evaluation split over the ranks, each once, every rank running as many
forwards as the busiest (FSDP's gathers are collectives); one process owns every batch."""

from magclip.distributed import ONE_PROCESS, Share


def test_every_batch_is_owned_once_and_every_rank_runs_as_many_forwards():
    for world in (1, 2, 3, 4):
        for batches in range(10):
            shares = [Share(rank, world) for rank in range(world)]
            owned = [[b for b in range(batches) if s.owns(b)] for s in shares]
            assert sorted(b for own in owned for b in own) == list(range(batches))
            runs = {len(own) + s.padding(batches) for own, s in zip(owned, shares)}
            assert runs == {-(-batches // world)}


def test_one_process_owns_everything_and_gathers_in_order():
    import torch

    assert not ONE_PROCESS.sharded and ONE_PROCESS.leads and ONE_PROCESS.padding(5) == 0
    rows = {1: torch.ones(1), 0: torch.zeros(1)}
    assert [float(r) for r in ONE_PROCESS.gather_rows(rows)] == [0.0, 1.0]
    assert ONE_PROCESS.broadcast("x") == "x"
