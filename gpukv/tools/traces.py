"""Workloads the replay runs: Mooncake JSONL traces and step traces (JSON).

A Mooncake request's prompt is the concatenation of its ``hash_ids`` blocks of
512 tokens, cut to ``input_length``; block ``h`` holds the tokens
``h * 512 + k`` (``k < 512``), so equal ids give equal tokens and different ids
different ones. Prompt tokens stay below ``2**31`` (generated tokens live
above), so a hash id is at most ``MAX_HASH_ID`` = 4194303; a larger one is
refused rather than wrapped onto another id's tokens. Its ``output_length``
generated tokens are distinct per request.

A step trace lists, step by step, what finishes, what decodes and what
arrives::

    {"config": {"block_size": 16, "num_blocks": 1024, "max_model_len": 4096},
     "steps": [{"finish": [ID, ...],
                "decode": [{"id": ID, "token_ids": [INT, ...]}, ...],
                "new": [{"id": ID, "token_ids": [INT, ...], "lora_id": INT, "cache_salt": STR,
                         "mm": [{"offset": INT, "length": INT, "hash": STR}], "skip_prefix_cache": BOOL}]}]}

Every field but ``steps`` and each request's ``id`` and ``token_ids`` is
optional. A malformed trace raises :class:`TraceError`, whose text is one line
``FILE:LINE: problem`` (for a step trace, the line where the offending JSON
object or array starts).

Either kind may be compressed: a file ending in ``.xz`` or ``.gz`` is read
through ``lzma`` or ``gzip`` (the whole Mooncake conversation trace ships as
``gpukv/data/mooncake_conversation_trace.jsonl.xz``, 0.2 MB for 3 MB), and its
format is judged by the name without that ending.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import io
import json
import json.decoder
import json.scanner
import lzma
import math
import re
import zlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from gpukv.core.hashing import MMItem

MOONCAKE_BLOCK_TOKENS = 512
# Generated tokens live above every prompt token id (ids below 2**31), and
# depend on the request, so two requests never share a generated block.
_OUTPUT_TOKEN_BASE = 2**31
#: The largest Mooncake hash id: block h holds tokens h*512 .. h*512+511, which
#: must stay below 2**31, where generated tokens start.
MAX_HASH_ID = _OUTPUT_TOKEN_BASE // MOONCAKE_BLOCK_TOKENS - 1
#: Token ids are hashed as uint32.
TOKEN_LIMIT = 2**32
#: Upper bound of the sizes a trace (or the command line) may set: block ids,
#: token positions and request rows are int32 on the device.
MAX_SIZE = 2**31 - 1
#: Request-id-like fields longer than this are refused (they end up in reports).
_MAX_ID_CHARS = 1000

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A malformed trace. ``str(e)`` is one line: ``path:line: problem``
    (``path: problem`` when no single line is to blame)."""

    def __init__(self, path: str | Path, line: int | None, problem: str) -> None:
        self.path, self.line = str(path), line
        self.problem = " ".join(str(problem).split())  # one line, whatever went in
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {self.problem}")


def _kind(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _show(value: Any) -> str:
    """A short rendering of a JSON value (containers: their kind only)."""
    if isinstance(value, (list, dict)):
        return _kind(value)
    if isinstance(value, int) and not isinstance(value, bool):
        digits = len(str(abs(value)))
        return str(value) if digits <= 40 else f"an integer of {digits} digits"
    text = json.dumps(value) if isinstance(value, (str, bool)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _got(value: Any) -> str:
    """``"an integer 5"``, ``"a string \"x\""``, ``"an array"``, ``"null"``."""
    if value is None or isinstance(value, (list, dict)):
        return _kind(value)
    shown = _show(value)
    return shown if shown.startswith("an integer of") else f"{_kind(value)} {shown}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        assert self.hash_ids is not None, "a TraceRequest has a prompt or hash_ids"
        return mooncake_tokens(self.hash_ids, self.input_length)

    def output_tokens(self, start: int, stop: int) -> np.ndarray:
        """Generated tokens ``start..stop-1`` (Mooncake requests)."""
        t = np.arange(start, stop, dtype=np.int64)
        return _OUTPUT_TOKEN_BASE + (self.index * 1_000_003 + t * 7919) % _OUTPUT_TOKEN_BASE


def mooncake_tokens(hash_ids: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` tokens of the blocks ``hash_ids``."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_HASH_ID):
        raise ValueError(f"hash ids must be in [0, {MAX_HASH_ID}]: block h holds tokens h*512+k, "
                         "which must stay below 2**31")
    pos = np.arange(length, dtype=np.int64)
    return ids[pos // MOONCAKE_BLOCK_TOKENS] * MOONCAKE_BLOCK_TOKENS + pos % MOONCAKE_BLOCK_TOKENS


@dataclass
class TraceStep:
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
    steps: list[TraceStep] | None = None

    @property
    def num_requests(self) -> int:
        if self.steps is not None:
            return sum(len(s.new) for s in self.steps)
        return len(self.requests)


def builtin_trace_path() -> Path:
    """The workload shipped in the package: the first requests of the Mooncake
    conversation trace (see ``gpukv/data/README.md`` for its origin)."""
    return Path(str(resources.files("gpukv") / "data" / "mooncake_conversation_slice.jsonl"))


def conversation_trace_path() -> Path:
    """The whole Mooncake conversation trace (12,031 requests), xz-compressed:
    what ``docs/chunked_prefill.md`` measures (``gpukv/data/README.md``)."""
    return Path(str(resources.files("gpukv") / "data" / "mooncake_conversation_trace.jsonl.xz"))


# The endings of compressed traces, read through lzma and gzip.
_COMPRESSED = (".xz", ".gz")
#: What reading a damaged compressed trace raises: lzma's and gzip's own
#: errors, EOFError for a cut-off stream, and zlib's for a corrupted deflate
#: stream inside a gzip file (which gzip lets through as it is).
DECOMPRESS_ERRORS = (lzma.LZMAError, gzip.BadGzipFile, EOFError, zlib.error)


def trace_suffix(path: str | Path) -> str:
    """The extension that tells a trace's format: ``.jsonl`` for both
    ``t.jsonl`` and ``t.jsonl.xz`` (a compression ending is looked through)."""
    path = Path(path)
    if path.suffix.lower() in _COMPRESSED:
        path = path.with_suffix("")
    return path.suffix


def open_trace(path: str | Path) -> io.BufferedIOBase:
    """``path`` opened for reading bytes (the caller closes it), decompressed
    if it ends in ``.xz`` or ``.gz``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".xz":
        return lzma.open(path, "rb")  # noqa: SIM115
    if suffix == ".gz":
        return gzip.open(path, "rb")  # noqa: SIM115
    return open(path, "rb")  # noqa: SIM115


def _read_problem(e: Exception) -> str:
    """What went wrong decompressing a trace, in words."""
    name = "zlib.error" if isinstance(e, zlib.error) else type(e).__name__  # zlib's is plain "error"
    return f"cannot decompress it ({name}: {e}): a damaged or truncated compressed file"


def load_trace(path: str | Path, fmt: str = "auto", *, max_requests: int | None = None,
               arrival: str = "back-to-back", step_ms: float = 100.0) -> Trace:
    """Load a trace file; ``fmt`` 'auto' takes ``.jsonl`` (also ``.jsonl.xz``,
    ``.jsonl.gz``) as Mooncake, anything else as a step trace. Raises
    :class:`TraceError` for a malformed trace (empty ones and damaged
    compressed files included) and ``OSError`` for a file that cannot be read."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "no such file", str(path))
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory, not a trace file", str(path))
    if fmt == "auto":
        fmt = "mooncake" if trace_suffix(path) == ".jsonl" else "step"
    if fmt == "mooncake":
        return load_mooncake(path, max_requests=max_requests, arrival=arrival, step_ms=step_ms)
    if fmt == "step":
        return load_step_trace(path, max_requests=max_requests)
    raise ValueError(f"unknown trace format {fmt!r}: use 'mooncake' or 'step'")


def _check_limit(max_requests: int | None) -> None:
    if max_requests is not None and (not _is_int(max_requests) or max_requests <= 0):
        raise ValueError(f"max_requests must be a positive int, got {max_requests!r}")


# --------------------------------------------------------------------------
# Mooncake JSONL
# --------------------------------------------------------------------------


def _json_problem(e: Exception) -> str:
    if isinstance(e, RecursionError):
        return "JSON nested too deeply"
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON: {e.msg} (column {e.colno})"
    return f"not JSON: {e}"  # e.g. an integer literal of more than 4300 digits


def mooncake_record(rec: Any, path: str | Path, line: int) -> tuple[float, int, int, np.ndarray]:
    """Check one decoded Mooncake record: ``(timestamp, input_length,
    output_length, hash_ids)``, or :class:`TraceError` naming ``path:line``."""

    def bad(problem: str):
        return TraceError(path, line, problem)

    if not isinstance(rec, dict):
        raise bad(f"expected a JSON object (a Mooncake record), got {_kind(rec)}")
    missing = [k for k in MOONCAKE_FIELDS if k not in rec]
    if missing:
        raise bad(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
                  f"(a Mooncake record has {', '.join(MOONCAKE_FIELDS)})")
    ts = rec["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise bad(f"field 'timestamp' must be a number (milliseconds), got {_got(ts)}")
    if _is_int(ts) and abs(ts) > 2**1000:
        raise bad(f"field 'timestamp' is {_show(ts)}, too large")
    if not math.isfinite(ts):
        raise bad(f"field 'timestamp' must be finite, got {_show(ts)}")
    if ts < 0:
        raise bad(f"field 'timestamp' must be >= 0 (milliseconds), got {_show(ts)}")
    lengths = []
    for name, minimum in (("input_length", 1), ("output_length", 0)):
        v = rec[name]
        if not _is_int(v):
            raise bad(f"field {name!r} must be an integer, got {_got(v)}")
        if v < minimum:
            raise bad(f"field {name!r} must be >= {minimum}, got {_show(v)}")
        if v > MAX_SIZE:
            raise bad(f"field {name!r} is {_show(v)}, more than {MAX_SIZE} tokens")
        lengths.append(v)
    n_in, n_out = lengths
    ids = rec["hash_ids"]
    if not isinstance(ids, list):
        raise bad(f"field 'hash_ids' must be an array of integers, got {_got(ids)}")
    for i, h in enumerate(ids):
        if not _is_int(h):
            raise bad(f"hash_ids[{i}] must be an integer, got {_got(h)}")
        if not 0 <= h <= MAX_HASH_ID:
            raise bad(f"hash_ids[{i}] is {_show(h)}, outside [0, {MAX_HASH_ID}]: block h holds tokens "
                      f"h*{MOONCAKE_BLOCK_TOKENS}+k, which must stay below 2**31 (generated tokens start there)")
    if n_in > len(ids) * MOONCAKE_BLOCK_TOKENS:
        raise bad(f"input_length {n_in} does not fit {len(ids)} hash_ids of {MOONCAKE_BLOCK_TOKENS} tokens")
    return float(ts), n_in, n_out, np.asarray(ids, dtype=np.int64)


def load_mooncake(path: Path, *, max_requests: int | None = None, arrival: str = "back-to-back",
                  step_ms: float = 100.0) -> Trace:
    """Mooncake JSONL. ``arrival``: 'back-to-back' (all wait from step 0, in
    order) or 'timestamp' (request arrives at step ``timestamp // step_ms``)."""
    if arrival not in ("back-to-back", "timestamp"):
        raise ValueError(f"arrival must be 'back-to-back' or 'timestamp', got {arrival!r}")
    if isinstance(step_ms, bool) or not isinstance(step_ms, (int, float)) or not (0 < step_ms < math.inf):
        raise ValueError(f"step_ms must be a positive finite number, got {step_ms!r}")
    _check_limit(max_requests)
    requests: list[TraceRequest] = []
    lineno = 0
    try:
        with open_trace(path) as f:
            for lineno, raw in enumerate(f, 1):
                if max_requests is not None and len(requests) >= max_requests:
                    break
                rec = _json_line(raw, path, lineno)
                if rec is _BLANK:
                    continue
                ts, n_in, n_out, ids = mooncake_record(rec, path, lineno)
                step = 0 if arrival == "back-to-back" else int(ts // step_ms)
                idx = len(requests)
                requests.append(TraceRequest(f"r{idx}", step, n_in, hash_ids=ids, output_length=n_out, index=idx))
    except DECOMPRESS_ERRORS as e:
        # The line after the last one read is where the damage starts.
        raise TraceError(path, lineno + 1, _read_problem(e)) from None
    if not requests:
        raise TraceError(path, None, "empty trace: no Mooncake records")
    if arrival == "timestamp":
        requests.sort(key=lambda r: r.arrival_step)  # stable: file order within a step
    return Trace("mooncake", requests=requests)


_BLANK = object()  # what _json_line returns for a line of white space


def _json_line(raw: bytes, path: Path, lineno: int) -> Any:
    """One line of a JSON Lines file, decoded (``_BLANK`` for white space
    alone), or a TraceError naming it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(path, lineno, f"not UTF-8 text (byte {e.start + 1} of the line)") from None
    if not text.strip():
        return _BLANK
    try:
        # Without its line ending: a line cut short is reported where it
        # stops, not at column 1 of the next line.
        return json.loads(text.rstrip("\r\n"))
    except (ValueError, RecursionError) as e:
        raise TraceError(path, lineno, _json_problem(e)) from None


# --------------------------------------------------------------------------
# Step traces
# --------------------------------------------------------------------------


class _LocatedDict(dict):
    """A JSON object that knows its line (``line``) and each member's (``lines[key]``)."""

    __slots__ = ("line", "lines")
    line: int
    lines: dict[Any, int]


class _LocatedList(list):
    """A JSON array that knows its line (``line``) and each element's (``lines[i]``)."""

    __slots__ = ("line", "lines")
    line: int
    lines: list[int]


def _loads_located(text: str):
    """``json.loads`` whose objects and arrays know the lines they and their
    members start on. Pure-Python scanning: used only to place an error."""
    newlines = [m.start() for m in re.finditer("\n", text)]

    def line_of(pos: int) -> int:
        return bisect.bisect_left(newlines, pos) + 1

    def recording(scan_once, starts):
        def scan(s, idx):
            starts.append(idx)
            return scan_once(s, idx)
        return scan

    # The scanner calls these as it calls json.decoder's JSONObject and JSONArray.
    def parse_object(s_and_end, strict, scan_once, _object_hook, _object_pairs_hook, memo=None):
        starts: list[int] = []
        # JSONObject, JSONArray and py_make_scanner: CPython's pure-Python scanner, not in typeshed.
        pairs, end = json.decoder.JSONObject(s_and_end, strict, recording(scan_once, starts), None,  # type: ignore[attr-defined]
                                             lambda p: p, memo)
        out = _LocatedDict(pairs)
        out.line = line_of(s_and_end[1] - 1)
        # Values are scanned in member order (an empty object scans none).
        out.lines = ({k: line_of(at) for (k, _), at in zip(pairs, starts, strict=True)}
                     if isinstance(pairs, list) else {})
        return out, end

    def parse_array(s_and_end, scan_once):
        starts: list[int] = []
        values, end = json.decoder.JSONArray(s_and_end, recording(scan_once, starts))  # type: ignore[attr-defined]
        out = _LocatedList(values)
        out.line = line_of(s_and_end[1] - 1)
        out.lines = [line_of(at) for at in starts[: len(values)]]
        return out, end

    decoder: Any = json.JSONDecoder()  # its scanner hooks are not in typeshed
    decoder.parse_object = parse_object
    decoder.parse_array = parse_array
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder.decode(text)


def _line_of_problem(text: str, e: Exception) -> int | None:
    """The line to blame for a document ``json.loads`` refused."""
    if isinstance(e, json.JSONDecodeError):
        return e.lineno
    if isinstance(e, RecursionError):
        # The first bracket nested deeper than any sane trace (strings blanked first).
        depth = 0
        flat = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        for m in re.finditer(r"[\[\]{}]", flat):
            depth += 1 if m.group() in "[{" else -1
            if depth > 100:
                return flat.count("\n", 0, m.start()) + 1
        return None
    big = re.search(r"\d{4000,}", text)  # an integer literal Python will not convert
    return text.count("\n", 0, big.start()) + 1 if big else None


def load_step_trace(path: Path, *, max_requests: int | None = None) -> Trace:
    try:
        with open_trace(path) as f:
            data = f.read()
    except DECOMPRESS_ERRORS as e:
        raise TraceError(path, None, _read_problem(e)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(path, data.count(b"\n", 0, e.start) + 1, "not UTF-8 text") from None
    if not text.strip():
        raise TraceError(path, None, "empty trace: the file holds no JSON")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TraceError(path, _line_of_problem(text, e), _json_problem(e)) from None
    try:
        trace = parse_step_trace(doc, where=str(path), max_requests=max_requests)
    except TraceError as first:
        # Parse again, keeping where each object starts, to name the line.
        try:
            located = _loads_located(text)
        except (ValueError, RecursionError):
            raise first from None
        parse_step_trace(located, where=str(path), max_requests=max_requests)
        raise first from None  # not reached: the same document fails the same way
    if trace.num_requests == 0:
        raise TraceError(path, None, "empty trace: no step brings a new request")
    return trace


class _Where:
    """Builds TraceErrors for one file. For a document from
    :func:`_loads_located` the line is the offending member's (``key``: a
    field name or an array index), else the line its object starts on."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, node: Any, context: str, problem: str, key: Any = None) -> TraceError:
        line = getattr(node, "line", None)
        lines = getattr(node, "lines", None)
        if key is not None and lines is not None:
            with contextlib.suppress(KeyError, IndexError, TypeError):
                line = lines[key]
        return TraceError(self.path, line, f"{context}: {problem}" if context else problem)


_STEP_KEYS = ("finish", "decode", "new")
_NEW_KEYS = ("id", "token_ids", "mm", "lora_id", "cache_salt", "skip_prefix_cache")
_CONFIG_KEYS = {"block_size": 1, "num_blocks": 2, "max_model_len": 1}  # name: minimum


def _check_keys(w: _Where, obj: dict, allowed, context: str) -> None:
    for k in obj:
        if k not in allowed:
            raise w.error(obj, context, f"unknown field {_show(k)} (expected {', '.join(allowed)})", key=k)


def _get(w: _Where, obj: dict, name: str, kinds: tuple, what: str, context: str, default: Any = ...):
    if name not in obj:
        if default is ...:
            raise w.error(obj, context, f"missing field {name!r}")
        return default
    value = obj[name]
    if value is None and default is None:
        return None
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise w.error(obj, context, f"field {name!r} must be {what}, got {_got(value)}", key=name)
    return value


def _request_id(w: _Where, node: Any, key: Any, value: Any, context: str) -> str:
    """``value`` (``node[key]``) as a request id."""
    if not (isinstance(value, str) or _is_int(value)):
        raise w.error(node, context, f"a request id must be a string or an integer, got {_got(value)}", key=key)
    rid = str(value)
    if not rid or len(rid) > _MAX_ID_CHARS:
        raise w.error(node, context, f"a request id must have 1 to {_MAX_ID_CHARS} characters", key=key)
    return rid


def _utf8(w: _Where, node: Any, key: str, value: str, context: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise w.error(node, context, f"{key} is not valid Unicode (a lone surrogate escape?)", key=key) from None
    return value


def _tokens(w: _Where, obj: dict, context: str) -> np.ndarray:
    """``obj["token_ids"]``: a non-empty array of ids in [0, 2**32)."""
    value = _get(w, obj, "token_ids", (list,), "an array of integers", context)
    for i, t in enumerate(value):
        if type(t) is not int:
            raise w.error(value, context, f"token id at position {i} is {_got(t)}; token ids must be integers", key=i)
        if not 0 <= t < TOKEN_LIMIT:
            raise w.error(value, context, f"token id at position {i} is {_show(t)}, outside [0, 2**32)", key=i)
    if not value:
        raise w.error(obj, context, "no tokens", key="token_ids")
    return np.asarray(value, dtype=np.int64)


def _mm_items(w: _Where, r: dict, num_tokens: int, context: str) -> tuple[MMItem, ...]:
    items = _get(w, r, "mm", (list,), "an array of objects", context, default=[])
    out = []
    for i, item in enumerate(items):
        at = f"{context} mm[{i}]"
        if not isinstance(item, dict):
            raise w.error(items, at, f"expected an object with offset, length, hash; got {_kind(item)}", key=i)
        _check_keys(w, item, ("offset", "length", "hash"), at)
        off = _get(w, item, "offset", (int,), "an integer", at)
        n = _get(w, item, "length", (int,), "an integer", at)
        h = _utf8(w, item, "hash", str(_get(w, item, "hash", (str, int), "a string or an integer", at)), at)
        if off < 0 or n < 1 or off + n > num_tokens:
            raise w.error(item, at, f"item at offset {_show(off)} of length {_show(n)} must have offset >= 0, "
                          f"length >= 1 and lie inside the prompt of {num_tokens} tokens", key="offset")
        if not h:
            raise w.error(item, at, "the hash must not be empty", key="hash")
        out.append((MMItem(off, n, h), i))
    out.sort(key=lambda p: p[0].offset)
    for (a, _), (b, j) in zip(out, out[1:], strict=False):
        if b.offset < a.offset + a.length:
            raise w.error(items, f"{context} mm[{j}]", f"items at offsets {a.offset} and {b.offset} overlap", key=j)
    return tuple(m for m, _ in out)


def parse_step_trace(doc: Any, *, where: str = "step trace", max_requests: int | None = None) -> Trace:
    """Check and convert a decoded step trace; :class:`TraceError` names
    ``where`` (and, for a document from :func:`_loads_located`, the line)."""
    _check_limit(max_requests)
    w = _Where(where)
    if not isinstance(doc, dict):
        raise w.error(doc, "", f"expected a JSON object with 'config' and 'steps', got {_kind(doc)}")
    _check_keys(w, doc, ("config", "steps"), "")
    config = _step_config(w, doc)
    steps = []
    known: set[str] = set()
    step_list = _get(w, doc, "steps", (list,), "an array", "")
    for s, raw in enumerate(step_list):
        at = f"step {s}"
        if not isinstance(raw, dict):
            raise w.error(step_list, at, f"expected an object, got {_kind(raw)}", key=s)
        _check_keys(w, raw, _STEP_KEYS, at)
        steps.append(TraceStep(finish=_step_finish(w, raw, at), decode=_step_decode(w, raw, at),
                          new=_step_new(w, raw, s, known, max_requests)))
    return Trace("step", config=config, steps=steps)


def _step_config(w: _Where, doc: dict) -> dict:
    """The sizes the trace's ``config`` sets, each checked against its minimum and MAX_SIZE."""
    cfg = _get(w, doc, "config", (dict,), "an object", "", default={})
    _check_keys(w, cfg, tuple(_CONFIG_KEYS), "config")
    config = {}
    for key, minimum in _CONFIG_KEYS.items():
        if key in cfg:
            v = _get(w, cfg, key, (int,), "an integer", "config")
            if v <= 0:
                raise w.error(cfg, "config", f"{key} must be positive, got {_show(v)}", key=key)
            if v < minimum:
                raise w.error(cfg, "config", f"{key} must be >= {minimum} (block 0 is the null block), got {v}",
                              key=key)
            if v > MAX_SIZE:
                raise w.error(cfg, "config", f"{key} must be at most {MAX_SIZE}, got {_show(v)}", key=key)
            config[key] = v
    return config


def _step_finish(w: _Where, raw: dict, at: str) -> list[str]:
    """The ids a step finishes."""
    finish = _get(w, raw, "finish", (list,), "an array of request ids", at, default=[])
    return [_request_id(w, finish, i, x, f"{at} finish") for i, x in enumerate(finish)]


def _step_decode(w: _Where, raw: dict, at: str) -> dict[str, np.ndarray]:
    """The tokens each request a step decodes brings, by id (one entry per id)."""
    decode: dict[str, np.ndarray] = {}
    decodes = _get(w, raw, "decode", (list,), "an array of objects", at, default=[])
    for i, d in enumerate(decodes):
        if not isinstance(d, dict):
            raise w.error(decodes, f"{at} decode", f"expected an object with 'id' and 'token_ids', got {_kind(d)}",
                          key=i)
        _check_keys(w, d, ("id", "token_ids"), f"{at} decode")
        rid = _request_id(w, d, "id", _get(w, d, "id", (str, int), "a string or an integer", f"{at} decode"),
                          f"{at} decode")
        dat = f"{at} decode {rid!r}"
        if rid in decode:
            raise w.error(d, dat, "decoded twice in one step", key="id")
        decode[rid] = _tokens(w, d, dat)
    return decode


def _step_new(w: _Where, raw: dict, s: int, known: set[str], max_requests: int | None) -> list[TraceRequest]:
    """Step ``s``'s new requests. ``known`` holds the ids of those taken so far
    (one each, added to here); past ``max_requests`` of them only ids are checked."""
    at = f"step {s}"
    new = []
    news = _get(w, raw, "new", (list,), "an array of objects", at, default=[])
    for i, r in enumerate(news):
        if not isinstance(r, dict):
            raise w.error(news, f"{at} new", f"expected an object with 'id' and 'token_ids', got {_kind(r)}", key=i)
        rid = _request_id(w, r, "id", _get(w, r, "id", (str, int), "a string or an integer", f"{at} new"),
                          f"{at} new")
        if max_requests is not None and len(known) >= max_requests:
            continue
        rat = f"{at} new request {rid!r}"
        _check_keys(w, r, _NEW_KEYS, rat)
        if rid in known:
            raise w.error(r, rat, "request id used twice", key="id")
        new.append(_new_request(w, r, rid, s, len(known), rat))
        known.add(rid)
    return new


def _new_request(w: _Where, r: dict, rid: str, s: int, index: int, rat: str) -> TraceRequest:
    """Request ``rid``, arriving at step ``s``, the trace's ``index``-th: its tokens and optional fields."""
    tokens = _tokens(w, r, rat)
    mm = _mm_items(w, r, tokens.size, rat)
    lora = _get(w, r, "lora_id", (int,), "an integer", rat, default=None)
    if lora is not None and not 0 <= lora < 2**64:
        raise w.error(r, rat, f"lora_id must be in [0, 2**64), got {_show(lora)}", key="lora_id")
    salt = _get(w, r, "cache_salt", (str,), "a string", rat, default=None)
    if salt is not None:
        _utf8(w, r, "cache_salt", salt, rat)
    skip = _get(w, r, "skip_prefix_cache", (bool,), "true or false", rat, default=False)
    return TraceRequest(
        rid, s, int(tokens.size), prompt=tokens, index=index, lora_id=lora, mm_items=mm,
        cache_salt=salt, skip_prefix_cache=skip,
    )
