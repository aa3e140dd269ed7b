"""Requests gpukv's adapter cannot serve, refused before they reach gpukv,
the way vLLM refuses a request it cannot start.

A request the adapter cannot follow (no prompt tokens, more than
``max_model_len``, prompt embeddings, a prompt token outside ``[0, 2**32)``,
a LoRA adapter or multimodal input it cannot key as vLLM does (``lora_ids``,
``mm_items``); a sampled token outside that range later) must not
be refused inside ``schedule()``: by then the step's running requests may
already have blocks in gpukv that vLLM never reports (an exception from
``schedule()`` discards its output), and vLLM's engine core stops on it. So
the scheduler screens a request when it arrives (``add_request``) and each
sampled token when it comes back (``update_from_output``), and a refused
request takes vLLM's own route for a request it cannot start, a structured-
output grammar that failed to compile: it waits without being scheduled
(``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``, with no grammar to wait for) and
the next ``update_from_output`` finishes it as ``FINISHED_ERROR`` with a
``RequestError`` (``grammar_compile_error_reqs``) saying what and what to do.
It never reaches gpukv, so no other request's blocks, tokens or events change.
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Any

import numpy as np

from gpukv.core.checks import normalize_token_ids
from gpukv.core.limits import MAX_TOKEN_ID
from gpukv.errors import GpukvInputError, InvalidInputError, InvalidTypeError
from gpukv.vllm.v0_33.groups import UnsupportedConfigError
from gpukv.vllm.v0_33.mm_items import mm_items


def check_request(request: Any, max_model_len: int) -> int:
    """A request the adapter can follow: some tokens, within
    ``max_model_len``, no prompt embeddings (whose extra keys gpukv does
    not derive as vLLM 0.33 does). Returns its
    ``num_tokens`` (read once here: the running loop's call needs it too)."""
    rid = getattr(request, "request_id", None)
    if not isinstance(rid, str):
        raise InvalidTypeError(f"expected a vLLM Request, got {type(request).__name__}", argument="request",
                               fix="pass a vllm.v1.request.Request")
    num_tokens = request.num_tokens  # (a property: read once, it is called per running request per step)
    if not num_tokens:
        raise InvalidInputError(f"request {rid!r} has no tokens", argument="request",
                                fix="give the request a prompt of at least one token")
    if num_tokens > max_model_len:
        raise InvalidInputError(f"request {rid!r} has {num_tokens} tokens, more than max_model_len="
                                f"{max_model_len}", argument="request",
                                fix="finish or truncate requests at max_model_len")
    if request.prompt_embeds is not None:
        raise UnsupportedConfigError(f"request {rid!r} has prompt embeddings, which gpukv's vLLM 0.33 adapter "
                                     "does not hash as vLLM does", argument="request",
                                     fix="send token ids, or use vLLM's own scheduler")
    return num_tokens


def prompt_refusal(request: Any, max_model_len: int, check: Any, lora_ids: Any = None) -> GpukvInputError | None:
    """Why the adapter cannot serve ``request`` (the error ``check(request,
    max_model_len)`` raises, one for a prompt token out of range, or, with
    ``lora_ids`` (``gpukv.vllm.v0_33.lora_ids.LoraIds``), one for a LoRA
    adapter gpukv cannot key as vLLM does; one for a multimodal input gpukv
    cannot key, ``gpukv.vllm.v0_33.mm_items``), or None."""
    try:
        check(request, max_model_len)
        if lora_ids is not None:
            lora_ids.id_of(request)  # (its int given now, at arrival; the same at admission)
        mm_items(request)
        tokens = request.prompt_token_ids
        if tokens is not None and not _int32_in_range(tokens):
            normalize_token_ids(tokens, "request.prompt_token_ids", request.request_id)  # (raises, naming it)
    except GpukvInputError as err:
        return err
    return None


def _int32_in_range(tokens: Any) -> bool:
    """Whether ``tokens`` are vLLM 0.34's int32 ``TokenBuffer`` (an
    ``array('i')``) holding no negative id: one pass in C, no Python int per
    token (an int32 is below 2**32 by its type). False for anything else, which
    the managers' rule then checks."""
    if not isinstance(tokens, array) or tokens.typecode != "i":
        return False
    return not len(tokens) or int(np.frombuffer(tokens, dtype=np.int32).min()) >= 0


def refuse_at_arrival(scheduler: Any, request: Any, error: GpukvInputError) -> None:
    """Keep ``request`` from being scheduled, and have the next
    ``update_from_output`` finish it as an error (before vLLM enqueues it)."""
    from vllm.outputs import RequestError  # type: ignore[attr-defined,unused-ignore]  # (0.33 on)
    from vllm.v1.request import RequestStatus

    request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR  # type: ignore[attr-defined,unused-ignore]
    scheduler.grammar_compile_error_reqs[request.request_id] = RequestError(
        code="validation_error", message=f"gpukv's block manager cannot serve this request: {error}")


def sampled_refusals(model_runner_output: Any) -> dict[str, str]:
    """The requests a model output gives a token outside ``[0, 2**32)``, with why."""
    sampled = model_runner_output.sampled_token_ids
    every = list(chain.from_iterable(sampled))  # (one pass over the step's tokens; a loop only past a bad one)
    if not every or (min(every) >= 0 and max(every) <= MAX_TOKEN_ID):
        return {}
    refused = {}
    for rid, tokens in zip(model_runner_output.req_ids, sampled, strict=False):
        bad = next((t for t in tokens if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            refused[rid] = f"the model sampled token {bad}, outside [0, 2**32)"
    return refused


def refuse_sampled(scheduler: Any, refused: dict[str, str]) -> None:
    """Have this ``update_from_output`` finish each refused request as an
    error (vLLM appends the token, then finishes it; gpukv never sees it)."""
    from vllm.outputs import RequestError  # type: ignore[attr-defined,unused-ignore]  # (0.33 on)

    for rid, why in refused.items():
        scheduler.grammar_compile_error_reqs[rid] = RequestError(
            code="validation_error", message=f"gpukv's block manager cannot serve this request: {why}")
