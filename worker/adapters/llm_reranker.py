"""Rerankers built on a causal LM that answers "yes" or "no" (Qwen3-Reranker style) for ``score``.

Each (query, document) pair becomes one prompt — ``prefix + body + suffix`` — where the body
holds the instruction, the query and the document. The score is P(yes) from the two logits of the
yes and no tokens at the prompt's last position: ``softmax([no, yes])[1]``.

Load-time options (the model YAML's ``adapter_options.loadtime``):

- ``prefix`` / ``suffix``: the fixed text around the body (a chat template's system and
  assistant turns); default none.
- ``body_template``: with ``{instruction}``, ``{query}`` and ``{document}``;
  default ``"<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}"``.
- ``default_instruction``: used when the request gives none.
- ``yes_token`` / ``no_token``: the answer tokens (default ``yes`` / ``no``), each one token.

Only the body is truncated (the document side, so the question survives), and prefix and suffix
are always kept: cutting the suffix would remove the question the logits answer.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.errors import ErrorCode, SIEError
from worker.adapters.base import InputTooLong, Prepared, RequestContext
from worker.adapters.hf import HFTextAdapter, full_tokens

DEFAULT_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class LLMRerankerAdapter(HFTextAdapter):
    operations = frozenset({"score"})
    supports_lora = True

    def load(self) -> None:
        from transformers import AutoModelForCausalLM

        self.load_model(AutoModelForCausalLM)
        opts = self.spec.loadtime
        self.prefix_ids = self.tokenizer.encode(str(opts.get("prefix") or ""), add_special_tokens=False)
        self.suffix_ids = self.tokenizer.encode(str(opts.get("suffix") or ""), add_special_tokens=False)
        self.body_template = str(opts.get("body_template") or DEFAULT_BODY)
        self.default_instruction = str(opts.get("default_instruction") or DEFAULT_INSTRUCTION)
        self.yes_id = self._single_token(str(opts.get("yes_token") or "yes"))
        self.no_id = self._single_token(str(opts.get("no_token") or "no"))

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise SIEError(
                ErrorCode.MODEL_LOAD_FAILED,
                f"answer token {text!r} is {len(ids)} tokens, not one",
                status=502,
            )
        return int(ids[0])

    def _body(self, ctx: RequestContext, query: str, document: str) -> str:
        instruction = ctx.instruction or self.default_instruction
        return (
            self.body_template.replace("{instruction}", instruction)
            .replace("{query}", query)
            .replace("{document}", document)
        )

    def document_room(self, ctx: RequestContext, query: str) -> int | None:
        around = (
            len(self.prefix_ids)
            + len(self.suffix_ids)
            + self.full_length(self._body(ctx, query, ""), special=False)
        )
        return self.limit(ctx) - around - 2  # two spare: BPE may merge across the document's edges

    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        fixed = len(self.prefix_ids) + len(self.suffix_ids)
        room = self.limit(ctx) - fixed
        if room < 8:
            raise SIEError(
                ErrorCode.INVALID_INPUT, f"the prompt of this model needs more than {self.limit(ctx)} tokens"
            )
        bodies = [self._body(ctx, q.text or "", d.text or "") for q, d in inputs]
        encs, truncated = self.encode(bodies, None, room, special=False)
        if not ctx.truncate and any(truncated):
            first = truncated.index(True)
            raise InputTooLong(first, fixed + self.full_length(bodies[first], special=False), self.limit(ctx))
        units = []
        for e in encs:
            ids = [*self.prefix_ids, *e.ids, *self.suffix_ids]
            cut = full_tokens(e)  # the body's tokens before truncation (0: nothing cut)
            units.append(
                Prepared(
                    cost=len(ids), data=ids, input_tokens=len(ids), full_tokens=fixed + cut if cut else 0
                )
            )
        return units

    @torch.inference_mode()
    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[float]:
        ids, mask = self.pad(batch)  # right padding: each prompt's last real token is at its length - 1
        with self.activate_lora(ctx.lora):
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        last = torch.tensor([p.cost - 1 for p in batch], device=logits.device)
        rows = logits[torch.arange(len(batch), device=logits.device), last]
        pair = torch.stack([rows[:, self.no_id], rows[:, self.yes_id]], dim=1).float()
        return [float(s) for s in torch.softmax(pair, dim=1)[:, 1].cpu().tolist()]
