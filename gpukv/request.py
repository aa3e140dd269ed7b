"""What a caller hands the block manager: new requests, running updates, and
what a batched step gives back.

Both managers (the reference and the device one) take these same types, so a
serving loop can switch backends without touching its own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Sequence

import numpy as np
import torch

from gpukv.hashing import MMItem

MAX_TOKEN_ID = 2**32 - 1


def check_token_ids(token_ids: Sequence[int], what: str) -> np.ndarray | torch.Tensor:
    """Return ``token_ids`` as an int64 array, or raise saying what is wrong.

    Token ids are hashed as little-endian uint32, so each must be an int in
    ``[0, 2**32)``; bools, floats and strings are refused rather than coerced.
    A tensor on a GPU (tokens a sampler just produced) is returned as it is,
    with its dtype and shape checked but not its values: reading them would
    stop the host until the GPU catches up. Its ids are taken modulo 2**32.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype not in (torch.int32, torch.int64) or token_ids.dim() > 1:
            raise TypeError(f"{what}: a token tensor must be 1-D int32 or int64, got {token_ids.dtype} "
                            f"of shape {tuple(token_ids.shape)}")
        if token_ids.device.type != "cpu":
            return token_ids.reshape(-1)
        token_ids = token_ids.numpy()
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{what}: token ids must be a sequence of ints, got {type(token_ids).__name__}")
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    else:
        token_ids = list(token_ids)
        for i, t in enumerate(token_ids):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise TypeError(
                    f"{what}: token id at position {i} is {t!r} ({type(t).__name__}); token ids must be ints"
                )
        arr = np.asarray(token_ids, dtype=object if not token_ids else None)
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "O":  # ints too large for int64
            bad = next(i for i, t in enumerate(arr.tolist()) if not 0 <= t <= MAX_TOKEN_ID)
            raise ValueError(
                f"{what}: token id at position {bad} is {arr[bad]}, outside [0, 2**32)"
            )
        raise TypeError(f"{what}: token ids must be ints, got an array of {arr.dtype}")
    arr = arr.astype(np.int64, copy=False).reshape(-1)
    if arr.size:
        bad = np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{what}: token id at position {i} is {int(arr[i])}, outside [0, 2**32)")
    return arr


@dataclass(frozen=True)
class NewRequest:
    """A request asking to be admitted: look up its prefix, then compute the rest.

    ``token_ids`` are all tokens known so far (a resumed request brings its
    prompt and what it generated). ``block_hashes``, when given, are the
    chained digests of its full blocks computed by the caller with the
    manager's key (vLLM's ``Request.block_hashes``); hits are verified against
    the tokens, so a wrong digest can cost a hit but never give a wrong one.
    """

    request_id: str
    token_ids: Sequence[int]
    lora_id: int | None = None
    mm_items: tuple[MMItem, ...] = ()
    cache_salt: str | None = None
    skip_prefix_cache: bool = False
    block_hashes: Sequence[bytes] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RunningUpdate:
    """A running request's work this step.

    ``new_token_ids`` are appended first (a decode step appends the token it
    sampled last step); then every token not yet computed is computed, so its
    blocks must exist. An update with no new tokens and nothing uncomputed
    needs nothing.
    """

    request_id: str
    new_token_ids: Sequence[int] = ()


@dataclass
class StepResult:
    """What one batched step did.

    ``running_failed_at``: index in the step's ``running`` of the first update
    that could not get its blocks (it and the later ones got nothing and no new
    request was looked at), or None. ``num_admitted``: the first
    ``num_admitted`` new requests were admitted. ``num_computed_tokens[i]``:
    the prefix-cache hit, in tokens, of admitted request ``i``.
    """

    running_failed_at: int | None = None
    num_admitted: int = 0
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.running_failed_at is None


def _all_digests(values: Sequence[bytes]) -> bool:
    """Whether every value is a 16-byte digest (one join, not a Python loop)."""
    try:
        return len(b"".join(values)) == 16 * len(values) and all(len(v) == 16 for v in values[:1])
    except TypeError:
        return False


def check_step_inputs(
    finished: Sequence[str],
    running: Sequence[RunningUpdate],
    new: Sequence[NewRequest],
    *,
    known: Container[str],
    block_size: int,
    num_blocks: int,
    num_groups: int,
    max_tokens: int | None = None,
) -> None:
    """Raise, saying what is wrong, unless a step's inputs make sense for a
    manager that holds the requests ``known``. Changes nothing: managers call
    it before touching any state, so a bad step leaves everything as it was."""

    def require_known(rid):
        if not isinstance(rid, str) or rid not in known:
            raise KeyError(f"unknown request id {rid!r}: it was never admitted or was already freed")

    done: set[str] = set()
    for rid in finished:
        require_known(rid)
        if rid in done:
            raise ValueError(f"request {rid!r} is finished twice in one step (double free)")
        done.add(rid)
    seen: set[str] = set()
    for update in running:
        if not isinstance(update, RunningUpdate):
            raise TypeError(f"running entries must be RunningUpdate, got {type(update).__name__}")
        rid = update.request_id
        require_known(rid)
        if rid in done:
            raise ValueError(f"request {rid!r} is both finished and running in one step")
        if rid in seen:
            raise ValueError(f"request {rid!r} has two running updates in one step")
        seen.add(rid)
        check_token_ids(update.new_token_ids, f"running request {rid!r}")
    seen = set()
    for r in new:
        if not isinstance(r, NewRequest):
            raise TypeError(f"new entries must be NewRequest, got {type(r).__name__}")
        rid = r.request_id
        if not isinstance(rid, str) or not rid:
            raise TypeError(f"request ids are non-empty strings, got {rid!r}")
        if rid in known or rid in seen:
            raise ValueError(f"request id {rid!r} is already in use")
        seen.add(rid)
        tokens = check_token_ids(r.token_ids, f"new request {rid!r}")
        if tokens.size == 0:
            raise ValueError(f"new request {rid!r} has no tokens")
        if max_tokens is not None and tokens.size > max_tokens:
            raise ValueError(f"new request {rid!r} has {tokens.size} tokens, more than max_model_len {max_tokens}")
        if r.block_hashes is not None:
            n_full = tokens.size // block_size
            if len(r.block_hashes) != n_full or not _all_digests(r.block_hashes):
                raise ValueError(
                    f"new request {rid!r}: block_hashes must be {n_full} digests of 16 bytes (one per full block)"
                )
        if r.lora_id is not None and (isinstance(r.lora_id, bool) or not isinstance(r.lora_id, int) or r.lora_id < 0):
            raise ValueError(f"new request {rid!r}: lora_id must be a non-negative int, got {r.lora_id!r}")
        if r.cache_salt is not None and not isinstance(r.cache_salt, str):
            raise TypeError(f"new request {rid!r}: cache_salt must be a str")
        for item in r.mm_items:
            if not isinstance(item, MMItem):
                raise TypeError(f"new request {rid!r}: mm_items must be MMItem, got {type(item).__name__}")
        n_blocks = -(-tokens.size // block_size) * num_groups
        if n_blocks > num_blocks - 1:
            raise ValueError(
                f"new request {rid!r} needs {n_blocks} blocks, more than the whole pool "
                f"({num_blocks - 1}); it can never be admitted"
            )
