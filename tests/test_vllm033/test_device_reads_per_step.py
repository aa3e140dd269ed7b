"""No engine step waits on the model: the device manager's
reads over a vLLM stream, counted where every read happens
(``CallContext._read``: ``counters.reads``).

A decode step reads nothing (``usage``, which vLLM's ``make_stats`` asks every
step, and the running loop's fit come from the host: the free-count mirror and
the adapter's records), except the one read of the new block ids vLLM's
``SchedulerOutput`` carries in a step where a request takes a block; an
admission reads at most once. And no read runs on the caller's (the model's)
stream: the CPU has no streams, so the manager is given stand-in ones, the
model's current, and every device-to-host copy is checked to run on the
manager's own, which never waits for the model's."""

from __future__ import annotations

import pytest
import torch

from .harness import Engine, gpukv033, make_requests, make_scheduler


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


class Streams:
    """The model's stream current; the manager's own; the stand-ins that
    read and switch the current one; and the stream of every copy to the host."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[str] = []
        self.own, self.model = FakeStream("own", self.log), FakeStream("model", self.log)
        self.current = self.model
        self.copies: list[str] = []
        streams = self

        class Switch:
            def __init__(self, stream: FakeStream) -> None:
                self.stream = stream

            def __enter__(self) -> None:
                self.saved, streams.current = streams.current, self.stream

            def __exit__(self, *exc: object) -> None:
                streams.current = self.saved

        cpu = torch.Tensor.cpu

        def copy_to_host(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            streams.copies.append(streams.current.name)
            return cpu(t, *args, **kwargs)

        monkeypatch.setattr(torch.cuda, "current_stream", lambda _device=None: streams.current)
        monkeypatch.setattr(torch.cuda, "stream", Switch)
        monkeypatch.setattr(torch.Tensor, "cpu", copy_to_host)


def _new_block(out) -> bool:
    """Whether a running request took a block in this step."""
    ids = out.scheduled_cached_reqs.new_block_ids
    return any(groups is not None and any(groups) for groups in ids)


@pytest.mark.parametrize("cls", [gpukv033.DeviceScheduler, gpukv033.DeviceAsyncScheduler], ids=["sync", "async"])
def test_decode_steps_read_nothing_an_admission_once_and_none_on_the_models_stream(cls, monkeypatch):
    scheduler = make_scheduler(cls, num_blocks=64, max_num_batched_tokens=256, max_model_len=256)
    manager = scheduler.kv_cache_manager.manager
    streams = Streams(monkeypatch)
    manager._stream = streams.own  # (the CPU manager on a stand-in stream of its own)
    engine = Engine(scheduler)
    # 40-token prompts: the third block of each is taken at its 49th slot, while decoding
    engine.add(make_requests(3, prompt=lambda i: list(range(100 * i, 100 * i + 40)), max_tokens=16))
    reads, steps = [], []
    for _ in range(40):
        if not scheduler.has_requests() and not engine.in_flight:
            break
        before = manager.counters.reads
        out = engine.step()
        reads.append(manager.counters.reads - before)
        steps.append("idle" if out is None else "admit" if out.scheduled_new_reqs
                     else "grow" if _new_block(out) else "decode")
    assert steps.count("admit") == 1 and steps.count("grow") == 1 and steps.count("decode") >= 10
    assert {s: sorted(set(r for s2, r in zip(steps, reads, strict=True) if s2 == s)) for s in set(steps)} == {
        "admit": [1], "grow": [1], "decode": [0], **({"idle": [0]} if "idle" in steps else {})}
    # ``usage`` came from the mirror each step (vLLM's make_stats), never read
    assert manager._mirror.reads >= len(steps) - 1
    assert streams.copies and set(streams.copies) == {"own"}
    assert "own waits for model" not in streams.log and "model waits for own" in streams.log
    assert streams.current is streams.model
