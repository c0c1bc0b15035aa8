"""Failure behaviour of LLM: dying ranks, interrupts and forgotten shutdowns never hang or leak."""
import gc
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import _thread

import psutil
import pytest
from conftest import hf_greedy, live_children

from tplab import LLM, SamplingParams, launch, models
from tplab.distributed.launcher import RankError
from tplab.engine.checks import NonFiniteError

LONG = SamplingParams(max_tokens=200, ignore_eos=True)
BUSY = [list(range(1, 40))] * 48    # with LONG: about 3 s of generating here, so 0.5 s in is the middle (16 took 1.0 s)


@pytest.fixture(scope="module")
def slow_checkpoint(tmp_path_factory):
    """Big enough that generating for BUSY takes seconds, so something can happen in the middle."""
    return models.save_random_qwen2(tmp_path_factory.mktemp("slow"), hidden_size=256, intermediate_size=1024,
                                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def rank_pids(llm):
    return [p.pid for p in llm._group._ranks.procs]


def gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def left_in_dev_shm(before: set) -> set:
    """What is in /dev/shm now and was not in ``before``, less what a live process outside this one's tree
    has open or mapped: another process's segment of the moment (another pytest-xdist worker's ranks, whose
    segments exist from their creation to their unlink while a rank holds them), not one that ours left."""
    me = psutil.Process()
    ours = {me.pid} | {c.pid for c in me.children(recursive=True)}
    new = set(os.listdir("/dev/shm")) - before
    held = set()
    for proc in psutil.process_iter():
        if new and proc.pid not in ours:
            try:
                paths = {m.path for m in proc.memory_maps(grouped=False)} | {f.path for f in proc.open_files()}
            except psutil.Error:        # gone meanwhile, or not ours to read
                continue
            held |= {name for name in new if f"/dev/shm/{name}" in paths}
    return (new & set(os.listdir("/dev/shm"))) - held        # there before and after the look: not a passing one


def test_nan_in_a_rank_names_the_layer_and_rank_then_a_new_llm_works(checkpoint):
    llm = LLM(checkpoint("gqa"), tensor_parallel_size=2, bugs=["mask_mul_inf"], check_finite=True)
    with pytest.raises(RankError, match=r"rank \d failed: NonFiniteError: model.layers.0.self_attn produced"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="shut down after RankError"):
        llm.generate([[1, 2, 3]])
    with LLM(checkpoint("gqa"), tensor_parallel_size=2) as fresh:
        assert len(fresh.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_finite_check_in_process_names_the_first_bad_sublayer(checkpoint):
    with LLM(checkpoint("gqa"), bugs=["mask_mul_inf"], check_finite=True) as llm:
        with pytest.raises(NonFiniteError, match=r"^model.layers.0.self_attn produced \d+ non-finite"):
            llm.generate([[1, 2, 3]])


def test_a_generate_that_raised_in_process_leaves_nothing_for_the_next_one(checkpoint):
    """At TP 1 the engine lives on after an error: the failed call's requests must not stay queued (the next
    call would run them first, or fail on them again) nor keep their KV blocks."""
    from tplab.kernels.attend import sdpa_attend
    calls = []

    def fails_once_decoding(*args, **kwargs):              # an attention part that raises mid-generate, once
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("a learner's attention fails on call 10")
        return sdpa_attend(*args, **kwargs)
    with LLM(checkpoint("gqa"), parts={"attend": fails_once_decoding}) as llm:
        with pytest.raises(RuntimeError, match="fails on call 10"):
            llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=20, ignore_eos=True))
        assert llm.stats()["kv_blocks_in_use"] == 0
        before = len(calls)
        out = llm.generate([[4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out) == 1 and len(out[0].token_ids) == 3
        assert len(calls) - before == 3 * llm.config.hf_config.num_hidden_layers, "the failed call's requests ran"


@pytest.mark.parametrize("fail_at", [1, 2, 10])      # the prompt's first chunk, its second, the decode that fills a block
def test_a_step_that_raised_leaves_no_unwritten_block_in_the_prefix_cache(checkpoint, fail_at):
    """Full blocks enter the prefix cache when they are allocated, before their K/V are written (a prompt's at
    admission, a decode's when its token fills one): after a step that raised (Ctrl-C in a notebook, a learner's
    part), a prompt that shares them must not read them."""
    from tplab.engine.model_runner import token_positions
    calls = []

    def fails_once(seq):                                   # tplab's positions, raising on one call
        calls.append(1)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return token_positions(seq)
    prompt, params = list(range(3, 43)), SamplingParams(max_tokens=12, ignore_eos=True)   # 40 tokens: 2 chunks
    settings = dict(enable_prefix_caching=True, max_num_batched_tokens=32, parts={"positions": fails_once})
    with LLM(checkpoint("gqa"), **settings) as llm:
        calls.extend([1] * fail_at)                        # no failure in the reference runs
        first = llm.generate([prompt], params)[0].token_ids
        longer = prompt + first[:9]                        # 49 tokens: its third block holds 8 decoded tokens
        want = [first, llm.generate([longer], params)[0].token_ids]
    with LLM(checkpoint("gqa"), **settings) as llm:
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompt], params)
        assert [o.token_ids for o in llm.generate([prompt, longer], params)] == want
        assert [o.token_ids for o in llm.generate([prompt, longer], params)] == want   # from the prefix cache, rightly


@pytest.mark.parametrize("tp", [1, 2])
def test_a_second_thread_calling_generate_meanwhile_is_refused_and_the_first_is_right(checkpoint, tp):
    """Two calls at once would share the schedulers (at TP 1) or the ranks' pipes (TP > 1): answers swapped."""
    from tplab.kernels.attend import sdpa_attend
    calls = []

    def attend_slow_once(*args, **kwargs):                # in each rank's own copy: the first call takes 4 s
        if not calls:
            calls.append(1)
            time.sleep(4)
        return sdpa_attend(*args, **kwargs)
    prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(checkpoint("gqa"), tensor_parallel_size=tp) as plain:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(checkpoint("gqa"), tensor_parallel_size=tp, parts={"attend": attend_slow_once}) as llm:
        box = []
        first = threading.Thread(target=lambda: box.append(llm.generate(prompts, params)))
        first.start()
        time.sleep(1.5)                                   # the first call is inside its slow attention
        with pytest.raises(RuntimeError, match="already running a call .* from another thread"):
            llm.generate([[6, 7]], params)
        first.join(60)
        assert [o.token_ids for o in box[0]] == want
        assert [o.token_ids for o in llm.generate(prompts, params)] == want       # and it goes on working


def test_rank_killed_mid_generate_is_reported_quickly(slow_checkpoint, hf_model):
    llm = LLM(slow_checkpoint, tensor_parallel_size=2, timeout=120)
    pids = rank_pids(llm)
    threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 died \(signal 9, SIGKILL\)"):
        llm.generate(BUSY, LONG)
    assert time.monotonic() - start < 30 and gone(pids)
    with LLM(slow_checkpoint, tensor_parallel_size=2) as fresh:                 # a new LLM serves, rightly
        tokens = fresh.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    assert tokens == hf_greedy(hf_model(slow_checkpoint), [1, 2], 2)[0]


def test_keyboard_interrupt_stops_the_ranks(slow_checkpoint, sigint_raises):
    llm = LLM(slow_checkpoint, tensor_parallel_size=2)
    pids = rank_pids(llm)
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(BUSY, LONG)
    assert gone(pids)


def test_many_cycles_leave_no_processes_ports_or_shared_memory(checkpoint):
    me = psutil.Process()
    before_fds, before_shm = me.num_fds(), set(os.listdir("/dev/shm"))
    before_listen = {c.laddr for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    for _ in range(3):
        with LLM(checkpoint("gqa"), tensor_parallel_size=2) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert launch(sum, 2, args=([1, 2],)) == [3, 3]
    assert live_children() == set()
    assert {c.laddr for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN} <= before_listen
    assert left_in_dev_shm(before_shm) == set()
    assert me.num_fds() <= before_fds + 2


def test_garbage_collected_llm_stops_its_ranks(checkpoint):
    llm = LLM(checkpoint("gqa"), tensor_parallel_size=2)
    pids = rank_pids(llm)
    del llm
    gc.collect()
    assert gone(pids)


@pytest.mark.parametrize("ending", ["return", "sigkill"])
def test_process_that_exits_without_shutdown_leaves_no_orphans(checkpoint, tmp_path, ending):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from tplab import LLM
        llm = LLM({str(checkpoint("gqa"))!r}, tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in llm._group._ranks.procs), flush=True)
        if {ending!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and gone(pids), out.stderr[-2000:]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(backend="nccl"), r"backend='nccl' needs one GPU per rank"),
    (dict(tensor_parallel_size=2, backend="mpi"), r"backend must be one of"),
    (dict(timeout=0), r"timeout must be a positive number"),
    (dict(timeout=float("inf"), tensor_parallel_size=2), r"timeout must be a positive number of seconds, at most 1e\+07"),
    (dict(seed=2 ** 64), r"seed must be an int in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=True), r"seed must be an int in"),
    (dict(max_num_seqs=0), r"max_num_seqs must be a positive int"),
    (dict(block_size=-4), r"block_size must be a positive int"),
    (dict(num_kv_blocks=0), r"num_kv_blocks must be a positive int"),
    (dict(enable_prefix_caching="False"), r"enable_prefix_caching must be True or False, got 'False'"),
    (dict(check_finite=1), r"check_finite must be True or False, got 1"),
    (dict(num_kv_blocks=10 ** 12), r"num_kv_blocks=1000000000000 makes a KV cache of [\d,]+ bytes on each rank, "
                                   r"more than the [\d,]+ free: ask for less"),
    (dict(kv_cache_memory=10 ** 15, max_num_seqs=10 ** 6), r"kv_cache_memory=1,000,000,000,000,000 makes a KV cache "
                                                           r"of [\d,]+ bytes on each rank, more than the [\d,]+ free"),
    (dict(device="cuda:99"), r"device='cuda:99', but this machine has \d+ CUDA GPU\(s\) visible: pass device='cpu'"),
])
def test_bad_engine_arguments_say_what_to_change(checkpoint, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        LLM(checkpoint("gqa"), **kwargs)
    assert live_children() == set()


def test_finite_check_names_the_first_nan_sublayer_and_is_off_unless_asked(checkpoint):
    with LLM(checkpoint("gqa"), bugs=["mask_mul_inf"], check_finite=True) as llm:
        with pytest.raises(NonFiniteError, match="model.layers.0.self_attn"):
            llm.generate([[1, 2, 3]])
    with LLM(checkpoint("gqa"), bugs=["mask_mul_inf"]) as llm:                     # off by default
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    # nothing stops the NaNs: every logit is NaN, so each token is argmax's answer for such a row (0), its logprob NaN
    assert out.token_ids == [0, 0, 0] and all(math.isnan(x) for x in out.logprobs), (out.token_ids, out.logprobs)


def test_a_part_that_reads_an_unpicklable_global_is_refused_before_ranks_start(checkpoint, tmp_path):
    from tplab.engine.model_runner import token_positions
    log = open(tmp_path / "positions.log", "w")

    def logged_positions(seq):                        # reads a notebook global that cannot travel to a rank
        print(seq.seq_id, file=log)
        return token_positions(seq)
    with pytest.raises(ValueError, match=r"the settings cannot be sent to the ranks \(.*\): at TP > 1 each part "
                                         r"\(parts=...\) travels to every rank with the notebook globals it reads"):
        LLM(checkpoint("gqa"), tensor_parallel_size=2, parts={"positions": logged_positions})
    assert live_children() == set()
    log.close()
