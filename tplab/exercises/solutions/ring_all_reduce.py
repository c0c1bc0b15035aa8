# Exercise: ring_all_reduce (reference solution)
import torch


def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over every rank of the default group, as ``dist.all_reduce`` does, with only point-to-point
    messages: ``world - 1`` ring steps of reduce-scatter, then ``world - 1`` of all-gather. Each step sends
    one chunk (``1 / world`` of ``x``) to the right neighbour and receives one from the left, so every rank
    sends ``2 (world - 1) / world`` of ``x`` in all, however many ranks there are."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    flat = x.reshape(-1).clone()                               # (N,): work on a copy, any shape in
    chunks = list(flat.tensor_split(world))                    # world views of flat, sizes differ by <= 1
    # Reduce-scatter: at step s, pass on chunk (rank - s) and add the left neighbour's chunk (rank - s - 1).
    # After world - 1 steps, chunk (rank + 1) % world holds the sum over every rank.
    for step in range(world - 1):
        send, recv = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv])
        request = dist.isend(chunks[send].contiguous(), right)  # isend: every rank sends and receives at once
        dist.recv(incoming, left)
        request.wait()
        chunks[recv] += incoming
    # All-gather: pass the finished chunks round the ring; what arrives is complete, so copy it, don't add.
    for step in range(world - 1):
        send, recv = (rank + 1 - step) % world, (rank - step) % world
        incoming = torch.empty_like(chunks[recv])
        request = dist.isend(chunks[send].contiguous(), right)
        dist.recv(incoming, left)
        request.wait()
        chunks[recv].copy_(incoming)
    return flat.view_as(x)                                     # (N,) -> x's shape
