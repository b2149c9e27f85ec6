"""Shared pieces for adapters built on Hugging Face transformers: tokenisation, padding, dtypes."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import torch

from protocol.api import Item
from worker.adapters.base import Adapter, InputTooLong, Prepared, RequestContext, apply_template
from worker.modeling.checkpoint import checkpoint_config
from worker.modeling.gte_new import is_new_model, load_new_model
from worker.modeling.packed import PackedBatch, PackedEncoder, try_packed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(precision: str, device: str) -> torch.dtype:
    dtype = DTYPES.get(precision, torch.float32)
    if device == "cpu" and dtype == torch.float16:
        return torch.bfloat16  # fp16 matmuls are slow or missing on CPU; bf16 keeps the range
    return dtype


def attn_implementation(device: str) -> str:
    """flash-attn varlen kernels on CUDA when installed, PyTorch SDPA everywhere else."""
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            return "sdpa"
    return "sdpa"


def full_tokens(enc: Any) -> int:
    """Tokens of the input before truncation: the kept ones plus what truncation moved to the
    encoding's overflow (without the special tokens each overflow piece gets again); 0 when
    nothing was cut."""
    if not enc.overflowing:
        return 0
    return len(enc.ids) + sum(len(o.ids) - sum(o.special_tokens_mask) for o in enc.overflowing)


class HFTextAdapter(Adapter):
    """Tokenises text with the model's fast tokenizer and pads batches to their longest item."""

    tokenizer: Any = None
    model: Any = None  # the transformers model (its body is what LoRA adapts)
    packed: PackedEncoder | None = None  # the encoder's packed forward, when enabled
    peft_model: Any = None  # the PeftModel wrapping ``model`` once a LoRA is loaded

    def load_model(self, auto_cls: Any) -> None:
        """The tokenizer, then the transformers model (``auto_cls``: AutoModel, AutoModelFor...) in
        eval mode on the device.

        A bare encoder of an architecture we implement ourselves (GTE NewModel, worker/modeling/gte_new.py,
        whose own code is remote) is built from the checkpoint's config and weights instead.
        """
        self.load_tokenizer()
        device = self.spec.device
        bare = getattr(auto_cls, "__name__", "") == "AutoModel"
        if bare and is_new_model(checkpoint_config(self.spec.weights_dir)):
            self.model = load_new_model(
                str(self.spec.weights_dir), device, torch_dtype(self.spec.precision, device)
            )
            return
        self.model = auto_cls.from_pretrained(self.spec.weights_dir, **self.model_kwargs())
        self.model.to(device).eval()

    def unload(self) -> None:
        self.model = None
        self.peft_model = None

    def memory_bytes(self) -> int:
        return self.param_bytes(self.model)

    def load_tokenizer(self, tokenizer: Any = None) -> None:
        """The checkpoint's tokenizer (or ``tokenizer``, one already loaded, e.g. a processor's)."""
        from transformers import AutoTokenizer

        self.tokenizer = (
            tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(self.spec.weights_dir)
        )
        model_max = getattr(self.tokenizer, "model_max_length", None) or 512
        if model_max > 10**8:  # transformers' "no limit known" sentinel (1e30)
            model_max = 512
        self.max_length = min(self.spec.config.max_sequence_length or model_max, model_max)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self._tokenizer_json = self.tokenizer.backend_tokenizer.to_str()
        self._local = threading.local()

    def limit(self, ctx: RequestContext) -> int:
        return min(ctx.max_length or self.max_length, self.max_length)

    def document_room(self, ctx: RequestContext, query: str) -> int | None:
        """Tokens a document may take beside ``query`` in one scored pair (the rest of the limit goes
        to the query, the template and the special tokens); None where the adapter does not score
        (query, document) pairs, so ``score`` cannot split documents into windows (MaxP)."""
        return None

    def _thread_tokenizer(self) -> Any:
        """This thread's own Rust tokenizer (truncation is state of the tokenizer object, so one
        shared by the tokenisation threads races: one thread's limit leaks into another's call)."""
        local = self._local
        tok = getattr(local, "tokenizer", None)
        if tok is None:
            from tokenizers import Tokenizer

            tok = local.tokenizer = Tokenizer.from_str(self._tokenizer_json)
            tok.no_padding()
        return tok

    def encode(
        self,
        texts: list[str],
        pairs: list[str] | None,
        limit: int,
        strategy: str = "longest_first",
        special: bool = True,
    ) -> tuple[list[Any], list[bool]]:
        """Encodings (ids, type ids) truncated to ``limit`` tokens, and which were truncated.

        One pass: the tokenizer reports what truncation cut off, so over-long texts are not
        tokenised twice. ``special``: add the tokenizer's special tokens ([CLS]/[SEP], BOS/EOS).
        """
        tok = self._thread_tokenizer()
        tok.enable_truncation(limit, strategy=strategy)
        encs = tok.encode_batch(
            texts if pairs is None else list(zip(texts, pairs, strict=True)), add_special_tokens=special
        )
        return encs, [bool(e.overflowing) for e in encs]

    def full_length(self, text: str, pair: str | None = None, special: bool = True) -> int:
        """Token count of one input without truncation (for the INPUT_TOO_LONG message)."""
        tok = self._thread_tokenizer()
        tok.no_truncation()
        return len(tok.encode(text, pair, add_special_tokens=special).ids)

    def token_spans(self, texts: list[str], special: bool = True) -> list[dict[str, Any]]:
        """The tokenize route: tokens, ids, character offsets and count per text, untruncated."""
        tok = self._thread_tokenizer()
        tok.no_truncation()
        return [
            {
                "tokens": list(e.tokens),
                "ids": list(e.ids),
                "offsets": [list(o) for o in e.offsets],
                "count": len(e.ids),
            }
            for e in tok.encode_batch(texts, add_special_tokens=special)
        ]

    def encode_checked(
        self,
        ctx: RequestContext,
        texts: list[str],
        pairs: list[str] | None = None,
        strategy: str = "longest_first",
    ) -> list[Any]:
        """Encodings within the limit; over-long inputs truncated, or refused per overflow policy."""
        limit = self.limit(ctx)
        encs, truncated = self.encode(texts, pairs, limit, strategy)
        if not ctx.truncate and any(truncated):
            first = truncated.index(True)
            raise InputTooLong(first, self.full_length(texts[first], pairs[first] if pairs else None), limit)
        return encs

    def full_counts(self, encs: list[Any], texts: list[str], pairs: list[str] | None) -> list[int]:
        """Per encoding, its input's tokens before truncation (0 where nothing was cut). Single texts
        count from the overflow; a pair's overflow repeats one side, so a cut pair is re-counted."""
        if pairs is None:
            return [full_tokens(e) for e in encs]
        return [
            self.full_length(t, p) if e.overflowing else 0 for e, t, p in zip(encs, texts, pairs, strict=True)
        ]

    def tokenize(
        self, ctx: RequestContext, texts: list[str], pairs: list[str] | None = None
    ) -> list[Prepared]:
        """Token ids per text (or text pair), truncated to the limit or refused per overflow policy."""
        encs = self.encode_checked(ctx, texts, pairs, "longest_first" if pairs is None else "only_second")
        return [
            Prepared(cost=len(e.ids), data=e.ids, input_tokens=len(e.ids), full_tokens=n)
            for e, n in zip(encs, self.full_counts(encs, texts, pairs), strict=True)
        ]

    def texts_of(self, ctx: RequestContext, items: list[Item]) -> list[str]:
        return [apply_template(item.text or "", ctx) for item in items]

    def pair_inputs(self, pairs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        """Model inputs of text pairs, each (ids, token type ids): right-padded ids, attention mask and,
        when the tokenizer makes them, token type ids."""
        width = max(len(ids) for ids, _ in pairs)
        ids = np.full((len(pairs), width), self.pad_id, dtype=np.int64)
        types = np.zeros((len(pairs), width), dtype=np.int64)
        mask = np.zeros((len(pairs), width), dtype=np.int64)
        for row, (seq, typ) in enumerate(pairs):
            ids[row, : len(seq)] = seq
            types[row, : len(typ)] = typ
            mask[row, : len(seq)] = 1
        device = self.spec.device
        out = {
            "input_ids": torch.from_numpy(ids).to(device),
            "attention_mask": torch.from_numpy(mask).to(device),
        }
        if "token_type_ids" in getattr(self.tokenizer, "model_input_names", []):
            out["token_type_ids"] = torch.from_numpy(types).to(device)
        return out

    def pad(self, batch: list[Prepared], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and attention mask, to the longest unit or to ``width``."""
        width = width or max(p.cost for p in batch)
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, p in enumerate(batch):
            ids[row, : p.cost] = p.data
            mask[row, : p.cost] = 1
        device = self.spec.device
        return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)

    # ---- LoRA (peft; inference thread; for every family with supports_lora) -----------------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        from peft import PeftModel

        if self.peft_model is None:
            self.peft_model = PeftModel.from_pretrained(
                self.model, path, adapter_name=name, is_trainable=False, torch_device=self.spec.device
            )
        else:
            self.peft_model.load_adapter(
                path, adapter_name=name, is_trainable=False, torch_device=self.spec.device
            )
        self.peft_model.eval()

    def unload_lora(self, name: str) -> None:
        if self.peft_model is None or name not in self.peft_model.peft_config:
            return
        others = [n for n in self.peft_model.peft_config if n != name]
        if self.peft_model.active_adapter == name and others:
            self.peft_model.set_adapter(others[0])  # every batch activates its own LoRA anyway
        self.peft_model.delete_adapter(name)

    def lora_names(self) -> list[str]:
        return sorted(self.peft_model.peft_config) if self.peft_model is not None else []

    def forwards_share_state(self) -> bool:
        """With peft's wrapper in place every forward switches LoRAs (or all of them off)."""
        return self.peft_model is not None

    def activate_lora(self, lora: str | None) -> contextlib.AbstractContextManager:
        """Right before a forward pass: the batch's LoRA active, or every LoRA off for the base model."""
        if self.peft_model is None:
            if lora is not None:
                raise RuntimeError(f"LoRA {lora!r} is not loaded")
            return contextlib.nullcontext()
        if lora is None:
            return self.peft_model.disable_adapter()
        self.peft_model.set_adapter(lora)
        return contextlib.nullcontext()

    def runs_packed(self, ctx: RequestContext) -> bool:
        """The packed forward serves the base model; a LoRA's weights live in peft's modules."""
        return self.packed is not None and ctx.lora is None

    def enable_packed(self, model: torch.nn.Module) -> None:
        """Run ``model``'s encoder packed (worker/modeling/packed.py) where wanted and supported.

        Load-time option ``packed: true|false`` forces it; by default it is on for CUDA.
        """
        self.packed = try_packed(model, self.spec.device, self.spec.loadtime.get("packed"))

    def pack(self, seqs: list[list[int]], token_types: list[list[int]] | None = None) -> PackedBatch:
        assert self.packed is not None
        return self.packed.pack(seqs, self.spec.device, token_types)

    def encode_packed(self, packed: PackedBatch) -> torch.Tensor:
        """The encoder's packed forward: ``[total_tokens, hidden]`` (only where :meth:`runs_packed`)."""
        assert self.packed is not None
        return self.packed(packed)

    def model_kwargs(self) -> dict[str, Any]:
        device = self.spec.device
        return {
            "dtype": torch_dtype(self.spec.precision, device),
            "attn_implementation": attn_implementation(device),
        }

    def param_bytes(self, module: torch.nn.Module | None) -> int:
        if module is None:
            return 0
        return sum(p.numel() * p.element_size() for p in module.parameters())
