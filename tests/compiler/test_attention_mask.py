"""Attention masks: causal masks pass unread, sliding windows are found and bound the runtime's sequences, other masks
are refused (compiler/attention_mask.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import moec
from moec.compiler.attention_mask import _window_of
from moec.compiler.errors import ContextTooLong, UnsupportedModel

from moec_testing import ATOL, torch_last_logits

WINDOW = 8


def _afmoe(window: int):
    """A tiny AFMoE (HF transformers' class): layer 0 attends over a sliding window, layer 1 causally; random
    routers (the class initialises them to zero: every score ties)."""
    import transformers as tf

    cfg = tf.AfmoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, num_dense_layers=0, num_shared_experts=1,
                         sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                         experts_implementation="batched_mm", attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.AfmoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "router.gate" in name or "expert_bias" in name:
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    model = _afmoe(WINDOW)
    art = tmp_path_factory.mktemp("window") / "art"
    moec.compile(model, art, target="llvm")
    return model, art


def test_window_patterns():
    n = 12
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    neg = np.float32(np.finfo(np.float32).min)
    causal = np.where(k <= q, 0.0, neg).astype(np.float32)
    assert _window_of(causal, "m") is None
    assert _window_of(np.where((k <= q) & (k > q - 5), 0.0, -np.inf).astype(np.float32), "m") == 5
    assert _window_of((k <= q) & (k > q - 3), "m") == 3  # a boolean mask
    with pytest.raises(UnsupportedModel, match="positional bias"):  # ALiBi: -slope * distance where visible
        _window_of(np.where(k <= q, -0.5 * (q - k), neg).astype(np.float32), "m")
    with pytest.raises(UnsupportedModel, match="neither causal nor a causal sliding window"):  # chunks of 4 tokens
        _window_of(np.where((k <= q) & (k // 4 == q // 4), 0.0, neg).astype(np.float32), "m")
    with pytest.raises(UnsupportedModel, match="neither causal"):  # bidirectional
        _window_of(np.zeros((n, n), np.float32), "m")


def test_structure_records_the_window():
    """Layer 0's mask (``kv > q - W`` in the export) is read and gives W; layer 1's causal mask is left unread."""
    from moec.compiler.importers import import_model
    from moec.compiler.moe_structure import analyze

    imported = import_model(_afmoe(WINDOW))
    structure = analyze(imported.main, imported.num_inputs, imported.source_name)
    assert [layer.attention.sliding_window for layer in structure.layers] == [None, None]  # before the masks are read
    structure.find_windows(imported.main, imported.num_inputs, imported.source_name)
    assert [layer.attention.sliding_window for layer in structure.layers] == [WINDOW, None]
    assert structure.max_context == WINDOW and structure.to_dict()["max_context"] == WINDOW
    assert f"window {WINDOW}" in structure.table().splitlines()[2]  # layer 0's row


def test_windowed_model_matches_torch_and_refuses_longer_sequences(windowed):
    """Within the window the compiled model equals torch; a sequence never grows past it (prefill, decode, generate
    and the scheduler refuse, and nothing changes)."""
    from moec.runtime.scheduler import Request, RequestRefused, Scheduler

    model, art = windowed
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["model"]["max_context"] == WINDOW
    assert [layer["attention"]["sliding_window"] for layer in manifest["structure"]["layers"]] == [WINDOW, None]
    engine = moec.load(art)
    assert engine.max_context == WINDOW
    prompts = ([5, 9, 2, 7, 1], [4, 4, 11])
    seqs, logits = engine.prefill([list(p) for p in prompts])
    hist = [list(p) for p in prompts]
    for step in range(3):  # up to 8 tokens in the first sequence
        for b, h in enumerate(hist):
            np.testing.assert_allclose(logits[b], torch_last_logits(model, h), rtol=ATOL, atol=ATOL)
        nxt = logits.argmax(-1)
        for h, t in zip(hist, nxt):
            h.append(int(t))
        logits = engine.decode(seqs, nxt)
    assert engine.lengths[seqs[0]] == WINDOW
    with pytest.raises(ContextTooLong, match=rf"sequence {seqs[0]} would hold 9 tokens; the model's attention sees at most "
                                             rf"{WINDOW} \(the sliding window of layer 0\)"):
        engine.decode(seqs, logits.argmax(-1))
    assert [engine.lengths[s] for s in seqs] == [8, 6]  # the refused step changed nothing
    with pytest.raises(ContextTooLong, match="a new sequence would hold 9 tokens"):
        engine.prefill([list(range(3, 12))])
    with pytest.raises(ContextTooLong, match="a new sequence would hold 9 tokens"):
        engine.generate([[3, 4, 5]], max_new_tokens=7)
    assert len(engine.lengths) == 2
    for s in seqs:
        engine.release(s)
    assert len(engine.generate([[3, 4, 5]], max_new_tokens=6)[0]) == 6  # 8 tokens cached at the longest
    sched = Scheduler(engine)
    with pytest.raises(RequestRefused, match="sliding window"):
        sched.submit(Request([1, 2, 3, 4], max_new_tokens=6))
    sched.submit(Request([1, 2, 3, 4], max_new_tokens=5))


def test_generate_cli_refuses_past_the_window(windowed):
    _, art = windowed
    run = subprocess.run([sys.executable, "-m", "moec.compiler.cli", "generate", str(art), "--prompt-ids", "1,2,3,4,5,6",
                          "--max-new-tokens", "4"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "caches up to 9 tokens, more than the model's sliding window" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("cls,kw,want", [
    ("Cohere2Moe", dict(num_experts=8, layer_types=["sliding_attention", "full_attention"]), [6, None]),
    ("ExaoneMoe", dict(num_experts=8, num_shared_experts=1, layer_types=["sliding_attention", "full_attention"]), [6, None]),
    ("Mixtral", dict(num_local_experts=8), [6, 6]),  # one window for every layer
    ("Qwen2Moe", dict(num_experts=8, use_sliding_window=True, max_window_layers=1, decoder_sparse_step=1, mlp_only_layers=[],
                      shared_expert_intermediate_size=32), [6, None]),
])
def test_windows_of_other_families(cls, kw, want):
    """The windows as each family's export computes its masks (HF's own classes, torch.export)."""
    import transformers as tf

    from moec.compiler.importers import import_model
    from moec.compiler.moe_structure import analyze

    cfg = getattr(tf, f"{cls}Config")(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256, head_dim=16, intermediate_size=64,
                                      moe_intermediate_size=32, num_experts_per_tok=2, sliding_window=6,
                                      experts_implementation="batched_mm", attn_implementation="eager", **kw)
    torch.manual_seed(0)
    imported = import_model(getattr(tf, f"{cls}ForCausalLM")(cfg).eval())
    structure = analyze(imported.main, imported.num_inputs, imported.source_name)
    structure.find_windows(imported.main, imported.num_inputs, imported.source_name)
    assert [layer.attention.sliding_window for layer in structure.layers] == want


def test_window_of_an_onnx_export(tmp_path):
    """The same model through ONNX (the exporter's Greater / Sub / Where ops): the same windows."""
    from moec.compiler.importers import import_model
    from moec.compiler.moe_structure import analyze
    from moec.models.export import save_onnx

    path = save_onnx(_afmoe(6), 128, tmp_path / "m.onnx")
    imported = import_model(path)
    structure = analyze(imported.main, imported.num_inputs, imported.source_name)
    structure.find_windows(imported.main, imported.num_inputs, imported.source_name)
    assert [layer.attention.sliding_window for layer in structure.layers] == [6, None]


class _MaskedReference(torch.nn.Module):
    """The reference MoE with another mask: ``alibi`` adds -slope_h |q - k| (slopes a per-head table) to the causal
    mask; ``chunked`` lets a query see only the keys of its 4-token chunk."""

    def __init__(self, kind: str):
        super().__init__()
        from moec.models import build_reference, get_config

        self.kind, self.inner = kind, build_reference(get_config("tiny"))
        self.config = self.inner.config
        self.register_buffer("slopes", torch.tensor([2.0 ** -(i + 1) for i in range(self.inner.config.num_heads)]))

    def forward(self, input_ids, attention_mask):
        m = self.inner
        b, s = input_ids.shape
        x = m.embed_tokens(input_ids)
        pos = torch.arange(s)
        cos, sin = m.rotary(pos)
        allowed = torch.ones(s, s, dtype=torch.bool).tril()
        if self.kind == "chunked":
            chunk = torch.floor(pos.float() / 4.0)
            allowed = allowed & (chunk[:, None] == chunk[None, :])
        allowed = allowed[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        if self.kind == "alibi":
            mask = mask - self.slopes[None, :, None, None] * (pos[:, None] - pos[None, :]).abs()
        for layer in m.layers:
            x = layer(x, cos, sin, mask)
        return m.lm_head(m.norm(x))


@pytest.mark.parametrize("kind,match", [("alibi", "values other than 0 and the masking value"),
                                        ("chunked", "neither causal nor a causal sliding window")])
def test_other_masks_are_refused(kind, match, tmp_path):
    """A positional bias or a chunked mask would be dropped by the paged attention: refused at compile, nothing
    written."""
    with pytest.raises(UnsupportedModel, match=match):
        moec.compile(_MaskedReference(kind).eval(), tmp_path / "art", target="llvm")
    assert not (tmp_path / "art").exists()


class _PositionsReference(torch.nn.Module):
    """The reference MoE with other positions: ``absolute`` adds a learned table looked up by the positions to the
    token embeddings; ``from_mask`` takes the rotary positions from a cumulative sum of the attention mask."""

    def __init__(self, kind: str):
        super().__init__()
        from moec.models import build_reference, get_config

        self.kind, self.inner = kind, build_reference(get_config("tiny"))
        self.config = self.inner.config
        self.wpe = torch.nn.Embedding(256, self.config.hidden_size)

    def forward(self, input_ids, attention_mask):
        m = self.inner
        b, s = input_ids.shape
        x = m.embed_tokens(input_ids)
        pos = torch.arange(s)
        if self.kind == "absolute":
            x = x + self.wpe(pos)[None]
        else:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[0]
        cos, sin = m.rotary(pos)
        allowed = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        for layer in m.layers:
            x = layer(x, cos, sin, mask)
        return m.lm_head(m.norm(x))


@pytest.mark.parametrize("kind,match", [
    ("absolute", r"the weight \w*wpe\w* is looked up by the sequence's positions at \w+ \(a learned absolute position"),
    ("from_mask", r"the rotary embedding's positions at \w+ are computed from the input attention_mask"),
])
def test_positions_moec_cannot_supply_are_refused(kind, match, tmp_path):
    """In the cached forward each chunk's aranges would start at 0: positions that are not the rotary embedding's
    arange of the sequence would be silently wrong after the first chunk, so they are refused. (The integer clamp
    of ``from_mask`` imports: ``clamp(min=0)`` of int64 positions.)"""
    with pytest.raises(UnsupportedModel, match=match):
        moec.compile(_PositionsReference(kind).eval(), tmp_path / "art", target="llvm")
    assert not (tmp_path / "art").exists()
