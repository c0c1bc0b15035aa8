"""The experts' exchange itself (``parallel_state.all_to_all``: uneven rows, a rank that sends none, the same path
on every rank, through shared memory and through gloo), and the bytes each MoE layout puts into collectives in a
real run (``layout_bytes.count_layout_bytes``) against the formula (``layout_bytes.expected_bytes``)."""
import pytest
import torch

from tplab import models
from tplab.distributed.launcher import launch
from tplab.engine.config import engine_config
from tplab.exercises.layout_bytes import count_layout_bytes, expected_bytes

# rows rank i sends rank j: rank 1 sends nothing, rank 2 keeps two rows for itself
TRAFFIC = [[2, 0, 1], [0, 0, 0], [3, 1, 2]]


def _exchange(traffic, width):
    import torch.distributed as dist
    from tplab.distributed import parallel_state as ps
    ps.init_model_parallel(1, 1, 3)                                   # 3 DP ranks of 1: every rank an EP rank
    me = dist.get_rank()
    rows = [[100 * me + 10 * dst + j] * width for dst, n in enumerate(traffic[me]) for j in range(n)]
    x = torch.tensor(rows, dtype=torch.float32).reshape(-1, width)   # (sum(traffic[me]), width)
    with ps.count_collectives() as seen:
        got = ps.all_to_all(x, traffic)
        counts = ps.ep_all_gather(torch.tensor([me, 7]), 3)
        anyone = (ps.dp_any(me == 2), ps.dp_any(False))
    return got[:, 0].tolist(), counts, anyone, [(r.op, r.path, r.to_others) for r in seen]


@pytest.mark.parametrize("path", ["shm", "gloo"])
def test_all_to_all_moves_uneven_rows_to_their_ranks(path, monkeypatch):
    if path == "gloo":
        monkeypatch.setenv("TPLAB_SHM_COMM", "0")
    for me, (got, counts, anyone, seen) in enumerate(launch(_exchange, 3, args=(TRAFFIC, 4), timeout=60)):
        assert got == [100 * src + 10 * me + j for src in range(3) for j in range(TRAFFIC[src][me])]
        assert counts.tolist() == [[0, 7], [1, 7], [2, 7]] and anyone == (True, False)
        mine = sum(TRAFFIC[me]) - TRAFFIC[me][me]
        assert seen == [("all_to_all", path, mine * 4 * 4), ("all_gather", path, None), ("dp_any", path, None),
                        ("dp_any", path, None)]


def test_all_to_all_takes_the_process_group_on_every_rank_when_one_ranks_rows_do_not_fit():
    width = 1 << 20                                                   # 4 MiB a row: rank 2's 6 rows pass the 8 MiB slot
    for me, (got, _, _, seen) in enumerate(launch(_exchange, 3, args=(TRAFFIC, width), timeout=120)):
        assert got == [100 * src + 10 * me + j for src in range(3) for j in range(TRAFFIC[src][me])]
        assert seen[0][:2] == ("all_to_all", "gloo"), f"rank {me} took {seen[0][1]}"   # rank 1 sends none, yet gloo


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory):
    return models.save_random_qwen2_moe(tmp_path_factory.mktemp("bytes"), seed=3, num_hidden_layers=3, mlp_only_layers=[1])


LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "dp2-ep": dict(data_parallel_size=2, enable_expert_parallel=True),
           "dp2-tp2-ep": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)}
TOKENS, CHUNK = 64, 16                                                # a prefill of 4 chunks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_bytes_counted_in_a_real_run_match_the_formula(layout, small_moe):
    settings = LAYOUTS[layout]
    hf = engine_config(small_moe).hf_config
    t, d = settings.get("tensor_parallel_size", 1), settings.get("data_parallel_size", 1)
    ranks = count_layout_bytes(small_moe, TOKENS, max_num_batched_tokens=CHUNK, **settings)
    assert len(ranks) == t * d
    moe_layers, k, row = 2, hf.num_experts_per_tok, hf.hidden_size * 4            # layers 0 and 2, fp32 rows
    for phase, tokens, forwards in (("prefill", TOKENS, TOKENS // CHUNK), ("decode", 1, 1)):
        want = expected_bytes(hf, tokens, t, d, forwards=forwards)
        for r, counted in enumerate(ranks):
            got = counted[phase]
            for op in ("all_reduce", "all_gather"):
                assert got.get(op, 0) == want.get(op, 0), f"{layout} rank {r} {phase} {op}: {got} against {want}"
            assert got.get("dp_any", 0) == (8 * (forwards + (phase == "prefill")) if d > 1 else 0)
        swapped = sum(c[phase].get("all_to_all", 0) for c in ranks)              # dispatch and combine, every pair
        assert swapped == (2 * moe_layers * k * row * tokens * d if d > 1 else 0), f"{layout} {phase}: {swapped}"
    if d > 1:                  # some rows stay on their rank, some travel
        assert 0 < sum(c["prefill"]["all_to_all_to_others"] for c in ranks) < sum(c["prefill"]["all_to_all"] for c in ranks)
    if layout == "tp2-ep":     # whole experts or each split: the same collectives
        assert ranks == count_layout_bytes(small_moe, TOKENS, max_num_batched_tokens=CHUNK, tensor_parallel_size=2)
