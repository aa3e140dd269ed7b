"""vLLM's running requests as one gpukv ``RunningBatch``.

For ``KVCacheManager.schedule_batch``: each running request's
``allocate_slots(request, n, num_lookahead_tokens=...)``, translated as the
one-request call translates it (``KVCacheManager._running_update``), for the
whole batch at once, over arrays: the tokens vLLM appended since gpukv last
saw the request, the tokens gpukv computes (vLLM's computed tokens less its
speculative ones, at least one more than gpukv has computed) and the
lookahead slots beyond them, capped at ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpukv.core.running_batch import RunningBatch
from gpukv.errors import InvalidInputError
from gpukv.vllm.v0_8.checks import check_running_batch


def running_batch(manager: Any, rows_of: dict[str, int], requests: Sequence[Any],
                  num_new_tokens: Sequence[int] | np.ndarray, num_lookahead_tokens: int,
                  max_model_len: int) -> RunningBatch:
    """gpukv's ``RunningBatch`` for ``requests`` (running, so in ``rows_of``:
    request id to gpukv row) on ``manager``, checked in vectorised passes
    before anything is read from the manager."""
    count = len(requests)
    try:
        rows = np.fromiter([rows_of[r.request_id] for r in requests], np.int64, count)
    except (KeyError, AttributeError):
        bad = next(r for r in requests if getattr(r, "request_id", None) not in rows_of)
        raise InvalidInputError(f"request {getattr(bad, 'request_id', bad)!r} is not running",
                                argument="running", fix="pass requests that hold blocks (running ones)") from None
    known = np.fromiter([r.num_tokens for r in requests], np.int64, count)
    spec = np.fromiter([len(r.spec_token_ids) for r in requests], np.int64, count)
    vllm_computed = np.fromiter([r.num_computed_tokens for r in requests], np.int64, count)
    n = np.asarray(num_new_tokens, dtype=np.int64)
    check_running_batch(requests, known, spec, vllm_computed, n, max_model_len)
    held, computed = manager.row_token_counts(rows)
    appended = known - held
    # What vLLM caches after these calls (its computed tokens less the
    # speculative ones), at least one token more than gpukv has computed.
    target = np.minimum(np.maximum(vllm_computed + n - spec, computed + 1), known)
    slots = np.maximum(0, np.minimum(vllm_computed + n + num_lookahead_tokens, max_model_len) - target)
    chunks = target - computed
    if appended.size and int(appended.max()) == 1 and int(appended.min()) == 1:  # a decode: the last token each
        return RunningBatch(rows, [r.all_token_ids[-1] for r in requests], num_tokens_to_compute=chunks,
                            num_lookahead_tokens=slots)
    tokens = [t for r, a in zip(requests, held.tolist(), strict=True) for t in r.all_token_ids[a:]]
    return RunningBatch(rows, tokens, num_new_tokens=appended, num_tokens_to_compute=chunks,
                        num_lookahead_tokens=slots)
