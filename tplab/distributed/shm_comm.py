"""All-reduce, all-gather, reduce-scatter and all-to-all through shared memory, for CPU ranks on one machine.

gloo sends even a (1, hidden) tensor through TCP and the kernel's network stack, and a TP
decode step needs two collectives per layer. Ranks on one host can instead write their part into a shared
buffer, wait until every rank has written, and read the others' parts, with no network stack in the way
(measured: docs/performance-journal.md). vLLM's CPU backend does the same.

Protocol, per collective: rank r copies its tensor into slot r of buffer ``seq % 2`` and what it called
(the op, the dtype and the shape, as one number) beside it, then publishes ``seq`` in its counter. Once
every counter reaches ``seq``, each rank checks that every rank called the same (gloo aborts on such a
mismatch; the slots alone would sum whatever overlaps, silently) and reads all slots in rank order (so
every rank computes the same sum, bit for bit).
Two buffers suffice: a rank can only write buffer ``seq % 2`` again at ``seq + 2``,
after every rank has published ``seq + 1``, i.e. finished reading ``seq``. An all-to-all
(the MoE experts' exchange) is the same step with rows of any number: rank r writes all
its rows into slot r, grouped by destination, and each rank copies out its rows from
every slot at offsets the traffic matrix (the same on every rank) gives.
"""
import math
import mmap
import os
import platform
import time
import uuid
import zlib

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 8 << 20          # per rank and buffer; larger tensors go through the process group
_PAGE = 4096                  # the header takes whole pages
_WORDS = 256                  # bytes of each rank's words for a mismatch: "all_reduce of a (3, 4) torch.float32 tensor"


class ShmComm:
    """Collectives over a shared-memory segment that every rank of ``group`` maps (the default group when
    None; under pipeline or data parallelism, one TP group's ranks, or the experts' EP group). Ranks are numbered within the group."""

    def __init__(self, group=None, timeout: float = 300.0):
        self.group = group or dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.timeout = timeout
        # one segment per group: its first rank names it (a fresh uuid) and tells the others
        first = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        name = [f"/dev/shm/tplab-r{first}-{uuid.uuid4().hex}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, group_src=0, group=self.group)
        # the header, per rank: its counter, its call in each of the two buffers, the step it said its words at
        # (four int64s), then its words
        self._header = _PAGE * -(-(4 * 8 + _WORDS) * self.world_size // _PAGE)
        size = self._header + 2 * self.world_size * SLOT_BYTES
        fd = os.open(name[0], os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if self.rank == 0:
                os.ftruncate(fd, size)
            dist.barrier(group=self.group)         # the file has its size before anyone maps it
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier(group=self.group)             # everyone has mapped it: the name can go
        if self.rank == 0:
            os.unlink(name[0])                     # nothing is left in /dev/shm, even after a crash
        self._seqs = np.ndarray((self.world_size,), dtype=np.int64, buffer=self._mm)
        self._seqs[self.rank] = 0
        # what each rank called, per buffer (as the slots: a rank writes buffer seq % 2's again only at seq + 2)
        calls = np.ndarray((2, self.world_size), dtype=np.int64, buffer=self._mm, offset=self._seqs.nbytes)
        self._calls = [calls[0], calls[1]]         # the two rows, made once (a view costs a share of a collective)
        # on a mismatch each rank writes what it called, then the step it did so at (read only on that path)
        self._said_at = np.ndarray((self.world_size,), dtype=np.int64, buffer=self._mm, offset=3 * self._seqs.nbytes)
        self._words = np.ndarray((self.world_size, _WORDS), dtype=np.uint8, buffer=self._mm,
                                 offset=4 * self._seqs.nbytes)
        self._call_ids: dict[tuple, int] = {}
        self._calls_said: dict[int, str] = {}      # a call id -> what this rank called, in words
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=self._header)
        self._seq = 0
        self._views: dict[tuple, list[torch.Tensor]] = {}

    def _slots(self, buffer: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot in ``buffer``, as tensors shaped like ``like``. Making a view costs a
        noticeable share of a small collective, so they are kept: a decode step's collectives have a
        few shapes (prefill chunks add more; the cache is emptied past 256 of them). They are made outside
        inference mode, which a forward runs in: a view made inside it may not be written outside it."""
        key = (buffer, like.dtype, like.shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            nbytes = like.numel() * like.element_size()
            starts = [(buffer * self.world_size + r) * SLOT_BYTES for r in range(self.world_size)]
            with torch.inference_mode(False):
                views = [self._data[s:s + nbytes].view(like.dtype).view(like.shape) for s in starts]
            self._views[key] = views
        return views

    def _exchange(self, x: torch.Tensor, op: str) -> list[torch.Tensor]:
        """Publish ``x``; return every rank's tensor (views into the shared buffer), in rank order."""
        self._seq += 1
        slots = self._slots(self._seq % 2, x)
        slots[self.rank].copy_(x)
        self._publish(self._call_id(op, x.dtype, x.shape))
        return slots

    def _call_id(self, op: str, dtype: torch.dtype, shape, traffic: tuple | None = None) -> int:
        """A number for "``op`` of a ``dtype`` tensor of ``shape``" (and an all-to-all's ``traffic``), the same in
        every rank process (a CRC, not Python's hash, which differs between processes)."""
        key = (op, dtype, shape, traffic)
        call = self._call_ids.get(key)
        if call is None:
            if len(self._call_ids) >= 1024:
                self._call_ids.clear()
                self._calls_said.clear()
            call = self._call_ids[key] = zlib.crc32(repr((op, str(dtype), tuple(shape), traffic)).encode())
            with_traffic = "" if traffic is None else f" with traffic {[list(t) for t in traffic]}"
            self._calls_said[call] = f"{op} of a {tuple(shape)} {dtype} tensor{with_traffic}"
        return call

    def _publish(self, call: int) -> None:
        """Say this rank has written collective ``seq``'s part (``call``: ``_call_id`` of what it called), wait
        until every rank has, and check that every rank called the same."""
        calls = self._calls[self._seq % 2]
        calls[self.rank] = call
        self._seqs[self.rank] = self._seq          # after the copy and the call: x86 keeps stores in order
        deadline, spins = time.monotonic() + self.timeout, 0
        while self._seqs.min() < self._seq:
            spins += 1
            if spins % 64 == 0:
                os.sched_yield()                   # let a rank sharing this core run
                if spins % 65536 == 0 and time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: peers did not reach collective {self._seq} "
                                       f"within {self.timeout:g} s (counters {self._seqs.tolist()})")
        if calls.tolist().count(call) != self.world_size:
            raise RuntimeError(self._mismatch(call))

    def _mismatch(self, call: int, wait_s: float = 1.0) -> str:
        """The ranks called different collectives at step ``seq`` (each of them finds so): write what this one
        called, wait up to ``wait_s`` for the others' words, and say what each rank called."""
        mine = self._calls_said[call].encode()[:_WORDS]
        self._words[self.rank] = 0
        self._words[self.rank, :len(mine)] = np.frombuffer(mine, dtype=np.uint8)
        self._said_at[self.rank] = self._seq       # after the words: x86 keeps stores in order
        deadline = time.monotonic() + wait_s
        while self._said_at.min() < self._seq and time.monotonic() < deadline:
            time.sleep(0.001)
        said: dict[str, list[int]] = {}
        for r in range(self.world_size):
            words = bytes(self._words[r]).rstrip(b"\0").decode() if self._said_at[r] == self._seq else "?"
            said.setdefault(words, []).append(r)
        return ("the ranks of this group called different collectives at the same step: " +
                "; ".join(f"rank(s) {ranks} {words}" for words, ranks in said.items()) +
                ". Every rank must call the same collectives, in the same order, with tensors of the same shape "
                "and dtype: a rank that skips one (inside `if tp_rank == 0:`) meets the others' next one")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x.contiguous(), "all_reduce")
        if len(parts) == 1:
            return x
        torch.add(parts[0], parts[1], out=x)        # x's own part is in the buffer: x can take the sum
        for part in parts[2:]:                      # the same order on every rank: the same bits
            x += part
        return x

    def fits(self, x: torch.Tensor) -> bool:
        """A CPU tensor that fits in one slot; anything else goes through the process group."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def fits_all_to_all(self, x: torch.Tensor, traffic: list[list[int]]) -> bool:
        """Whether every rank's rows (``traffic[i]``, rows shaped like ``x``'s) fit in its slot: decided from the
        traffic matrix, which every rank has, so that every rank takes the same path."""
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        return x.device.type == "cpu" and max(map(sum, traffic)) * row_bytes <= SLOT_BYTES

    def all_to_all(self, x: torch.Tensor, traffic: list[list[int]]) -> torch.Tensor:
        """``x``: this rank's rows grouped by destination (``traffic[rank]`` rows for each rank, in rank order);
        returns the rows every rank sent this one (``traffic[src][rank]``), grouped by source in rank order."""
        self._seq += 1
        buffer, rows = self._seq % 2, x.shape[1:]

        def slot(src: int, num_rows: int) -> torch.Tensor:         # the first num_rows rows of rank src's slot
            start = (buffer * self.world_size + src) * SLOT_BYTES
            nbytes = num_rows * math.prod(rows) * x.element_size()
            return self._data[start:start + nbytes].view(x.dtype).view(num_rows, *rows)

        slot(self.rank, x.shape[0]).copy_(x)
        # rows of any number, each of this shape; every rank must pass the same traffic
        self._publish(self._call_id("all_to_all", x.dtype, rows, tuple(map(tuple, traffic))))
        offsets = [sum(sent[:self.rank]) for sent in traffic]       # where this rank's rows start in each slot
        return torch.cat([slot(src, offsets[src] + sent[self.rank])[offsets[src]:]
                          for src, sent in enumerate(traffic)])      # copied out before the next collective

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(x.contiguous(), "all_gather"), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunk (``1 / world_size`` of ``dim``) of the sum of every rank's ``x``, summed in rank
        order as ``all_reduce`` sums (the same bits); it reads only that chunk of each rank's slot."""
        parts = [p.chunk(self.world_size, dim)[self.rank] for p in self._exchange(x.contiguous(), "reduce_scatter")]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total


def shm_applies(group=None) -> bool:
    """Shared memory needs gloo ranks that all live on this machine, Linux's ``/dev/shm``, and x86's store
    ordering (so not an Arm Mac, nor an Intel one): every rank of
    ``group`` (default: the world) among this node's ranks, which torchrun (and ``tplab.launch``) number
    contiguously: ``RANK - LOCAL_RANK`` and the next ``LOCAL_WORLD_SIZE - 1``. So under pipeline parallelism
    over two machines each stage's TP group still uses it. ``TPLAB_SHM_COMM=0`` turns it off (the benchmarks
    compare both paths)."""
    if (os.environ.get("TPLAB_SHM_COMM", "1") == "0" or dist.get_backend() != "gloo"
            or platform.machine() not in ("x86_64", "AMD64") or not os.path.isdir("/dev/shm")):
        return False
    local_size, local_rank = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("LOCAL_RANK")
    if local_size is None or local_rank is None:
        return False
    first = dist.get_rank() - int(local_rank)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return all(first <= r < first + int(local_size) for r in ranks)
