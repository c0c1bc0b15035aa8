"""``parallel_state.count_collectives()`` records what the TP collectives send, and a real decode step
of the engine runs exactly the collectives Megatron's pairing predicts."""
import torch

from tplab import launch


def _record_some():
    import torch.distributed as dist
    from tplab.distributed.parallel_state import all_gather, all_reduce, count_collectives

    n = dist.get_world_size()
    all_reduce(torch.ones(1, 8), n)                                  # before any block: not recorded
    with count_collectives() as outer:
        all_reduce(torch.ones(1, 8), n)
        with count_collectives() as inner:
            gathered = all_gather(torch.ones(2, 4), n, dim=-1)
        all_reduce(torch.ones(3), 1)                                 # tp_size 1: no collective at all
    all_reduce(torch.ones(1, 8), n)                                  # after: not recorded
    with count_collectives() as late:                                # an inner block opened while the outer is
        with count_collectives():                                    # still empty (equal lists): the outer
            pass                                                     # one keeps recording after it
        all_reduce(torch.ones(1, 8), n)
    return ([(r.op, r.shape, r.path, r.nbytes) for r in outer], [(r.op, r.shape) for r in inner],
            all(r.seconds > 0 for r in outer), tuple(gathered.shape), len(late))


def test_count_collectives_records_op_shape_path_and_bytes_inside_the_block_only():
    for outer, inner, timed, gathered, late in launch(_record_some, 2, timeout=120):
        assert outer == [("all_reduce", (1, 8), "shm", 32), ("all_gather", (2, 4), "shm", 32)]
        assert inner == [("all_gather", (2, 4))] and timed and gathered == (2, 8) and late == 1


def _decode_step_collectives(model):
    from tplab import LLM, SamplingParams
    from tplab.distributed.parallel_state import count_collectives

    with LLM(model, tensor_parallel_size=2, num_kv_blocks=8) as llm:
        with count_collectives() as prefill:
            llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1))
        with count_collectives() as both:
            llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2))
    return [(r.op, r.shape) for r in prefill], [(r.op, r.shape) for r in both[len(prefill):]]


def test_one_decode_step_at_tp2_runs_two_all_reduces_per_layer_plus_embedding_and_lm_head(checkpoint):
    from transformers import AutoConfig
    path = checkpoint("vocab_pad")                                   # vocab 251: the LM head's shard is padded
    cfg = AutoConfig.from_pretrained(path)
    layers, hidden, per_rank = cfg.num_hidden_layers, cfg.hidden_size, -(-cfg.vocab_size // 2)
    for prefill, decode in launch(_decode_step_collectives, 2, args=(str(path),), timeout=300):
        want = [("all_reduce", (1, hidden))] * (2 * layers + 1) + [("all_gather", (1, per_rank))]
        assert sorted(decode) == sorted(want) and len(decode) == 2 * layers + 2
        assert decode[0] == ("all_reduce", (1, hidden)) and decode[-1] == ("all_gather", (1, per_rank))
        assert len(prefill) == len(decode) and prefill[0] == ("all_reduce", (5, hidden))   # the prompt's 5 rows
