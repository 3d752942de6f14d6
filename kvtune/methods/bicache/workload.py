"""Requests with a real shared prefix: an embedding instruction before NarrativeQA passages.

The use case (issue 8): instruction-prefixed embedding, where many requests share one long
instruction (INSTRUCTOR / E5-instruct style). Each request is ``[CLS] + instruction`` (the
shared prefix, P tokens) followed by a window of a NarrativeQA story summary and ``[SEP]``
(the suffix, N tokens). The prefix ratio ``P / (P + N)`` is set per request by the window
length: a bucket ``[lo, hi)`` draws a ratio uniformly in it and takes
``N = round(P (1 - r) / r)`` suffix tokens.

Retrieval task: the request's window is the one of its story that shares the most words with
one of the story's questions (and its answers); the question, encoded on its own, must
retrieve a window of its own story (top-1, cosine) among the bucket's windows.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.core.errors import BiCacheError
from kvtune.evaluate.workloads.data import Field, resolve_data, stable_seed

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_INSTRUCTION",
    "BiCacheRequest",
    "RatioBucket",
    "best_window",
    "build_requests",
    "parse_buckets",
    "suffix_tokens_for_ratio",
]

#: The shared instruction (72 MiniLM word pieces; 73 prefix tokens with [CLS]).
DEFAULT_INSTRUCTION = (
    "Represent this passage from a story summary for retrieving it with a reader's question. "
    "The question may ask who a character is, what happens to them, where and when the events take place, "
    "why a character acts as they do, or how the story ends. Keep the people, places, actions and "
    "their causes; ignore style and wording."
)
#: Prefix-ratio bucket edges (fractions of the request that is shared prefix).
DEFAULT_BUCKETS: tuple[float, ...] = (0.15, 0.30, 0.45, 0.60, 0.75, 0.90)

_FIELDS = (Field("passage", "str", allow_empty=True), Field("question", "str"), Field("answer", "str_list"))
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class RatioBucket:
    """A shared-prefix-ratio bucket ``[lo, hi)`` (fractions)."""

    lo: float
    hi: float

    @property
    def key(self) -> str:
        """Policy-table key, ``"prefix_ratio=[0.15,0.30)"`` (see ``kvtune.tables.policy_table``)."""
        return f"prefix_ratio=[{self.lo:.2f},{self.hi:.2f})"

    def contains(self, ratio: float) -> bool:
        return self.lo <= ratio < self.hi


def parse_buckets(edges: Sequence[float]) -> list[RatioBucket]:
    """Buckets between consecutive edges.

    Raises:
        BiCacheError: fewer than two edges, edges not strictly increasing, or outside (0, 1].
    """
    e = [float(x) for x in edges]
    if len(e) < 2 or any(b <= a for a, b in zip(e, e[1:], strict=False)) or e[0] <= 0 or e[-1] > 1:
        raise BiCacheError(f"prefix-ratio bucket edges must be >= 2 increasing numbers in (0, 1], got {e}")
    return [RatioBucket(a, b) for a, b in zip(e, e[1:], strict=False)]


def suffix_tokens_for_ratio(prefix_tokens: int, ratio: float) -> int:
    """Suffix length N giving prefix ratio ``P / (P + N)`` closest to ``ratio`` (at least 1).

    >>> suffix_tokens_for_ratio(73, 0.5), suffix_tokens_for_ratio(73, 0.25)
    (73, 219)
    """
    if not 0 < ratio <= 1:
        raise BiCacheError(f"prefix ratio must be in (0, 1], got {ratio}")
    return max(1, round(prefix_tokens * (1.0 - ratio) / ratio))


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) > 3}


def best_window(tokens: Sequence[str], length: int, target_words: set[str]) -> int:
    """Start of the ``length``-token window (stride ``length // 2``) sharing most words with
    ``target_words``; ties go to the earliest. ``tokens`` are word pieces (``##`` joined).

    Returns:
        The start index (0 when the text is not longer than the window).
    """
    if len(tokens) <= length:
        return 0
    stride = max(1, length // 2)
    starts = list(range(0, len(tokens) - length + 1, stride))
    if starts[-1] != len(tokens) - length:
        starts.append(len(tokens) - length)
    best, best_score = 0, -1
    for s in starts:
        text = " ".join(tokens[s:s + length]).replace(" ##", "")
        score = len(_words(text) & target_words)
        if score > best_score:
            best, best_score = s, score
    return best


@dataclass(frozen=True)
class BiCacheRequest:
    """One request of the profiler.

    Attributes:
        bucket: the bucket's key.
        suffix_ids: the request's own tokens (passage window + ``[SEP]``).
        prefix_ratio: ``P / (P + N)``.
        story: index of the story (retrieval group).
        query_ids: the question, ``[CLS] question [SEP]``.
    """

    bucket: str
    suffix_ids: tuple[int, ...]
    prefix_ratio: float
    story: int
    query_ids: tuple[int, ...]


def build_requests(
    tokenizer: Any,
    prefix_ids: Sequence[int],
    buckets: Sequence[RatioBucket],
    *,
    n_per_bucket: int,
    data: str = "narrativeqa",
    seed: int = 0,
    max_positions: int = 512,
) -> tuple[dict[str, list[BiCacheRequest]], dict[str, Any]]:
    """Draw ``n_per_bucket`` requests per bucket from a QA set (questions on distinct stories first).

    Returns:
        ``(requests by bucket key, data description for the run record)``.

    Raises:
        BiCacheError: a bucket needs more suffix tokens than the encoder has positions, or
            the data has too few usable records.
        DataError, AssetError: the data cannot be read.
    """
    source, records = resolve_data(data, _FIELDS, workload="bicache")
    P = len(prefix_ids)
    sep = tokenizer.sep_token_id
    cls = tokenizer.cls_token_id
    if sep is None or cls is None:
        raise BiCacheError("the tokenizer has no [CLS]/[SEP] tokens (BERT-style encoders only)")
    stories: dict[str, int] = {}
    by_story: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["passage"].strip():
            sid = stories.setdefault(r["passage"], len(stories))
            by_story.setdefault(sid, []).append(r)
    passages = {sid: p for p, sid in stories.items()}
    piece_cache: dict[int, tuple[list[int], list[str]]] = {}

    def pieces(sid: int) -> tuple[list[int], list[str]]:
        if sid not in piece_cache:
            ids = tokenizer(passages[sid], add_special_tokens=False, verbose=False)["input_ids"]  # windowed below
            piece_cache[sid] = (ids, tokenizer.convert_ids_to_tokens(ids))
        return piece_cache[sid]

    out: dict[str, list[BiCacheRequest]] = {}
    for b in buckets:
        rng = random.Random(stable_seed("bicache", seed, b.key))
        n_max = suffix_tokens_for_ratio(P, b.lo)
        if P + n_max > max_positions:
            raise BiCacheError(
                f"bucket {b.key} needs up to {P + n_max} tokens; the encoder has {max_positions} positions "
                f"(shorten the instruction or raise the lowest bucket edge)"
            )
        order = list(by_story)
        rng.shuffle(order)
        picks: list[tuple[int, dict[str, Any]]] = []
        depth = 0
        while len(picks) < n_per_bucket:
            progressed = False
            for sid in order:
                qs = by_story[sid]
                if depth < len(qs) and len(picks) < n_per_bucket:
                    picks.append((sid, qs[(depth + rng.randrange(len(qs))) % len(qs)]))
                    progressed = True
            depth += 1
            if not progressed:
                raise BiCacheError(f"only {len(picks)} usable records in {data!r}; asked for {n_per_bucket} per bucket")
        reqs = []
        for sid, rec in picks:
            r = rng.uniform(b.lo, b.hi)
            n = suffix_tokens_for_ratio(P, r)
            ids, toks = pieces(sid)
            body = n - 1
            target = _words(rec["question"]) | set().union(*(_words(a) for a in rec["answer"]))
            s = best_window(toks, body, target)
            window = ids[s:s + body]
            suffix = tuple(window) + (sep,)
            q = tokenizer(rec["question"], add_special_tokens=False)["input_ids"][: max_positions - 2]
            ratio = P / (P + len(suffix))
            reqs.append(BiCacheRequest(b.key, suffix, ratio, sid, (cls, *q, sep)))
        out[b.key] = reqs
    info = {**source.describe(), "stories": len(stories), "records": len(records)}
    return out, info


def instruction_prefix(tokenizer: Any, instruction: str) -> list[int]:
    """``[CLS] + instruction`` word pieces: the shared prefix (no ``[SEP]``: the suffix ends with it)."""
    ids = tokenizer(instruction, add_special_tokens=False)["input_ids"]
    if not ids:
        raise BiCacheError("the shared instruction is empty")
    return [tokenizer.cls_token_id, *ids]


def ratio_summary(requests: Sequence[BiCacheRequest]) -> dict[str, float]:
    """Mean / min / max prefix ratio and mean suffix tokens of a bucket's requests."""
    r = [q.prefix_ratio for q in requests]
    n = [len(q.suffix_ids) for q in requests]
    return {
        "ratio_mean": sum(r) / len(r) if r else math.nan,
        "ratio_min": min(r, default=math.nan),
        "ratio_max": max(r, default=math.nan),
        "suffix_tokens_mean": sum(n) / len(n) if n else math.nan,
    }
