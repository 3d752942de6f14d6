"""``summarize``: XSum news articles, one-sentence summaries scored with ROUGE-L."""

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
from kvtune.evaluate.workloads.scoring import rouge_l


@register
class SummarizeWorkload(OwnAnswerMixin, Workload):
    """Single-sentence summarization of a document (XSum by default).

    The document is the compressed context; the instruction (chat: "Summarize the article
    above in one sentence."; plain: ``Summary:``) and the summary run on the decode side.

    Data (``--data``; default ``xsum``): JSONL records with ``document`` (string) and
    ``summary`` (string, the reference). Records are picked in a fixed seeded order;
    documents longer than ``context_tokens`` are not used.

    Scores:
        full: greedy summary (at most ``max_new_tokens``, first line), ROUGE-L F-measure
            against the reference (``rouge-score``, Porter stemming); relative accuracy =
            mean ROUGE-L / mean ROUGE-L on the original KV. ``agreement_rouge_l`` compares
            the summaries generated on decoded and on original KV.
        cheap: teacher-forced log-likelihood of the summary generated on the original KV
            (see :class:`~kvtune.evaluate.workloads.base.OwnAnswerMixin`); relative accuracy =
            ``exp(-mean(nll - nll_base))``. The reference summary's mean NLL per token is
            reported as ``ref_nll`` / ``ref_nll_base``.
    """

    name = "summarize"
    description = "XSum article: ROUGE-L of the generated one-sentence summary (full), likelihood of the original summary (cheap)"
    default_data = "xsum"
    default_samples = 16
    default_cheap_samples = 8
    default_max_new_tokens = 40
    score_names = {"cheap": "own_summary_token_prob", "full": "rouge_l"}
    fields = (Field("document", "str", allow_empty=True), Field("summary", "str"))

    def build_samples(self) -> list[Sample]:
        st = self.settings
        source, records = resolve_data(st.data or self.default_data, self.fields, workload=self.name)
        self.source = source
        pb = PromptBuilder(self.lm, st.prompt_format)
        self.prompt_format = pb.format
        prefix, decode = pb.split(chat_instruction="\n\nSummarize the article above in one sentence.",
                                  plain_instruction="\n\nSummary of the article above in one sentence:")
        budget = int(st.context_tokens) - len(prefix)

        def fits(rec):
            return self.fit_context(pb.encode(rec["document"].strip()), budget)

        chosen = select_fitting(records, self.n_full, fits=fits, group_key=None, seed=("summarize", source.sha256),
                                where=f"--data {source.spec}", limit_hint="raise --context-tokens or lower --samples")
        lead = "" if pb.format == "chat" else " "
        return [
            Sample(context_ids=prefix + doc_ids, prompt_ids=decode, targets=[pb.encode(lead + rec["summary"].strip())],
                   references=[rec["summary"].strip()], meta={"line": rec["_line"]})
            for rec, doc_ids in chosen
        ]

    def run_sample(self, sample: Sample, kv: KVLayers, fidelity: str) -> dict[str, Any]:
        t = len(sample.context_ids)
        if fidelity == "cheap":
            return self.cheap_outputs(sample, kv)
        ids = greedy_generate(self.lm, kv, t, sample.prompt_ids, max_new_tokens=self.max_new_tokens,
                              stop_ids=self.stop_ids)
        summary = first_line(self.lm.tokenizer.decode(ids, skip_special_tokens=True))
        return {"summary": summary, "rouge_l": rouge_l(summary, sample.references[0])}

    def score(self, base, out, fidelity):
        if fidelity == "cheap":
            return self.cheap_score(base, out)
        res = mean_relative([b["rouge_l"] for b in base], [o["rouge_l"] for o in out])
        res["rouge_l"], res["rouge_l_base"] = res["score"], res["score_base"]
        res["agreement_rouge_l"] = sum(rouge_l(o["summary"], b["summary"]) for b, o in zip(base, out)) / len(out)
        return res
