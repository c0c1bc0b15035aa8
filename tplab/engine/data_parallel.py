"""Data-parallel attention (``data_parallel_size`` d, vLLM's): d DP ranks, each a TP group with its own
scheduler, KV cache and requests.

The driver splits the prompts between the DP ranks (``split_prompts``: by load, deterministically) and puts
the answers back in prompt order (``in_prompt_order``). A dense model's DP ranks are replicas that never talk.
An MoE model's experts are spread over every rank, so every forward pass exchanges tokens with every DP rank:
the DP ranks step together (vLLM's lockstep). Each step they agree whether any of them has work
(``parallel_state.dp_any``, one all-reduce of one number, in ``LLMEngine.generate``), and a DP rank with nothing
scheduled runs the model's ``dummy_forward`` (``LLMEngine.step``), whose MoE layers send and receive no
tokens, so that the others' exchanges complete. Under pipeline parallelism a DP rank is a pipeline, and its stage
with no batch in a tick runs its own layers' ``dummy_forward`` (``PipelineLoop`` with ``lockstep``).
"""


def split_prompts(lengths: list[int], dp_size: int) -> list[list[int]]:
    """The prompts each DP rank serves, as indices in the caller's list: each prompt in turn goes to the DP rank
    with the fewest tokens so far (``lengths[i]``: prompt i's tokens and the most it may generate), the lowest
    rank on a tie. Deterministic; a DP rank may get none."""
    shares, load = [[] for _ in range(dp_size)], [0] * dp_size
    for i, n in enumerate(lengths):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += n
    return shares


def in_prompt_order(answers: list[list], shares: list[list[int]]) -> list:
    """Each DP rank's answers (``answers[r]``, in the order of ``shares[r]``) back in the caller's prompt order."""
    ordered = [None] * sum(map(len, shares))
    for share, answer in zip(shares, answers):
        if len(answer) != len(share):
            raise RuntimeError(f"a DP rank answered {len(answer)} of its {len(share)} prompts")
        for i, a in zip(share, answer):
            ordered[i] = a
    return ordered
