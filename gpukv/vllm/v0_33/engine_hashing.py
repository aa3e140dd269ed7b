"""Every token hashed once under vLLM: the engine builds no request block
hasher for gpukv's scheduler.

vLLM's ``EngineCore.__init__`` builds the scheduler, then, when
``cache_config.enable_prefix_caching`` is set, a request block hasher: every
full block of every request is hashed (sha256 over a pickle by default) as the
request is built and as sampled tokens fill blocks. vLLM's own manager keys its
cache by those hashes. gpukv's never does: a digest gpukv did not compute
under its own key is not proof that two blocks hold the same KV, so gpukv
hashes the tokens itself (keyed BLAKE3; the device manager on the device).
With both, every token is hashed twice; on long prompts vLLM's hashing is
most of vLLM's admission cost.

So gpukv's scheduler hands the hashing over: at the end of its construction
it clears ``enable_prefix_caching`` on the engine's cache config (the flag
the engine reads next, to build the hasher; gpukv's manager was built with
the flag's value and keeps caching), and sets it back at its first
``add_request``, after the engine's construction. The engine then builds no
hasher, requests arrive with no vLLM block hashes (a frontend's hashes too
are dropped: the engine takes them only with its hash config), and gpukv's
digests are the only ones computed. vLLM itself clears the same flag in the
engine core for models it cannot cache.

vLLM's hashes are kept (the flag left alone) where something still reads
them: KV events (``BlockStored`` carries vLLM's hashes, which a router
computes from the tokens itself) and the shared-prefix boundary of models
whose first lookup group is a window one (an index of vLLM's hashes per
group; a hybrid model's boundary is gpukv's full-attention hit); and on a
vLLM whose engine core does not build its scheduler first and its hasher on
that flag (read from its source, ``engine_builds_hasher_after_scheduler``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

FLAG = "enable_prefix_caching"
"""The cache config's flag on which vLLM's engine core builds its request block hasher."""


@functools.cache
def engine_builds_hasher_after_scheduler() -> bool:
    """Whether the installed vLLM's ``EngineCore.__init__`` builds the
    scheduler before its request block hasher, the hasher behind a test of
    ``cache_config.enable_prefix_caching``: the order the hand-over needs
    (read from vLLM's source; False when it cannot be read)."""
    try:
        from vllm.v1.engine.core import EngineCore

        source = inspect.getsource(EngineCore.__init__)
    except (ImportError, OSError, TypeError):
        return False
    scheduler_at = source.find("Scheduler(")
    guard_at = source.find(f"cache_config.{FLAG}")
    hasher_at = source.find("get_request_block_hasher(")
    return 0 <= scheduler_at < guard_at < hasher_at


def hand_over(scheduler: Any, needs_vllm_hashes: bool) -> bool:
    """Turn off the engine's request block hasher for ``scheduler`` (module
    docstring) unless vLLM's hashes are read (``needs_vllm_hashes``) or the
    engine's order does not allow it; returns whether it did."""
    cache_config = scheduler.cache_config
    if needs_vllm_hashes or not getattr(cache_config, FLAG) or not engine_builds_hasher_after_scheduler():
        return False
    setattr(cache_config, FLAG, False)
    return True


def take_back(scheduler: Any) -> None:
    """Set the flag back (the engine's construction is over)."""
    setattr(scheduler.cache_config, FLAG, True)
