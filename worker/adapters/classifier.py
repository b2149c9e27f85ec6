"""Sequence classification for ``extract``: each item's text gets ``classifications``
(``[{label, score}]``, highest score first) from the checkpoint's ``id2label`` head.

Scores are softmax probabilities, or independent sigmoids for multi-label checkpoints
(``problem_type: multi_label_classification``, or runtime option ``multi_label: true``).
Request ``labels`` restrict the answer to those labels (each must be one of the model's);
runtime option ``top_k`` keeps the best k. Texts over the window are truncated unless
``overflow_policy`` is ``error``.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.errors import invalid_input
from worker.adapters.base import Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter


class SequenceClassifierAdapter(HFTextAdapter):
    operations = frozenset({"extract"})

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        self.load_tokenizer()
        assert self.spec.weights_dir is not None, "a classifier loads from a checkpoint directory"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.spec.weights_dir, **self.model_kwargs()
        )
        self.model.to(self.spec.device).eval()
        cfg = self.model.config
        self.labels = [str(cfg.id2label[i]) for i in range(cfg.num_labels)]
        self.multi_label = cfg.problem_type == "multi_label_classification"

    def unload(self) -> None:
        self.model = None

    def memory_bytes(self) -> int:
        return self.param_bytes(getattr(self, "model", None))

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        unknown = [x for x in ctx.labels if x not in self.labels]
        if unknown:
            raise invalid_input(
                f"unknown labels {unknown}; this classifier knows {self.labels}", param="labels"
            )
        return self.tokenize(ctx, [item.text or "" for item in inputs])

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[dict[str, Any]]:
        ids, mask = self.pad(batch)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        opts = ctx.options
        multi = bool(opts.get("multi_label", self.multi_label))
        probs = (torch.sigmoid(logits) if multi else torch.softmax(logits, dim=-1)).cpu().tolist()
        wanted = set(ctx.labels) if ctx.labels else None
        top_k = opts.get("top_k")
        out = []
        for row in probs:
            pairs = [
                (label, float(p))
                for label, p in zip(self.labels, row, strict=True)
                if wanted is None or label in wanted
            ]
            pairs.sort(key=lambda lp: -lp[1])
            if isinstance(top_k, int) and top_k > 0:
                pairs = pairs[:top_k]
            out.append({"classifications": [{"label": label, "score": p} for label, p in pairs]})
        return out
