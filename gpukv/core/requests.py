"""What a caller hands the block manager (new requests, running updates) and
what a step gives back (``StepResult``, a lookup's ``ComputedBlocks`` and
``PrefixHit``, a checked ``Step``).

Both managers take these same types, so a serving loop can switch backends
without touching its own code; ``gpukv.core.checks`` normalises and checks
them before a manager changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpukv.core.blocks import check_count, common_prefix_length
from gpukv.core.hashing import MMItem
from gpukv.errors import InvalidInputError

# ----------------------------------------------------------------- the types

@dataclass(frozen=True)
class NewRequest:
    """A request asking to be admitted: look up its prefix, then compute the rest.

    ``token_ids`` are all tokens known so far (a resumed request brings its
    prompt and what it generated): a sequence or iterator of ints in
    ``[0, 2**32)``, a 1-D integer numpy array, or a 1-D int32/int64 tensor.
    ``lora_id`` is None or an int in ``[0, 2**64)``; ``mm_items`` the
    multimodal items (inside the prompt, not overlapping each other);
    ``cache_salt`` None or a str (requests with different salts share no
    block); ``skip_prefix_cache`` a bool.

    ``num_tokens_to_compute`` (chunked prefill): compute at most that many
    tokens *beyond the cache hit* this step (None: every one after the hit),
    as vLLM counts ``num_new_tokens``: the request computes ``hit + min(k,
    tokens - hit)`` (and less when the step's ``token_budget`` runs out,
    ``step``); later ``RunningUpdate``s compute the rest.
    ``num_lookahead_tokens``: extra slots beyond the computed tokens (see
    ``RunningUpdate``).
    ``num_preemptions``: how often the request was preempted before (as
    vLLM's ``Request.num_preemptions``); a re-admission (> 0) counts in the
    stats' ``preempted_*`` fields.

    ``block_hashes`` is deprecated and ignored (a ``DeprecationWarning`` when
    given): the manager computes every digest itself from the tokens and extra
    keys, so a caller's digests can neither give nor poison a hit. It is kept
    for compatibility; its form is still checked (one 16-byte digest per full
    block).
    """

    request_id: str
    token_ids: Sequence[int]
    lora_id: int | None = None
    mm_items: tuple[MMItem, ...] = ()
    cache_salt: str | None = None
    skip_prefix_cache: bool = False
    block_hashes: Sequence[bytes] | None = field(default=None, repr=False)
    num_tokens_to_compute: int | None = None
    num_lookahead_tokens: int = 0
    num_preemptions: int = 0


@dataclass(frozen=True, init=False)
class RunningUpdate:
    """A running request's work this step.

    ``new_token_ids`` are appended first (a decode step appends the token it
    sampled last step); then ``num_tokens_to_compute`` more of its tokens are
    computed (None: every token not computed yet), so their blocks must exist.
    An update with no new tokens and nothing uncomputed needs nothing.
    ``num_lookahead_tokens`` extra slots (speculative decoding) get blocks
    too, beyond the computed tokens; they are never cached, and the request
    keeps them for the tokens that later fill them.
    ``num_processed_tokens`` (tokens in flight: vLLM's async scheduling or
    speculative decoding): sliding-window groups release the blocks behind
    these tokens' window instead of behind the computed tokens before the
    update (None), at most up to the blocks the request holds; between 0 and
    its computed tokens after the update.
    """

    request_id: str
    new_token_ids: Sequence[int] = ()
    num_tokens_to_compute: int | None = None
    num_lookahead_tokens: int = 0
    num_processed_tokens: int | None = None

    def __init__(self, request_id: str, new_token_ids: Sequence[int] = (), num_tokens_to_compute: int | None = None,
                 num_lookahead_tokens: int = 0, num_processed_tokens: int | None = None) -> None:
        # What the generated frozen __init__ does (object.__setattr__ per
        # field), written straight into the instance's __dict__: a decode step
        # builds one update per running request.
        fields = self.__dict__
        fields["request_id"] = request_id
        fields["new_token_ids"] = new_token_ids
        fields["num_tokens_to_compute"] = num_tokens_to_compute
        fields["num_lookahead_tokens"] = num_lookahead_tokens
        fields["num_processed_tokens"] = num_processed_tokens


@dataclass
class StepResult:
    """What one batched step did.

    ``running_failed_at``: index in the step's ``running`` of the first update
    that could not get its blocks (it and the later ones got nothing and no new
    request was looked at), or None. ``num_admitted``: the first
    ``num_admitted`` new requests were admitted. ``num_computed_tokens[i]``:
    the prefix-cache hit, in tokens, of admitted request ``i``;
    ``num_new_tokens[i]`` the tokens it computes in this step beyond the hit
    (vLLM's ``num_new_tokens``, what the step's budget is charged);
    ``rows[i]`` its row, the index ``decode`` addresses it by
    (``gpukv.device.rows``). After a ``decode``, ``running_failed_at`` indexes its
    ``rows``. ``refused_hit_tokens``: the hit, in tokens, of the new request
    the step looked up and refused (its blocks did not fit: vLLM's waiting
    loop stops there, and counts its lookup in the stats), None when none
    was. ``full_attention_hit_tokens[i]``: the longest prefix, in tokens, that
    admitted request ``i``'s full-attention groups alone could serve at its
    lookup (``ComputedBlocks.full_attention_hit_tokens``; None in a model
    without both kinds of group, or when no request was admitted).
    """

    running_failed_at: int | None = None
    num_admitted: int = 0
    num_computed_tokens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    refused_hit_tokens: int | None = None
    full_attention_hit_tokens: list[int] | None = None
    # With ``step(..., block_ids=True)``: per group, each running update's new
    # blocks (the updates that got theirs, in order), and each admitted
    # request's blocks (all of them, its hit included).
    running_block_ids: list[list[list[int]]] | None = None
    admitted_block_ids: list[list[list[int]]] | None = None
    # With ``step(..., prefix_of=request_id)``: per group, the reference
    # counts of that request's blocks after the step, in order (None for a
    # sliding-window group; the whole field None for a new request the step
    # did not admit); ``num_common_prefix_blocks`` reads them.
    prefix_ref_counts: list[list[int] | None] | None = None

    @property
    def ok(self) -> bool:
        return self.running_failed_at is None

    def num_common_prefix_blocks(self, num_running_requests: int) -> list[int]:
        """``get_num_common_prefix_blocks(prefix_of, num_running_requests)``
        as of the end of the step, from ``prefix_ref_counts`` (no read)."""
        if self.prefix_ref_counts is None:
            raise InvalidInputError("the step was not asked for a common prefix, or its prefix_of was a new request "
                                    "it did not admit", argument="prefix_of",
                                    fix="pass step(..., prefix_of=request_id) naming a running or admitted request")
        count = check_count(num_running_requests, "num_running_requests")
        return [0 if refs is None else common_prefix_length(refs, count) for refs in self.prefix_ref_counts]


@dataclass(frozen=True)
class StepOutputs:
    """What a step hands back besides its decisions (``step``'s
    ``block_ids`` and ``prefix_of``, checked)."""

    block_ids: bool = False
    prefix_of: str | None = None


@dataclass
class ComputedBlocks:
    """A request's prefix-cache hit: per group, the block at each hit position
    (the null block where a sliding window does not reach).

    ``full_attention_hit_tokens``: the longest prefix, in tokens, that the
    full-attention groups alone could serve (whole blocks, within the same
    limit as the hit; the cache as the lookup saw it), so at least
    ``num_tokens``; longer where a sliding-window group holds less. None in
    a model without both kinds of group (``gpukv.core.windows.is_hybrid``),
    where it would be the hit. A serving engine's hybrid lookup reports it
    (vLLM's shared-prefix boundary)."""

    block_ids: list[list[int]]
    num_tokens: int
    full_attention_hit_tokens: int | None = None


@dataclass(frozen=True)
class PrefixHit:
    """A request's prefix-cache hit known by its size only: its blocks stay
    with the manager (``read_prefix_hit``, then ``admit``). Under a model
    runner that reads the manager's block tables on the device, no block id
    of the hit ever reaches the host.

    ``num_tokens``: the hit, in tokens (whole blocks); ``num_unheld_blocks``:
    how many of its blocks no request holds, which an admission takes out of
    the free queue (vLLM's fit check counts them as blocks to take)."""

    num_tokens: int
    num_unheld_blocks: int
    full_attention_hit_tokens: int | None = None  # (as ``ComputedBlocks``')


@dataclass(frozen=True)
class Step:
    """A step's arguments, normalised and checked: ``finished`` request ids,
    ``running`` updates whose ``new_token_ids`` are int64 arrays (or CUDA
    tensors), ``new`` requests as described in the module docstring."""

    finished: tuple[str, ...] = ()
    running: tuple[RunningUpdate, ...] = ()
    new: tuple[NewRequest, ...] = ()
