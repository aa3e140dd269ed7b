"""Catalogues of bad inputs for the surfaces beside the managers, in the
style of ``tests/differential/test_catalogue.py``: the KV-event publisher (``gpukv.events.wire``:
its config, constructor, ``publish``, ``flush``,
``close``, ``publish_from``, ``make_publisher``), ``ServingMetrics.serve``,
and reconciliation's own checks (``reconcile_kv_cache_config`` in one
process, ``KVCacheConfig.from_dict``; the hostile peers are in
``tests/sizing/test_distributed.py``).

For every entry: the exact ``gpukv.errors`` class; ``error.argument`` names
the argument and starts the message (``argument: problem; fix``), which ends
with a fix; and the object refused still works afterwards, unchanged: the
live publisher's queue, counters and replay buffer are as before and its next
batch comes out with the next sequence number; a refused constructor leaves
no socket or file descriptor open; the metrics still count.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import tempfile
import urllib.request

import pytest
import torch
import zmq

from gpukv.core.metrics import PrefixCacheStats
from gpukv.errors import (
    AddressError,
    AddressInUseError,
    GpukvError,
    GpukvInputError,
    InvalidInputError,
    InvalidTypeError,
)
from gpukv.events import schema as gk
from gpukv.events import wire as kv_events
from gpukv.sizing.config import get_kv_cache_config
from gpukv.sizing.reconcile import reconcile_kv_cache_config
from gpukv.sizing.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from gpukv.tools.prometheus import ServingMetrics

D0 = bytes(range(16))


def check_refusal(info, exc, argument) -> None:
    """The refusal's class, its argument at the message's start, a fix at its end."""
    err = info.value
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert isinstance(err, GpukvError)
    assert err.argument == argument, str(err)
    assert str(err).startswith(argument + ": "), str(err)
    assert err.fix and str(err).endswith("; " + err.fix), str(err)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def listening(path: str) -> bool:
    """Whether a socket listens on the Unix socket ``path`` (ZMQ leaves the
    file of a closed socket behind: only a listener counts)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    finally:
        probe.close()
    return True


# ------------------------------------------------------------ the scenario

@pytest.fixture(scope="module")
def sockdir():
    path = tempfile.mkdtemp(prefix="gpukv-cat-", dir="/tmp")  # short: ipc paths hold 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


class LivePublisher:
    """A publisher on ipc sockets and a replay client: ``good_batch`` sends one
    batch and reads it back from the replay socket by its sequence number."""

    def __init__(self, sockdir: str) -> None:
        self.pub = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/live", f"ipc://{sockdir}/live-replay",
                                               topic="kv", sliding_windows=[None, 4])
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(self.pub.replay_endpoint)
        self.sent = 0

    def state(self) -> tuple:
        p = self.pub
        return (p._queued, p._next_seq, p._queue.qsize(), list(p._buffer), p._closed, p.endpoint, p.replay_endpoint,
                p.topic, p.sliding_windows, p.int_block_hashes, p.medium, p.data_parallel_rank)

    def good_batch(self) -> None:
        marker = float(self.sent)
        self.pub.publish(gk.KVEventBatch(0, [gk.BlockStored([D0], None, [1, 2], 2, None, 1)], ts=marker))
        assert self.pub.flush()
        self.dealer.send_multipart([b"", self.sent.to_bytes(8, "big")])
        assert self.dealer.poll(5000)
        _, topic, seq, payload = self.dealer.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"kv", self.sent)
        wire = kv_events.decode(payload)
        assert wire.ts == marker and wire.events[0].kv_cache_spec_kind == "sliding_window"
        assert self.dealer.poll(5000)
        assert self.dealer.recv_multipart() == [b"", b"", kv_events.END_SEQ, b""]
        self.sent += 1

    def close(self) -> None:
        self.pub.close()
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def live(sockdir):
    publisher = LivePublisher(sockdir)
    yield publisher
    publisher.close()


# ---------------------------------------------------------------- the tables

def stored(**kw):
    fields = dict(block_hashes=[D0], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None, group=0)
    return gk.BlockStored(**{**fields, **kw})


def batch(*events, **kw):
    return gk.KVEventBatch(0, list(events), **kw)


def raising():
    yield batch()
    raise RuntimeError("the caller's generator failed midway")


GOOD = batch(stored())

PUBLISH_CASES = [
    ("str", "x", InvalidTypeError, "batches"),
    ("int", 5, InvalidTypeError, "batches"),
    ("none", None, InvalidTypeError, "batches"),
    ("dict", {"a": 1}, InvalidTypeError, "batches"),
    ("bytes", b"x", InvalidTypeError, "batches"),
    ("second-is-str", [GOOD, "x"], InvalidTypeError, "batches[1]"),  # the issue's partial publish
    ("second-is-none", [GOOD, None], InvalidTypeError, "batches[1]"),
    ("generator-raises", raising(), InvalidInputError, "batches"),
    ("events-not-list", [gk.KVEventBatch(0, "events")], InvalidTypeError, "batches[0].events"),
    ("event-object", [batch(object())], InvalidTypeError, "batches[0].events[0]"),
    ("event-wire-struct", [batch(kv_events.WireAllBlocksCleared())], InvalidTypeError, "batches[0].events[0]"),
    ("ts-nan", [batch(ts=float("nan"))], InvalidInputError, "batches[0].ts"),
    ("ts-str", [batch(ts="now")], InvalidInputError, "batches[0].ts"),
    ("ts-bool", [batch(ts=True)], InvalidInputError, "batches[0].ts"),
    ("dropped-negative", [batch(dropped=-1)], InvalidInputError, "batches[0].dropped"),
    ("dropped-float", [batch(dropped=1.0)], InvalidInputError, "batches[0].dropped"),
    ("token-str", [batch(stored(token_ids=["a", "b"]))], InvalidTypeError, "batches[0].events[0].token_ids"),
    ("token-2**70", [batch(stored(token_ids=[2**70, 1]))], InvalidInputError, "batches[0].events[0].token_ids"),
    ("hash-str", [batch(stored(block_hashes=["digest"]))], InvalidTypeError, "batches[0].events[0].block_hashes[0]"),
    ("hashes-none", [batch(stored(block_hashes=None))], InvalidTypeError, "batches[0].events[0].block_hashes"),
    ("parent-float", [batch(stored(parent_block_hash=1.5))], InvalidTypeError,
     "batches[0].events[0].parent_block_hash"),
    ("lora-str", [batch(stored(lora_id="x"))], InvalidTypeError, "batches[0].events[0].lora_id"),
    ("block-size-str", [batch(stored(block_size="2"))], InvalidTypeError, "batches[0].events[0].block_size"),
    ("group-str", [batch(gk.BlockRemoved([D0], "g"))], InvalidTypeError, "batches[0].events[0].group"),
    ("third-bad", [GOOD, GOOD, batch(stored(token_ids=None))], InvalidTypeError, "batches[2].events[0].token_ids"),
]

TIMEOUT_CASES = [
    ("str", "1", InvalidTypeError),
    ("none", None, InvalidTypeError),
    ("bool", True, InvalidTypeError),
    ("negative", -1, InvalidInputError),
    ("nan", float("nan"), InvalidInputError),
    ("inf", float("inf"), InvalidInputError),
]


def _occupied_tcp_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def constructor_cases(sockdir: str) -> list[tuple]:
    """(name, kwargs, class, argument); ``{dir}`` in a str value is ``sockdir``."""
    ipc = f"ipc://{sockdir}/ctor"
    return [
        ("endpoint-int", dict(endpoint=5), InvalidTypeError, "endpoint"),
        ("endpoint-none", dict(endpoint=None), InvalidTypeError, "endpoint"),
        ("endpoint-garbage", dict(endpoint="garbage"), InvalidInputError, "endpoint"),
        ("endpoint-udp", dict(endpoint="udp://*:5557"), InvalidInputError, "endpoint"),
        ("endpoint-no-port", dict(endpoint="tcp://127.0.0.1"), InvalidInputError, "endpoint"),
        ("endpoint-no-host", dict(endpoint="tcp://:5557"), InvalidInputError, "endpoint"),
        ("endpoint-port-99999", dict(endpoint="tcp://*:99999"), InvalidInputError, "endpoint"),
        ("endpoint-port-word", dict(endpoint="tcp://*:http"), InvalidInputError, "endpoint"),
        ("endpoint-port-negative", dict(endpoint="tcp://*:-1"), InvalidInputError, "endpoint"),
        ("endpoint-connect-port-0", dict(endpoint="tcp://127.0.0.1:0"), InvalidInputError, "endpoint"),
        ("endpoint-connect-port-65536", dict(endpoint="tcp://127.0.0.1:65536"), InvalidInputError, "endpoint"),
        ("endpoint-ipc-empty", dict(endpoint="ipc://"), InvalidInputError, "endpoint"),
        ("endpoint-ipc-too-long", dict(endpoint=f"{ipc}{'x' * 120}"), InvalidInputError, "endpoint"),
        ("endpoint-nul", dict(endpoint=f"{ipc}\0x"), InvalidInputError, "endpoint"),
        ("endpoint-surrogate", dict(endpoint=f"{ipc}\udc80"), InvalidInputError, "endpoint"),
        ("endpoint-space-host", dict(endpoint="tcp://a b:5557"), InvalidInputError, "endpoint"),
        ("replay-int", dict(endpoint=ipc, replay_endpoint=5), InvalidTypeError, "replay_endpoint"),
        ("replay-port-99999", dict(endpoint=ipc, replay_endpoint="tcp://127.0.0.1:99999"), InvalidInputError,
         "replay_endpoint"),
        ("replay-garbage", dict(endpoint=ipc, replay_endpoint="replay"), InvalidInputError, "replay_endpoint"),
        ("replay-not-here", dict(endpoint=ipc, replay_endpoint="tcp://192.0.2.1:5558"), AddressError,
         "replay_endpoint"),  # TEST-NET-1: an address no machine has
        ("replay-same-ipc", dict(endpoint=ipc, replay_endpoint=ipc), AddressInUseError, "replay_endpoint"),
        ("buffer-steps-2**40", dict(endpoint=ipc, buffer_steps=2**40), InvalidInputError, "buffer_steps"),
        ("buffer-steps-0", dict(endpoint=ipc, buffer_steps=0), InvalidInputError, "buffer_steps"),
        ("buffer-steps-bool", dict(endpoint=ipc, buffer_steps=True), InvalidTypeError, "buffer_steps"),
        ("buffer-steps-float", dict(endpoint=ipc, buffer_steps=10.0), InvalidTypeError, "buffer_steps"),
        ("hwm-2**31", dict(endpoint=ipc, hwm=2**31), InvalidInputError, "hwm"),
        ("hwm-0", dict(endpoint=ipc, hwm=0), InvalidInputError, "hwm"),
        ("queue-2**31", dict(endpoint=ipc, max_queue_size=2**31), InvalidInputError, "max_queue_size"),
        ("queue-str", dict(endpoint=ipc, max_queue_size="10"), InvalidTypeError, "max_queue_size"),
        ("topic-int", dict(endpoint=ipc, topic=5), InvalidTypeError, "topic"),
        ("topic-bytes", dict(endpoint=ipc, topic=b"kv"), InvalidTypeError, "topic"),
        ("topic-surrogate", dict(endpoint=ipc, topic="kv\udc80"), InvalidInputError, "topic"),
        ("dp-rank-negative", dict(endpoint=ipc, data_parallel_rank=-1), InvalidInputError, "data_parallel_rank"),
        ("dp-rank-bool", dict(endpoint=ipc, data_parallel_rank=True), InvalidTypeError, "data_parallel_rank"),
        ("dp-rank-str", dict(endpoint=ipc, data_parallel_rank="1"), InvalidTypeError, "data_parallel_rank"),
        ("dp-rank-past-port", dict(endpoint="tcp://*:65530", data_parallel_rank=10), InvalidInputError,
         "data_parallel_rank"),
        ("windows-int", dict(endpoint=ipc, sliding_windows=5), InvalidTypeError, "sliding_windows"),
        ("windows-str", dict(endpoint=ipc, sliding_windows="ab"), InvalidTypeError, "sliding_windows"),
        ("windows-zero", dict(endpoint=ipc, sliding_windows=[None, 0]), InvalidInputError, "sliding_windows[1]"),
        ("windows-float", dict(endpoint=ipc, sliding_windows=[4.0]), InvalidInputError, "sliding_windows[0]"),
        ("int-hashes-str", dict(endpoint=ipc, int_block_hashes="yes"), InvalidTypeError, "int_block_hashes"),
        ("medium-int", dict(endpoint=ipc, medium=5), InvalidTypeError, "medium"),
    ]


CONFIG_CASES = [
    ("enable-str", dict(enable_kv_cache_events="yes"), InvalidTypeError, "enable_kv_cache_events"),
    ("enable-int", dict(enable_kv_cache_events=1), InvalidTypeError, "enable_kv_cache_events"),
    ("publisher-kafka", dict(publisher="kafka"), InvalidInputError, "publisher"),
    ("publisher-int", dict(publisher=5), InvalidTypeError, "publisher"),
    ("endpoint-int", dict(endpoint=5), InvalidTypeError, "endpoint"),
    ("endpoint-garbage", dict(endpoint="garbage"), InvalidInputError, "endpoint"),
    ("replay-port-99999", dict(replay_endpoint="tcp://*:99999"), InvalidInputError, "replay_endpoint"),
    ("buffer-steps-2**40", dict(buffer_steps=2**40), InvalidInputError, "buffer_steps"),
    ("hwm-none", dict(hwm=None), InvalidTypeError, "hwm"),
    ("queue-negative", dict(max_queue_size=-1), InvalidInputError, "max_queue_size"),
    ("topic-int", dict(topic=5), InvalidTypeError, "topic"),
    ("topic-surrogate", dict(topic="\udc80"), InvalidInputError, "topic"),
]

JSON_CASES = [
    ("truncated", "{", InvalidInputError, "text"),
    ("empty", "", InvalidInputError, "text"),
    ("not-text", 5, InvalidTypeError, "text"),
    ("none", None, InvalidTypeError, "text"),
    ("array", "[1]", InvalidTypeError, "text"),
    ("string", '"zmq"', InvalidTypeError, "text"),
    ("deep", "[" * 100_000, InvalidInputError, "text"),
    ("bad-utf8-bytes", b'{"topic": "\xff"}', InvalidInputError, "text"),
    ("unknown-field", '{"port": 1}', InvalidInputError, "port"),
    ("topic-int", '{"topic": 5}', InvalidTypeError, "topic"),
    ("enable-str", '{"enable_kv_cache_events": "true"}', InvalidTypeError, "enable_kv_cache_events"),
    ("buffer-steps-float", '{"buffer_steps": 1e12}', InvalidTypeError, "buffer_steps"),
    ("hwm-null", '{"hwm": null}', InvalidTypeError, "hwm"),
    ("endpoint-port", '{"endpoint": "tcp://*:70000"}', InvalidInputError, "endpoint"),
    ("replay-int", '{"replay_endpoint": 5557}', InvalidTypeError, "replay_endpoint"),
    ("publisher-kafka", '{"publisher": "kafka"}', InvalidInputError, "publisher"),
]

MAKE_PUBLISHER_CASES = [
    ("config-str", ("zmq",), {}, InvalidTypeError, "config"),
    ("config-dict", ({"enable_kv_cache_events": True},), {}, InvalidTypeError, "config"),
    ("dp-rank-negative", (None,), dict(data_parallel_rank=-1), InvalidInputError, "data_parallel_rank"),
    ("unknown-option", (None,), dict(hash_key=b"k"), InvalidTypeError, "hash_key"),
]

SERVE_CASES = [
    ("port-70000", (70000,), InvalidInputError, "port"),
    ("port-negative", (-1,), InvalidInputError, "port"),
    ("port-bool", (True,), InvalidTypeError, "port"),
    ("port-str", ("8000",), InvalidTypeError, "port"),
    ("port-float", (8000.0,), InvalidTypeError, "port"),
    ("port-none", (None,), InvalidTypeError, "port"),
    ("addr-int", (0, 5), InvalidTypeError, "addr"),
    ("addr-empty", (0, ""), InvalidInputError, "addr"),
    ("addr-space", (0, "127.0.0.1 "), InvalidInputError, "addr"),
    ("addr-surrogate", (0, "\udc80"), InvalidInputError, "addr"),
    ("addr-not-here", (0, "192.0.2.1"), AddressError, "addr"),
]


def test_the_catalogues_are_large_enough(sockdir):
    tables = [PUBLISH_CASES, TIMEOUT_CASES, constructor_cases(sockdir), CONFIG_CASES, JSON_CASES,
              MAKE_PUBLISHER_CASES, SERVE_CASES, FROM_DICT_CASES]
    assert [len(t) for t in tables] == [25, 6, 42, 12, 16, 4, 11, 20]
    for table in tables:
        assert len({case[0] for case in table}) == len(table)


# ------------------------------------------------------- the publisher's calls

@pytest.mark.parametrize("_name, batches, exc, argument", PUBLISH_CASES, ids=[c[0] for c in PUBLISH_CASES])
def test_a_refused_publish_queues_nothing(live, _name, batches, exc, argument):
    before = live.state()
    with pytest.raises(exc) as info:
        live.pub.publish(batches)
    check_refusal(info, exc, argument)
    assert live.state() == before
    live.good_batch()


@pytest.mark.parametrize("method", ["flush", "close"])
@pytest.mark.parametrize("_name, timeout, exc", TIMEOUT_CASES, ids=[c[0] for c in TIMEOUT_CASES])
def test_a_refused_timeout_changes_nothing(live, method, _name, timeout, exc):
    before = live.state()
    with pytest.raises(exc) as info:
        getattr(live.pub, method)(timeout)
    check_refusal(info, exc, "timeout")
    assert live.state() == before
    live.good_batch()


def test_publish_from_refuses_what_is_not_a_manager(live):
    before = live.state()
    with pytest.raises(InvalidTypeError) as info:
        live.pub.publish_from(object())
    check_refusal(info, InvalidTypeError, "manager")
    assert str(info.value) == ("manager: has no take_events(), got object; pass a manager built with "
                               "enable_kv_cache_events=True")
    assert live.state() == before
    live.good_batch()


def test_the_null_publisher_refuses_the_same_batches():
    null = kv_events.NullEventPublisher()
    for _name, batches, exc, argument in PUBLISH_CASES:  # every case is decided before encoding
        with pytest.raises(exc) as info:
            null.publish(batches if not hasattr(batches, "__next__") else raising())
        check_refusal(info, exc, argument)
    null.publish([GOOD])


# ------------------------------------------------------ the constructor, config

@pytest.mark.parametrize("index", range(42))
def test_a_refused_constructor_leaves_nothing_open(sockdir, index):
    name, kwargs, exc, argument = constructor_cases(sockdir)[index]
    fds = open_fds()
    with pytest.raises(exc) as info:
        kv_events.ZmqEventPublisher(**kwargs)
    check_refusal(info, exc, argument)
    assert open_fds() == fds, f"{name}: a refused constructor left a file descriptor open"
    assert not listening(f"{sockdir}/ctor")  # nothing left bound
    publisher = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/ctor")  # the same path still works
    publisher.close()


def test_the_issue_cases_read_well(sockdir):
    """The messages of the issue's cases, word for word."""
    expected = {
        "endpoint-garbage": "endpoint: 'garbage' is not a tcp://, ipc:// or inproc:// endpoint; write "
                            "tcp://HOST:PORT (HOST * to bind every interface), ipc://PATH or inproc://NAME",
        "endpoint-int": "endpoint: must be a str, got int 5; write tcp://HOST:PORT (HOST * to bind every "
                        "interface), ipc://PATH or inproc://NAME",
        "topic-int": "topic: must be a str, got int 5; pass the topic as text ('' for every subscriber)",
        "topic-surrogate": "topic: is not UTF-8 text (surrogates not allowed at index 2); pass the topic as text "
                           "('' for every subscriber)",
        "replay-port-99999": "replay_endpoint: 'tcp://127.0.0.1:99999' has port '99999', not a number from 0 to "
                             "65535; use a TCP port from 1 to 65535 (0: any free one)",
        "buffer-steps-2**40": "buffer_steps: must be from 1 to 1073741822, got 1099511627776; pass a whole number "
                              "from 1 to 1073741822",
    }
    cases = {c[0]: c for c in constructor_cases(sockdir)}
    for name, message in expected.items():
        with pytest.raises(GpukvError) as info:
            kv_events.ZmqEventPublisher(**cases[name][1])
        assert str(info.value) == message


def test_ports_in_use_are_refused_with_a_hint(sockdir):
    holder, port = _occupied_tcp_port()
    try:
        for kwargs, argument in ((dict(endpoint=f"tcp://*:{port}"), "endpoint"),
                                 (dict(endpoint=f"ipc://{sockdir}/ctor", replay_endpoint=f"tcp://127.0.0.1:{port}"),
                                  "replay_endpoint")):
            fds = open_fds()
            with pytest.raises(AddressInUseError) as info:
                kv_events.ZmqEventPublisher(**kwargs)
            check_refusal(info, AddressInUseError, argument)
            assert "is in use (Address already in use)" in str(info.value)
            assert str(info.value).endswith("; use another port or path (port 0: any free one)")
            assert isinstance(info.value, OSError) and open_fds() == fds
    finally:
        holder.close()
    publisher = kv_events.ZmqEventPublisher(f"ipc://{sockdir}/ctor", f"tcp://127.0.0.1:{port}")  # freed: it binds
    assert publisher.replay_endpoint == f"tcp://127.0.0.1:{port}"
    publisher.close()


@pytest.mark.parametrize("_name, kwargs, exc, argument", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_a_config_is_checked_at_construction(_name, kwargs, exc, argument):
    with pytest.raises(exc) as info:
        kv_events.KVEventsConfig(**kwargs)
    check_refusal(info, exc, argument)


@pytest.mark.parametrize("_name, text, exc, argument", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_from_json_refuses_with_a_typed_error(_name, text, exc, argument):
    with pytest.raises(exc) as info:
        kv_events.KVEventsConfig.from_json(text)
    check_refusal(info, exc, argument)
    assert kv_events.KVEventsConfig.from_json('{"topic": "kv"}').topic == "kv"  # still reads a good one


def test_from_json_messages():
    with pytest.raises(InvalidInputError) as info:
        kv_events.KVEventsConfig.from_json("{")
    assert str(info.value) == ("text: is not JSON (Expecting property name enclosed in double quotes: line 1 "
                               "column 2 (char 1)); pass a JSON object such as {\"enable_kv_cache_events\": true, "
                               "\"endpoint\": \"tcp://*:5557\"}")
    with pytest.raises(InvalidTypeError) as info:
        kv_events.KVEventsConfig.from_json('{"topic": 5}')
    assert str(info.value) == "topic: must be a str, got int 5; pass the topic as text ('' for every subscriber)"


@pytest.mark.parametrize("_name, args, kwargs, exc, argument", MAKE_PUBLISHER_CASES,
                         ids=[c[0] for c in MAKE_PUBLISHER_CASES])
def test_make_publisher_refuses(_name, args, kwargs, exc, argument):
    with pytest.raises(exc) as info:
        kv_events.make_publisher(*args, **kwargs)
    check_refusal(info, exc, argument)


# ----------------------------------------------------------------- serve

@pytest.fixture(scope="module")
def metrics():
    return ServingMetrics()


def _observe(m: ServingMetrics) -> None:
    m.observe_step(PrefixCacheStats(requests=1, queries=8, hits=4), usage=0.5, blocks_in_use=1, running=1,
                   waiting=0, preemptions=0, evictions_total=0, step_seconds=1e-4)


@pytest.mark.parametrize("_name, args, exc, argument", SERVE_CASES, ids=[c[0] for c in SERVE_CASES])
def test_serve_refuses_with_a_typed_error(metrics, _name, args, exc, argument):
    before = metrics.value("vllm:prefix_cache_hits_total")
    with pytest.raises(exc) as info:
        metrics.serve(*args)
    check_refusal(info, exc, argument)
    _observe(metrics)  # still counts
    assert metrics.value("vllm:prefix_cache_hits_total") == before + 4


def test_serve_messages_and_a_port_in_use():
    m = ServingMetrics()
    with pytest.raises(InvalidInputError) as info:
        m.serve(70000)
    assert str(info.value) == "port: must be from 0 to 65535, got 70000; pass a TCP port from 1 to 65535, or 0 for " \
                              "any free one"
    holder, port = _occupied_tcp_port()
    try:
        with pytest.raises(AddressInUseError) as info:
            m.serve(port)
        assert str(info.value) == (f"port: 127.0.0.1:{port} is in use (Address already in use); pass another "
                                   "port, or 0 for any free one (serve returns it)")
        assert isinstance(info.value, OSError)  # what gpukv replay --metrics-port catches
    finally:
        holder.close()
    bound = m.serve(0)
    _observe(m)
    with urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics", timeout=10) as response:
        assert 'vllm:prefix_cache_hits_total{engine="0",model_name="gpukv"} 4.0' in response.read().decode()


# --------------------------------------------------------- reconciliation

FULL = FullAttentionSpec(16, 8, 128, torch.float16)


def _config() -> KVCacheConfig:
    specs = {"layers.0": FULL, "layers.1": SlidingWindowSpec(16, 8, 128, torch.float16, 64)}
    return get_kv_cache_config(specs, 10 * 2 * 65536, max_model_len=64)


FROM_DICT_CASES = [
    ("not-a-dict", lambda d: [d], InvalidTypeError),
    ("missing-num-blocks", lambda d: d.pop("num_blocks") and d, InvalidInputError),
    ("unknown-key", lambda d: d.update(extra=1) or d, InvalidInputError),
    ("num-blocks-str", lambda d: d.update(num_blocks="10") or d, InvalidTypeError),
    ("num-blocks-bool", lambda d: d.update(num_blocks=True) or d, InvalidTypeError),
    ("num-blocks-zero", lambda d: d.update(num_blocks=0) or d, InvalidInputError),
    ("tensors-str", lambda d: d.update(tensors="layers.0") or d, InvalidTypeError),
    ("tensors-dict", lambda d: d.update(tensors={"size": 1}) or d, InvalidTypeError),
    ("tensor-not-dict", lambda d: d.update(tensors=[5]) or d, InvalidTypeError),
    ("shared-by-str", lambda d: d["tensors"][0].update(shared_by="layers.0") or d, InvalidTypeError),
    ("tensor-unknown-key", lambda d: d["tensors"][0].update(offset=0) or d, InvalidInputError),
    ("layer-names-str", lambda d: d["kv_cache_groups"][0].update(layer_names="layers.0") or d, InvalidTypeError),
    ("groups-none", lambda d: d.update(kv_cache_groups=None) or d, InvalidTypeError),
    ("kind-list", lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(kind=["full_attention"]) or d,
     InvalidInputError),
    ("kind-unknown", lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(kind="mamba") or d,
     InvalidInputError),
    ("dtype-torch-attribute", lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(dtype="_dynamo") or d,
     InvalidInputError),
    ("dtype-int", lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(dtype=16) or d, InvalidTypeError),
    ("use-mla-str", lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(use_mla="no") or d, InvalidTypeError),
    ("window-on-full", lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].update(sliding_window=4) or d,
     InvalidInputError),
    ("window-missing", lambda d: d["kv_cache_groups"][1]["kv_cache_spec"].pop("sliding_window") and d,
     InvalidInputError),
]


@pytest.mark.parametrize("_name, mutate, exc", FROM_DICT_CASES, ids=[c[0] for c in FROM_DICT_CASES])
def test_from_dict_refuses_every_other_shape(_name, mutate, exc):
    config = _config()
    assert [g.kv_cache_spec.kind for g in config.kv_cache_groups] == ["full_attention", "sliding_window"]
    data = mutate(config.to_dict())
    kept = copy.deepcopy(data)
    with pytest.raises(exc) as info:
        KVCacheConfig.from_dict(data)
    check_refusal(info, exc, "data")
    assert data == kept  # the caller's dict is left as it was
    assert KVCacheConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("value", [None, 5, "config", {"num_blocks": 1}])
def test_reconcile_in_one_process_refuses_a_non_config(value):
    with pytest.raises(InvalidTypeError) as info:
        reconcile_kv_cache_config(value)
    check_refusal(info, InvalidTypeError, "config")
    config = _config()
    assert reconcile_kv_cache_config(config) is config


def test_the_new_errors_pickle_and_read_as_their_builtins():
    import pickle

    from gpukv.errors import PublisherClosedError

    for err, builtin in ((AddressInUseError("127.0.0.1:1 is in use", argument="port", fix="pass 0"), OSError),
                         (AddressError("cannot use 'tcp://x:1'", argument="endpoint", fix="use this host"), OSError),
                         (PublisherClosedError("the publisher is closed", fix="make a new one"), RuntimeError)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.argument == err.argument
        assert isinstance(back, builtin)
    assert AddressInUseError.__mro__[1:4] == (AddressError, GpukvInputError, GpukvError)


# ------------------------------------------ a manager's own hook
# The one caller code that runs inside a device manager's call is its
# ``graphs`` hook (``gpukv.device.graphs.DecodeGraphs``' launch, between the
# decode's stage and its launch). A call of the manager made from there
# once went through the call lock (the same thread) and ran mid-step: a
# decode staged over the running one's buffers and the device cached a
# block under tokens its KV was not computed for. Each is refused now with
# a ``ConcurrentCallError`` naming the call; the decode goes on as if the
# hook had made none (its tokens, hashes and pool as the reference's).

HOOK_CASES = [
    ("decode", lambda m: m.decode([0], [9])),  # ("x"'s row: row_of would be refused first)
    ("step", lambda m: m.step(new=[gk_new("h", [3, 4])])),
    ("free", lambda m: m.free("x")),
    ("allocate_slots", lambda m: m.allocate_slots("x", [9])),
    ("get_computed_blocks", lambda m: m.get_computed_blocks(gk_new("h", [1, 2, 3]))),
    ("read_prefix_hit", lambda m: m.read_prefix_hit(gk_new("h", [1, 2, 3]))),
    ("admit", lambda m: m.admit(gk_new("h", [3, 4]))),
    ("reset_prefix_cache", lambda m: m.reset_prefix_cache()),
    ("make_prefix_cache_stats", lambda m: m.make_prefix_cache_stats()),
    ("take_events", lambda m: m.take_events()),
    ("prepare_admissions", lambda m: m.prepare_admissions(8)),
    ("read_num_free_blocks", lambda m: m.read_num_free_blocks()),
    ("get_block_ids", lambda m: m.get_block_ids("x")),
    ("row_token_counts", lambda m: m.row_token_counts([0])),
    ("check_invariants", lambda m: m.check_invariants()),
]


def gk_new(rid, tokens):
    from gpukv.core.requests import NewRequest

    return NewRequest(rid, tokens)


class _CallingHook:
    """A ``graphs`` hook that makes one call of the manager, then launches."""

    def __init__(self, m, call) -> None:
        self.m, self.call, self.info = m, call, None

    def run(self, _key, launch) -> None:
        with pytest.raises(GpukvError) as self.info:
            self.call(self.m)
        launch()


@pytest.fixture(scope="module")
def hooked():
    from gpukv.device.manager import DeviceManager
    from gpukv.reference.manager import ReferenceManager

    key = bytes(range(16))
    ref = ReferenceManager(32, 2, hash_key=key, max_model_len=64)
    dev = DeviceManager(32, 2, hash_key=key, max_model_len=64, max_num_reqs=4)
    for m in (ref, dev):
        assert m.step(new=[gk_new("x", [1, 2, 3, 4, 5])]).rows == [0]
    return ref, dev


def test_the_hook_catalogue_names_every_mutating_call():
    from gpukv.device.manager import DeviceManager

    mutating = {n for n in dir(DeviceManager) if getattr(getattr(DeviceManager, n), "mutates", False)}
    assert mutating <= {c[0] for c in HOOK_CASES}
    assert len({c[0] for c in HOOK_CASES}) == len(HOOK_CASES) == 15


@pytest.mark.parametrize("name, call", HOOK_CASES, ids=[c[0] for c in HOOK_CASES])
def test_a_call_from_the_managers_own_hook_is_refused(hooked, name, call):
    from gpukv.errors import ConcurrentCallError

    ref, dev = hooked
    token = 10 + len(ref.get_block_ids("x")[0])  # (a new token each case)
    ref.decode([ref.row_of("x")], [token])
    hook = _CallingHook(dev, call)
    assert dev.decode([dev.row_of("x")], [token], graphs=hook).ok
    check_refusal(hook.info, ConcurrentCallError, name)
    assert "comes from the hook it runs" in str(hook.info.value)
    assert not dev.failed
    assert dev.get_block_ids("x") == ref.get_block_ids("x")
    assert dev.block_hashes("x") == ref.block_hashes("x")
    assert dev.free_queue() == ref.free_queue()
    dev.check_invariants()
