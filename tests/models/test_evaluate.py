"""The quality harness: windows, compiled-vs-torch agreement, perturbation detection, CLI report."""

import copy
import json

import numpy as np
import pytest
import torch

import moec
from moec.compiler import cli
from moec.compiler.errors import MoecError
from moec.models.evaluate import ArtifactSubject, TorchSubject, evaluate, topk_overlap, window_starts
from moec.models.train import corpus_of, load_trained

CONTEXT = 1024  # the long-context evaluation length on CPU


def test_windows_score_each_token_once():
    starts = window_starts(10_000, 1024, 512, None)
    scored = np.concatenate([np.arange(s + 512, s + 1024) for s in starts])
    assert len(np.unique(scored)) == scored.size and scored.min() == 512
    assert len(window_starts(10_000, 1024, 512, 1500)) == 3
    with pytest.raises(MoecError, match="stride"):
        window_starts(10_000, 16, 16, None)
    with pytest.raises(MoecError, match="fewer than one window"):
        window_starts(100, 1024, 512, None)


def test_topk_overlap():
    a = [np.array([[0, 1], [2, 3]])]
    b = [np.array([[1, 0], [2, 5]])]
    assert topk_overlap(a, b) == [0.75]


@pytest.fixture(scope="module")
def trained(trained_tiny):
    model, meta = load_trained(trained_tiny)
    return model, meta, corpus_of(meta)


@pytest.fixture(scope="module")
def compiled(trained_tiny, tmp_path_factory):
    return moec.compile(trained_tiny / "model.onnx", tmp_path_factory.mktemp("art") / "tiny-text", target="llvm")


def test_compiled_perplexity_matches_torch(trained, compiled):
    model, _, corpus = trained
    report = evaluate(ArtifactSubject(compiled, mode="prefill"), corpus, context=CONTEXT, max_tokens=8192,
                      reference=TorchSubject(model))
    cmp = report["comparison"]
    assert abs(cmp["perplexity_delta_rel"]) < 1e-3, report  # within 0.1%
    assert cmp["next_token_agreement"] > 0.999
    assert report["tokens_scored"] == 8192 and report["context"] == CONTEXT
    assert report["routing"] is None and "does not expose" in report["routing_note"]
    ref = report["reference"]
    assert len(ref["routing"]) == 2 and abs(sum(ref["routing"][0]["load"]) - 1) < 1e-4


def test_decode_path_matches_torch(trained, compiled):
    model, _, corpus = trained
    report = evaluate(ArtifactSubject(compiled, mode="decode", batch_size=4), corpus, context=CONTEXT, stride=128,
                      max_tokens=512, reference=TorchSubject(model))
    assert report["mode"] == "decode" and report["tokens_scored"] == 512
    assert abs(report["comparison"]["perplexity_delta_rel"]) < 1e-3, report


def test_random_routing_is_detected(trained):
    model, _, corpus = trained
    perturbed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in perturbed.layers:  # routing to random experts
            w = layer.moe.router.weight
            w.copy_(torch.randn(w.shape, generator=gen) * w.std() * 5)
    report = evaluate(TorchSubject(perturbed, "perturbed"), corpus, context=CONTEXT, max_tokens=4096,
                      reference=TorchSubject(model, "trained"))
    cmp = report["comparison"]
    assert cmp["perplexity_delta_rel"] > 0.05, cmp  # clearly worse
    assert max(cmp["topk_overlap_per_layer"]) < 0.7 and cmp["next_token_agreement"] < 0.99
    same = evaluate(TorchSubject(model, "a"), corpus, context=CONTEXT, max_tokens=1024, reference=TorchSubject(model, "b"))
    assert same["comparison"]["perplexity_delta_rel"] == 0.0 and same["comparison"]["topk_overlap_per_layer"] == [1.0, 1.0]


def test_cli_eval_side_by_side(trained_tiny, compiled, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = cli.main(["eval", str(compiled), "--reference", str(trained_tiny), "--context", str(CONTEXT),
                   "--max-tokens", "1024", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"perplexity", "reference", "comparison", "command", "tokens_scored"} <= set(report)
    assert "perplexity delta" in capsys.readouterr().out
    # an artifact alone does not know its tokenizer
    assert cli.main(["eval", str(compiled), "--max-tokens", "512"]) == 2
    assert cli.main(["eval", str(tmp_path)]) == 2


def test_eval_on_user_text(trained_tiny, tmp_path):
    f = tmp_path / "user.py"
    f.write_text("def add(a, b):\n    return a + b\n" * 200)
    out = tmp_path / "r.json"
    assert cli.main(["eval", str(trained_tiny), "--data", str(f), "--context", "256", "--max-tokens", "512", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["data"]["split"] == "user"
