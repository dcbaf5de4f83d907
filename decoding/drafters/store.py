"""Model-generated store: n-gram continuations from the base's own answers (HD's
"model-dependent" database, SuffixDecoding's global tree), as compact numpy arrays in one
safetensors file that is memory-mapped, never read whole.

Layout. ``tokens`` (T,) int32 is every answer concatenated, each followed by -1. For each
position j whose token is a real continuation, ``keys`` holds the n tokens *before* j packed
most-recent-first into one uint64 (``bits`` per token, the all-ones digit marking "before the
answer's start"); ``keys`` is sorted and ``positions`` holds the matching j. The suffix of
length m ≤ n of a history then owns one contiguous key range (its m digits on top), found by
two binary searches: longest match first costs ≤ 2n ``searchsorted`` calls on a mapped
array. ``bigram_next``/``bigram_prob`` (V,) is the statistics table (:mod:`.sources.stats_source`) built from
the same tokens. The header (safetensors ``__metadata__``) records the format version, the
tokenizer identity (vocab size + SHA-256 of its vocab), n, the build date and the source.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ...core.atomic import atomic_file
from ...core.errors import DraftheadsError
from ..base.hardware import available_ram_bytes

FORMAT = "draftheads-lookup-store"
FORMAT_VERSION = 1
SEPARATOR = -1
_DTYPES = {"I32": np.int32, "U64": np.uint64, "F32": np.float32}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
FIX = "rebuild it with `draftheads store build --data <answers.jsonl> --out <store.safetensors>`"


class StoreError(DraftheadsError, ValueError):
    """A store file that cannot be used: wrong tokenizer, corrupt, empty, or too large."""


@dataclass(frozen=True)
class TokenizerIdentity:
    vocab_size: int
    vocab_sha256: str


def tokenizer_identity(tokenizer) -> TokenizerIdentity:
    """Vocab size + a hash of the token → id map (any object with ``get_vocab()``), so a store
    is only used with the tokenizer whose ids it holds."""
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
    return TokenizerIdentity(len(vocab), hashlib.sha256(blob).hexdigest())


@dataclass(frozen=True)
class StoreHeader:
    format_version: int
    vocab_size: int
    vocab_sha256: str
    n: int
    bits: int
    build_date: str
    source: str
    records: int
    tokens: int

    def to_metadata(self) -> dict[str, str]:
        return {"format": FORMAT} | {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_metadata(cls, meta: dict[str, str], path: Path) -> "StoreHeader":
        if not isinstance(meta, dict):
            raise StoreError(f"{path} has a damaged header (__metadata__ is a {type(meta).__name__}); {FIX}.")
        if meta.get("format") != FORMAT:
            raise StoreError(f"{path} is not a draftheads lookup store (format={meta.get('format')!r}); {FIX}.")
        try:
            return cls(int(meta["format_version"]), int(meta["vocab_size"]), meta["vocab_sha256"], int(meta["n"]),
                       int(meta["bits"]), meta["build_date"], meta["source"], int(meta["records"]), int(meta["tokens"]))
        except (KeyError, ValueError, TypeError) as err:
            raise StoreError(f"{path} has a damaged header ({err!r}); {FIX}.") from None


def key_bits(vocab_size: int) -> int:
    """Bits per packed token: enough for every id plus the all-ones "no token" digit."""
    return max(1, int(vocab_size).bit_length())


def pack_suffix(history: Sequence[int], m: int, bits: int) -> int:
    """The last m tokens, most recent in the top digit."""
    key = 0
    for k in range(1, m + 1):
        key = (key << bits) | int(history[-k])
    return key


def build_arrays(records: Sequence[Sequence[int]], vocab_size: int) -> dict[str, np.ndarray]:
    """All arrays of a store from token sequences (vectorised; ~1 s for 650k tokens)."""
    bits = key_bits(vocab_size)
    n = 64 // bits
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    if lengths.sum() == 0:
        raise StoreError("refusing to build an empty store: the data held no answer tokens (check `response_ids`).")
    tokens = np.full(int(lengths.sum()) + len(records), SEPARATOR, dtype=np.int64)
    ends = np.cumsum(lengths + 1) - 1  # separator slots
    starts = ends - lengths
    for s, r in zip(starts, records):
        tokens[s:s + len(r)] = r
    if tokens.size and (tokens.max() >= vocab_size or (tokens[tokens != SEPARATOR] < 0).any()):
        raise StoreError(f"token ids must lie in [0, {vocab_size}): the data was tokenized with another tokenizer.")
    none = (1 << bits) - 1
    digits = np.where(tokens == SEPARATOR, none, tokens).astype(np.uint64)
    j = np.flatnonzero(tokens != SEPARATOR)
    keys = np.zeros(j.size, dtype=np.uint64)
    for k in range(1, n + 1):
        prev = j - k
        d = np.where(prev >= 0, digits[np.maximum(prev, 0)], np.uint64(none))
        keys |= d.astype(np.uint64) << np.uint64(bits * (n - k))
    order = np.argsort(keys, kind="stable")
    nxt, prob = bigram_arrays(tokens, vocab_size)
    return {"tokens": tokens.astype(np.int32), "keys": keys[order], "positions": j[order].astype(np.int32),
            "bigram_next": nxt, "bigram_prob": prob}


def bigram_arrays(tokens: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(V,) most frequent next token per token (-1 if never followed) and its frequency."""
    a, b = tokens[:-1], tokens[1:]
    ok = (a != SEPARATOR) & (b != SEPARATOR)
    pairs, counts = np.unique(a[ok] * vocab_size + b[ok], return_counts=True)
    first, second = pairs // vocab_size, pairs % vocab_size
    # per first token: the pair with the highest count, ties to the smaller next id (pairs are sorted)
    order = np.lexsort((second, -counts, first))
    first, second, counts = first[order], second[order], counts[order]
    lead = np.r_[True, first[1:] != first[:-1]]
    totals = np.bincount(first, weights=counts, minlength=vocab_size)
    nxt = np.full(vocab_size, -1, dtype=np.int32)
    prob = np.zeros(vocab_size, dtype=np.float32)
    nxt[first[lead]] = second[lead]
    prob[first[lead]] = counts[lead] / totals[first[lead]]
    return nxt, prob


def save_store(path: str | Path, arrays: dict[str, np.ndarray], header: StoreHeader) -> Path:
    """Write a safetensors file atomically (temp file + rename)."""
    path = Path(path)
    if header.tokens == 0:
        raise StoreError(f"refusing to write an empty store to {path}: the data held no answer tokens.")
    meta: dict = {"__metadata__": header.to_metadata()}
    # widest dtypes first: with the header padded to 8 bytes every array starts aligned, so the
    # mapped arrays need no copy (an unaligned uint64 key array made searchsorted copy it whole)
    arrays = dict(sorted(arrays.items(), key=lambda kv: -kv[1].dtype.itemsize))
    offset = 0
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        meta[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(meta).encode()
    blob += b" " * (-len(blob) % 8)
    with atomic_file(path) as tmp, open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for arr in arrays.values():
            out.write(np.ascontiguousarray(arr).tobytes())
    return path


def available_memory() -> int:
    """Bytes the OS can give us now (MemAvailable), or total RAM where /proc is missing."""
    return available_ram_bytes() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


ARRAYS = ("tokens", "keys", "positions", "bigram_next", "bigram_prob")


def _read_layout(path: Path) -> tuple[dict, int]:
    """Header dict and data start offset; every inconsistency is a StoreError naming the file."""
    if not path.is_file():
        raise StoreError(f"store file {path} does not exist; {FIX}.")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise StoreError(f"{path} is truncated ({size} bytes, no header); {FIX}.")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > 100_000_000:
            raise StoreError(f"{path} is truncated or corrupt (header of {length} bytes in a {size}-byte file); {FIX}.")
        try:
            layout = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise StoreError(f"{path} is corrupt (unreadable header); {FIX}.") from None
    if not isinstance(layout, dict):
        raise StoreError(f"{path} is corrupt (its header is a JSON {type(layout).__name__}, not an object); {FIX}.")
    data_start = 8 + length
    for name in ARRAYS:
        _check_array_spec(path, name, layout.get(name), size - data_start)
    return layout, data_start


def _check_array_spec(path: Path, name: str, spec, data_bytes: int) -> None:
    """One array's header entry: a known dtype, a 1-D shape, and offsets inside the file that
    hold exactly shape × itemsize bytes."""
    if not isinstance(spec, dict) or spec.get("dtype") not in _DTYPES:
        raise StoreError(f"{path} is corrupt (array {name!r} missing or of unknown type); {FIX}.")
    offsets, shape = spec.get("data_offsets"), spec.get("shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise StoreError(f"{path} is corrupt (array {name!r} has no valid data_offsets: {offsets!r}); {FIX}.")
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
        raise StoreError(f"{path} is corrupt (array {name!r} has shape {shape!r}, not one length); {FIX}.")
    begin, end = offsets
    if end > data_bytes:
        raise StoreError(f"{path} is truncated (array {name!r} needs {end} data bytes, the file holds {data_bytes}); "
                         f"{FIX}.")
    if end - begin != np.dtype(_DTYPES[spec["dtype"]]).itemsize * shape[0]:
        raise StoreError(f"{path} is corrupt (array {name!r} has the wrong byte length); {FIX}.")


def _check_header(path: Path, header: "StoreHeader", layout: dict) -> None:
    """The header's numbers against each other and the arrays' lengths: a wrong n or bits
    would make every key lookup wrong (or overflow), a wrong count would read past an answer."""
    length = {name: layout[name]["shape"][0] for name in ARRAYS}
    problems = []
    if header.vocab_size < 1 or header.bits != key_bits(header.vocab_size) or header.n != 64 // header.bits:
        problems.append(f"vocab_size={header.vocab_size}, bits={header.bits}, n={header.n} do not fit together "
                        f"(bits must be {key_bits(max(header.vocab_size, 1))}, n = 64 // bits)")
    if header.records < 0 or header.tokens < 0 or length["tokens"] != header.tokens + header.records:
        problems.append(f"tokens={header.tokens} + records={header.records} separators != {length['tokens']} stored")
    if not length["keys"] == length["positions"] == header.tokens:
        problems.append(f"{length['keys']} keys and {length['positions']} positions for {header.tokens} tokens")
    if not length["bigram_next"] == length["bigram_prob"] == header.vocab_size:
        problems.append(f"bigram tables of {length['bigram_next']}/{length['bigram_prob']} rows for a vocabulary "
                        f"of {header.vocab_size}")
    if problems:
        raise StoreError(f"{path} has an inconsistent header ({'; '.join(problems)}); {FIX}.")


def _check_values(path: Path, arrays: dict[str, np.ndarray], vocab: int) -> None:
    """Once on open, vectorized over the mapped arrays: every token id in [0, vocab) (or the
    separator), every position inside the token array, every bigram successor a token, the
    keys sorted. Overwritten bytes would otherwise surface as an IndexError inside the base's
    embedding during ``generate``."""
    tokens, positions, keys, nxt = arrays["tokens"], arrays["positions"], arrays["keys"], arrays["bigram_next"]
    if tokens.size and (int(tokens.max()) >= vocab or int(tokens.min()) < SEPARATOR):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab else int(tokens.min())
        raise StoreError(f"{path} holds token id {bad}, outside this vocabulary [0, {vocab}): the file is damaged or "
                         f"was built with another tokenizer; {FIX}.")
    if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= tokens.size
                           or bool((tokens[positions] == SEPARATOR).any())):
        raise StoreError(f"{path} is corrupt (positions outside its answers); {FIX}.")
    if nxt.size and (int(nxt.max()) >= vocab or int(nxt.min()) < -1):
        raise StoreError(f"{path} is corrupt (bigram table holds ids outside [0, {vocab})); {FIX}.")
    if keys.size > 1 and bool((keys[1:] < keys[:-1]).any()):
        raise StoreError(f"{path} is corrupt (its keys are not sorted); {FIX}.")


@dataclass(frozen=True)
class StoreConfig:
    min_match: int = 1  # shortest suffix worth a store lookup (1 ≈ a bigram with branches)
    max_depth: int = 12  # tokens per continuation (and never more than the budget)
    max_occurrences: int = 8  # occurrences sampled from a match's range (evenly, deterministic)
    eos_token_id: int | None = None


class ModelStore:
    """A memory-mapped store; :meth:`open` checks everything before touching the arrays."""

    def __init__(self, path: Path, header: StoreHeader, arrays: dict[str, np.ndarray]):
        self.path, self.header = path, header
        self.tokens = arrays["tokens"]
        self.keys = arrays["keys"]
        self.positions = arrays["positions"]
        self.bigram_next = arrays["bigram_next"]
        self.bigram_prob = arrays["bigram_prob"]

    @classmethod
    def open(cls, path: str | Path, expect: TokenizerIdentity | None = None,
             memory_limit: int | None = None, vocab_limit: int | None = None) -> "ModelStore":
        """Open and check the store: header, sizes, tokenizer, memory, then every id against the
        vocabulary (``vocab_limit``: the base's embedding rows, when smaller than the header's)."""
        path = Path(path)
        layout, data_start = _read_layout(path)
        header = StoreHeader.from_metadata(layout.get("__metadata__") or {}, path)
        if header.format_version != FORMAT_VERSION:
            raise StoreError(f"{path} is store format {header.format_version}; this draftheads reads {FORMAT_VERSION}; {FIX}.")
        if expect is not None and (header.vocab_size, header.vocab_sha256) != (expect.vocab_size, expect.vocab_sha256):
            raise StoreError(f"{path} was built for another tokenizer (vocab {header.vocab_size}, sha256 "
                             f"{header.vocab_sha256[:12]}…; this base's is vocab {expect.vocab_size}, "
                             f"{expect.vocab_sha256[:12]}…): its token ids mean other words here; rebuild it from "
                             f"this base's answers with `draftheads store build --data <answers.jsonl> --out {path}`.")
        if header.tokens == 0 or layout["keys"]["shape"][0] == 0:
            raise StoreError(f"{path} is an empty store (no answer tokens); {FIX} from data with answers.")
        _check_header(path, header, layout)
        need = path.stat().st_size
        limit = available_memory() if memory_limit is None else memory_limit
        if need > limit:
            raise StoreError(f"{path} needs {need / 2**20:.1f} MiB but only {limit / 2**20:.1f} MiB of memory is "
                             f"available: free memory, or rebuild a smaller store (`--max-records`).")
        with open(path, "rb") as handle:  # the mapping outlives the descriptor
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        # plain ndarrays over the mapping: pages are read on first touch, and slicing them is
        # cheaper than slicing np.memmap (no subclass bookkeeping on every lookup)
        arrays = {name: np.frombuffer(mapped, dtype=_DTYPES[spec["dtype"]], offset=data_start + spec["data_offsets"][0],
                                      count=int(np.prod(spec["shape"], dtype=np.int64)))
                  for name, spec in layout.items() if name in ARRAYS}
        _check_values(path, arrays, min(header.vocab_size, vocab_limit or header.vocab_size))
        return cls(path, header, arrays)

    def match(self, history: Sequence[int], min_match: int = 1) -> tuple[int, int, int]:
        """(m, lo, hi): the longest suffix of ``history`` (m ≤ n) present in the store and its
        key range; (0, 0, 0) if none or the history is shorter than ``min_match``."""
        m, lo, hi = self.match_many([history], min_match)
        return int(m[0]), int(lo[0]), int(hi[0])

    def match_many(self, histories: Sequence[Sequence[int]], min_match: int = 1) -> tuple[np.ndarray, ...]:
        """:meth:`match` for many histories: (R,) match lengths, (R,) lo, (R,) hi — every
        candidate suffix of every history in two ``searchsorted`` calls."""
        bits, n = self.header.bits, self.header.n
        lo_keys, hi_keys, owner, length = [], [], [], []
        for r, history in enumerate(histories):
            for m in range(min(n, len(history)), max(min_match, 1) - 1, -1):  # longest first
                shift = bits * (n - m)
                prefix = pack_suffix(history, m, bits)
                lo_keys.append(prefix << shift)
                hi_keys.append(((prefix + 1) << shift) - 1)
                owner.append(r)
                length.append(m)
        out = tuple(np.zeros(len(histories), dtype=np.int64) for _ in range(3))
        if not owner:
            return out
        lo = np.searchsorted(self.keys, np.array(lo_keys, dtype=np.uint64), side="left")
        hi = np.searchsorted(self.keys, np.array(hi_keys, dtype=np.uint64), side="right")
        found = np.flatnonzero(hi > lo)
        rows, first = np.unique(np.asarray(owner)[found], return_index=True)  # each history's longest match
        best = found[first]
        for array, values in zip(out, (np.asarray(length)[best], lo[best], hi[best])):
            array[rows] = values
        return out

    def continuations(self, lo: np.ndarray, hi: np.ndarray, config: StoreConfig) -> tuple[np.ndarray, ...]:
        """Up to ``max_occurrences`` continuations of each key range (lo (R,), hi (R,); an empty
        range gives none), sampled evenly over the range so shares estimate the whole range's
        frequencies, each cut before its answer's end and after EOS: ((S, max_depth) tokens,
        (S,) lengths ≥ 1, (S,) the range each came from)."""
        lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
        k = np.minimum(config.max_occurrences, np.maximum(hi - lo, 0))
        owner = np.repeat(np.arange(k.size), k)
        j = np.arange(owner.size) - np.repeat(np.cumsum(k) - k, k)
        step = (hi - 1 - lo) / np.maximum(k - 1, 1)
        picks = np.round(lo[owner] + j * step[owner]).astype(np.int64)
        starts = self.positions[picks].astype(np.int64)
        at = starts[:, None] + np.arange(config.max_depth)
        window = np.where(at < self.tokens.size, self.tokens[np.minimum(at, self.tokens.size - 1)], SEPARATOR)
        window = window.astype(np.int64)
        length = first_true(window == SEPARATOR, config.max_depth)
        if config.eos_token_id is not None:
            length = np.minimum(length, first_true(window == config.eos_token_id, config.max_depth - 1) + 1)
        keep = length > 0
        return window[keep], length[keep], owner[keep]


def first_true(mask: np.ndarray, default: int) -> np.ndarray:
    """(S,) the first True column of each row of ``mask`` (S, D), ``default`` where none."""
    return np.where(mask.any(axis=1), mask.argmax(axis=1), default) if mask.size else np.full(mask.shape[0], default)
