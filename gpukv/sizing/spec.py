"""KV-cache specs and configs: what one layer's cache looks like, and how a
whole model's cache is laid out in memory.

A *spec* describes one attention layer's cache: how many tokens a block holds,
the per-token shape, the dtype. From it follow the bytes of one block of that
layer (``page_size_bytes``), the most memory one request can need in that layer
(``max_memory_usage_bytes``) and a ``type_id`` that names the spec's kind for
grouping.

A *config* is what the host controller hands to the workers: ``num_blocks``
blocks in one shared pool, the raw byte tensors to allocate (a tensor may be
shared by several layers of different groups, each using it for its own
blocks), and the groups of layers that share one block table.

Everything here is an immutable value: frozen dataclasses, compared by value,
turned into plain JSON-able dicts and back (``to_dict`` / ``from_dict``) so
that ranks can compare configs and logs can record them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from gpukv.errors import GpukvInputError, InvalidInputError, InvalidTypeError

__all__ = [
    "KVCacheSpec",
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "KVCacheTensor",
    "KVCacheGroupSpec",
    "KVCacheConfig",
    "spec_from_dict",
]


def _require_positive_int(owner: str, name: str, value: Any) -> None:
    """Raise unless ``value`` is an int > 0 (bool is refused: True is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}; "
            f"pass a positive whole number"
        )
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value}")


def _require_non_negative_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0, got {value}")


def _dtype_to_str(dtype: torch.dtype) -> str:
    # str(torch.float16) is "torch.float16"; the short name round-trips through
    # getattr(torch, name) and reads well in JSON.
    return str(dtype).removeprefix("torch.")


def _dtype_from_str(name: Any) -> torch.dtype:
    if not isinstance(name, str):
        raise TypeError(f"dtype must be a string like 'float16', got {name!r}")
    # Looked up among torch's dtypes only: a name from a peer must not reach
    # getattr(torch, ...), whose lazy attributes import modules.
    dtypes = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}
    dtype = dtypes.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown torch dtype {name!r}; use a name like 'float16'")
    return dtype


def _require_keys(what: str, data: Any, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """``data`` is a dict with every key of ``keys``, and no key outside
    ``keys`` and ``optional`` (a stray key is a dict of another shape)."""
    if not isinstance(data, dict):
        raise TypeError(f"{what} must be a dict, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"{what} is missing key(s) {missing}; it has {sorted(map(repr, data))}")
    unknown = sorted(repr(k) for k in data if k not in keys and k not in optional)
    if unknown:
        raise ValueError(f"{what} has unknown key(s) {', '.join(unknown)}; its keys are "
                         f"{sorted(keys + optional)}")


def _as_list(what: str, value: Any) -> list[Any]:
    """A JSON array (a list; a tuple from Python) as a list; a str is refused,
    not read as a list of characters."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list, got {type(value).__name__}")
    return list(value)


_FROM_DICT_FIX = "pass what to_dict() returns (its JSON, parsed)"


@contextlib.contextmanager
def _typed_refusals() -> Iterator[None]:
    """The builtin TypeError / ValueError of a dict of the wrong shape as
    gpukv's typed errors (subclasses of the same builtins), naming ``data``."""
    try:
        yield
    except GpukvInputError:
        raise
    except TypeError as err:
        raise InvalidTypeError(str(err), argument="data", fix=_FROM_DICT_FIX) from err
    except ValueError as err:
        raise InvalidInputError(str(err), argument="data", fix=_FROM_DICT_FIX) from err


@dataclass(frozen=True)
class KVCacheSpec:
    """The cache format of one attention layer (abstract: use a subclass).

    Invariants (checked at construction): ``block_size``, ``num_kv_heads`` and
    ``head_size`` are positive ints; ``dtype`` is a ``torch.dtype``.

    ``use_mla`` (multi-head latent attention) stores one latent vector per
    token instead of a key and a value, so a block holds half the bytes.
    It is keyword-only so that a bare ``True`` is never read as a size.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    use_mla: bool = field(default=False, kw_only=True)

    # The tag written into ``to_dict()`` and read by ``spec_from_dict``.
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if type(self) is KVCacheSpec:
            raise TypeError(
                "KVCacheSpec is abstract; use FullAttentionSpec or SlidingWindowSpec"
            )
        for name in ("block_size", "num_kv_heads", "head_size"):
            _require_positive_int(owner, name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"{owner}.dtype must be a torch.dtype such as torch.float16, "
                f"got {type(self.dtype).__name__} {self.dtype!r}"
            )
        if not isinstance(self.use_mla, bool):
            raise TypeError(f"{owner}.use_mla must be a bool, got {self.use_mla!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: K and V (or one MLA latent) for
        ``block_size`` tokens."""
        coef = 1 if self.use_mla else 2
        return coef * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def type_id(self) -> str:
        """Equal for two specs exactly when their layers can share one group
        (one block table): same kind, block size, page size (and window)."""
        raise NotImplementedError

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        """The most bytes one request of ``max_model_len`` tokens can hold in
        this layer at once."""
        raise NotImplementedError

    def _check_lengths(self, max_model_len: int, max_num_batched_tokens: int | None) -> int:
        """Validate the length arguments; return max_num_batched_tokens with its
        default (max_model_len: a whole prompt scheduled in one step) applied."""
        _require_positive_int("max_memory_usage_bytes", "max_model_len", max_model_len)
        if max_num_batched_tokens is None:
            return max_model_len
        _require_positive_int(
            "max_memory_usage_bytes", "max_num_batched_tokens", max_num_batched_tokens
        )
        return max_num_batched_tokens

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict; ``spec_from_dict`` turns it back."""
        return {
            "kind": self.kind,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": _dtype_to_str(self.dtype),
            "use_mla": self.use_mla,
        }


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A layer that attends to every earlier token: a request keeps all its
    blocks, ``ceil(num_tokens / block_size)`` of them."""

    kind: ClassVar[str] = "full_attention"

    @property
    def type_id(self) -> str:
        # MLA gets its own suffix: a latent page and a K/V page of the same
        # size still have different layouts, so they never share a group spec.
        suffix = "_mla" if self.use_mla else ""
        return f"full_attention_{self.block_size}_{self.page_size_bytes}{suffix}"

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        self._check_lengths(max_model_len, max_num_batched_tokens)
        return math.ceil(max_model_len / self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A layer that attends to the last ``sliding_window`` tokens only; blocks
    wholly outside the window are given back (their table slots point at the
    null block).

    Invariant: ``sliding_window`` is a positive int; MLA is not supported with
    a sliding window (as in vLLM: no attention backend implements it).
    """

    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive_int(type(self).__name__, "sliding_window", self.sliding_window)
        if self.use_mla:
            raise ValueError(
                "SlidingWindowSpec does not support use_mla=True; "
                "describe an MLA layer with FullAttentionSpec(use_mla=True)"
            )

    @property
    def type_id(self) -> str:
        return (
            f"sliding_window_{self.sliding_window}_{self.block_size}_{self.page_size_bytes}"
        )

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        batched = self._check_lengths(max_model_len, max_num_batched_tokens)
        # While a chunk of `batched` tokens is computed, the cache must hold the
        # `sliding_window - 1` tokens before it plus the chunk itself, never more
        # than the whole request. The window start rarely falls on a block
        # boundary, so the span can straddle one block more: hence the +1.
        tokens = min(self.sliding_window - 1 + batched, max_model_len)
        return (math.ceil(tokens / self.block_size) + 1) * self.page_size_bytes

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["sliding_window"] = self.sliding_window
        return data


_SPEC_KINDS: dict[str, type[KVCacheSpec]] = {
    FullAttentionSpec.kind: FullAttentionSpec,
    SlidingWindowSpec.kind: SlidingWindowSpec,
}


def spec_from_dict(data: dict[str, Any]) -> KVCacheSpec:
    """The inverse of ``KVCacheSpec.to_dict``. A dict of another shape (a
    missing or unknown key, a value of the wrong type or range) raises
    ``InvalidTypeError`` / ``InvalidInputError`` (``argument`` ``"data"``)."""
    with _typed_refusals():
        return _spec_from_dict(data)


def _spec_from_dict(data: Any) -> KVCacheSpec:
    _require_keys(
        "a KV cache spec dict",
        data,
        ("kind", "block_size", "num_kv_heads", "head_size", "dtype"),
        optional=("use_mla", "sliding_window"),
    )
    kind = data["kind"]
    cls = _SPEC_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(
            f"unknown KV cache spec kind {kind!r}; expected one of {sorted(_SPEC_KINDS)}"
        )
    kwargs: dict[str, Any] = {
        "block_size": data["block_size"],
        "num_kv_heads": data["num_kv_heads"],
        "head_size": data["head_size"],
        "dtype": _dtype_from_str(data["dtype"]),
        "use_mla": data.get("use_mla", False),
    }
    if cls is SlidingWindowSpec:
        if "sliding_window" not in data:
            raise ValueError("a sliding window spec dict is missing key(s) ['sliding_window']")
        kwargs["sliding_window"] = data["sliding_window"]
    elif "sliding_window" in data:
        raise ValueError(f"a {kind} spec dict has no key 'sliding_window'")
    return cls(**kwargs)


def _require_names(owner: str, name: str, value: Any, *, allow_empty: bool) -> None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{owner}.{name} must be a list of layer names (str), got {value!r}")
    if not allow_empty and not value:
        raise ValueError(f"{owner}.{name} must name at least one layer")
    if len(set(value)) != len(value):
        raise ValueError(f"{owner}.{name} names a layer twice: {value}")


@dataclass(frozen=True)
class KVCacheTensor:
    """One raw byte buffer of ``size`` bytes. Every layer in ``shared_by`` uses
    it as its cache: layers of different groups can share a buffer because
    each group only touches the blocks its own block table points at, and all
    groups draw their block ids from one pool."""

    size: int
    shared_by: list[str]

    def __post_init__(self) -> None:
        _require_positive_int("KVCacheTensor", "size", self.size)
        _require_names("KVCacheTensor", "shared_by", self.shared_by, allow_empty=False)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table: a request has the same block ids in
    every layer of the group. ``kv_cache_spec`` is the format of those layers."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        _require_names("KVCacheGroupSpec", "layer_names", self.layer_names, allow_empty=False)
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise TypeError(
                "KVCacheGroupSpec.kv_cache_spec must be a KVCacheSpec, "
                f"got {type(self.kv_cache_spec).__name__}"
            )


@dataclass(frozen=True)
class KVCacheConfig:
    """How the whole cache is laid out.

    Invariants: ``num_blocks`` is a positive int and is the size of the one
    block pool that all groups draw from (block 0 is the null block, so
    ``num_blocks - 1`` are allocatable); every tensor's size is a multiple of
    ``num_blocks`` (``page_size * num_blocks``); a layer is in at most one group.
    """

    num_blocks: int
    tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        _require_positive_int("KVCacheConfig", "num_blocks", self.num_blocks)
        if not isinstance(self.tensors, list) or not all(
            isinstance(t, KVCacheTensor) for t in self.tensors
        ):
            raise TypeError("KVCacheConfig.tensors must be a list of KVCacheTensor")
        if not isinstance(self.kv_cache_groups, list) or not all(
            isinstance(g, KVCacheGroupSpec) for g in self.kv_cache_groups
        ):
            raise TypeError("KVCacheConfig.kv_cache_groups must be a list of KVCacheGroupSpec")
        seen: set[str] = set()
        for group in self.kv_cache_groups:
            twice = seen.intersection(group.layer_names)
            if twice:
                raise ValueError(f"KVCacheConfig: layer(s) {sorted(twice)} are in two groups")
            seen.update(group.layer_names)
        for tensor in self.tensors:
            if tensor.size % self.num_blocks:
                raise ValueError(
                    f"KVCacheConfig: tensor of {tensor.size} bytes shared by "
                    f"{tensor.shared_by} is not a multiple of num_blocks={self.num_blocks}; "
                    "each tensor must be page_size * num_blocks bytes"
                )

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict (dtype as a name like "float16")."""
        return {
            "num_blocks": self.num_blocks,
            "tensors": [
                {"size": t.size, "shared_by": list(t.shared_by)} for t in self.tensors
            ],
            "kv_cache_groups": [
                {"layer_names": list(g.layer_names), "kv_cache_spec": g.kv_cache_spec.to_dict()}
                for g in self.kv_cache_groups
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheConfig:
        """The inverse of ``to_dict``; validates as the constructor does. A
        dict of another shape (a missing or unknown key, a str or a number
        where a list goes, a value of the wrong type or range) raises
        ``InvalidTypeError`` / ``InvalidInputError`` (``argument``
        ``"data"``); so does any value the constructors refuse."""
        with _typed_refusals():
            _require_keys("a KV cache config dict", data, ("num_blocks", "tensors", "kv_cache_groups"))
            tensors = []
            for t in _as_list("tensors", data["tensors"]):
                _require_keys("a KV cache tensor dict", t, ("size", "shared_by"))
                tensors.append(KVCacheTensor(size=t["size"], shared_by=_as_list("shared_by", t["shared_by"])))
            groups = []
            for g in _as_list("kv_cache_groups", data["kv_cache_groups"]):
                _require_keys("a KV cache group dict", g, ("layer_names", "kv_cache_spec"))
                groups.append(
                    KVCacheGroupSpec(
                        layer_names=_as_list("layer_names", g["layer_names"]),
                        kv_cache_spec=_spec_from_dict(g["kv_cache_spec"]),
                    )
                )
            return cls(num_blocks=data["num_blocks"], tensors=tensors, kv_cache_groups=groups)
