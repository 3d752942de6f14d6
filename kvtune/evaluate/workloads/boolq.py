"""``boolq``: BoolQ passages with yes/no questions, scored from the yes/no next-token logits."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvtune.core.errors import KvtuneError
from kvtune.evaluate.model import KVLayers
from kvtune.evaluate.workloads.base import (
    PromptBuilder,
    Sample,
    Workload,
    mean_relative,
    next_token_logits,
    register,
)
from kvtune.evaluate.workloads.data import Field, resolve_data, select_fitting


def answer_token_ids(tokenizer, word: str) -> list[int]:
    """Ids of the single tokens that spell ``word`` (any case, with or without a leading space).

    Variants that the tokenizer splits into several tokens contribute their first token only
    when that token alone still reads as the word's start of 2+ letters (e.g. ``"ye"``); the
    word is always represented by at least one id.
    """
    ids: list[int] = []
    for variant in (word, word.capitalize(), word.upper(), " " + word, " " + word.capitalize(), " " + word.upper()):
        toks = tokenizer(variant, add_special_tokens=False)["input_ids"]
        if not toks:
            continue
        text = tokenizer.decode(toks[:1]).strip().lower()
        if len(toks) == 1 or (len(text) >= 2 and word.startswith(text)):
            if toks[0] not in ids:
                ids.append(int(toks[0]))
    if not ids:
        raise KvtuneError(f"the tokenizer cannot spell {word!r} as a token")
    return ids


@register
class BoolQWorkload(Workload):
    """Yes/no questions over a passage (BoolQ by default), scored from next-token logits.

    The passage is the compressed context; the question and the instruction run on the
    decode side. After the prompt (chat: "Answer yes or no." and the assistant header;
    plain: ``Answer (yes or no):``) the model's next-token logits give
    ``p_yes = softmax(logsumexp(yes variants), logsumexp(no variants))[0]``.

    Data (``--data``; default ``boolq``): JSONL records with ``passage`` (string),
    ``question`` (string) and ``answer`` (JSON true/false, or the string true/false/yes/no
    in any case). Records are picked in a fixed seeded order; passages longer than
    ``context_tokens`` are not used.

    Scores (one forward pass per sample at both fidelities):
        full: accuracy (``p_yes > 0.5`` equals the answer); relative accuracy = accuracy /
            accuracy on the original KV.
        cheap: the probability given to the original run's own decision, ``p_same``
            (``p_yes`` where the original KV answered yes, else ``1 - p_yes``): a smooth score
            of how much of the model's decision the decoded cache keeps; relative accuracy =
            mean p_same / mean on the original KV (there ``max(p_yes, 1 - p_yes)``). Not the
            probability of the *correct* answer: SmolLM2-135M is below chance on BoolQ (44 %
            on 64 samples vs 62 % "yes"), so a cache that destroys the model pushes
            ``p_correct`` toward 0.5 and *up* (2-bit per-token keys: ratio 2.07 on 6 samples).
        Both fidelities report ``accuracy``, ``accuracy_base``, ``p_correct``,
        ``p_correct_base``, ``p_same`` and ``flip_rate`` (share of samples whose yes/no
        decision changed).
    """

    name = "boolq"
    description = "BoolQ passage + yes/no question: accuracy (full), probability of the original decision (cheap)"
    default_data = "boolq"
    default_samples = 64
    default_cheap_samples = 32
    score_names = {"cheap": "p_same_decision", "full": "accuracy"}
    fields = (Field("passage", "str", allow_empty=True), Field("question", "str"), Field("answer", "bool"))

    def build_samples(self) -> list[Sample]:
        st = self.settings
        source, records = resolve_data(st.data or self.default_data, self.fields, workload=self.name)
        self.source = source
        pb = PromptBuilder(self.lm, st.prompt_format)
        self.prompt_format = pb.format
        self.yes_ids = answer_token_ids(self.lm.tokenizer, "yes")
        self.no_ids = answer_token_ids(self.lm.tokenizer, "no")
        budget = int(st.context_tokens) - len(pb.split(chat_instruction="", plain_instruction="")[0])

        def fits(rec):
            return self.fit_context(pb.encode(rec["passage"].strip()), budget)

        chosen = select_fitting(records, self.n_full, fits=fits, group_key=None, seed=("boolq", source.sha256),
                                where=f"--data {source.spec}", limit_hint="raise --context-tokens or lower --samples")
        samples = []
        for rec, passage_ids in chosen:
            q = rec["question"].strip()
            q = q[0].upper() + q[1:] + ("" if q.endswith("?") else "?")
            prefix, decode = pb.split(
                chat_instruction=f"\n\nQuestion: {q}\nAnswer yes or no.",
                plain_instruction=f"\n\nQuestion: {q}\nAnswer (yes or no):",
            )
            samples.append(Sample(context_ids=prefix + passage_ids, prompt_ids=decode, label=bool(rec["answer"]),
                                  references=["yes" if rec["answer"] else "no"], meta={"line": rec["_line"]}))
        return samples

    def run_sample(self, sample: Sample, kv: KVLayers, fidelity: str) -> dict[str, Any]:
        logits = next_token_logits(self.lm, kv, len(sample.context_ids), sample.prompt_ids).double()
        yes, no = torch.logsumexp(logits[self.yes_ids], 0), torch.logsumexp(logits[self.no_ids], 0)
        p_yes = float(torch.sigmoid(yes - no))
        p_correct = p_yes if sample.label else 1.0 - p_yes
        return {"p_yes": p_yes, "p_correct": p_correct, "correct": float((p_yes > 0.5) == sample.label)}

    def score(self, base, out, fidelity):
        same = [o["p_yes"] if b["p_yes"] > 0.5 else 1.0 - o["p_yes"] for b, o in zip(base, out)]
        same_base = [max(b["p_yes"], 1.0 - b["p_yes"]) for b in base]
        if fidelity == "cheap":
            res = mean_relative(same_base, same)
        else:
            res = mean_relative([b["correct"] for b in base], [o["correct"] for o in out])
        n = len(out)
        res.update({
            "p_same": sum(same) / n,
            "accuracy": sum(o["correct"] for o in out) / n,
            "accuracy_base": sum(b["correct"] for b in base) / n,
            "p_correct": sum(o["p_correct"] for o in out) / n,
            "p_correct_base": sum(b["p_correct"] for b in base) / n,
            "flip_rate": sum((o["p_yes"] > 0.5) != (b["p_yes"] > 0.5) for b, o in zip(base, out)) / n,
            "p_yes_abs_change": sum(math.fabs(o["p_yes"] - b["p_yes"]) for b, o in zip(base, out)) / n,
        })
        return res
