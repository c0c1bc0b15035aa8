"""``LLM``: the user-facing engine, as in vLLM's offline API.

TP 1 runs in this process. TP > 1 (or PP > 1, or DP > 1) starts ``data_parallel_size x pipeline_parallel_size
x tensor_parallel_size`` rank processes with ``tplab.distributed.RankGroup``, each holding a ``Worker`` with the
same engine; this process only tokenizes, checks input and collects rank 0's answer (under data parallelism,
splits the prompts between the DP ranks and puts every DP rank's answers back in prompt order). Under
``torchrun`` (a process group already initialised) every rank runs the engine in-process.
"""
import contextlib
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from tplab.distributed.launcher import RankGroup
from tplab.distributed.parallel_state import cdiv
from tplab.engine.config import check_sendable, engine_config
from tplab.engine.data_parallel import in_prompt_order, split_prompts
from tplab.engine.sampling import SamplingParams, is_int
from tplab.engine.worker import Worker


@dataclass
class RequestOutput:
    """One prompt's result."""
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]       # generated tokens, prompt excluded
    text: str | None           # decoded generated tokens, where the checkpoint has a tokenizer
    logprobs: list[float]      # log-softmax of each generated token under the model
    finish_reason: str         # "stop" (end-of-sequence token) or "length"


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer, or None when the folder has none."""
    folder = Path(model_dir)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def check_world(tp: int, pp: int, world: int, dp: int = 1) -> None:
    """Under torchrun the ranks are given: ``tensor_parallel_size x pipeline_parallel_size`` (x
    ``data_parallel_size``) must be all of them."""
    if tp * pp * dp == world:
        return
    others = [f"{name}={size}" for name, size in (("pipeline_parallel_size", pp), ("data_parallel_size", dp))
              if size > 1 or name == "pipeline_parallel_size"]
    given = "".join(f" x {size}" for size in others)
    hint = f"pass sizes whose product is {world}"
    if pp * dp == 1:
        hint = f"pass tensor_parallel_size={world}"
    elif world % (pp * dp) == 0:
        hint += f", e.g. tensor_parallel_size={world // (pp * dp)} with {' and '.join(others)}"
    raise ValueError(f"tensor_parallel_size={tp}{given} = {tp * pp * dp} ranks, but the process group has {world} "
                     f"ranks: {hint} under torchrun")


class LLM:
    """A tensor-parallel engine for Qwen2 and Qwen3 (and their MoE models) over an HF checkpoint: a folder or a hub id.

    ``LLM(model_dir, tensor_parallel_size=2, dtype="float32", seed=0, ...)``: the settings are the fields
    of ``EngineConfig`` (``tplab.engine.config``), resolved once into ``llm.config``; then
    ``generate(prompts, SamplingParams(...))``; ``shutdown()`` (or use ``with``).
    """

    def __init__(self, model, **settings):
        self.config = engine_config(model, **settings)    # every setting resolved once; see EngineConfig
        self.tokenizer = load_tokenizer(self.config.model)
        self.timeout = self.config.timeout
        self._group = self._worker = None
        self._why_down, self._busy = "", threading.Lock()
        tp, pp, dp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size, self.config.data_parallel_size
        if dist.is_initialized():                       # torchrun: this process is one of the ranks
            check_world(tp, pp, dist.get_world_size(), dp)
            self._worker = Worker(self.config)
        elif self.config.world_size == 1:               # one rank: this process
            self._worker = Worker(self.config)
        else:               # d x p x t ranks: world rank (dp_rank * p + stage) * t + tp_rank (distributed.layout)
            check_sendable(self.config)
            self._group = RankGroup(self.config.world_size, backend=self.config.backend, timeout=self.timeout)
        try:
            if self._group is not None:
                self._group.create(Worker, (self.config,), timeout=self.timeout)
                self.rank_info = self._group.call(Worker.info, timeout=self.timeout)
            else:
                self.rank_info = [self._worker.info()]
        except BaseException:
            self.shutdown()
            raise

    @property
    def engine(self):
        """This process's ``LLMEngine``, to watch or drive its steps: there is one with a single rank (or under
        torchrun, this rank's); with more ranks each runs in its own process."""
        if self._worker is None and self.config.world_size == 1:
            raise RuntimeError("llm.engine: this LLM was shut down; create a new one")
        if self._worker is None:
            raise RuntimeError(f"llm.engine: this LLM's {self.config.world_size} ranks run in their own processes "
                               "(or it was shut down); a single rank (TP x PP x DP = 1) runs in this one")
        return self._worker.engine

    @property
    def backend(self) -> str:
        """The collective backend the ranks use ("nccl" or "gloo"); "none" with one rank, in this process."""
        if self._group is not None:
            return self._group.backend
        return dist.get_backend() if dist.is_initialized() else "none"

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None):
        """Continue each prompt (strings, or lists of token ids); one ``RequestOutput`` per prompt, in order.

        ``use_tqdm``: a progress bar of finished prompts and token rates on stderr, as vLLM's; None (the
        default) shows it when stderr is a terminal and there is more than one prompt, so notebooks and
        tests stay quiet."""
        texts, token_lists = self._tokenize(prompts)
        params = self._params_for(sampling_params, len(token_lists))
        self._check_lengths(token_lists, params)
        if use_tqdm is None:
            use_tqdm = len(token_lists) > 1 and sys.stderr.isatty()
        if not isinstance(use_tqdm, bool):
            raise ValueError(f"use_tqdm must be True, False or None (a bar when stderr is a terminal), got {use_tqdm!r}")
        dp = self.config.data_parallel_size
        if dp == 1:
            results = self._call(Worker.generate, token_lists, params, use_tqdm)
        else:               # each DP rank its share, by load; every answer back in prompt order
            shares = split_prompts([len(ids) + p.max_tokens for ids, p in zip(token_lists, params)], dp)
            answers = self._call_all(Worker.generate, token_lists, params, use_tqdm, shares)
            results = in_prompt_order(self._dp_firsts(answers), shares)
        return [RequestOutput(text, prompt_ids, ids, self._decode(ids), lps, reason)
                for text, prompt_ids, (ids, lps, reason) in zip(texts, token_lists, results, strict=True)]

    def chat_prompt(self, messages, system: str | None = None) -> str:
        """A prompt in the checkpoint's chat template: ``messages`` is the user's text, or a list of
        ``{"role": ..., "content": ...}``; the assistant's turn is opened for the model to continue."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.config.model} has no tokenizer with a chat template")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"messages must be a string, or a non-empty list of {{'role': ..., 'content': ...}} dicts "
                             f"with string values, got {messages!r:.80}")
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages, sampling_params: SamplingParams | None = None, system: str | None = None):
        """``generate`` on ``chat_prompt(messages)``; one ``RequestOutput``."""
        return self.generate([self.chat_prompt(messages, system)], sampling_params)[0]

    def stats(self) -> dict:
        """Cache and scheduler counters of rank 0 (under torchrun, of this process's rank): num_preemptions,
        prefix_cache_hit_blocks, peak_kv_blocks_used, num_kv_blocks, kv_cache_bytes, ... (cumulative over generate
        calls). Under data parallelism each counter is summed over the DP ranks (``block_size`` aside), and
        ``"dp_ranks"`` lists each DP rank's own. Under torchrun every rank must call it then (it gathers)."""
        if self.config.data_parallel_size == 1:
            return self._call(Worker.stats)
        ranks = self._dp_firsts(self._call_all(Worker.stats))
        total = {k: v if k == "block_size" else sum(r[k] for r in ranks) for k, v in ranks[0].items()}
        return {**total, "dp_ranks": ranks}

    def pipeline_timeline(self) -> list[list[dict]]:
        """Under pipeline parallelism, each stage's ticks in the last ``generate`` (from its TP rank 0), in stage
        order: dicts with ``tick``, ``stage``, ``virtual_engine`` (None: idle), ``num_tokens`` and the seconds
        ``start`` (the tick began), ``busy`` (its input had arrived) and ``end``, counted from the first tick's
        start. Empty lists without PP. Under torchrun every rank must call it (it gathers)."""
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        ranks = self._call_all(Worker.timeline)
        stages = [ranks[s * tp] for s in range(pp)]
        t0 = min((t["start"] for ticks in stages for t in ticks), default=0.0)
        return [[{**t, **{k: t[k] - t0 for k in ("start", "busy", "end")}} for t in ticks] for ticks in stages]

    def _call(self, method, *args):
        """``method(worker, *args)`` for this rank's ``Worker`` on every rank (``Worker.generate``, say), or on
        this process's worker; rank 0's answer (under torchrun, where there is no group, this rank's own)."""
        if self._group is None:
            if self._worker is None:
                raise RuntimeError(f"this LLM was shut down{self._why_down}; create a new one")
            with self._one_call_at_a_time():
                return method(self._worker, *args)
        return self._call_all(method, *args)[0]

    def _call_all(self, method, *args) -> list:
        """``method(worker, *args)`` on every rank; every rank's answer, in rank order (under torchrun gathered
        from every process)."""
        if self._group is None:
            mine = self._call(method, *args)
            if not dist.is_initialized():
                return [mine]
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            return every
        with self._one_call_at_a_time():
            try:
                return self._group.call(method, args, timeout=self.timeout)
            except BaseException as e:  # RankGroup already stopped every rank; this LLM cannot go on
                self._why_down = f" after {type(e).__name__} in a rank call"
                self.shutdown()
                raise

    @contextlib.contextmanager
    def _one_call_at_a_time(self):
        """Refuse a call while another thread's runs: two would share the schedulers (and the ranks' pipes),
        and each could get the other's answers."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this LLM is already running a call (generate, stats, ...) from another thread: "
                               "call it from one thread at a time, or give each thread an LLM of its own")
        try:
            yield
        finally:
            self._busy.release()

    def _dp_firsts(self, per_rank: list) -> list:
        """The answers of each DP rank's first rank (world rank ``r x pipeline_parallel_size x tensor_parallel_size``),
        in DP rank order."""
        return per_rank[::self.config.pipeline_parallel_size * self.config.tensor_parallel_size]

    def shutdown(self) -> None:
        """Stop the ranks (or drop the in-process engine) and free their memory."""
        if self._group is not None:
            self._group.close()
            self._group = None
        self._worker = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _tokenize(self, prompts):
        prompts = prompts.tolist() if hasattr(prompts, "tolist") else prompts     # a numpy array or a tensor
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of strings or of lists of token ids, got "
                             f"{type(prompts).__name__} {prompts!r:.60}")
        texts, token_lists = [], []
        for i, p in enumerate(prompts):
            p = p.tolist() if hasattr(p, "tolist") else p
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"{self.config.model} has no tokenizer: pass prompts as lists of token ids")
                texts.append(p)
                token_lists.append(self.tokenizer.encode(p))
            elif isinstance(p, (list, tuple)) and all(map(is_int, p)):
                texts.append(None)
                token_lists.append([int(t) for t in p])
            else:
                wrong = next((t for t in p if not is_int(t)), p) if isinstance(p, (list, tuple)) else p
                raise ValueError(f"prompt {i}: a prompt is a string or a list of int token ids, got "
                                 f"{type(wrong).__name__} {wrong!r:.60}")
            if not token_lists[-1]:
                raise ValueError(f"prompt {i} is empty: give at least one token")
        vocab = self.config.hf_config.vocab_size
        for i, ids in enumerate(token_lists):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        return texts, token_lists

    @staticmethod
    def _params_for(sampling_params, n):
        if sampling_params is None:
            return [SamplingParams()] * n
        given = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else sampling_params
        if not isinstance(given, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in given):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, one per prompt; got "
                             f"{type(sampling_params).__name__} {sampling_params!r:.60}")
        if len(given) != n:
            raise ValueError(f"{len(given)} SamplingParams for {n} prompts: give one, or one per prompt")
        for p in given:
            p.check()                                  # a field set after it was made is checked here
        return list(given)

    def _check_lengths(self, token_lists, params):
        limit = self.config.hf_config.max_position_embeddings
        blocks, block_size = self.rank_info[0]["kv_blocks_per_batch"], self.config.block_size
        pp = self.config.pipeline_parallel_size
        share = f" (for each of the {pp} batches in flight under pipeline parallelism)" if pp > 1 else ""
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            total = len(ids) + p.max_tokens
            if total > limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens + max_tokens {p.max_tokens} = "
                                 f"{total} > max_position_embeddings {limit}: shorten the prompt or lower max_tokens")
            needed = cdiv(total, block_size)                  # blocks, rounded up
            if needed > blocks:                   # it could never run, even alone: refuse instead of hanging
                raise ValueError(f"prompt {i} needs {needed} KV blocks of {block_size} tokens for "
                                 f"{len(ids)} prompt tokens + max_tokens {p.max_tokens}, but the cache has {blocks}{share}: "
                                 "raise num_kv_blocks / kv_cache_memory, or shorten the prompt or max_tokens")

    def _decode(self, ids):
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)
