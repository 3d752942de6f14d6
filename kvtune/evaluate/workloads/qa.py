"""``qa``: NarrativeQA story passages with questions; answer F1 (full) or answer likelihood (cheap)."""

from __future__ import annotations

from typing import Any

from kvtune.evaluate.model import KVLayers
from kvtune.evaluate.workloads.base import (
    OwnAnswerMixin,
    PromptBuilder,
    Sample,
    Workload,
    first_line,
    greedy_generate,
    mean_relative,
    register,
)
from kvtune.evaluate.workloads.data import Field, resolve_data, select_fitting
from kvtune.evaluate.workloads.scoring import best_f1


@register
class QAWorkload(OwnAnswerMixin, Workload):
    """Question answering over a passage (NarrativeQA by default).

    The passage is the compressed context; the question, the instruction and the answer run
    on the decode side. Chat template (when the tokenizer has one): user turn = passage,
    then "Answer the question about the text above with a short phrase." and the question;
    plain: passage, ``Question: ...`` and ``Answer:``.

    Data (``--data``; default ``narrativeqa``): JSONL records with
    ``passage`` (string), ``question`` (string) and ``answer`` (string or non-empty list of
    strings: the references). Records are grouped by passage and picked round-robin over
    passages in a fixed seeded order; passages longer than ``context_tokens`` (with the
    template prefix) are not used.

    Scores:
        full: generated answer (greedy, at most ``max_new_tokens``, first line), SQuAD token
            F1 against the best reference; relative accuracy = mean F1 / mean F1 on the
            original KV. Also ``agreement_f1``: F1 between the answers generated on decoded
            and on original KV.
        cheap: teacher-forced log-likelihood of the answer generated on the original KV
            (see :class:`~kvtune.evaluate.workloads.base.OwnAnswerMixin` for why not the
            references'); relative accuracy = ``exp(-mean(nll - nll_base))``. The mean NLL
            per token of the references is reported as ``ref_nll`` / ``ref_nll_base``.
    """

    name = "qa"
    description = "NarrativeQA passage + question: generated-answer F1 (full), likelihood of the original answer (cheap)"
    default_data = "narrativeqa"
    default_samples = 24
    default_cheap_samples = 12
    default_max_new_tokens = 24
    score_names = {"cheap": "own_answer_token_prob", "full": "f1"}
    fields = (Field("passage", "str", allow_empty=True), Field("question", "str"), Field("answer", "str_list"))

    def build_samples(self) -> list[Sample]:
        st = self.settings
        source, records = resolve_data(st.data or self.default_data, self.fields, workload=self.name)
        self.source = source
        pb = PromptBuilder(self.lm, st.prompt_format)
        self.prompt_format = pb.format
        budget = int(st.context_tokens) - len(pb.split(chat_instruction="", plain_instruction="")[0])
        cache: dict[str, list[int] | None] = {}

        def fits(rec):
            passage = rec["passage"].strip()
            if passage not in cache:
                cache[passage] = self.fit_context(pb.encode(passage), budget)
            return cache[passage]

        chosen = select_fitting(records, self.n_full, fits=fits, group_key="passage", seed=("qa", source.sha256),
                                where=f"--data {source.spec}",
                                limit_hint="raise --context-tokens or lower --samples")
        samples = []
        for rec, passage_ids in chosen:
            q = rec["question"].strip()
            prefix, decode = pb.split(
                chat_instruction=f"\n\nAnswer the question about the text above with a short phrase.\nQuestion: {q}",
                plain_instruction=f"\n\nQuestion: {q}\nAnswer:",
            )
            lead = "" if pb.format == "chat" else " "
            samples.append(Sample(
                context_ids=prefix + passage_ids,
                prompt_ids=decode,
                targets=[pb.encode(lead + a.strip()) for a in rec["answer"]],
                references=list(rec["answer"]),
                meta={"line": rec["_line"]},
            ))
        return samples

    def run_sample(self, sample: Sample, kv: KVLayers, fidelity: str) -> dict[str, Any]:
        t = len(sample.context_ids)
        if fidelity == "cheap":
            return self.cheap_outputs(sample, kv)
        ids = greedy_generate(self.lm, kv, t, sample.prompt_ids, max_new_tokens=self.max_new_tokens,
                              stop_ids=self.stop_ids)
        answer = first_line(self.lm.tokenizer.decode(ids, skip_special_tokens=True))
        return {"answer": answer, "f1": best_f1(answer, sample.references)}

    def score(self, base, out, fidelity):
        if fidelity == "cheap":
            return self.cheap_score(base, out)
        res = mean_relative([b["f1"] for b in base], [o["f1"] for o in out])
        res["f1"], res["f1_base"] = res["score"], res["score_base"]
        res["agreement_f1"] = sum(best_f1(o["answer"], [b["answer"]]) for b, o in zip(base, out)) / len(out)
        return res
