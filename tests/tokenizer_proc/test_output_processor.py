"""The one output pipeline (tokenizer_proc/output_processor.py) through both of its users: the
offline LLM's cumulative RequestOutput and the tokenizer process's RequestDeltas
(tokenizer_proc/streams.py), fed the same engine outputs. Every finish and stop rule must come
out the same through both."""

from __future__ import annotations

import pytest

from protocol.engine_core import EngineCoreOutput, FinishReason, Logprobs
from protocol.sampling_params import SamplingParams
from tokenizer_proc.output_processor import OutputProcessor
from tokenizer_proc.request_output import Logprob, RequestOutput
from tokenizer_proc.streams import DeltaStreams

PROMPT = [1, 2, 3]
OWNER = b"api-0"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class BothEntryPoints:
    """One request tracked by an offline OutputProcessor (as LLM does) and by DeltaStreams (as
    the tokenizer process does)."""

    def __init__(self, tokenizer, params: SamplingParams, request_id: str = "r") -> None:
        self.offline = OutputProcessor(tokenizer)
        self.output = RequestOutput.empty(
            request_id, None, PROMPT, params.n, params.logprobs is not None
        )
        self.child_ids = self.offline.add_request(request_id, PROMPT, params, owner=self.output)
        self.server = DeltaStreams(tokenizer)
        assert self.server.add(request_id, OWNER, PROMPT, params) == self.child_ids
        self.deltas = []

    def step(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Feed one step to both; the engine ids to abort, which both must agree on."""
        offline_deltas, offline_abort = self.offline.process_outputs(outputs)
        for delta in offline_deltas:
            delta.apply_to(delta.request.owner)
        sent, server_abort = self.server.process(outputs)
        assert offline_abort == server_abort
        assert all(owner == OWNER for owner, _ in sent)
        self.deltas += [d for _, d in sent]
        return server_abort

    def streamed(self, index: int = 0) -> str:
        return "".join(d.text for d in self.deltas if d.index == index)

    def assert_same(self) -> None:
        """The server's deltas add up to the offline output, completion by completion."""
        for completion in self.output.outputs:
            mine = [d for d in self.deltas if d.index == completion.index]
            assert "".join(d.text for d in mine) == completion.text
            assert [t for d in mine for t in d.token_ids] == completion.token_ids
            last = mine[-1] if mine else None
            assert (last.finish_reason, last.stop_reason) == (
                completion.finish_reason,
                completion.stop_reason,
            )


def out(
    child_id: str, token_ids: list[int], finish: FinishReason | None = None, **kwargs
) -> EngineCoreOutput:
    return EngineCoreOutput(child_id, token_ids, finish_reason=finish, **kwargs)


def test_stop_string_ends_the_sequence_and_aborts_it(tokenizer):
    ids = encode(tokenizer, "one two three four five")
    both = BothEntryPoints(tokenizer, SamplingParams(stop=[" three"], max_tokens=20))
    to_abort = [both.step([out("r", [token])]) for token in ids]
    assert to_abort[:2] == [[], []] and to_abort[2] == ["r"]
    assert (both.output.outputs[0].text, both.output.finished) == ("one two", True)
    assert both.output.outputs[0].finish_reason == "stop"
    assert both.output.outputs[0].stop_reason == " three"
    # Outputs the engine sent before it saw the abort are ignored by both.
    assert len(both.deltas) == 3 and len(both.server) == 0
    both.assert_same()


def test_partial_stop_string_is_held_back_and_released(tokenizer):
    ids = encode(tokenizer, "a b c d e")
    both = BothEntryPoints(tokenizer, SamplingParams(stop=[" b c x"], max_tokens=len(ids)))
    for i, token in enumerate(ids[:-1]):
        both.step([out("r", [token])])
        # The last len(stop) - 1 characters could begin the stop string: not streamed yet.
        decoded = tokenizer.decode(ids[: i + 1])
        assert both.streamed() == decoded[: max(len(decoded) - 5, 0)]
    both.step([out("r", ids[-1:], FinishReason.LENGTH)])
    assert both.streamed() == "a b c d e" and both.output.outputs[0].finish_reason == "length"
    both.assert_same()


def test_held_back_text_is_what_the_stop_string_cuts(tokenizer):
    ids = encode(tokenizer, "x yz")
    both = BothEntryPoints(tokenizer, SamplingParams(stop=[" yz"], max_tokens=10))
    both.step([out("r", [ids[0]])])
    assert both.streamed() == ""  # "x" is within the holdback (len(" yz") - 1 characters)
    for token in ids[1:]:
        both.step([out("r", [token])])
    assert both.streamed() == "x" and both.output.outputs[0].stop_reason == " yz"
    both.assert_same()


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_finish_leaves_its_text_out_unless_asked(tokenizer, include):
    ids = encode(tokenizer, "Hello world")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    both = BothEntryPoints(
        tokenizer,
        SamplingParams(
            stop_token_ids=[im_end],
            max_tokens=10,
            include_stop_str_in_output=include,
            skip_special_tokens=False,
        ),
    )
    both.step([out("r", ids)])
    both.step([out("r", [im_end], FinishReason.STOP, stop_reason=im_end)])
    completion = both.output.outputs[0]
    assert completion.text == ("Hello world<|im_end|>" if include else "Hello world")
    assert (completion.finish_reason, completion.stop_reason) == ("stop", im_end)
    assert completion.token_ids == [*ids, im_end]
    both.assert_same()


@pytest.mark.parametrize(
    "finish, name",
    [(FinishReason.LENGTH, "length"), (FinishReason.STOP, "stop"), (FinishReason.ABORT, "abort")],
)
def test_engine_finish_reasons(tokenizer, finish, name):
    both = BothEntryPoints(tokenizer, SamplingParams(max_tokens=2))
    assert both.step([out("r", encode(tokenizer, "hi there"), finish)]) == []
    assert both.output.outputs[0].finish_reason == name and both.output.finished
    assert both.output.outputs[0].stop_reason is None
    both.assert_same()


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = encode(tokenizer, "stop stop stop")
    both = BothEntryPoints(tokenizer, SamplingParams(stop=["stop"], min_tokens=2, max_tokens=9))
    aborts = [both.step([out("r", [token])]) for token in ids]
    assert aborts == [[], [], ["r"]]
    assert both.output.outputs[0].text == "stop stop "
    both.assert_same()


def test_n_sequences_finish_separately_and_the_request_after_the_last(tokenizer):
    first, second = encode(tokenizer, "a b c"), encode(tokenizer, "a b d")
    both = BothEntryPoints(tokenizer, SamplingParams(n=2, stop=[" c"], max_tokens=3))
    assert both.child_ids == ["0_r", "1_r"]
    both.step([out("0_r", first[:2]), out("1_r", second[:2])])
    assert both.step([out("0_r", first[2:]), out("1_r", [])]) == ["0_r"]
    assert not both.output.finished and len(both.server) == 1
    assert both.output.outputs[0].finish_reason == "stop"
    both.step([out("0_r", [7]), out("1_r", second[2:], FinishReason.LENGTH)])
    assert both.output.finished and len(both.server) == 0
    assert [c.finish_reason for c in both.output.outputs] == ["stop", "length"]
    assert [c.text for c in both.output.outputs] == ["a b", "a b d"]
    assert [c.token_ids for c in both.output.outputs] == [first, second]
    both.assert_same()


def test_logprobs_prompt_logprobs_and_cached_tokens(tokenizer):
    hello, world = encode(tokenizer, "Hello world")
    both = BothEntryPoints(tokenizer, SamplingParams(logprobs=1, prompt_logprobs=1, max_tokens=2))
    prompt_lp = Logprobs([[2, 2], [3, 3]], [[-1.0, -1.0], [-2.0, -2.0]], [1, 1])
    both.step(
        [
            out(
                "r",
                [hello],
                new_logprobs=Logprobs([[hello, world]], [[-0.5, -0.25]], [2]),
                new_prompt_logprobs=prompt_lp,
                num_cached_tokens=16,
            )
        ]
    )
    both.step(
        [
            out(
                "r",
                [world],
                FinishReason.LENGTH,
                new_logprobs=Logprobs([[world, world]], [[-0.75, -0.75]], [1]),
                new_prompt_logprobs=prompt_lp,
            )
        ]
    )
    completion = both.output.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-1.25)
    assert completion.logprobs[0] == {
        hello: Logprob(-0.5, 2, "Hello"),
        world: Logprob(-0.25, 1, " world"),
    }
    assert both.output.prompt_logprobs[0] is None and len(both.output.prompt_logprobs) == 3
    assert both.output.num_cached_tokens == 16
    first, second = both.deltas
    assert [(t.token_id, t.logprob, t.rank) for t in first.logprobs[0]] == [
        (hello, -0.5, 2),
        (world, -0.25, 1),
    ]
    # Prompt logprobs travel once, on the first delta, as the offline output has them.
    assert first.prompt_logprobs[0] is None and second.prompt_logprobs is None
    assert [[t.token_id for t in p] for p in first.prompt_logprobs[1:]] == [[2], [3]]
    assert first.num_cached_tokens == second.num_cached_tokens == 16
    both.assert_same()


def test_abort_returns_only_live_sequences(tokenizer):
    processor = OutputProcessor(tokenizer)
    children = processor.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=4))
    processor.process_outputs([out("1_r", [5], FinishReason.LENGTH)])
    assert processor.abort_request("r") == [children[0], children[2]]
    assert processor.abort_request("r") == [] and len(processor) == 0
    assert processor.process_outputs([out("0_r", [5])]) == ([], [])


def test_server_only_removes_a_request_for_its_owner(tokenizer):
    streams = DeltaStreams(tokenizer)
    streams.add("r", OWNER, PROMPT, SamplingParams(max_tokens=4))
    streams.return_prompt_token_ids("r", PROMPT)
    assert streams.remove("r", b"someone-else") == [] and "r" in streams
    assert streams.owner_of_child("r") == ("r", OWNER) and streams.live() == [("r", OWNER)]
    sent, _ = streams.process([out("r", [5], prefill_chunks=[(1.0, 3)])])
    assert sent[0][1].prompt_token_ids == PROMPT and sent[0][1].prefill_chunks == [(1.0, 3)]
    sent, _ = streams.process([out("r", [6])])
    assert sent[0][1].prompt_token_ids is None and sent[0][1].num_prompt_tokens == 3
    assert streams.remove("r", OWNER) == ["r"] and "r" not in streams
    with pytest.raises(KeyError):
        streams.return_prompt_token_ids("r", PROMPT)
