"""Beam search as vLLM builds it, in the frontend: each step extends every live beam by one token
with an engine request of max_tokens=1 and logprobs=2*beam_width (the engine's prefix cache
keeps the beams' shared prefixes, so a step recomputes only each beam's last token), keeps the
beam_width best by length-penalised score, and sets aside beams that reached EOS.

BeamSearch holds the algorithm; the offline LLM and the HTTP server each drive its steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from protocol.sampling_params import SamplingParams


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's included, as vLLM keeps them) and their log probability;
    text is filled when the beam is returned."""

    tokens: list[int]
    cum_logprob: float = 0.0
    # Per generated position: token id -> log probability of the candidates seen there.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """vLLM's (and transformers') score: cumulative logprob / length ** length_penalty, the
    length counting the prompt and not a final EOS."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (seq_len**length_penalty)


class BeamSearch:
    """The beams of several prompts, advanced one token per step."""

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None
    ) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.prompt_lens = [len(p) for p in prompts]
        self.beams = [[BeamSearchSequence(list(p))] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        # One token per request; 2 * beam_width candidates, as transformers takes.
        self.step_params = SamplingParams(
            n=1,
            max_tokens=1,
            temperature=params.temperature,
            logprobs=2 * params.beam_width,
            ignore_eos=True,
        )

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty
        )

    def pending(self) -> list[list[int]]:
        """The token ids of every live beam, prompt by prompt; empty once the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        return [beam.tokens for beams in self.beams for beam in beams]

    def advance(self, candidates: list[dict[int, float] | None]) -> None:
        """One step's result: per pending beam (in pending()'s order), its candidates' log
        probabilities (None: the beam could not be extended, e.g. at the context length)."""
        width, eos = self.params.beam_width, self.eos_token_id
        it = iter(candidates)
        for i, beams in enumerate(self.beams):
            extended = []
            for beam in beams:
                options = next(it)
                if options is None:
                    continue
                for token_id, logprob in options.items():
                    new = BeamSearchSequence(
                        beam.tokens + [token_id],
                        beam.cum_logprob + logprob,
                        beam.logprobs + [options],
                    )
                    if token_id == eos and not self.params.ignore_eos:
                        new.finish_reason, new.stop_reason = "stop", token_id
                        self.completed[i].append(new)
                    else:
                        extended.append(new)
            extended.sort(key=self._score, reverse=True)
            self.beams[i] = extended[:width]
        self.steps += 1
        if not any(self.beams):
            self.steps = self.params.max_tokens

    def results(
        self, decode: Callable[[list[int]], str], include_prompt: bool = False
    ) -> list[BeamSearchOutput]:
        """The beam_width best beams of each prompt, best first, with their text: the generated
        tokens decoded (the prompt's too with include_prompt, as vLLM's LLM.beam_search does),
        without a final EOS unless include_stop_str_in_output."""
        outputs = []
        for i, beams in enumerate(self.beams):
            for beam in beams:
                beam.finish_reason = "length"
            best = sorted(self.completed[i] + beams, key=self._score, reverse=True)
            best = best[: self.params.beam_width]
            for beam in best:
                generated = beam.tokens[0 if include_prompt else self.prompt_lens[i] :]
                if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    generated = generated[:-1]
                beam.text = decode(generated)
            outputs.append(BeamSearchOutput(best))
        return outputs
