"""LLM: the offline Python API, as a vLLM user expects it."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

import msgspec

from engine_core.client import EngineCoreClient, EngineDeadError
from engine_core.engine_core import EngineCore
from engine_core.inproc_client import InprocClient
from engine_core.resolve import resolved_config
from engine_core.structured_output.grammar import check_grammar
from engine_core.validation import validate_request
from frontend.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from frontend.chat_args import check_reasoning_parser
from frontend.reasoning.registry import reasoning_parser as make_reasoning_parser
from metrics.offline_stats import OfflineStatsRecorder
from metrics.reader import Metric, get_metrics_snapshot
from protocol.engine_core import EngineCoreRequest
from protocol.frames import tolist
from protocol.sampling_params import SamplingParams
from tokenizer_proc.output_processor import OutputProcessor, child_sampling_params
from tokenizer_proc.prompt_inputs import truncate_prompt, with_bad_words_tokenized
from tokenizer_proc.request_output import RequestOutput
from tokenizer_proc.tokenizer import apply_chat_template, load_tokenizer

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase


class TextPrompt(TypedDict, total=False):
    """vLLM's TextPrompt: a prompt as text."""

    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's TokensPrompt: a prompt as token ids (prompt, its text, is optional)."""

    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str


PromptInput = str | list[int] | TextPrompt | TokensPrompt | dict[str, Any]


class LLM:
    """Generate from prompts: LLM(model=None, **engine_args).generate(...).

    The engine core runs in a child process (engine_process=True) or in this one (False).
    reasoning_parser (vLLM's names, docs/reasoning.md): chat()'s structured outputs apply to
    the answer after the reasoning, as in vLLM (the text is returned whole).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        engine_process: bool = True,
        reasoning_parser: str | None = None,
        **engine_args: Any,
    ) -> None:
        config = resolved_config(model=model, **engine_args)
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        if config.arch is not None:
            check_reasoning_parser(reasoning_parser, config.arch.model_type)
        self.reasoning_parser = make_reasoning_parser(reasoning_parser, self.tokenizer)
        self.engine: EngineCoreClient | InprocClient = (
            EngineCoreClient(engine_args=config) if engine_process else InprocClient(config)
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._stats = OfflineStatsRecorder(
            config.model.served_model_names[0],
            config.max_model_len,
            config.speculative.num_speculative_tokens if config.speculative else 0,
        )
        self._ids = itertools.count()

    @property
    def engine_core(self) -> EngineCore:
        """The in-process EngineCore; only with LLM(engine_process=False)."""
        if not isinstance(self.engine, InprocClient):
            raise AttributeError(
                "the engine core runs in its own process; use "
                "LLM(engine_process=False) to reach it, or get_engine_stats()"
            )
        return self.engine.engine_core

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's Hugging Face tokenizer."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams used when generate() is given none: vLLM's defaults, with those of
        the model's generation config (--generation-config, --override-generation-config)."""
        return SamplingParams(**self.config.sampling_defaults)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, a list of token ids, or a dict (TextPrompt, TokensPrompt) with
        'prompt' or 'prompt_token_ids' (and optionally 'cache_salt'); vLLM's older
        prompt_token_ids keyword (one list of ids, or a list of them) is taken too. Every
        prompt is checked before any is scheduled, so a bad one raises ValueError and nothing
        runs.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give prompts or prompt_token_ids (not both)")
        if prompts is None:
            ids = prompt_token_ids or []
            prompts = [ids] if ids and isinstance(ids[0], int) else list(ids)  # type: ignore
        assert prompts is not None
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        requests = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            text, token_ids, salt = self._tokenize(prompt)
            params = with_bad_words_tokenized(self.tokenizer, params)
            token_ids = truncate_prompt(
                token_ids, params.truncate_prompt_tokens, self.config.max_model_len
            )
            request = EngineCoreRequest(
                str(next(self._ids)),
                token_ids,
                params,
                priority=priority[i] if priority else 0,
                cache_salt=salt,
            )
            validate_request(request, self.config)
            if params.structured_outputs is not None:
                check_grammar(params.structured_outputs)
            requests.append((text, request))
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.

        tools (OpenAI's function definitions) are rendered by the template, as vLLM's LLM.chat
        does; to force a call, constrain the output (SamplingParams.structured_outputs)."""
        conversations = cast(
            list[list[dict[str, Any]]],
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    self.tokenizer,
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                )
            }
            for conv in conversations
        ]
        params = self._as_params_list(sampling_params, len(prompts))
        if self.reasoning_parser is not None:  # structured outputs after the reasoning
            ends = self.reasoning_parser.end_token_ids(chat_template_kwargs or {})
            params = [
                msgspec.structs.replace(p, reasoning_end_token_ids=ends)
                if p.structured_outputs is not None and p.reasoning_end_token_ids is None
                else p
                for p in params
            ]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the params.beam_width best continuations of each prompt, best
        first (each sequence's tokens and text include the prompt, as vLLM's do).

        Each step is one generate() of every live beam for a single token with
        2 * beam_width logprobs; the prefix cache shares the beams' common prefixes.
        concurrency_limit: at most this many prompts are searched at once."""
        prompt_list = self._as_prompt_list(prompts)
        limit = concurrency_limit or len(prompt_list) or 1
        outputs: list[BeamSearchOutput] = []
        progress = _progress(len(prompt_list), use_tqdm)
        for start in range(0, len(prompt_list), limit):
            chunk = [self._tokenize(p)[1] for p in prompt_list[start : start + limit]]
            search = BeamSearch(chunk, params, self.tokenizer.eos_token_id)
            max_len = self.config.max_model_len
            while beams := search.pending():
                # A beam at the context length cannot grow: it ends as it is.
                live = [t for t in beams if len(t) < max_len]
                steps = iter(
                    self.generate(
                        [{"prompt_token_ids": t} for t in live], search.step_params, use_tqdm=False
                    )
                    if live
                    else []
                )
                search.advance(
                    [_candidates(next(steps)) if len(t) < max_len else None for t in beams]
                )
            outputs += search.results(self._decode, include_prompt=True)
            if progress is not None:
                progress.update(len(chunk))
        if progress is not None:
            progress.close()
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False while requests hold blocks."""
        return self.engine.call_utility("reset_prefix_cache")

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLM.get_metrics(): a snapshot of the vllm: metrics this LLM recorded (the
        engine's per-step counters and gauges, and its requests' latencies and sizes), as
        Counter, Gauge and Histogram values (metrics.reader)."""
        return get_metrics_snapshot()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Not supported: refused with NotImplementedError (see docs/generate.md)."""
        raise NotImplementedError(
            "collective_rpc is not supported: the executor carries only scheduled steps to the "
            "workers, not arbitrary calls; the engine core's utilities (get_engine_stats, "
            "reset_prefix_cache) are what can be called"
        )

    def sleep(self, level: int = 1) -> None:
        """Not supported: refused with NotImplementedError (see docs/generate.md)."""
        raise NotImplementedError(
            "sleep is not supported (vLLM's enable_sleep_mode): the engine cannot release its "
            "weights and KV cache and restore them; shut the LLM down and create a new one"
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Not supported, as sleep is not."""
        raise NotImplementedError("wake_up is not supported: the engine never sleeps (see sleep)")

    def get_engine_stats(self) -> dict[str, Any]:
        """The engine core's counters since start (engine_core.utilities get_stats)."""
        return self.engine.call_utility("get_stats")

    def shutdown(self) -> None:
        """Stop the engine core (its process, when it has one)."""
        self.engine.shutdown()

    def _run(
        self, requests: list[tuple[str | None, EngineCoreRequest]], use_tqdm: bool
    ) -> list[RequestOutput]:
        order: dict[str, int] = {}
        for text, request in requests:
            params = request.sampling_params
            prompt_ids = tolist(request.prompt_token_ids)  # built from a list: that list
            output = RequestOutput.empty(
                request.request_id, text, prompt_ids, params.n, params.logprobs is not None
            )
            child_ids = self.output_processor.add_request(
                request.request_id, prompt_ids, params, owner=output
            )
            self._stats.on_request(child_ids, params, len(prompt_ids))
            for index, child_id in enumerate(child_ids):
                child = (
                    request
                    if len(child_ids) == 1
                    else EngineCoreRequest(
                        child_id,
                        request.prompt_token_ids,
                        child_sampling_params(params, index),
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                    )
                )
                self.engine.add_request(child)
            order[request.request_id] = len(order)
        results: list[RequestOutput | None] = [None] * len(order)
        progress = _progress(len(order), use_tqdm)
        try:
            while len(self.output_processor):
                step = self.engine.get_output()
                deltas, to_abort = self.output_processor.process_outputs(step.outputs)
                self._stats.on_step(step, to_abort)
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for delta in deltas:
                    output = delta.request.owner
                    delta.apply_to(output)
                    index = order[output.request_id]
                    if output.finished and results[index] is None:
                        results[index] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException as e:
            # Leave no request running: a later generate() would wait for it forever.
            children = [
                child
                for request_id in order
                for child in self.output_processor.abort_request(request_id)
            ]
            self._stats.on_abort(children)
            if children and not isinstance(e, EngineDeadError):
                self.engine.abort_requests(children)
            raise
        if progress is not None:
            progress.close()
        return results  # type: ignore[return-value]

    def _decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids)
        assert isinstance(text, str)  # one sequence's ids give one string
        return text

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids, None
        if isinstance(prompt, dict):
            fields = cast(dict[str, Any], prompt)  # any of the prompt dicts
            salt = fields.get("cache_salt")
            if "prompt_token_ids" in fields:
                return fields.get("prompt"), list(fields["prompt_token_ids"]), salt
            if "prompt" in fields:
                return fields["prompt"], self.tokenizer(fields["prompt"]).input_ids, salt
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), None
        raise ValueError(
            f"unsupported prompt type {type(prompt).__name__}; use str, a list of "
            "token ids, or a dict with 'prompt' or 'prompt_token_ids'"
        )

    @staticmethod
    def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [cast(list[int], prompts)]
        return list(cast(Sequence[PromptInput], prompts))

    def _as_params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params


def _candidates(out: RequestOutput) -> dict[int, float] | None:
    """A one-token step's candidates (token id -> logprob); None when it produced no token."""
    completion = out.outputs[0]
    if not completion.logprobs:
        return None
    return {token_id: lp.logprob for token_id, lp in completion.logprobs[0].items()}


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
