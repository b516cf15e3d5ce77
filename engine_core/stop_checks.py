"""When a sampled token ends a request: stop tokens, length caps and a finished grammar."""

from __future__ import annotations

import logging

from engine_core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The status token (already appended) ends req with, or None.

    Stop tokens win over length caps; EOS and stop ids wait for min_tokens. A stop id is kept
    as req.stop_reason.
    """
    params = req.sampling_params
    num_output = len(req.all_token_ids) - req.prompt_len
    if num_output >= params.min_tokens:
        if token == req.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in req.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if (params.max_tokens is not None and num_output >= params.max_tokens) or len(
        req.all_token_ids
    ) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def advance_grammar(req: Request, token: int) -> RequestStatus | None:
    """Feed a sampled token to the request's matcher; STOPPED once the grammar has ended."""
    grammar = req.grammar
    assert grammar is not None
    if not grammar.accept(token):
        # Only when the mask left nothing (min_tokens forbidding the one stop token the
        # finished grammar allows); the request goes on from the grammar's last state.
        logger.warning("request %s: sampled token %d is outside its grammar", req.request_id, token)
        return None
    if grammar.terminated:
        if token != req.eos_token_id:
            req.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    return None
