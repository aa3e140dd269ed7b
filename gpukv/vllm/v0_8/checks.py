"""The 0.8.5 adapter's checks of what vLLM's scheduler hands it.

``gpukv.vllm.KVCacheManager`` refuses a caller's mistake (a request that is
not one, one with no tokens or past ``max_model_len``, tokens scheduled
beyond what a request has) with a typed error from ``gpukv.errors`` naming
the argument, before anything changes; ``check_running_batch`` makes the
same checks of a whole running batch in vectorised passes, and on a failure
gives the one-request message of the first request that fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpukv.errors import InvalidInputError, InvalidTypeError


def request_id_of(request: Any) -> str:
    """The request's id (a str), or refused: not a vLLM request."""
    rid = getattr(request, "request_id", None)
    if not isinstance(rid, str):
        raise InvalidTypeError(f"expected a vLLM Request, got {type(request).__name__}", argument="request",
                               fix="pass a vllm.v1.request.Request")
    return rid


def check_num_tokens(num_tokens: Any, num_lookahead_tokens: Any) -> None:
    """``allocate_slots``'s counts: at least one token, lookahead slots >= 0 (ints, not bools)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise InvalidInputError(f"num_tokens must be an int >= 1, got {num_tokens!r}", argument="num_tokens",
                                fix="pass the tokens scheduled this step (vLLM never allocates for 0)")
    if isinstance(num_lookahead_tokens, bool) or not isinstance(num_lookahead_tokens, int) \
            or num_lookahead_tokens < 0:
        raise InvalidInputError(f"num_lookahead_tokens must be an int >= 0, got {num_lookahead_tokens!r}",
                                argument="num_lookahead_tokens", fix="pass 0 without speculative decoding")


def checked_length(request: Any, max_model_len: int) -> int:
    """The request's known tokens (prompt and outputs, no speculative ones):
    how many; read without copying them (a running request's call costs what
    it appends, not its length)."""
    num_tokens = request.num_tokens
    if not num_tokens:
        raise InvalidInputError(f"request {request.request_id!r} has no tokens", argument="request",
                                fix="give the request a prompt of at least one token")
    if num_tokens > max_model_len:
        raise InvalidInputError(f"request {request.request_id!r} has {num_tokens} tokens, more than "
                                f"max_model_len={max_model_len}", argument="request",
                                fix="finish or truncate requests at max_model_len")
    return num_tokens


def check_scheduled(request: Any, num_known: int, num_computed: int, num_tokens: int) -> None:
    """Tokens scheduled past the request's known and speculative tokens have
    nothing to compute: a caller's mistake, refused before anything changes."""
    limit = num_known + len(request.spec_token_ids)
    if num_computed + num_tokens > limit:
        raise InvalidInputError(f"request {request.request_id!r}: {num_computed} computed tokens plus num_tokens="
                                f"{num_tokens} is more than its {limit} tokens (speculative ones included)",
                                argument="num_tokens",
                                fix="schedule at most the tokens the request has that are not computed yet")


def check_running_batch(requests: Sequence[Any], known: np.ndarray, spec: np.ndarray, computed: np.ndarray,
                        num_new: np.ndarray, max_model_len: int) -> None:
    """``checked_length``, ``check_num_tokens`` and ``check_scheduled`` of
    every running request at once (the one-request messages on failure)."""
    if num_new.shape != known.shape:
        raise InvalidInputError(f"{len(num_new)} token counts for {len(known)} requests", argument="num_new_tokens",
                                fix="pass one count per running request")
    bad = (known < 1) | (known > max_model_len) | (num_new < 1) | (computed + num_new > known + spec)
    if bad.any():
        i = int(np.argmax(bad))
        checked_length(requests[i], max_model_len)
        check_num_tokens(int(num_new[i]), 0)
        check_scheduled(requests[i], int(known[i]), int(computed[i]), int(num_new[i]))
