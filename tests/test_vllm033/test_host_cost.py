"""The adapter's host cost per admission, flat in the prompt's length: from
64 to 8,192 blocks, the Python-level calls of one ``schedule()`` that admits
a prompt (vLLM's scheduler and gpukv's adapter, each gpukv manager call
counted as one: the manager's own work is the device's) stay within a small
constant, and the prompt's tokens reach the manager as one int32 array,
never as a list of Python ints. Counted, not timed: the count is the same
on every run, whatever the machine's load."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from gpukv.core.requests import NewRequest

from .harness import gpukv033, make_requests, make_scheduler

SIZES = (64, 1024, 8192)  # prompt blocks of 16 tokens
DEVICE_SIZES = (64, 1024)  # (Triton's interpreter runs the device manager's kernels: 8,192 blocks take minutes)
SLACK = 8  # calls the count may differ by between sizes (vLLM's lazily read environment, first-time paths)
HAS_TOKEN_BUFFER = importlib.util.find_spec("vllm.v1.token_buffer") is not None  # (vLLM 0.34 on)


class CallCounter:
    """Python function calls and builtin (C) calls made while counting, a
    call of the gpukv manager counted as one whatever it does inside (the
    profiler is off for its span, so the kernels the interpreter runs cost
    nothing to count)."""

    def __init__(self) -> None:
        self.calls = 0

    def _event(self, frame: Any, event: str, arg: Any) -> None:  # noqa: ARG002  (sys.setprofile's signature)
        if event in ("call", "c_call"):
            self.calls += 1

    @contextmanager
    def counting(self) -> Iterator[None]:
        sys.setprofile(self._event)
        try:
            yield
        finally:
            sys.setprofile(None)

    def opaque(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` counted as one call, its inside not at all."""

        def call(*args: Any, **kwargs: Any) -> Any:
            outer = sys.getprofile()
            sys.setprofile(None)
            try:
                return method(*args, **kwargs)
            finally:
                sys.setprofile(outer)

        return call


def _watch_manager(scheduler: Any, counter: CallCounter, seen: list[Any]) -> None:
    """Each public method of the adapter's gpukv manager made one opaque call
    that also records the token containers of the ``NewRequest``\\ s it gets."""
    manager = scheduler.kv_cache_manager.manager
    for name, attr in inspect.getmembers_static(type(manager)):
        if not name.startswith("_") and inspect.isfunction(attr):  # (methods only: a property is not read here)
            setattr(manager, name, counter.opaque(_recording(getattr(manager, name), seen)))


def _recording(method: Callable[..., Any], seen: list[Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        for value in [*args, kwargs.get("new") or ()]:
            for request in value if isinstance(value, list) else [value]:
                if isinstance(request, NewRequest):
                    seen.append(request.token_ids)
        return method(*args, **kwargs)

    return call


def _admission_calls(cls: type, num_blocks: int, *, shared: bool, **options: Any) -> tuple[int, list[Any]]:
    """The calls of the ``schedule()`` that admits a prompt of ``num_blocks``
    full blocks and one token (after a warm-up step admitting another; with
    ``shared`` that one is the prompt's first ``num_blocks`` blocks, so the
    admission hits all of them), and the token containers the manager got."""
    n = num_blocks * 16
    scheduler = make_scheduler(cls, max_num_batched_tokens=n + 32, num_blocks=2 * num_blocks + 64, max_num_seqs=4,
                               **options)
    first = list(range(1, n + 1)) if shared else [7] * 32
    for request in make_requests(1, prompt=lambda _: first, first_id=100, scheduler=scheduler):
        scheduler.add_request(request)
    scheduler.schedule()
    (request,) = make_requests(1, prompt=lambda _: [*range(1, n + 1), 5], scheduler=scheduler)
    scheduler.add_request(request)
    counter, seen = CallCounter(), []
    _watch_manager(scheduler, counter, seen)
    with counter.counting():
        output = scheduler.schedule()
    (new,) = output.scheduled_new_reqs
    assert [len(ids) for ids in new.block_ids] == [num_blocks + 1]
    assert new.num_computed_tokens == (n if shared else 0)  # (the hit)
    return counter.calls, seen


@pytest.mark.parametrize("options", [{}, dict(num_speculative_tokens=2)], ids=["batched", "per-request"])
@pytest.mark.parametrize("shared", [False, True], ids=["miss", "hit"])
def test_an_admission_costs_the_same_calls_from_64_to_8192_blocks(shared, options):
    """No Python call per block or per token at the boundary: the ``Block``
    objects vLLM's ``KVCacheBlocks`` would hold are built only if something
    reads ``blocks`` (vLLM's scheduler reads ``get_block_ids()``), and the
    tokens cross as one array. The admissions take the batched run
    (``gpukv.vllm.v0_33.admissions``) or, with speculative decoding on, the
    per-request calls; missing the cache, or hitting every block but the
    last token's."""
    counts = {size: _admission_calls(gpukv033.ReferenceScheduler, size, shared=shared, **options)[0]
              for size in SIZES}
    assert max(counts.values()) - min(counts.values()) <= SLACK, counts


@pytest.mark.parametrize("shared", [False, True], ids=["miss", "hit"])
def test_a_device_admission_costs_the_same_calls_whatever_the_prompt(shared):
    """The same on the device manager (its kernels under Triton's
    interpreter here), from 64 to 1,024 blocks: the batched run missing the
    cache, the per-request calls hitting it."""
    options = {} if not shared else dict(num_speculative_tokens=2)
    counts = {size: _admission_calls(gpukv033.DeviceScheduler, size, shared=shared, **options)[0]
              for size in DEVICE_SIZES}
    assert max(counts.values()) - min(counts.values()) <= SLACK, counts


@pytest.mark.parametrize("options", [{}, dict(num_speculative_tokens=2)], ids=["batched", "per-request"])
def test_the_prompt_reaches_the_manager_as_one_int32_array(options):
    """vLLM 0.34 keeps a request's tokens in an int32 ``TokenBuffer``: the
    manager gets them as an int32 array copied from its buffer (no list of
    Python ints), equal to the prompt; vLLM 0.33's list is handed on as a
    list, which the manager converts in one C-level pass."""
    _, seen = _admission_calls(gpukv033.ReferenceScheduler, 64, shared=True, **options)
    prompt = [*range(1, 64 * 16 + 1), 5]
    assert seen
    for tokens in seen:
        if HAS_TOKEN_BUFFER:
            assert isinstance(tokens, np.ndarray) and tokens.dtype == np.int32
        else:
            assert isinstance(tokens, list)
        assert list(tokens) == prompt[:len(tokens)]
    assert max(len(tokens) for tokens in seen) == len(prompt)


def test_a_request_grows_after_its_tokens_were_read():
    """The token copy keeps no export of vLLM's buffer: the request takes its
    sampled tokens afterwards (a view kept alive would make that a
    ``BufferError``)."""
    from gpukv.vllm.v0_33.views import token_ids

    (request,) = make_requests(1, prompt=lambda _: [3, 1, 4, 1, 5])
    tokens = token_ids(request, 3)
    request.append_output_token_ids(9)
    assert list(tokens) == [3, 1, 4] and list(request.all_token_ids) == [3, 1, 4, 1, 5, 9]
    assert list(token_ids(request)) == [3, 1, 4, 1, 5, 9] and list(token_ids(request, 0)) == []
