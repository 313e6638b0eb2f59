"""HF transformers MoE families beyond the first three: compiled numerics against torch, and the families moec
refuses, refused with a message naming what and where."""

import numpy as np
import pytest
import torch

import moec
from moec.compiler.errors import ImportFailure, MoecError
from moec.models.hf import tiny_hf_model

from moec_testing import ATOL, prefill_and_decode, torch_last_logits

PROMPTS = ([5, 9, 2, 7, 1, 3, 8], [4, 4, 11, 6, 2, 9, 1, 12, 3, 5, 10])


@pytest.fixture(scope="module")
def family():
    """``family(name)``: the tiny model of a family and its import, made once for the file (the export is most of a
    build's time)."""
    from moec.compiler.importers import import_model

    made = {}

    def get(name):
        if name not in made:
            model = tiny_hf_model(name)
            made[name] = model, import_model(model)
        return made[name]
    return get


def _matches_torch(model, art, steps: int) -> None:
    """Prefill and ``steps`` greedy decode steps of PROMPTS against HF's forward over each history (float32)."""
    got, hist = prefill_and_decode(art, PROMPTS, steps)
    for i in range(len(got)):
        for b, p in enumerate(PROMPTS):
            np.testing.assert_allclose(got[i][b], torch_last_logits(model, hist[b][:len(p) + i]), rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "granitemoe", "phimoe"])
def test_family_matches_torch(family, name, tmp_path):
    """Prefill and 3 greedy decode steps of a batch of two against HF's forward over each history (float32).
    qwen3_moe: per-head QK-norms; glm4_moe: sigmoid scores with a correction bias, groups, shared experts;
    granitemoe: multipliers; phimoe: rotary frequencies computed in the forward, biases, LayerNorms."""
    model, imported = family(name)
    art = moec.compile(imported, tmp_path / "art", target="llvm")
    _matches_torch(model, art, 3)


def test_static_arange_before_rotary_is_not_a_position_source(family):
    """PhiMoE computes ``inv_freq = 1 / base ** (arange(0, d, 2) / d)`` in its forward: that arange (static
    length) is not the sequence's positions; only the arange of the sequence length is."""
    from moec.compiler.moe_structure import analyze
    from moec.compiler.graph import shape_of
    from moec.passes.paged_kv_attention import _bind_batch_to_one

    imported = family("phimoe")[1]  # test_family_matches_torch[phimoe]'s import
    structure = analyze(_bind_batch_to_one(imported.main, imported.num_inputs), imported.num_inputs)
    assert structure.position_sources and all(not isinstance(shape_of(v)[0], int) for v in structure.position_sources)


def _hf(cfg_name, cls_name, **kw):
    import transformers as tf

    torch.manual_seed(0)
    return getattr(tf, cls_name)(getattr(tf, cfg_name)(**kw)).eval()


def test_hybrid_layers_are_refused(tmp_path):
    """LFM2-MoE: a convolution layer with experts, then an attention layer. The first layer's router lies outside
    every attention layer: refused by name, not dropped."""
    model = _hf("Lfm2MoeConfig", "Lfm2MoeForCausalLM", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, intermediate_size=64,
                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_dense_layers=0,
                layer_types=["conv", "full_attention"], experts_implementation="batched_mm", attn_implementation="eager")
    with pytest.raises(MoecError, match="layers_0_feed_forward_gate_weight .* lies outside every decoder layer with self-attention"):
        moec.compile(model, tmp_path / "a", target="llvm")
    assert not (tmp_path / "a").exists()


def test_data_dependent_expert_loop_is_refused(tmp_path):
    """Experts as a loop over the experts that received tokens (``nonzero``; Mixtral's ``eager`` form): torch.export
    cannot trace it with dynamic axes. The refusal names the source line and says what to change."""
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                           experts_implementation="eager", attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(cfg).eval()
    with pytest.raises(ImportFailure, match=r"failed at modeling_mixtral\.py:\d+ .*experts_implementation=\"batched_mm\""):
        moec.compile(model, tmp_path / "b", target="llvm")
    assert not (tmp_path / "b").exists()


def test_conversion_failure_names_the_node(tmp_path):
    """A torch op TVM's importer fails on: the message names the exported node, its op and the model's source line."""
    import transformers as tf

    cfg = tf.JetMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_key_value_heads=2, kv_channels=16,
                          intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                          attn_implementation="eager")
    torch.manual_seed(0)
    with pytest.raises(ImportFailure, match=r"conversion failed at node '\w+' \([\w.]+, modeling_jetmoe\.py:\d+\)"):
        moec.compile(tf.JetMoeForCausalLM(cfg).eval(), tmp_path / "c", target="llvm")


def test_attention_sinks_are_refused(tmp_path):
    """gpt-oss concatenates a learned logit per head to the attention scores before the softmax (sinks): refused by
    name, not compiled without them."""
    model = _hf("GptOssConfig", "GptOssForCausalLM", vocab_size=128, hidden_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, intermediate_size=32,
                num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"],
                experts_implementation="batched_mm", attn_implementation="eager")
    with pytest.raises(MoecError, match=r"the attention at \w+ concatenates extra logits to its scores before the softmax "
                                        r"\(attention sinks"):
        moec.compile(model, tmp_path / "s", target="llvm")
    assert not (tmp_path / "s").exists()


def test_clamped_expert_ids_take_the_grouped_kernels(tmp_path, monkeypatch):
    """transformers 5.17's batched_mm clamps the top-k ids to [0, E - 1] before gathering the expert weights (later
    versions only under expert parallelism). Exported with that clamp (an integer clamp imports as maximum, then
    minimum), every MoE layer still takes the grouped expert kernels, with no UnreplacedExperts warning, and the
    numerics match torch."""
    import json
    import warnings

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from moec.compiler.build import UnreplacedExperts
    from moec.compiler.importers import import_model

    plain = ALL_EXPERTS_FUNCTIONS["batched_mm"]
    seen = []

    def clamped(self, hidden_states, top_k_index, top_k_weights):  # 5.17's clamp is of the flattened [T * K] ids
        seen.append(1)
        ids = top_k_index.reshape(-1).clamp(0, self.num_experts - 1).reshape(top_k_index.shape)
        return plain(self, hidden_states, ids, top_k_weights)

    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "batched_mm", clamped)
    model = tiny_hf_model("olmoe")
    imported = import_model(model)
    assert seen  # the export traced the clamping forward
    assert "R.minimum" in imported.mod.script()  # ... whose clamp imported as maximum / minimum
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreplacedExperts)
        art = moec.compile(imported, tmp_path / "art", target="llvm")
    manifest = json.loads((art / "manifest.json").read_text())
    layers = model.config.num_hidden_layers
    grouped = manifest["options"]["grouped_experts"]
    assert grouped["replaced"] == {"decode": layers, "prefill": layers}, grouped
    _matches_torch(model, art, 2)
