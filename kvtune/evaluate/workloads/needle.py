"""``needle``: a random-digit passkey hidden at several depths of an essay context."""

from __future__ import annotations

import random
import re
from typing import Any

from kvtune.evaluate.assets import read_texts
from kvtune.core.errors import KvtuneError
from kvtune.evaluate.model import KVLayers
from kvtune.evaluate.workloads.base import (
    PromptBuilder,
    Sample,
    Workload,
    greedy_generate,
    mean_relative,
    nll_relative,
    register,
    target_nll,
)
from kvtune.evaluate.workloads.data import stable_seed

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
"""Relative positions of the needle in the haystack, cycled over samples (so the first five
samples, and therefore the default cheap set, cover every depth)."""

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PREAMBLE = ("There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it.\n\n")
_SENTENCE_END = (".", "!", "?", "\n")


@register
class NeedleWorkload(Workload):
    """Passkey retrieval (Mohtashami & Jaggi, 2023): find a number hidden in long text.

    Each sample is the passkey preamble ("There is an important piece of information hidden
    inside a lot of irrelevant text. Find it and memorize it. I will quiz you about it.") and a
    window of real essay text (``--text``), ``context_tokens`` tokens in total, with the sentence ``The pass key is NNNNN. Remember it. NNNNN is the pass key.``
    inserted at a sentence boundary near depth 10/30/50/70/90 % (cycled over samples); the
    5-digit key is random with a fixed per-sample seed. The haystack and the needle are the
    compressed context; the question "What is the pass key?" and the primed answer
    ``The pass key is`` run on the decode side.

    Scores:
        full: greedy digits (at most ``max_new_tokens``, default key length + 2 tokens);
            ``passkey_accuracy`` = the first number generated equals the key; relative
            accuracy = accuracy / accuracy on the original KV. ``digit_accuracy`` gives
            the share of key digits right in place.
        cheap: teacher-forced log-likelihood of the key tokens; relative accuracy =
            ``exp(-mean(nll - nll_base))``.
    """

    name = "needle"
    description = "passkey hidden at 5 depths of an essay context: retrieval accuracy (full), key likelihood (cheap)"
    default_samples = 20
    default_cheap_samples = 5
    default_max_new_tokens = 0  # key length + 2, set per sample
    score_names = {"cheap": "passkey_token_prob", "full": "passkey_accuracy"}
    key_digits = 5

    def build_samples(self) -> list[Sample]:
        st = self.settings
        tok = self.lm.tokenizer
        pb = PromptBuilder(self.lm, st.prompt_format)
        self.prompt_format = pb.format
        prefix, decode = pb.split(
            chat_instruction="\n\nWhat is the pass key? Answer with the number only.",
            plain_instruction="\n\nWhat is the pass key?",
            answer_prefix="The pass key is" if pb.format == "chat" else " The pass key is",
        )
        sep = pb.encode("\n\n")
        preamble = pb.encode(PREAMBLE)
        stream: list[int] = []
        for _, text in read_texts(st.text):
            stream.extend(pb.encode(text.strip()))
            stream.extend(sep)
        samples = []
        n = self.n_full
        for i in range(n):
            rng = random.Random(stable_seed("needle", i))
            key = str(rng.randrange(10 ** (self.key_digits - 1), 10**self.key_digits))
            needle = pb.encode(NEEDLE.format(key=key))
            hay_len = int(st.context_tokens) - len(prefix) - len(preamble) - len(needle)
            if hay_len < 16:
                raise KvtuneError(f"needle: --context-tokens {st.context_tokens} leaves no room for a haystack")
            if len(stream) < hay_len:
                raise KvtuneError(f"needle: the text has {len(stream)} tokens, fewer than the {hay_len} a haystack needs")
            stride = (len(stream) - hay_len) // max(n - 1, 1)
            hay = stream[i * stride : i * stride + hay_len]
            depth = DEPTHS[i % len(DEPTHS)]
            pos = int(depth * hay_len)
            for j in range(pos, max(pos - 64, 1) - 1, -1):
                if tok.decode(hay[j - 1 : j]).endswith(_SENTENCE_END):
                    pos = j
                    break
            target = pb.encode(" " + key)
            samples.append(Sample(
                context_ids=prefix + preamble + hay[:pos] + needle + hay[pos:],
                prompt_ids=decode,
                targets=[target],
                references=[key],
                label=key,
                meta={"depth": depth, "needle_position": len(prefix) + len(preamble) + pos, "key": key},
            ))
        return samples

    def run_sample(self, sample: Sample, kv: KVLayers, fidelity: str) -> dict[str, Any]:
        t = len(sample.context_ids)
        if fidelity == "cheap":
            return {"nll": target_nll(self.lm, kv, t, sample.prompt_ids, sample.targets)[0]}
        budget = self.max_new_tokens or len(sample.targets[0]) + 2
        ids = greedy_generate(self.lm, kv, t, sample.prompt_ids, max_new_tokens=budget, stop_ids=self.stop_ids)
        text = self.lm.tokenizer.decode(ids, skip_special_tokens=True)
        found = re.search(r"\d+", text)
        guess = found.group(0) if found else ""
        key = sample.label
        digits = sum(a == b for a, b in zip(guess, key)) / len(key)
        return {"guess": guess, "correct": float(guess == key), "digits": digits}

    def score(self, base, out, fidelity):
        if fidelity == "cheap":
            return nll_relative([b["nll"] for b in base], [o["nll"] for o in out])
        res = mean_relative([b["correct"] for b in base], [o["correct"] for o in out])
        n = len(out)
        res.update({
            "passkey_accuracy": res["score"],
            "passkey_accuracy_base": res["score_base"],
            "digit_accuracy": sum(o["digits"] for o in out) / n,
            "digit_accuracy_base": sum(b["digits"] for b in base) / n,
        })
        return res

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "text": self.settings.text, "depths": list(DEPTHS), "key_digits": self.key_digits}
