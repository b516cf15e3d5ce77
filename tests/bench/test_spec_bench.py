"""`engine bench single-stream --speculative-config`: the editing workload's prompt, the flag,
the acceptance figures read from the counters, and one run end to end (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from bench import spec_workload
from serve.cli import build_parser, main
from tests.tiny_models import make_tiny_model_with_tokenizer

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp("spec-bench") / "tiny", max_position_embeddings=2048
    )


def _find(seq: list[int], part: list[int]) -> int:
    return next((i for i in range(len(seq) - len(part) + 1) if seq[i : i + len(part)] == part), -1)


def test_editing_prompt_holds_the_text_and_asks_for_its_length(tiny_model):
    from tokenizer_proc.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    prompt, new_tokens = spec_workload.editing_prompt(tokenizer)
    text = tokenizer(spec_workload.EDIT_TEXT, add_special_tokens=False)["input_ids"]
    assert new_tokens == len(text) > 200
    # Through the chat template: the user turn, then the assistant's turn opened.
    rendered = tokenizer.decode(prompt)
    assert rendered.index(spec_workload.INSTRUCTION) < rendered.index(spec_workload.EDIT_TEXT)
    assert rendered.rstrip().endswith("<|im_start|>assistant")
    # The text's tokens (all but the first, whose merge may depend on the newlines before it)
    # appear in the prompt as they are: what an n-gram lookup finds.
    assert _find(prompt, text[1:]) > 0
    tokenizer.chat_template = None
    plain, same = spec_workload.editing_prompt(tokenizer)
    assert same == new_tokens and _find(plain, text[1:]) > 0
    assert tokenizer.decode(plain).startswith(spec_workload.INSTRUCTION)


def test_acceptance_sums_the_runs():
    runs = [
        {"drafts": 6, "draft_tokens": 18, "accepted_tokens": 9, "accepted_per_pos": [5, 3, 1]},
        {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 6, "accepted_per_pos": [4, 2]},
    ]
    assert spec_workload.acceptance(runs) == {
        "drafts": 10,
        "draft_tokens": 30,
        "accepted_tokens": 15,
        "mean_acceptance_length": 2.5,  # 1 + 15 / 10
        "acceptance_rate": 0.5,
        "per_position_acceptance_rate": [0.9, 0.5, 0.1],  # [9, 5, 1] / 10
    }


def test_acceptance_without_drafts():
    gained = spec_workload.acceptance(
        [{"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}]
    )
    assert gained["mean_acceptance_length"] is None and gained["acceptance_rate"] is None
    assert gained["per_position_acceptance_rate"] == []


def test_single_stream_takes_the_speculative_config():
    args = build_parser().parse_args(
        ["bench", "single-stream", "--speculative-config", NGRAM, "--runs", "2"]
    )
    assert json.loads(args.speculative_config)["num_speculative_tokens"] == 3
    assert args.runs == 2


def test_editing_workload_end_to_end(tiny_model, tmp_path, capsys, monkeypatch):
    # A shorter text keeps the run short; the flow is the workload's.
    monkeypatch.setattr(spec_workload, "EDIT_TEXT", spec_workload.EDIT_TEXT[:200])
    out_file = tmp_path / "spec.json"
    argv = ["bench", "single-stream", "--model", str(tiny_model), "--device", "cpu"]
    argv += ["--runs", "2", "--kv-cache-memory", "16MiB"]
    argv += ["--speculative-config", NGRAM]
    assert main([*argv, "--output-json", str(out_file)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out_file.read_text())
    assert result["workload"] == spec_workload.WORKLOAD
    assert result["speculative_config"]["method"] == "ngram"
    assert result["speculative_config"]["num_speculative_tokens"] == 3
    assert result["greedy_tokens_identical"] is True
    assert result["baseline_decode_tok_s"] > 0 and result["spec_decode_tok_s"] > 0
    ratio = result["spec_decode_tok_s"] / result["baseline_decode_tok_s"]
    assert result["ratio"] == pytest.approx(ratio, abs=0.01)
    assert len(result["run_ratios"]) == len(result["spec_runs"]) == 2
    counts = result["spec_decoding"]
    assert counts["draft_tokens"] <= 3 * counts["drafts"]
    assert counts["accepted_tokens"] <= counts["draft_tokens"]
    # Each step after the first token gives one token and its accepted drafts (the last step's
    # cut at max_tokens): steps + accepted covers the new_tokens - 1, by at most k more.
    decoded = result["new_tokens"] - 1
    steps = round(decoded / result["spec_tokens_per_step"])
    assert decoded <= steps + counts["accepted_tokens"] / 2 <= decoded + 3


def test_device_check_summary_and_targets():
    from scripts.device_spec_check import editing_ids, summarise

    ids = editing_ids(128256)
    assert len(ids) == 302 and min(ids) >= 128256 // 8 and max(ids) < 128256
    assert editing_ids(128256) == ids  # the same prompt for every engine
    base = {"decode_tok_s": 100.0, "ms_per_step": 5.0, "tokens": [1, 2, 3]}
    result = {
        "baseline": base,
        "ngram": {"decode_tok_s": 250.0, "ms_per_step": 6.0, "tokens": [1, 2, 3]},
        "draft_model": {
            "decode_tok_s": 88.0,
            "ms_per_step": 5.6,
            "acceptance_rate": 0.0,
            "tokens": [1, 2, 4],
        },
    }
    summarise(result)
    assert "tokens" not in base
    assert result["ngram"]["ratio_tok_s"] == 2.5 and result["ngram"]["ms_per_step_ratio"] == 1.2
    assert result["ngram"]["greedy_tokens_identical"] is True
    assert result["draft_model"]["greedy_tokens_identical"] is False
    assert result["targets"] == [
        {"target": "n-gram >= 2x decode tok/s", "value": 2.5, "met": True},
        {
            "target": "draft model's step overhead <= 10% (at its acceptance)",
            "value": 0.12,
            "met": False,
            "acceptance_rate": 0.0,
        },
    ]
    failed = {"baseline": {"error": "x"}, "ngram": {"error": "y"}, "draft_model": {}}
    summarise(failed)
    assert failed["targets"] == []
