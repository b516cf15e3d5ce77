"""Tensor parallelism on the real default model over gloo, through the engine core process and
its worker processes, gives transformers' greedy tokens. SmolLM2-135M has 9 query and 3 KV heads,
so TP=3 is the split it allows (TP=2 is tested on tiny models in test_multiproc.py)."""

from __future__ import annotations

from frontend.llm import LLM
from protocol.sampling_params import SamplingParams
from tests.hf_reference import NEW_TOKENS, greedy, prompt_ids


def test_tp3_matches_transformers():
    ids = prompt_ids()
    prompts = {name: ids[name] for name in ("p0", "p5", "p10")}
    llm = LLM(tensor_parallel_size=3, max_model_len=512, kv_cache_memory="128MiB")
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts.values()],
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    got = {name: out.outputs[0].token_ids for name, out in zip(prompts, outputs)}
    assert got == {name: greedy(tuple(p))[0] for name, p in prompts.items()}
