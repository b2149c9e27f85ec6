"""Zero-shot classification for ``extract`` with an NLI cross-encoder: the request's ``labels`` are
the classes, chosen per request (no training for them).

Each item's text is the premise; each label becomes a hypothesis through ``hypothesis_template``
(runtime option, default ``"This example is {}."``), and the pair runs through the checkpoint's
sequence-classification head. The checkpoint's ``id2label`` names its entailment and
contradiction classes. Scores are computed as transformers' zero-shot pipeline does:

* one label per text (default): softmax of the entailment logits over the request's labels;
* ``multi_label: true``: per label, softmax of (contradiction, entailment), the entailment share.

Items answer ``classifications`` (``[{label, score}]``, highest first). Premises over the window
are truncated (only the premise is cut) unless ``overflow_policy`` is ``error``. The cost of an
item is the tokens of all its pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.errors import invalid_input
from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter

DEFAULT_TEMPLATE = "This example is {}."


def _label_index(id2label: dict[int, str], prefix: str) -> int | None:
    for i, name in id2label.items():
        if str(name).lower().startswith(prefix):
            return int(i)
    return None


class ZeroShotAdapter(HFTextAdapter):
    operations = frozenset({"extract"})

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self.load_model(AutoModelForSequenceClassification)
        id2label = {int(k): str(v) for k, v in self.model.config.id2label.items()}
        entail = _label_index(id2label, "entail")
        if entail is None:
            raise ValueError(f"not an NLI checkpoint: id2label {id2label} names no entailment class")
        self.entail = entail
        contra = _label_index(id2label, "contra")
        # unnamed: transformers' pipeline rule (the first class, or the last when entailment is first)
        self.contra = contra if contra is not None else (len(id2label) - 1 if entail == 0 else 0)

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        labels = [str(x) for x in ctx.labels or []]
        if not labels:
            raise invalid_input("zero-shot classification needs labels", param="labels")
        options = ctx.options
        template = str(options.get("hypothesis_template") or DEFAULT_TEMPLATE)
        if "{}" not in template:
            raise invalid_input("hypothesis_template must contain {}", param="options.hypothesis_template")
        hypotheses = [template.format(label) for label in labels]
        out = []
        for item in inputs:
            text = item.text or ""
            encs = self.encode_checked(ctx, [text] * len(labels), hypotheses, "only_first")
            full = self.full_counts(encs, [text] * len(labels), hypotheses)
            pairs = [(list(e.ids), list(e.type_ids)) for e in encs]
            cost = sum(len(ids) for ids, _ in pairs)
            out.append(
                Prepared(
                    cost=cost,
                    data=(labels, pairs),
                    input_tokens=cost,
                    full_tokens=sum(full) if any(full) else 0,
                )
            )
        return out

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        pairs = [pair for p in batch for pair in p.data[1]]
        logits = self.model(**self.pair_inputs(pairs)).logits.float()
        multi = bool(ctx.options.get("multi_label", False))
        out = []
        start = 0
        for p in batch:
            labels = p.data[0]
            rows = logits[start : start + len(labels)]
            start += len(labels)
            if multi:
                two = torch.stack([rows[:, self.contra], rows[:, self.entail]], dim=-1)
                scores = torch.softmax(two, dim=-1)[:, 1]
            else:
                scores = torch.softmax(rows[:, self.entail], dim=0)
            ranked = sorted(zip(labels, scores.cpu().tolist(), strict=True), key=lambda ls: -ls[1])
            out.append({"classifications": [{"label": label, "score": float(s)} for label, s in ranked]})
        return out
