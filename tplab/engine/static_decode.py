"""Decode steps at fixed shapes (``static_decode``), replayed as CUDA graphs on a GPU.

On a GPU a decode step of a small model waits on the host: the kernels are short, and launching them
one by one from Python takes longer than running them. A CUDA graph records a step's kernels once and
replays them all with one launch. A replay runs the same kernels on the same addresses, so the step it
replays must have fixed shapes and read its inputs from tensors that never move:
- the batch is padded to a bucket (1, 2, 4, 8, then every multiple of 16 sequences, and max_num_seqs); a
  padding row decodes token 0 at position 0 into a scratch block of the KV cache that no sequence holds, and its
  output is dropped;
- the inputs live in buffers allocated once: token ids, positions, ``slot_mapping``, the block tables
  padded to a width bucket, the context lengths. Every step copies its values into them, then replays
  (from pinned host memory: each copy is queued, and the host does not wait for it);
- attention reads the padded block tables under a mask of each row's length (``PaddedDecode``);
- the largest bucket's graph is captured first, as vLLM and nano-vllm capture theirs: every graph shares one
  memory pool, and a smaller step reuses the larger one's memory, where a larger step after smaller ones would
  need memory of its own.
On a CPU the same step runs eagerly, so the code a graph captures is held to HF's tokens on every machine.
"""
import sys

import torch

from tplab.kernels.decode_blocks import PaddedDecode
from tplab.layers.metadata import AttentionMetadata, check_positions


# Decode steps whose longest sequence holds more tokens than this run at their own shapes (vLLM's
# max_seq_len_to_capture): a graph for every width up to a 128K context would hold gigabytes of gathered keys.
MAX_CONTEXT = 8192


def buckets(largest: int) -> list[int]:
    """The sizes a step is padded to (its batch, and its block tables' width): 1, 2, 4, 8, then multiples of
    16, ending at ``largest``."""
    sizes = [s for s in (1, 2, 4, 8) if s < largest] + list(range(16, largest, 16))
    return sizes + [largest]


def bucket_of(n: int, sizes: list[int]) -> int:
    """The smallest of ``sizes`` that holds ``n``."""
    return next(s for s in sizes if s >= n)


class StaticDecode:
    """Runs a rank's decode steps at fixed shapes: ``fits(seqs)``, then ``forward(seqs)`` -> ``(B, E)``.

    ``graphs``: capture each (batch, width) bucket as a CUDA graph the first time it runs (after one
    eager warm-up; the largest bucket before the first), and replay it from then on; without, run the
    padded step eagerly (CPU, or a check).
    ``scratch_block``: a KV block the block manager never hands out, for the padding rows."""

    def __init__(self, model, kv_caches, scratch_block: int, positions_of, *, block_size: int, max_num_seqs: int,
                 max_blocks: int, device: torch.device, graphs: bool):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.positions_of, self.scratch_block, self.device = positions_of, scratch_block, torch.device(device)
        self.batch_sizes, self.widths = buckets(max_num_seqs), buckets(max_blocks)
        n, w = self.batch_sizes[-1], self.widths[-1]
        sizes = dict(input_ids=n, positions=n, slot_mapping=n, context_lens=n, block_tables=n * w)   # (n,), (n W,)
        self.buffers = {name: torch.zeros(size, dtype=torch.long, device=self.device) for name, size in sizes.items()}
        # where a step's values wait on the host: pinned on a GPU, so that their copies need not wait for it
        pinned = self.device.type == "cuda"
        self.staged = {name: torch.zeros(size, dtype=torch.long, pin_memory=pinned) for name, size in sizes.items()}
        self.copied = torch.cuda.Event() if pinned else None        # recorded after a step's copies are queued
        self.use_graphs = graphs
        self.side_stream = None            # where each capture's warm-up runs (one stream, made at the first)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None                   # one memory pool shared by every graph
        self.num_steps = self.num_replays = 0      # steps run here; of them, replayed as graphs

    def fits(self, seqs) -> bool:
        """Whether every sequence of this step feeds one token (a decode, or a prompt's last one), at most
        the largest bucket of them, within the widest table."""
        return (len(seqs) <= self.batch_sizes[-1] and all(s.num_new_tokens == 1 for s in seqs)
                and all(len(s.block_table) <= self.widths[-1] for s in seqs))

    def forward(self, seqs) -> torch.Tensor:
        """The final hidden states ``(B, E)`` of a decode step of ``seqs`` (one new token each)."""
        n = bucket_of(len(seqs), self.batch_sizes)
        w = bucket_of(max(len(s.block_table) for s in seqs), self.widths)
        if self.use_graphs and not self.graphs:    # the largest bucket first, on padding rows alone
            largest = self.batch_sizes[-1], self.widths[-1]
            self.write(self.step_inputs([], *largest), *largest)
            self.add_graph(*largest)
        self.copy_inputs(seqs, n, w)
        self.num_steps += 1
        if self.use_graphs and (n, w) not in self.graphs:
            self.add_graph(n, w)
        if not self.use_graphs:
            return self.model(self.views(n, w)["input_ids"], self.kv_caches, self.metadata(n, w))[:len(seqs)]
        graph, hidden = self.graphs[(n, w)]
        graph.replay()
        self.num_replays += 1
        return hidden[:len(seqs)]

    def add_graph(self, n: int, w: int) -> None:
        """Capture bucket (n, w)'s graph from the values in the buffers now; if a kernel cannot be captured,
        every step runs eagerly from then on."""
        try:
            self.graphs[(n, w)] = self.capture(n, w)
        except RuntimeError as e:
            self.use_graphs = False
            self.graphs.clear()                # their memory back: every step runs eagerly from now on
            print(f"tplab: decode steps run eagerly: capturing a CUDA graph failed ({e})"[:400], file=sys.stderr)

    def copy_inputs(self, seqs, n: int, w: int) -> None:
        """Write this step's values into the buffers the step (or its graph) reads, at their fixed addresses."""
        self.write(self.step_inputs(seqs, n, w), n, w)

    def write(self, values: dict[str, torch.Tensor], n: int, w: int) -> None:
        """``values`` (host tensors, by buffer name) into bucket (n, w)'s views of the buffers, through the
        staged host buffers. On a GPU those copies are queued, so the host waits for the last step's copies
        before it overwrites what they read (done long since, as a rule: the tokens that step sampled came
        back after them)."""
        views, staged = self.views(n, w), self.views(n, w, self.staged)
        if self.copied is not None:
            self.copied.synchronize()
        for name, value in values.items():
            staged[name].copy_(value)
            views[name].copy_(staged[name], non_blocking=True)
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.device))

    def views(self, n: int, w: int, buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Bucket (n, w)'s views of the buffers (default: the device's), each contiguous: the same tensors every
        step of the bucket."""
        b = self.buffers if buffers is None else buffers
        return dict(input_ids=b["input_ids"][:n], positions=b["positions"][:n], slot_mapping=b["slot_mapping"][:n],
                    context_lens=b["context_lens"][:n], block_tables=b["block_tables"][:n * w].view(n, w))

    def step_inputs(self, seqs, n: int, w: int) -> dict[str, torch.Tensor]:
        """This step's values of each buffer, on the host: rows ``len(seqs)..n - 1`` are padding, a decode
        of token 0 at position 0 into the scratch block."""
        pad, bs = n - len(seqs), self.block_size
        lens = [s.num_cached_tokens + 1 for s in seqs]                  # keys of each row: its cache and its token
        positions = [p for s in seqs for p in self.positions_of(s)]
        if positions != [length - 1 for length in lens]:
            check_positions(positions, [1] * len(seqs), lens)          # raises, naming the token
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        tables = [s.block_table + [self.scratch_block] * (w - len(s.block_table)) for s in seqs]
        values = dict(input_ids=[s.new_token_ids()[0] for s in seqs] + [0] * pad, positions=positions + [0] * pad,
                      slot_mapping=slots + [self.scratch_block * bs] * pad, context_lens=lens + [1] * pad,
                      block_tables=tables + [[self.scratch_block] * w] * pad)
        return {name: torch.tensor(v, dtype=torch.long) for name, v in values.items()}

    def metadata(self, n: int, w: int) -> AttentionMetadata:
        """The step's metadata, made of the buffers' views. Only what a decode at fixed shapes reads is set:
        the per-sequence lists of a step at its own shapes are None."""
        v = self.views(n, w)
        return AttentionMetadata(positions=v["positions"], slot_mapping=v["slot_mapping"],
                                 query_start_loc=list(range(n + 1)), seq_lens=None, kv_slots=None,
                                 kv_start_loc=None, visible=None,
                                 decode=PaddedDecode(v["block_tables"], v["context_lens"], self.block_size))

    def capture(self, n: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record bucket (n, w)'s forward as a CUDA graph; the graph and the tensor its replays write to.
        A warm-up run first (on a side stream, as capture requires) makes every lazy allocation and
        kernel choice before recording; it computes this step's K/V too, the same values the replay writes.
        Each run gets metadata of its own: what the first layer makes for the others (the lengths' mask) is
        then made inside the graph, and each replay makes it again from the buffers, never the warm-up's."""
        ids, current = self.views(n, w)["input_ids"], torch.cuda.current_stream(self.device)
        if self.side_stream is None:           # one for every warm-up: each new stream gets its own workspaces
            self.side_stream = torch.cuda.Stream(self.device)
        self.side_stream.wait_stream(current)
        with torch.cuda.stream(self.side_stream):
            self.model(ids, self.kv_caches, self.metadata(n, w))
        current.wait_stream(self.side_stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(ids, self.kv_caches, self.metadata(n, w))     # (n, E), at the pool's address
        finally:
            torch.cuda.set_stream(current)     # a capture that fails to end leaves its own stream current
        self.pool = graph.pool()
        return graph, hidden


def graph_memory_bound(max_num_seqs: int, max_blocks: int, block_size: int, hidden_size: int,
                       intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes the graphs' memory pool can need at most, counted before the KV cache is sized: the
    activations of the largest bucket's step (the gathered K and V of the widest tables, the scores and
    their fp32 softmax, the MLP), twice over for the intermediates the allocator keeps apart."""
    n, keys = buckets(max_num_seqs)[-1], buckets(max_blocks)[-1] * block_size
    item = torch.empty((), dtype=dtype).element_size()
    attention = n * keys * (2 * num_kv_heads * head_dim * item + 2 * num_heads * 4)
    mlp = n * (4 * hidden_size + 3 * intermediate_size) * item
    return 2 * (attention + mlp)
