"""The replay's defaults, in a module that imports nothing but ``gpukv.core.limits``.

``gpukv replay`` shows them in its ``--help`` and starts its metrics server
before it imports torch; ``gpukv.tools.replay``, which imports torch,
re-exports them, and is where they apply.
"""

from __future__ import annotations

from gpukv.core.limits import MAX_NUM_BLOCKS  # noqa: F401  (re-exported: the command line reads it here)

# vLLM 0.8.5 (engine/arg_utils.py, _set_default_args_v1): the OpenAI server's
# max_num_batched_tokens on GPUs with at least 70 GiB; 2048 on smaller ones.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# The pool every replay gets unless told otherwise: 65,536 blocks of 16 tokens.
# Block 0 is the null block (vLLM's null_block: a placeholder in block tables
# that never holds KV), so it holds 65,535 x 16 = 1,048,560 tokens: for a model
# of Llama-3.1-8B's shape, 32 layers of 8 KV heads of 128, 64 GiB of KV cache in
# fp8 or 128 GiB in bf16; one H200's scale.
DEFAULT_NUM_BLOCKS = 65_536
DEFAULT_BLOCK_SIZE = 16
# Requests running at once: sized for that pool, which holds about 72 of the
# built-in workload's requests at their full length (README.md, "How to read
# it", and --help say so; tests/helpers/doc_figures.py checks the figure): 64
# running fit with room to spare. (vLLM's own default, 1024 on an H200, suits
# short chats: with 14k-token requests and a long queue it would oversubscribe
# this pool 14 times over, and the replay would measure recomputation after
# preemptions rather than caching.)
DEFAULT_MAX_NUM_SEQS = 64
# Mooncake arrivals: by the trace's timestamps, each step standing for this
# many milliseconds (an engine step with a few dozen running requests; at 100
# ms a step the built-in workload's arrivals outrun its decodes).
DEFAULT_ARRIVAL = "timestamp"
DEFAULT_STEP_MS = 40.0

# The progress bar: where stderr is no terminal, a line at most every this
# many seconds, and none at all for a replay shorter than PLAIN_DELAY_S.
PLAIN_INTERVAL_S = 15.0
PLAIN_DELAY_S = 5.0

# The command line's ranges (a size a manager cannot take is a
# usage error, exit 2, caught while parsing, never an internal error later);
# token counts, requests and steps go up to gpukv.tools.traces.MAX_SIZE (2**31 - 1,
# int32 on the device). Blocks in a pool: the managers' own limit, from
# their one table (gpukv.core.limits, which imports nothing either).
#: Tokens per block: vLLM's largest is 128 and Mooncake's traces count in
#: 512; a block past this would only make every array the replay keeps per
#: block (the ceiling's keys, the device pool's tokens) huge for nothing.
MAX_BLOCK_SIZE = 2**16
#: --metrics-linger: a day at most (time.sleep refuses values near 2**63 ns).
MAX_LINGER_S = 86_400.0
