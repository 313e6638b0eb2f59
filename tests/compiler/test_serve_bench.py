"""`moec bench` end to end on a tiny shape: the JSON schema, the plot file, refusals (not speed)."""

import json

import pytest

from moec.compiler.cli import main
from moec.compiler.serve_bench import SHAPES, _kv_elements, build_hf, floor_ms


def test_bench_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--shape", "tiny-olmoe", "--streams", "1,2", "--contexts", "24,40", "--steps", "3",
               "--systems", "moec-paged,hf-eager,moec-bf16", "--prefill-chunk", "32", "--work", str(tmp_path / "work"),
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["prefill_chunk"] == 32  # the prompts (21 and 37 tokens) packed into calls of 32 tokens
    assert doc["benchmark"] == "serve" and doc["command"].startswith("moec bench") and doc["git_commit"] and doc["complete"]
    import transformers

    assert doc["versions"]["transformers"] == transformers.__version__ and doc["versions"]["tvm"]  # (the export's and runtime's)
    # the two cache kinds share the model's weights file on disk (one hard-linked to the other)
    work = tmp_path / "work" / "tiny-olmoe-float32"
    a, b = (work / f"art-{k}-cpu" / "weights.safetensors" for k in ("paged", "bf16"))
    assert a.samefile(b) and a.stat().st_nlink == 2
    assert list(doc["systems"]) == ["hf-eager", "moec-paged", "moec-bf16"]  # HF first, then in the order given
    assert doc["systems"]["moec-bf16"]["points"][0]["kv_bytes_per_token"] == 2 * _kv_elements(build_hf("tiny-olmoe").config)
    assert doc["copy_bandwidth_GBps"] > 0
    cfg = build_hf("tiny-olmoe").config
    for name in ("moec-paged", "hf-eager"):
        pts = doc["systems"][name]["points"]
        assert [(p["streams"], p["context"]) for p in pts] == [(1, 24), (1, 40), (2, 24), (2, 40)]
        for p in pts:
            assert "error" not in p, p
            assert 0 < p["tpot_ms_median"] <= p["tpot_ms_p99"] and p["ttft_ms"] > 0
            assert p["kv_bytes_per_token"] == 4 * _kv_elements(cfg)  # float32 cache, both systems
            assert p["decode_tokens_per_s"] == pytest.approx(p["streams"] / p["tpot_ms_median"] * 1e3)
            # moec: a warm-up step, then 2 timed; HF (eager: no warm-up) times all 3
            assert len(p["step_ms"]) == (2 if name.startswith("moec") else 3)
            if name.startswith("moec"):
                assert p["graph_steps"] == {"all": 0, "greedy": 0}  # no CUDA graphs on the CPU
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_floor_grows_with_streams_and_context():
    model = build_hf("tiny-olmoe")
    kv = 4 * _kv_elements(model.config)
    a, b, c = (floor_ms(model, s, n, kv, 1e11) for s, n in [(1, 64), (8, 64), (8, 512)])
    assert a < b < c
    # one stream activates top-k experts per layer: weights other than experts + k experts + its KV
    assert SHAPES["tiny-olmoe"][1]["num_experts_per_tok"] == 2


def test_bench_refusals(tmp_path, capsys):
    base = ["bench", "--shape", "tiny-olmoe", "--streams", "1", "--contexts", "24", "--steps", "3",
            "--work", str(tmp_path), "--json", str(tmp_path / "x.json")]
    assert main(base + ["--systems", "vllm"]) == 2
    assert "unknown system 'vllm'" in capsys.readouterr().err
    assert main(base[:2] + ["llama-70b"] + base[3:] + ["--systems", "hf-eager"]) == 2
    assert "unknown model shape" in capsys.readouterr().err
    assert main(base[:-6] + ["--contexts", "3"] + base[-4:] + ["--systems", "hf-eager"]) == 2
    steps = base.index("--steps") + 1
    assert main(base[:steps] + ["1"] + base[steps + 1:] + ["--systems", "moec-paged"]) == 2
    assert "--steps must be at least 2" in capsys.readouterr().err
    assert main(base[:steps] + ["2"] + base[steps + 1:] + ["--systems", "moec-paged", "--profile"]) == 2
    assert "--steps must be at least 3" in capsys.readouterr().err
    assert main(base + ["--systems", "moec-paged", "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk must be positive" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_bench_profile_and_tied_layers(tmp_path):
    """--profile: the last decode step runs untimed with each VM call timed alone; the point keeps the top calls
    (the grouped expert kernels among them) and the step times exclude it. --tie-layers (the same run, a tiny
    Mixtral): every layer reads the first layer's weights, which the artifact holds once."""
    import numpy as np
    import torch
    from safetensors import safe_open

    from moec.compiler.serve_bench import weight_bytes

    tied, full = build_hf("tiny-mixtral", tie_layers=True), build_hf("tiny-mixtral")
    assert len(tied.model.layers) == 3 and tied.config.num_hidden_layers == 3
    assert [m.self_attn.layer_idx for m in tied.model.layers] == [0, 1, 2]  # each layer its own cache slot
    assert tied.model.layers[2].mlp.experts.down_proj is tied.model.layers[0].mlp.experts.down_proj
    assert weight_bytes(tied) == weight_bytes(full)  # the floor counts the bytes every layer reads
    with torch.no_grad():
        assert np.isfinite(tied(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.numpy()).all()

    out = tmp_path / "p.json"
    assert main(["bench", "--shape", "tiny-mixtral", "--tie-layers", "--streams", "2", "--contexts", "24", "--steps", "3",
                 "--profile", "--systems", "moec-bf16,hf-eager", "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["tied_layers"] is True
    assert "error" not in doc["systems"]["hf-eager"]["points"][0]
    assert "profile" not in doc["systems"]["hf-eager"]["points"][0]
    prof = doc["systems"]["moec-bf16"]["points"][0]["profile"]
    names = [c["name"] for c in prof["top"]]
    assert {"moe_gate_up", "moe_down"} <= set(names)
    assert any(n.startswith("vm.builtin.attention_kv_cache") for n in names)  # the paged cache's attention
    assert prof["kernel_launches"] >= len([n for n in names if not n.startswith("vm.builtin.")])
    assert 0 < prof["kernels_ms"] <= prof["calls_ms"] <= prof["profiled_step_ms"]
    assert sum(c["ms"] for c in prof["top"]) + prof["rest_ms"] == pytest.approx(prof["calls_ms"])
    assert prof["host_ms_estimate"] >= 0
    chunk = prof["prefill_chunk"]  # a fresh stream's first prefill chunk, profiled the same way
    assert chunk["tokens"] == 24 - 3 and {"moe_gate_up", "moe_down"} <= {c["name"] for c in chunk["top"]}
    # the artifact holds one layer's weights: 9 per layer, plus the embedding, the final norm and the LM head
    with safe_open(tmp_path / "work" / "tiny-mixtral-tied-float32" / "art-bf16-cpu" / "weights.safetensors", "np") as f:
        assert len(list(f.keys())) == 9 + 3


def test_bench_reports_a_failed_system(tmp_path, capsys, monkeypatch):
    """A system that cannot be built (here: the disk filled while writing its artifact) is named on stderr and in
    the JSON, the others still run, and the exit status is 1."""
    from moec.compiler import serve_bench

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serve_bench, "_Moec", full)
    out = tmp_path / "x.json"
    assert main(["bench", "--shape", "tiny-olmoe", "--streams", "1", "--contexts", "24", "--steps", "3",
                 "--systems", "moec-bf16,hf-eager", "--work", str(tmp_path / "w"), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "moec-bf16 was not built: OSError" in err and "No space left on device" in err and "failed: moec-bf16" in err
    doc = json.loads(out.read_text())
    assert "No space left" in doc["systems"]["moec-bf16"]["error"] and doc["complete"] is True
    assert doc["systems"]["hf-eager"]["points"][0]["tpot_ms_median"] > 0


def test_layers_override():
    model = build_hf("tiny-olmoe", layers=1)
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    from moec.compiler.errors import MoecError

    with pytest.raises(MoecError, match="--layers"):
        build_hf("tiny-olmoe", layers=0)


def test_bench_synthetic_kv(zoo, tmp_path):
    """--synthetic-kv: the tiered system decodes over caches filled with random entries (no prefill, TTFT not
    measured), whose page tables are those a real prefill of the same prompts leaves; refused for TVM's paged cache."""
    import numpy as np

    import moec
    from moec.compiler.errors import MoecError

    out = tmp_path / "s.json"
    assert main(["bench", "--shape", "tiny-olmoe", "--streams", "2", "--contexts", "300", "--steps", "3", "--synthetic-kv",
                 "--systems", "moec-tiered", "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    run = doc["systems"]["moec-tiered"]
    assert doc["synthetic_kv"] is True and run["kv_fill"] == "synthetic"
    point = run["points"][0]
    assert point["ttft_ms"] is None and point["tpot_ms_median"] > 0 and "error" not in point

    art = tmp_path / "work" / "tiny-olmoe-float32" / "art-tiered-cpu"
    real, synth = (moec.load(art, max_batch=4, max_total_tokens=2048, prefill_chunk=128) for _ in range(2))
    lengths = [297, 130]
    rs, _ = real.prefill([list(range(3, 3 + n)) for n in lengths])
    ss = synth.fill_synthetic(lengths, seed=3)
    for a, b in zip(rs, ss):
        qa, qb = real.tiered.tables.seqs[real.tiered.slot[a]], synth.tiered.tables.seqs[synth.tiered.slot[b]]
        assert (qa.length, qa.t1_len, len(qa.t1_pages), len(qa.t2_pages)) == (qb.length, qb.t1_len, len(qb.t1_pages),
                                                                             len(qb.t2_pages))
    pools = {n: p.numpy() for n, p in zip(("t1_k", "t1_v"), synth.tiered.pools)}
    assert all((v & 0x7F != 0x7F).all() and v.any() for v in pools.values())  # random FP8 codes, none NaN
    assert np.isfinite(synth.decode(ss, [5, 6])).all()
    for s in ss:
        synth.release(s)
    synth.tiered.tables.check()
    assert synth.tiered.tables.t1.free == synth.tiered.tables.t1.num_pages
    with pytest.raises(MoecError, match="tiered or FP8"):
        moec.load(zoo.artifact("tiny", "onnx"), max_batch=2, max_total_tokens=256).fill_synthetic([10])


def test_bench_offloaded_experts(tmp_path):
    """moec-<cache>-offload and -prefetch: one artifact with --expert-slots, loaded on demand and with prefetch; the
    points record what the experts' copies did, and their greedy tokens equal the all-resident model's. bfloat16
    weights, as on the GPU (whose export's norms once went unrecognised, leaving the prefetch without predictors).
    -offload-fp8 / -prefetch-fp8 and -fp8experts: FP8 experts offloaded (codes and float32 scales copied) and all
    resident give the same tokens, and the FP8 systems' floor counts FP8 expert bytes."""
    out = tmp_path / "bench.json"
    base = ["bench", "--shape", "tiny-olmoe", "--streams", "2", "--contexts", "24", "--steps", "4", "--dtype", "bfloat16",
            "--work", str(tmp_path / "work"), "--json", str(out)]
    assert main(base + ["--systems", "moec-bf16-offload"]) == 2 and not out.exists()  # no --expert-slots
    systems = ["moec-bf16", "moec-bf16-offload", "moec-bf16-prefetch", "moec-bf16-fp8experts", "moec-bf16-offload-fp8",
               "moec-bf16-prefetch-fp8"]
    assert main(base + ["--systems", ",".join(systems), "--expert-slots", "12"]) == 0
    doc = json.loads(out.read_text())
    assert doc["expert_slots"] == 12 and doc["complete"]
    pt = {s: doc["systems"][s]["points"][0] for s in systems}
    d, i = doc["config"]["hidden_size"], doc["config"]["intermediate_size"]
    for s in systems[1:3] + systems[4:]:
        p = pt[s]
        fp8 = s.endswith("-fp8")
        assert "error" not in p and p["experts"]["slots"] == 12 and p["experts"]["copies"] > 0
        # per copy: W1 (2I x D) and W2 (D x I) in bfloat16, or their FP8 codes and float32 scales per output channel
        assert p["experts"]["copy_bytes"] == p["experts"]["copies"] * (3 * d * i + 4 * (2 * i + d) if fp8 else 3 * d * i * 2)
        assert p["tokens_sha256"] == pt["moec-bf16-fp8experts" if fp8 else "moec-bf16"]["tokens_sha256"], s
        assert p["experts"]["prefetched"] > 0 if "-prefetch" in s else p["experts"]["prefetched"] == 0
        pre, host = p["experts"]["prefill_host_ms"], p["experts"]["host_ms"]  # prefill's residency host time, then all
        assert 0 < pre["total"] <= host["total"] and (pre["predict"] > 0) == ("-prefetch" in s)
        calls = p["experts"]["prefill_calls_ms"]  # the prefill's residency calls, from its start, in order
        assert [c[0] for c in calls] == list(range(len(calls))) and 0 < calls[0][1] <= calls[-1][3] <= p["ttft_ms"]
    assert pt["moec-bf16-offload"]["tokens_vs"] == {"system": "moec-bf16", "agree": 1.0}
    assert pt["moec-bf16-fp8experts"]["floor_ms"] < pt["moec-bf16"]["floor_ms"]
    assert pt["moec-bf16-offload-fp8"]["floor_ms"] == pytest.approx(pt["moec-bf16-fp8experts"]["floor_ms"])
    work = tmp_path / "work" / "tiny-olmoe-bfloat16"
    assert (work / "art-bf16-slots12-cpu" / "manifest.json").exists() and (work / "art-bf16-slots12-fp8-cpu").is_dir()
    manifest = json.loads((work / "art-bf16-fp8experts-cpu" / "manifest.json").read_text())
    assert manifest["options"]["grouped_experts"]["expert_weights"] == "fp8"


def _result(systems, streams, contexts, **over):
    """A `moec bench` result as the runs write it (points with TPOT only)."""
    doc = {"benchmark": "serve", "command": "moec bench ...", "git_commit": "abc", "device": "NVIDIA H200", "shape": "olmoe-1b-7b",
           "config": {"num_hidden_layers": 16}, "dtype": "bfloat16", "device_kind": "cuda", "decode_steps": 16,
           "tied_layers": False, "synthetic_kv": False, "copy_bandwidth_GBps": 4100.0, "complete": True,
           "grid": {"streams": streams, "contexts": contexts},
           "systems": {name: {"points": [{"streams": s, "context": c, "tpot_ms_median": 1.0 + s / 100 + c / 1e4}
                                         for s in streams for c in contexts]} for name in systems}}
    doc.update(over)
    return doc


def test_bench_merge_joins_runs_and_refuses_mismatches(tmp_path, capsys):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(_result(["moec-tiered", "moec-fp8"], [1, 128], [512, 4096], synthetic_kv=True)))
    b.write_text(json.dumps(_result(["hf-compile"], [1, 16, 128], [512, 4096], git_commit="def", copy_bandwidth_GBps=4000.0)))
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    assert main(["bench-merge", str(a), str(b), "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["systems"]) == ["moec-tiered", "moec-fp8", "hf-compile"] and doc["complete"]
    assert [doc["systems"][s]["merged_from"] for s in doc["systems"]] == [0, 0, 1]
    assert doc["grid"] == {"streams": [1, 16, 128], "contexts": [512, 4096]}
    assert [m["git_commit"] for m in doc["merged_from"]] == ["abc", "def"] and doc["merged_from"][0]["synthetic_kv"]
    assert doc["command"].startswith("moec bench-merge") and png.stat().st_size > 0
    # the same system twice, another shape, a file that is not a bench result: refused, nothing written
    c.write_text(json.dumps(_result(["moec-fp8"], [1], [512])))
    stopped = tmp_path / "f.json"  # a run stopped before moec-fp8 measured a point: the other run's stands
    doc = _result(["moec-bf16"], [1], [512])
    doc["systems"]["moec-fp8"] = {"points": [], "error": "x"}
    stopped.write_text(json.dumps(doc))
    assert main(["bench-merge", str(stopped), str(a), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["systems"]["moec-fp8"]["merged_from"] == 1
    for bad, why in ((c, "system moec-fp8 is also measured in"), (None, "shape 'mixtral-8x7b' differs"), ("junk", "not a `moec bench` result")):
        if bad is None:
            bad = tmp_path / "d.json"
            bad.write_text(json.dumps(_result(["x"], [1], [512], shape="mixtral-8x7b")))
        elif bad == "junk":
            bad = tmp_path / "e.json"
            bad.write_text(json.dumps({"benchmark": "tiered_decode"}))
        assert main(["bench-merge", str(a), str(bad), "--json", str(tmp_path / "n.json")]) == 2
        assert why in capsys.readouterr().err and not (tmp_path / "n.json").exists()


def test_summarize_trace_busy_idle_and_top():
    """The device trace's summary: kernels summed by name, copies apart, overlapping activities counted once in
    the busy time, the gaps between them as idle time; a trace without kernels is refused."""
    from moec.compiler.errors import MoecError
    from moec.compiler.serve_bench import summarize_trace

    ev = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0.0, "dur": 10.0},
          {"ph": "X", "cat": "kernel", "name": "b", "ts": 5.0, "dur": 10.0},  # overlaps a: busy 0-15
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 20.0, "dur": 2.0},  # idle 15-20
          {"ph": "X", "cat": "kernel", "name": "a", "ts": 30.0, "dur": 4.0},  # idle 22-30
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 100.0},  # host side: ignored
          {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0}]
    t = summarize_trace(ev, top=1)
    assert t["kernel_launches"] == 3 and t["copies"] == 1
    assert t["kernels_ms"] == pytest.approx(24e-3) and t["copies_ms"] == pytest.approx(2e-3)
    assert t["span_ms"] == pytest.approx(34e-3)
    assert t["busy_ms"] == pytest.approx((15 + 2 + 4) * 1e-3) and t["idle_ms"] == pytest.approx(13e-3)
    assert t["top"] == [{"name": "a", "calls": 2, "ms": pytest.approx(14e-3), "us_per_call": pytest.approx(7.0),
                         "share": pytest.approx(14 / 24)}]
    assert t["rest_ms"] == pytest.approx(10e-3)
    # the idle time as its gaps, named by the activity ending the busy stretch before (b ends after a) and the next
    assert t["gaps"] == {"count": 2, "median_us": pytest.approx(6.5), "p90_us": pytest.approx(7.7),
                         "largest": [{"us": pytest.approx(8.0), "after": "Memcpy HtoD", "before": "a"},
                                     {"us": pytest.approx(5.0), "after": "b", "before": "Memcpy HtoD"}]}
    with pytest.raises(MoecError, match="no kernel"):
        summarize_trace([e for e in ev if e["cat"] != "kernel"])


def test_trace_device_without_a_tracer(monkeypatch):
    """A tracer that cannot start (here: torch.profiler refuses) leaves the step untraced, not failed: the function
    runs once and the trace summary says why it is missing; a trace without kernels is reported likewise."""
    import torch
    import torch.profiler

    from moec.compiler import serve_bench

    class Refusing:
        def __init__(self, *a, **k):
            pass

        def start(self):
            raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")

    monkeypatch.setattr(torch.profiler, "profile", Refusing)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    out, trace = serve_bench.trace_device(lambda: calls.append(1) or 7)
    assert out == 7 and calls == [1] and "could not start" in trace["error"]
    monkeypatch.setattr(serve_bench, "device_events", lambda fn: (fn(), [{"ph": "X", "cat": "gpu_memcpy", "name": "m", "ts": 0, "dur": 1}]))
    out, trace = serve_bench.trace_device(lambda: 8)
    assert out == 8 and "no kernel" in trace["error"]


def test_wgmma_systems_compile_for_sm_90a(tmp_path, monkeypatch):
    # moec-<cache>[-fp8experts]-wgmma: the same system compiled for sm_90a on CUDA (the wgmma linear layers); FP8
    # experts still counted in the floor; on the CPU the llvm build as any other
    from moec.compiler import serve_bench

    assert {"moec-tiered-fp8experts-wgmma", "moec-bf16-wgmma"} <= set(serve_bench.SYSTEMS)
    assert serve_bench._fp8_experts("moec-tiered-fp8experts-wgmma") and not serve_bench._fp8_experts("moec-tiered-wgmma")
    seen = []

    class Stop(Exception):
        pass

    def fake_compile(source, art, **kw):
        seen.append((art.name, kw.get("arch"), kw.get("expert_weights"), kw.get("kv_cache")))
        raise Stop

    import moec

    monkeypatch.setattr(moec, "compile", fake_compile)
    for device in ("cuda", "cpu"):
        with pytest.raises(Stop):
            serve_bench._Moec("moec-tiered-fp8experts-wgmma", build_hf("tiny-olmoe"), "src", tmp_path, device, 2, 64)
    assert seen == [("art-tiered-fp8experts-wgmma-cuda", "sm_90a", "fp8", "tiered"),
                    ("art-tiered-fp8experts-wgmma-cpu", None, "fp8", "tiered")]


def test_system_whose_experts_stay_in_the_gather_form_is_refused(tmp_path, monkeypatch):
    """A compile that warns UnreplacedExperts (MoE layers left gathering one weight matrix per routed token) fails
    the system with that reason before any artifact is written or loaded: the gather form's prefill runs out of
    device memory minutes later, and its speed is not moec's. The grid's other systems still run."""
    import warnings

    import moec
    from moec.compiler import serve_bench
    from moec.compiler.build import UnreplacedExperts

    def warn_compile(source, art, **kw):
        warnings.warn("m.pt2: decode: 2 of 2 MoE layers are not on the grouped expert kernels (expert matmul lv1: "
                      "the gather index does not come from [T, K] top-k expert ids)", UnreplacedExperts, stacklevel=2)
        raise AssertionError("the warning did not stop the compile")

    monkeypatch.setattr(moec, "compile", warn_compile)
    with pytest.raises(UnreplacedExperts, match="top-k expert ids"):
        serve_bench._Moec("moec-tiered", build_hf("tiny-olmoe"), "src", tmp_path, "cpu", 2, 64)
    assert not (tmp_path / "art-tiered-cpu").exists()
    doc = serve_bench.run_bench("tiny-olmoe", [1], [24], ["moec-bf16", "hf-eager"], steps=3, work=tmp_path, progress=False)
    assert doc["systems"]["moec-bf16"]["error"].startswith("UnreplacedExperts: m.pt2: decode: 2 of 2 MoE layers")
    assert "tpot_ms_median" in doc["systems"]["hf-eager"]["points"][0]
