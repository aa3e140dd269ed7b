"""gpukv's LoRA id for vLLM's requests: one int per adapter as vLLM's block
hashes tell adapters apart.

gpukv keys a LoRA request's blocks by an int (``NewRequest.lora_id``).
vLLM 0.33 and 0.34 key them by what ``_gen_lora_extra_hash_keys`` returns
for the request: the adapter's name and path, not its ``lora_int_id``. A name
loaded again gets a new int id and shares the KV computed under the old one;
an int id re-pointed at another path (``load_inplace``) or reused for another
name shares nothing. Handing vLLM's int id to gpukv would break both: the
first a hit vLLM finds and gpukv does not, the second KV computed with one
adapter reused for another.

So the adapter asks vLLM's own rule (``features.LORA_HASH_KEYS``) for each
LoRA request's keys and gives every distinct answer its own int, in the
order first seen: equal keys, one int; different keys, different ints. The
ints live as long as the adapter (one per adapter the server has served;
none is ever dropped, so a key's int never changes while its blocks are
cached). A vLLM without the rule, or a key that cannot be compared, gets
the request refused (``UnsupportedConfigError``), never a guessed key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpukv.vllm.v0_33 import features
from gpukv.vllm.v0_33.groups import UnsupportedConfigError


class LoraIds:
    """The int gpukv keys each LoRA adapter's blocks by (``id_of``).
    ``hash_keys``: vLLM's rule, ``request -> what its block hashes key of
    the request's adapter`` (None: this vLLM has none the adapter knows)."""

    def __init__(self, hash_keys: Callable[[Any], Any] | None = features.LORA_HASH_KEYS) -> None:
        self._hash_keys = hash_keys
        self._ids: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def id_of(self, request: Any) -> int | None:
        """``request``'s LoRA id for gpukv (None without a LoRA adapter): the
        int of vLLM's keys for it, a new one (1, 2, ...) for keys not seen
        before."""
        if not request.lora_request:
            return None
        key = self._key(request)
        lora_id = self._ids.get(key)
        if lora_id is None:
            lora_id = self._ids[key] = len(self._ids) + 1
        return lora_id

    def _key(self, request: Any) -> Any:
        """vLLM's keys of ``request``'s adapter, as one comparable value."""
        fix = "serve LoRA requests with vLLM's own scheduler, or install a vLLM release gpukv is tested with"
        if self._hash_keys is None:
            raise UnsupportedConfigError(f"request {request.request_id!r} has a LoRA adapter, and the installed vLLM "
                                         "has no rule gpukv knows for what its block hashes key of one",
                                         argument="request.lora_request", fix=fix)
        try:
            key = tuple(self._hash_keys(request))
            hash(key)
        except TypeError as err:
            raise UnsupportedConfigError(f"request {request.request_id!r}: vLLM's block-hash keys of its LoRA adapter "
                                         f"cannot be compared ({err})", argument="request.lora_request",
                                         fix=fix) from err
        return key
