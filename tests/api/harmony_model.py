"""A tiny gpt-oss checkpoint that answers known harmony completions, for the chat endpoint's test.

The tokenizer is o200k_harmony (harmony's ids), converted by transformers from the tiktoken file
(tests/api/harmony_vocab.py). The model is random but for its lm_head: transformers runs each
prompt with its wanted completion (teacher forcing), and the lm_head rows of the completion's
tokens are solved so that at each position the wanted token scores +10 and every other one of
them -10 (exact: fewer positions than hidden units), every other row 0. Greedy decoding then
writes exactly those completions, for the engine as for transformers, with a margin of 10.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch

from tests.api.harmony_vocab import encoding, vocab_dir

MARGIN = 10.0
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def save_harmony_tokenizer(path: Path) -> None:
    """o200k_harmony as a transformers fast tokenizer (ids 199,998.. its special tokens)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:  # without tiktoken
            ranks = {}
            for line in Path(tiktoken_url).read_bytes().splitlines():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            return ranks

    enc = encoding()
    specials = [enc.decode([i]) for i in range(199_998, 201_088)]
    converted = _Converter(
        vocab_file=str(vocab_dir() / "o200k_base.tiktoken"),
        pattern=O200K_PATTERN,
        extra_special_tokens=specials,
    ).converted()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|return|>", pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(path)


def make_harmony_model(path: Path, conversations: list[tuple[list[int], list[int]]]) -> Path:
    """A tiny GptOssForCausalLM at path whose greedy completion of each prompt is its
    completion ((prompt ids, completion ids) pairs), with the harmony tokenizer."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=201_088,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=1024,
        # gpt-oss's YaRN, its original length scaled down so the factor matches (no warning).
        rope_parameters={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
            "rope_theta": 150000.0,
        },
        eos_token_id=200002,
        pad_token_id=199999,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    states, wanted = [], []
    with torch.no_grad():
        for prompt, completion in conversations:
            ids = torch.tensor([prompt + completion[:-1]])
            hidden = model.model(input_ids=ids).last_hidden_state[0]  # after the final norm
            states.append(hidden[len(prompt) - 1 :])
            wanted += completion
    h = torch.cat(states).double()  # [positions, hidden]
    if h.shape[0] > config.hidden_size:
        raise ValueError(f"{h.shape[0]} positions: no more than {config.hidden_size} solve exactly")
    tokens = sorted(set(wanted))
    target = torch.full((h.shape[0], len(tokens)), -MARGIN, dtype=torch.float64)
    for row, token in enumerate(wanted):
        target[row, tokens.index(token)] = MARGIN
    rows = torch.linalg.lstsq(h, target).solution.T  # [tokens, hidden]
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokens] = rows.float()
        for prompt, completion in conversations:  # transformers' own greedy writes them
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=len(completion), do_sample=False
            )
            assert out[0, len(prompt) :].tolist() == completion
    model.save_pretrained(path, safe_serialization=True)
    save_harmony_tokenizer(path)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [200002, 199999, 200012], "do_sample": False})
    )
    return path
