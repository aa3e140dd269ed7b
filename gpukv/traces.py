"""Workloads the replay runs: Mooncake JSONL traces and step traces (JSON).

A Mooncake request's prompt is the concatenation of its ``hash_ids`` blocks of
512 tokens, cut to ``input_length``; block ``h`` holds the tokens
``h * 512 + k`` (``k < 512``), so equal ids give equal tokens and different ids
different ones. Its ``output_length`` generated tokens are distinct per
request. A step trace lists, step by step, what finishes, what decodes and what
arrives (``docs/design.md`` has the format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from gpukv.hashing import MMItem
from gpukv.request import check_token_ids

MOONCAKE_BLOCK_TOKENS = 512
# Generated tokens live above every prompt token id (ids below 2**31), and
# depend on the request, so two requests never share a generated block.
_OUTPUT_TOKEN_BASE = 2**31


@dataclass
class TraceRequest:
    """One request of a trace, as it arrives."""

    request_id: str
    arrival_step: int
    input_length: int
    prompt: np.ndarray | None = None  # explicit tokens (step traces)
    hash_ids: np.ndarray | None = None  # Mooncake: the prompt comes from these
    output_length: int | None = None  # Mooncake: tokens it generates
    index: int = 0
    lora_id: int | None = None
    mm_items: tuple[MMItem, ...] = ()
    cache_salt: str | None = None
    skip_prefix_cache: bool = False

    def prompt_tokens(self) -> np.ndarray:
        if self.prompt is not None:
            return self.prompt
        return mooncake_tokens(self.hash_ids, self.input_length)

    def output_tokens(self, start: int, stop: int) -> np.ndarray:
        """Generated tokens ``start..stop-1`` (Mooncake requests)."""
        t = np.arange(start, stop, dtype=np.int64)
        return _OUTPUT_TOKEN_BASE + (self.index * 1_000_003 + t * 7919) % _OUTPUT_TOKEN_BASE


def mooncake_tokens(hash_ids: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` tokens of the blocks ``hash_ids``."""
    pos = np.arange(length, dtype=np.int64)
    return np.asarray(hash_ids, dtype=np.int64)[pos // MOONCAKE_BLOCK_TOKENS] * MOONCAKE_BLOCK_TOKENS + pos % MOONCAKE_BLOCK_TOKENS


@dataclass
class Step:
    """One step of a step trace."""

    finish: list[str] = field(default_factory=list)
    decode: dict[str, np.ndarray] = field(default_factory=dict)
    new: list[TraceRequest] = field(default_factory=list)


@dataclass
class Trace:
    """A parsed workload. ``steps`` is set for step traces, ``requests`` for
    Mooncake ones (arrival steps set, decoding driven by the replay)."""

    kind: str
    config: dict[str, int] = field(default_factory=dict)
    requests: list[TraceRequest] = field(default_factory=list)
    steps: list[Step] | None = None

    @property
    def num_requests(self) -> int:
        if self.steps is not None:
            return sum(len(s.new) for s in self.steps)
        return len(self.requests)


def builtin_trace_path() -> Path:
    """The workload shipped in the package: the first requests of the Mooncake
    conversation trace (see ``gpukv/data/README.md`` for its origin)."""
    return Path(str(resources.files("gpukv") / "data" / "mooncake_conversation_slice.jsonl"))


def load_trace(path: str | Path, fmt: str = "auto", *, max_requests: int | None = None,
               arrival: str = "back-to-back", step_ms: float = 100.0) -> Trace:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    if fmt == "auto":
        fmt = "mooncake" if path.suffix == ".jsonl" else "step"
    if fmt == "mooncake":
        return load_mooncake(path, max_requests=max_requests, arrival=arrival, step_ms=step_ms)
    if fmt == "step":
        return load_step_trace(path, max_requests=max_requests)
    raise ValueError(f"unknown trace format {fmt!r}: use 'mooncake' or 'step'")


def load_mooncake(path: Path, *, max_requests: int | None = None, arrival: str = "back-to-back",
                  step_ms: float = 100.0) -> Trace:
    """Mooncake JSONL. ``arrival``: 'back-to-back' (all wait from step 0, in
    order) or 'timestamp' (request arrives at step ``timestamp // step_ms``)."""
    if arrival not in ("back-to-back", "timestamp"):
        raise ValueError(f"arrival must be 'back-to-back' or 'timestamp', got {arrival!r}")
    if step_ms <= 0:
        raise ValueError(f"step_ms must be positive, got {step_ms}")
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if max_requests is not None and len(requests) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = np.asarray(rec["hash_ids"], dtype=np.int64)
                n_in, n_out, ts = int(rec["input_length"]), int(rec["output_length"]), float(rec["timestamp"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake record ({e}); expected "
                                 "timestamp, input_length, output_length, hash_ids") from None
            if n_in <= 0 or n_out < 0 or n_in > len(ids) * MOONCAKE_BLOCK_TOKENS or (ids < 0).any():
                raise ValueError(f"{path}:{lineno}: input_length {n_in} does not fit {len(ids)} hash_ids "
                                 "of 512 tokens (or a length/id is negative)")
            step = 0 if arrival == "back-to-back" else int(ts // step_ms)
            idx = len(requests)
            requests.append(TraceRequest(f"r{idx}", step, n_in, hash_ids=ids, output_length=n_out, index=idx))
    if arrival == "timestamp":
        requests.sort(key=lambda r: r.arrival_step)  # stable: file order within a step
    return Trace("mooncake", requests=requests)


def _field(obj: dict, name: str, kind, where: str, default: Any = ...):
    if name not in obj:
        if default is ...:
            raise ValueError(f"{where}: missing field {name!r}")
        return default
    value = obj[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{where}: field {name!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def load_step_trace(path: Path, *, max_requests: int | None = None) -> Trace:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return parse_step_trace(doc, where=str(path), max_requests=max_requests)


def parse_step_trace(doc: dict, *, where: str = "step trace", max_requests: int | None = None) -> Trace:
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object with 'config' and 'steps'")
    cfg = _field(doc, "config", dict, where, default={})
    config = {}
    for key in ("block_size", "num_blocks", "max_model_len"):
        if key in cfg:
            config[key] = _field(cfg, key, int, f"{where}: config")
            if config[key] <= 0:
                raise ValueError(f"{where}: config.{key} must be positive, got {config[key]}")
    steps = []
    n_new = 0
    known: set[str] = set()
    for s, raw in enumerate(_field(doc, "steps", list, where)):
        at = f"{where}: step {s}"
        if not isinstance(raw, dict):
            raise ValueError(f"{at}: expected an object")
        step = Step()
        step.finish = [str(x) for x in _field(raw, "finish", list, at, default=[])]
        for d in _field(raw, "decode", list, at, default=[]):
            rid = str(_field(d, "id", (str, int), f"{at} decode"))
            step.decode[rid] = check_token_ids(_field(d, "token_ids", list, f"{at} decode {rid}"), f"{at} decode {rid}")
        for r in _field(raw, "new", list, at, default=[]):
            rid = str(_field(r, "id", (str, int), f"{at} new"))
            if max_requests is not None and n_new >= max_requests:
                continue
            rat = f"{at} new request {rid!r}"
            if rid in known:
                raise ValueError(f"{rat}: request id used twice")
            known.add(rid)
            tokens = check_token_ids(_field(r, "token_ids", list, rat), rat)
            if tokens.size == 0:
                raise ValueError(f"{rat}: no tokens")
            mm = []
            for item in _field(r, "mm", list, rat, default=[]):
                mm.append(MMItem(_field(item, "offset", int, rat), _field(item, "length", int, rat),
                                 str(_field(item, "hash", (str, int), rat))))
            lora = _field(r, "lora_id", int, rat, default=None) if r.get("lora_id") is not None else None
            salt = _field(r, "cache_salt", str, rat, default=None) if r.get("cache_salt") is not None else None
            step.new.append(TraceRequest(
                rid, s, int(tokens.size), prompt=tokens, index=n_new, lora_id=lora, mm_items=tuple(mm),
                cache_salt=salt, skip_prefix_cache=bool(_field(r, "skip_prefix_cache", bool, rat, default=False)),
            ))
            n_new += 1
        steps.append(step)
    return Trace("step", config=config, steps=steps)
