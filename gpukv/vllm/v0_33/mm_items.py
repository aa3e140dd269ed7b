"""gpukv's multimodal items for vLLM's requests: what vLLM's block hashes
key of a request's images, audio and video.

vLLM 0.33 and 0.34 key each full block by every multimodal item its tokens
overlap, as the item's identifier (its content hash, with the LoRA prefix
where one applies, or the caller's uuid) and its offset from the block's
start (``kv_cache_utils._gen_mm_extra_hash_keys``). gpukv keys a block by
the offset and hash of each ``MMItem(offset, length, hash)`` it overlaps
(``gpukv.core.hashing.extra_key_digests``; the length only says which blocks
an item overlaps). Handed the identifier as the hash and vLLM's placeholder
range as offset and length, the same blocks carry the same keys, so the same
blocks are shared, two ranges of one identifier included.

An item gpukv cannot key (no identifier, a range outside the prompt, two
ranges overlapping, an item without vLLM's ``identifier`` and
``mm_position``) gets its request refused at arrival
(``UnsupportedConfigError``), never a guessed key.
"""

from __future__ import annotations

from typing import Any

from gpukv.core.checks import normalize_mm_items
from gpukv.core.hashing import MMItem
from gpukv.errors import GpukvInputError
from gpukv.vllm.v0_33.groups import UnsupportedConfigError


def mm_items(request: Any, num_tokens: int | None = None) -> tuple[MMItem, ...]:
    """The ``MMItem``\\ s of ``request``'s multimodal inputs (vLLM's
    ``mm_features``), sorted by offset; () for a text request. With
    ``num_tokens`` (a lookup on the prompt's first tokens), those items
    within them, the last cut at the end: an item's length is not in gpukv's
    keys, so the blocks before the cut keep theirs."""
    features = request.mm_features
    if not features:
        return ()
    try:
        items = normalize_mm_items([MMItem(f.mm_position.offset, f.mm_position.length, f.identifier)
                                    for f in features], "request.mm_features", f"request {request.request_id!r}: ",
                                   request.num_prompt_tokens)
        if num_tokens is None:
            return items
        return tuple(item if item.offset + item.length <= num_tokens else
                     MMItem(item.offset, num_tokens - item.offset, item.hash)
                     for item in items if item.offset < num_tokens)
    except (GpukvInputError, AttributeError) as err:  # (AttributeError: a vLLM whose inputs say it otherwise)
        raise UnsupportedConfigError(f"request {request.request_id!r}: a multimodal input gpukv cannot key as vLLM "
                                     f"does ({err})", argument="request",
                                     fix="give each input an identifier and a placeholder range inside the prompt, "
                                         "none overlapping another, or use vLLM's own scheduler") from err
