"""Text scores of generated outputs: SQuAD-style answer F1 and ROUGE-L.

Pure functions on strings, testable with hand-computed values.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 answer normalization: lower case, drop punctuation and the articles a/an/the,
    collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 between one prediction and one reference (after :func:`normalize_answer`).

    Both empty gives 1.0; exactly one empty gives 0.0.
    """
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: list[str]) -> float:
    """Max :func:`token_f1` over the references (SQuAD / NarrativeQA convention)."""
    return max(token_f1(prediction, r) for r in references)


@lru_cache(maxsize=1)
def _rouge_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError as exc:  # pragma: no cover - dependency declared in pyproject
        from kvtune.core.errors import KvtuneError

        raise KvtuneError("the summarize workload needs the rouge-score package: pip install rouge-score") from exc
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (longest common subsequence; Porter stemming, Google ``rouge-score``)."""
    return float(_rouge_scorer().score(reference, prediction)["rougeL"].fmeasure)
