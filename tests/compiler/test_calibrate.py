"""moec calibrate: co-activation groups, least-squares coarse routers, the calibration directory, compile with it."""

import json
import shutil

import numpy as np
import pytest
import torch

import moec
from moec.compiler import cli
from moec.compiler.calibrate import (CALIBRATION, TENSORS, calibrate, coactivation, coactivation_groups, fit_coarse_lstsq, group_lse,
                                     load_calibration, prefetch_recall, within_share)
from moec.compiler.errors import MoecError
from moec.models.cascade import cascaded, flat_topk
from moec.passes.cascade_gating import CascadeSpec, data_free_groups, fit_coarse

from moec_testing import ATOL

G = 4  # groups of the tiny test model's 8 experts


def _router_inputs(model, windows: np.ndarray) -> list[np.ndarray]:
    """Per layer, the router inputs [T, D] of the torch model on ``windows``."""
    seen = [[] for _ in model.layers]
    hooks = [layer.moe.router.register_forward_pre_hook(lambda _m, a, _i=i: seen[_i].append(a[0].numpy()))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        model(torch.from_numpy(windows))
    for h in hooks:
        h.remove()
    return [np.concatenate(s) for s in seen]


# ---------------------------------------------------------------------------- grouping and fit


def test_coactivation_groups_recover_planted_clusters():
    rng = np.random.default_rng(3)
    planted = rng.permutation(16).reshape(4, 4)  # expert ids of each planted cluster
    ids = []
    for _ in range(3000):  # top-2 mostly inside one planted cluster, sometimes across
        if rng.random() < 0.8:
            ids.append(rng.choice(planted[rng.integers(4)], 2, replace=False))
        else:
            ids.append(rng.choice(16, 2, replace=False))
    counts = coactivation(np.asarray(ids), 16)
    assert counts.shape == (16, 16) and np.all(counts == counts.T) and not np.diag(counts).any()
    groups = coactivation_groups(counts, 4)
    assert groups == coactivation_groups(counts, 4)  # deterministic
    assert sorted(map(sorted, groups)) == sorted(sorted(m.tolist()) for m in planted)
    # balanced for group counts that are not powers of two, and never worse than the start it is given
    free = [list(range(i, 16, 8)) for i in range(8)]
    eight = coactivation_groups(counts, 8, init=free)
    assert sorted(len(g) for g in eight) == [2] * 8 and sorted(sum(eight, [])) == list(range(16))
    assert within_share(counts, eight) >= within_share(counts, free)
    six = coactivation_groups(coactivation(rng.integers(0, 12, (500, 3)), 12), 3)
    assert sorted(len(g) for g in six) == [4, 4, 4]


def test_fit_coarse_lstsq():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 16))
    w = rng.standard_normal((8, 16))
    # one expert per group: the group log-sum-exp is the logit itself, which the fit recovers exactly
    cr, b = fit_coarse_lstsq(x, x @ w.T, np.arange(8).reshape(8, 1))
    np.testing.assert_allclose(cr, w, atol=1e-5)
    np.testing.assert_allclose(b, 0, atol=1e-5)
    groups = np.arange(8).reshape(4, 2)
    cr, b = fit_coarse_lstsq(x, x @ w.T, groups)
    resid = x @ cr.T + b - group_lse(x @ w.T, groups)
    assert cr.shape == (4, 16) and b.shape == (4,) and np.abs(resid.mean(0)).max() < 1e-8  # the bias centres it


# ---------------------------------------------------------------------------- calibrate (TVM path: ONNX / .pt2)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "calib.npy"
    np.save(path, np.random.default_rng(11).integers(1, 256, 24 * 128))
    return path


@pytest.fixture(scope="module")
def calibrated(zoo, tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "tiny"
    calibrate(zoo.source("tiny", "onnx"), tokens, out, groups=[2, G], context=128, check_every=6)
    return load_calibration(out)


def test_calibrate_onnx_groups_and_coarse_fit(zoo, calibrated):
    model, _ = zoo.model("tiny")
    meta = calibrated.meta
    assert calibrated.group_counts == [2, G] and meta["data"]["tokens"] == 24 * 128
    assert meta["data"]["check_tokens"] == 4 * 128 and meta["data"]["kind"] == "tokens"
    held_out = np.random.default_rng(12).integers(1, 256, (6, 128))  # other tokens than the calibration's
    xs = _router_inputs(model, held_out)
    groups, coarse = calibrated.cascade_inputs(G)
    for i, layer in enumerate(model.layers):
        w = layer.moe.router.weight.detach().numpy()
        assert meta["model"]["moe_layers"][i]["num_experts"] == 8
        grp = np.asarray(groups[i])
        assert grp.shape == (G, 2) and sorted(grp.reshape(-1).tolist()) == list(range(8))  # balanced partition
        x = xs[i]
        target = group_lse(x @ w.T, grp)
        cal = ((x @ coarse[i][0].T + coarse[i][1] - target) ** 2).mean()
        cr, b = fit_coarse(w, grp, layer.post_attention_norm.weight.detach().numpy())  # the data-free fit, same groups
        free = ((x @ cr.T + b - target) ** 2).mean()
        assert cal < free, (i, cal, free)  # fitted on the model's hidden states: better on held-out tokens
        # the recorded check figures say the same about the calibration's own held-out windows
        check = meta["groupings"][str(G)]["layers"][str(i)]["check"]
        assert check["coarse_fit"]["calibrated"]["lse_rmse"] < check["coarse_fit"]["data_free"]["lse_rmse"]
        assert set(check["topk_agreement"]["calibrated"]) == {"1", "2", "3", "4"}
        assert check["topk_agreement"]["calibrated"][str(G)] == 1.0  # every group kept: the flat router
    # the prefetch predictor of layer 1 from layer 0's router input (router inputs recorded by TVM from the export)
    pre = meta["prefetch"]["layers"]
    assert list(pre) == ["1"] and pre["1"]["from"] == 0 and meta["prefetch"]["target"] == 0.9
    pw, pb = calibrated.prefetch_inputs()[1]
    assert pw.shape == (8, 64) and pb.shape == (8,) and pw.flags["C_CONTIGUOUS"]
    assert 0 <= pre["1"]["check"]["extra_for_target"] <= 6 and set(pre["1"]["check"]["recall"]) == {str(n) for n in range(7)}


def test_calibrate_trained_dir_uses_torch_and_matches_its_export(trained_tiny, tmp_path):
    from moec.compiler.importers import import_model
    from moec.compiler.moe_structure import analyze
    from moec.models.train import corpus_of, load_trained

    out = calibrate(trained_tiny, "train", tmp_path / "c", groups=[G], context=256, max_tokens=8192)
    calib = load_calibration(out)
    assert calib.meta["model"]["kind"] == "trained" and calib.meta["data"]["split"] == "train"
    model, meta = load_trained(trained_tiny)
    stream = corpus_of(meta).tokens("heldout")
    heldout = np.stack([stream[s:s + 256] for s in np.linspace(0, stream.size - 256, 24).astype(int)])  # across its files
    xs = _router_inputs(model, heldout)
    groups, coarse = calib.cascade_inputs(G)
    shares = []
    for i, layer in enumerate(model.layers):
        w = layer.moe.router.weight.detach().numpy()
        cal, free = np.asarray(groups[i]), np.asarray(data_free_groups(w, G))
        assert sorted(len(g) for g in cal) == [2] * G and sorted(cal.reshape(-1).tolist()) == list(range(8))
        x = xs[i]
        counts = coactivation(flat_topk(torch.from_numpy(x), layer.moe.router.weight.detach(), 2).numpy(), 8)
        shares.append((within_share(counts, cal), within_share(counts, free)))
        # the coarse router against the data-free one for the same groups, on held-out text
        target = group_lse(x @ w.T, cal)
        err = ((x @ coarse[i][0].T + coarse[i][1] - target) ** 2).mean()
        cr, b = fit_coarse(w, cal, layer.post_attention_norm.weight.detach().numpy())
        err_free = ((x @ cr.T + b - target) ** 2).mean()
        assert err < 0.5 * err_free, (i, err, err_free)
    cal_share, free_share = np.mean(shares, axis=0)
    assert cal_share > free_share, shares  # held-out text: more co-activated pairs kept inside a group
    # the router weights it recorded are the ones the ONNX export carries: compile accepts the calibration for it
    imp = import_model(trained_tiny / "model.onnx")
    calib.check_model(analyze(imp.main, imp.num_inputs), imp.main, imp.num_inputs, dict(zip(imp.weight_names(), imp.weights)))
    # prefetch predictor of layer 1 from layer 0's router input, fitted on the fit windows: on held-out text it
    # finds more of layer 1's routed experts than layer 1's router applied to layer 0's input
    pre = calib.meta["prefetch"]["layers"]
    assert list(pre) == ["1"] and pre["1"]["from"] == 0
    pw, pb = calib.prefetch_inputs()[1]
    x0, x1 = xs
    routed = np.argsort(-(x1 @ model.layers[1].moe.router.weight.detach().numpy().T), axis=1)[:, :2]
    ratio = (model.layers[1].post_attention_norm.weight / model.layers[0].post_attention_norm.weight).detach().numpy()
    fitted = prefetch_recall(x0 @ pw.T + pb, routed, 2, 0)
    plain = prefetch_recall((x0 * ratio) @ model.layers[1].moe.router.weight.detach().numpy().T, routed, 2, 0)
    assert fitted > plain + 0.1, (fitted, plain)
    assert pre["1"]["check"]["recall"]["0"] > pre["1"]["check"]["recall_uncalibrated"]["0"] + 0.1
    chk = pre["1"]["check"]
    assert chk["recall"]["2"] >= chk["recall"]["0"] and sorted(chk["recall"]) == [str(n) for n in range(7)]
    n = chk["extra_for_target"]  # the fewest extra experts whose recall reaches 90% (8 experts: always some)
    assert chk["recall"][str(n)] >= 0.9 and (n == 0 or chk["recall"][str(n - 1)] < 0.9)
    # offloaded experts compiled with it: the artifact carries the predictor, the runtime prefetches with it, and
    # the logits are those of loading on demand (prefetch never changes results)
    art = moec.compile(trained_tiny / "model.onnx", tmp_path / "slots", target="llvm", expert_slots=8, calibration=out)
    man = json.loads((art / "manifest.json").read_text())
    assert man["options"]["prefetch"]["layers"] == [1] and man["options"]["prefetch"]["check"] == pre
    prompts = [stream[:40].tolist(), stream[500:517].tolist()]
    runs = []
    for extra in (None, 0, "auto"):
        e = moec.load(art, max_batch=2, max_total_tokens=256, expert_prefetch=extra)
        seqs, lg = e.prefill(prompts)
        outs, toks = [np.asarray(lg)], np.asarray(lg).argmax(-1)
        for _ in range(8):
            lg = np.asarray(e.decode(seqs, toks.tolist()))
            outs.append(lg)
            toks = lg.argmax(-1)
        runs.append((e, outs))
    for a, b, c in zip(runs[0][1], runs[1][1], runs[2][1]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert runs[1][0].experts.extra == 0 and runs[2][0].experts.extra == [0, n]  # "auto": the calibration's choice
    e = runs[1][0]
    w, b, r = e.experts.predictors[1]
    np.testing.assert_array_equal(w, pw)
    np.testing.assert_array_equal(b, pb)
    assert float(r) == 1.0 and e.experts.cache.stats.prefetched > 0 and e.experts.cache.stats.prefetch_used > 0


# ---------------------------------------------------------------------------- compile with a calibration


def _specs(calib, keep):
    groups, coarse = calib.cascade_inputs(G)
    return {i: CascadeSpec(np.asarray(g), coarse[i][0], coarse[i][1], keep) for i, g in groups.items()}


def test_compile_with_calibration_round_trip(zoo, calibrated, tmp_path):
    model, _ = zoo.model("tiny")
    calib_dir = tmp_path / "calib"  # a copy whose default g is 2, to see that compile takes it
    shutil.copytree(calibrated.root, calib_dir)
    meta = json.loads((calib_dir / CALIBRATION).read_text())
    meta["groupings"][str(G)]["keep_default"] = 2
    (calib_dir / CALIBRATION).write_text(json.dumps(meta))
    out = moec.compile(zoo.source("tiny", "onnx"), tmp_path / "art", calibration=calib_dir, cascade_groups=G)
    manifest = json.loads((out / "manifest.json").read_text())
    cascade = manifest["options"]["cascade"]
    assert cascade["keep"] == 2 and cascade["calibration"]["format"] == "moec-calibration/1"
    assert cascade["calibration"]["sha256"][TENSORS] == calibrated.meta["files"][TENSORS]
    assert (out / "cascade_calibration.json").read_bytes() == (calib_dir / CALIBRATION).read_bytes()
    assert "cascade_calibration.json" in manifest["files"]
    groups, _ = calibrated.cascade_inputs(G)
    assert cascade["groups"] == {str(i): g for i, g in groups.items()}
    assert all(v.startswith("calibrated") for v in cascade["coarse"].values())
    prompts = [list(range(5, 45)), [7, 3, 9, 200, 11, 12, 13]]
    engine = moec.load(out)
    _, logits = engine.prefill(prompts, logit_positions=[list(range(len(p))) for p in prompts])
    with torch.no_grad():
        flat = [model(torch.tensor([p]))[0].numpy() for p in prompts]
        with cascaded(model, _specs(calibrated, 2)):
            ref = [model(torch.tensor([p]))[0].numpy() for p in prompts]
        with cascaded(model, _specs(calibrated, G)):  # g = G with the calibrated groups: the original model
            every = [model(torch.tensor([p]))[0].numpy() for p in prompts]
    for got, want, f, e in zip(logits, ref, flat, every):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-4)  # the compiled cascade is the reference's
        np.testing.assert_allclose(e, f, atol=1e-5, rtol=1e-5)
    assert max(np.abs(r - f).max() for r, f in zip(ref, flat)) > 1e-2  # and g < G does change some tokens' routing


# ---------------------------------------------------------------------------- refusals


def _compile_error(zoo, tmp_path, calib, name="tiny", groups=G):
    with pytest.raises(MoecError) as err:
        moec.compile(zoo.source(name, "onnx"), tmp_path / "art", calibration=calib, cascade_groups=groups)
    assert not (tmp_path / "art").exists()
    return str(err.value)


def test_bad_calibrations_refused(zoo, calibrated, tmp_path, capsys):
    root = calibrated.root
    assert "calibrated for 2, 4 groups, not 8" in _compile_error(zoo, tmp_path, root, groups=8)
    assert "calibration needs cascade groups (--cascade-groups G) or offloaded experts" in _compile_error(zoo, tmp_path, root, groups=None)
    assert f"{root / CALIBRATION}: layer 0 was calibrated with 8 experts" in _compile_error(zoo, tmp_path, root, "tiny-deepseek", 8)

    def broken(edit):
        d = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root, d)
        edit(d)
        return d

    def set_sha(d):
        meta = json.loads((d / CALIBRATION).read_text())
        meta["model"]["moe_layers"][1]["router_sha256"] = "0" * 64
        (d / CALIBRATION).write_text(json.dumps(meta))

    d = broken(set_sha)
    assert f"{d / CALIBRATION}: layer 1's router weight" in _compile_error(zoo, tmp_path, d)
    d = broken(lambda d: (d / TENSORS).unlink())
    assert f"{d / TENSORS}: missing" in _compile_error(zoo, tmp_path, d)
    d = broken(lambda d: (d / TENSORS).write_bytes((d / TENSORS).read_bytes()[:-8] + b"\0" * 8))
    assert f"{d / TENSORS}: SHA-256 does not match" in _compile_error(zoo, tmp_path, d)
    def no_prefetch(d):  # a calibration made before moec fitted prefetch predictors
        meta = json.loads((d / CALIBRATION).read_text())
        del meta["prefetch"]
        (d / CALIBRATION).write_text(json.dumps(meta))

    d = broken(no_prefetch)
    with pytest.raises(MoecError, match="holds no prefetch predictors"):
        moec.compile(zoo.source("tiny", "onnx"), tmp_path / "art", calibration=d, expert_slots=8)
    assert not (tmp_path / "art").exists()
    d = broken(lambda d: (d / CALIBRATION).write_text("{not json"))
    assert f"{d / CALIBRATION}: corrupt" in _compile_error(zoo, tmp_path, d)
    assert "no such calibration directory" in _compile_error(zoo, tmp_path, tmp_path / "nowhere")
    # the CLI: one line naming the file, exit code 2, no artifact
    d = broken(lambda d: (d / CALIBRATION).unlink())
    rc = cli.main(["compile", str(zoo.source("tiny", "onnx")), "-o", str(tmp_path / "art"), "--cascade-groups", "4",
                   "--calibration", str(d)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("moec: error:") and str(d / CALIBRATION) in err[-1]
    assert not (tmp_path / "art").exists()


def test_calibrate_refuses_bad_inputs(zoo, tokens, tmp_path):
    with pytest.raises(MoecError, match="group-limited"):
        calibrate(zoo.source("tiny-deepseek", "onnx"), tokens, tmp_path / "c", context=128)
    with pytest.raises(MoecError, match="G must be >= 2 and divide the 8 experts"):
        calibrate(zoo.source("tiny", "onnx"), tokens, tmp_path / "c", groups=[3], context=128)
    with pytest.raises(MoecError, match="needs a corpus"):
        calibrate(zoo.source("tiny", "onnx"), "train", tmp_path / "c")
    with pytest.raises(MoecError, match="fewer than two windows"):
        calibrate(zoo.source("tiny", "onnx"), tokens, tmp_path / "c", context=4096)
    assert not (tmp_path / "c").exists()
