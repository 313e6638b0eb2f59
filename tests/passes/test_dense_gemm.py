"""InsertDenseGEMM and its kernel: linear layers against a transposed 16-bit weight."""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import moec
from moec.compiler.errors import MoecError
from moec.compiler.targets import make_target
from moec.passes.dense_gemm import InsertDenseGEMM
from moec.schedules.kernels.dense_gemm import DenseSpec, compiled_spec, eligible, launch_config, make_dense, reference

from moec_testing import prefill_and_decode as _run

LLVM = make_target("llvm")
BF16 = ml_dtypes.bfloat16


# ---------------------------------------------------------------------------- kernel


@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_kernel_matches_numpy(m, out_dtype):
    spec = DenseSpec(out_features=48, in_features=128, out_dtype=out_dtype)
    ex = tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec)}), target=LLVM)
    rng = np.random.default_rng(m)
    x, w = rng.standard_normal((m, 128)).astype(BF16), rng.standard_normal((48, 128)).astype(BF16)
    y = tvm.runtime.tensor(np.zeros((m, 48), BF16 if out_dtype == "bfloat16" else np.float32))
    ex["dense_gemm"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), y)
    ref = reference(x, w, np.float32)
    tol = 1e-5 if out_dtype == "float32" else 1e-2
    np.testing.assert_allclose(y.numpy().astype(np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_eligibility_and_refusals():
    assert eligible(DenseSpec(2048, 2048)) is None
    assert "float32" in eligible(DenseSpec(2048, 2048, x_dtype="float32", w_dtype="float32"))
    assert "differ" in eligible(DenseSpec(2048, 2048, x_dtype="float32"))
    assert "multiple of 64" in eligible(DenseSpec(2048, 2000))
    assert "multiple of 16" in eligible(DenseSpec(2040, 2048))
    with pytest.raises(MoecError, match="multiple of 64"):
        make_dense(DenseSpec(64, 96))
    with pytest.raises(MoecError, match="at most 8 token tiles"):
        make_dense(DenseSpec(64, 64, n_tiles=9))
    with pytest.raises(MoecError, match="target must be"):
        make_dense(DenseSpec(64, 64), "rocm")


def test_cuda_form_tensor_cores_and_nvcc():
    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules

    spec = DenseSpec(out_features=50304, in_features=2048)  # an LM head: 786 blocks of 64 rows
    cfg = launch_config(spec)
    assert cfg["blocks"] == ("ceil(M / 32)", 786) and cfg["threads"] == 128 and cfg["steps"] == 32
    src = _cuda_modules(tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec, "cuda")}),
                                    target=make_target("cuda", "sm_90")).mod)[0].inspect_source("cuda")
    assert set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", src)) == {"dense_gemm_kernel"}
    assert src.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 16  # 4 token tiles x 4 k steps
    assert "uint4" in src  # 16-byte loads of both operands
    # ... into 16-bit arrays: a uint4-typed operand array would scale mma's fragment offsets by 16 bytes
    assert not re.search(r"uint4 \w+_ptr\[", src)
    assert set(re.findall(r"\(unsigned \*\)\((\w+)_ptr \+", src)) == {"af", "xb"}
    with make_target("cuda", "sm_90"):
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0


def test_cuda_cp_async_stages_form():
    # the staged form (compiled models' default): the grouped expert kernels' cp.async loop, as many stages
    # as fit in 48 KB of shared memory; nvcc accepts it
    from tvm.support import nvcc

    from moec.compiler.build import _cuda_modules
    from moec.schedules.kernels.dense_gemm import pipe_stages

    spec = DenseSpec(out_features=2048, in_features=2048, stages=4)
    cfg = launch_config(spec)
    assert cfg["stages"] == 4 and cfg["shared_bytes"] == 4 * (4 * 16 * 64 * 2 + 32 * 64 * 2) == 49152
    assert pipe_stages(DenseSpec(2048, 2048, stages=8, n_tiles=8)) == (3, 16384)  # 3 fit, not 8
    src = _cuda_modules(tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec, "cuda")}),
                                    target=make_target("cuda", "sm_90")).mod)[0].inspect_source("cuda")
    assert "cp.async.wait_group 2" in src and "cp.async.cg.shared.global.L2::256B" in src
    assert src.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 16
    with make_target("cuda", "sm_90"):
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
    with pytest.raises(MoecError, match="stages must be"):
        DenseSpec(64, 64, stages=1).check()
    with pytest.raises(MoecError, match="exceed"):  # one stage of 8 warps x 4 tiles is 64 KB
        DenseSpec(64, 64, stages=2, warps=8, row_tiles=4).check()
    # the llvm form ignores the launch options: same numbers
    x = np.random.default_rng(0).standard_normal((5, 128)).astype(ml_dtypes.bfloat16)
    w = np.random.default_rng(1).standard_normal((64, 128)).astype(ml_dtypes.bfloat16)
    f = tvm.compile(make_dense(DenseSpec(64, 128, stages=4), "llvm"), target="llvm")
    y = tvm.runtime.tensor(np.zeros((5, 64), np.float32))
    f(tvm.runtime.tensor(x), tvm.runtime.tensor(w), y)
    np.testing.assert_allclose(y.numpy(), reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [(64, 32), (2048, 512, 512)])
def test_merged_kernel_builds_for_cuda(parts):
    # one launch for 2 or 3 weights: row blocks over the weights in turn, each block's rows in one weight
    src = tvm.compile(make_dense(compiled_spec(sum(parts), 128), "cuda", parts), target=make_target("cuda", "sm_90")
                      ).mod.imports[0].inspect_source()
    assert "mma.sync" in src and "cp.async" in src and src.count("__global__") == 2  # one kernel: declared, defined


def test_merged_kernel_refusals():
    with pytest.raises(MoecError, match="summing to 96"):
        make_dense(compiled_spec(96, 128), "llvm", (64, 48))
    with pytest.raises(MoecError, match="1 to 3 multiples of 16"):
        make_dense(compiled_spec(64, 128), "llvm", (16, 16, 16, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 300])
@pytest.mark.parametrize("parts", [(64, 32), (256, 64, 64)])
def test_cuda_merged_kernel_matches_numpy_on_gpu(m, parts):
    from moec_testing import require_cuda

    require_cuda()
    rng = np.random.default_rng(m)
    k = 256
    f = tvm.compile(make_dense(compiled_spec(sum(parts), k), "cuda", parts), target=make_target("cuda"))
    x = rng.standard_normal((m, k)).astype(BF16)
    ws = [(rng.standard_normal((n, k)) * k**-0.5).astype(BF16) for n in parts]
    dev = tvm.cuda()
    args = [tvm.runtime.tensor(a, dev) for a in [x] + ws + [np.zeros((m, n), np.float32) for n in parts]]
    f[f"dense_gemm{len(parts)}"](*args)
    for i, w in enumerate(ws):
        np.testing.assert_allclose(args[1 + len(parts) + i].numpy(), reference(x, w), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- pass: IR before / after


def _entry(x_dtype="bfloat16", w_dtype="bfloat16", k=128, n=64, bmm=False):
    """``main(x [s, K], w [N, K])``: a linear layer as torch.export writes it (or as a batched matmul)."""
    bb = relax.BlockBuilder()
    s = tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType((s, k), x_dtype))
    w = relax.Var("w", relax.TensorType((n, k), w_dtype))
    with bb.function("main", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w, [1, 0]))
            if bmm:
                x3 = bb.emit(relax.op.broadcast_to(relax.op.expand_dims(x, 0), relax.ShapeExpr([1, s, k])))
                wt = bb.emit(relax.op.broadcast_to(wt, relax.ShapeExpr([1, k, n])))
                y = bb.emit(relax.op.matmul(x3, wt, out_dtype="float32"))
            else:
                y = bb.emit(relax.op.matmul(x, wt, out_dtype="float32"))
            out = bb.emit_output(relax.op.astype(y, x_dtype))
        bb.emit_func_output(out)
    return bb.get()


def _ops(func):
    found = []

    def visit(e):
        if isinstance(e, relax.Call):
            found.append(e.op.name_hint if isinstance(e.op, relax.GlobalVar) else e.op.name)

    relax.analysis.post_order_visit(func.body, visit)
    return found


@pytest.mark.parametrize("bmm", [False, True])
def test_ir_before_after(bmm):
    before = _entry(bmm=bmm)
    assert "relax.permute_dims" in _ops(before["main"]) and "relax.matmul" in _ops(before["main"])
    p = InsertDenseGEMM(LLVM)
    after = relax.transform.DeadCodeElimination(["main"])(p(before))
    ops = _ops(after["main"])
    assert "relax.matmul" not in ops and "relax.permute_dims" not in ops and "relax.call_tir" in ops
    assert p.manifest() == {"replaced": {"main": 1}, "merged": {"main": []}, "tiled": {}, "skipped": {"main": []},
                            "kernels": ["dense_gemm"]}
    assert list(p.kernels) == [(compiled_spec(64, 128), None, False)]  # the staged form, 4 token tiles (not an LM head)
    prim = after["dense_gemm"]
    assert int(prim.attrs["op_pattern"]) == 8
    # the call reads the weight as stored [N, K] and writes [M, N] float32 (then the graph's own cast)
    call = [b.value for blk in after["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"][0]
    assert call.args[1][1].same_as(after["main"].params[1])
    assert str(call.ty.dtype) == "float32" and [int(d) if isinstance(d, tvm.tirx.IntImm) else None
                                                  for d in call.ty.shape.values][1] == 64
    # numerics of the rewritten function: against the matmul it replaced
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 128)).astype(BF16), rng.standard_normal((64, 128)).astype(BF16)
    outs = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy().astype(np.float32))
    np.testing.assert_allclose(outs[1].reshape(outs[0].shape), outs[0], rtol=1e-2, atol=1e-2)


def _parallel_entry(widths, k=128, second_input=False):
    """``main(x [s, K], (x2,) w_1 [N_1, K], ...)``: linear layers of one input (q, k, v), the last of another
    input when ``second_input``; returns the sum of their float32 outputs' first columns and each output."""
    bb = relax.BlockBuilder()
    s = tvm.tirx.Var("s", "int64")
    xs = [relax.Var(f"x{i}", relax.TensorType((s, k), "bfloat16")) for i in range(1 + second_input)]
    ws = [relax.Var(f"w{i}", relax.TensorType((n, k), "bfloat16")) for i, n in enumerate(widths)]
    with bb.function("main", xs + ws, attrs={"num_input": len(xs)}):
        with bb.dataflow():
            ys = []
            for i, w in enumerate(ws):
                x = xs[-1] if second_input and i == len(ws) - 1 else xs[0]
                ys.append(bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w, [1, 0])), out_dtype="float32")))
            out = bb.emit_output(relax.Tuple(ys))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("widths,second_input,runs", [((64, 32, 32), False, [3]), ((64, 32, 32, 48), False, [3]),
                                                      ((64, 32, 48), True, [2]), ((64, 32), False, [2])])
def test_ir_parallel_layers_share_one_launch(widths, second_input, runs):
    # q, k, v (and a dense MLP's gate and up) read one input: one dense_gemm_xN call with N outputs, at most 3 a
    # launch; a layer of another input, or the fourth, stays a dense_gemm of its own. Same numbers, bit for bit.
    before = _parallel_entry(widths, second_input=second_input)
    merged = relax.transform.DeadCodeElimination(["main"])(InsertDenseGEMM(LLVM)(before))
    p = InsertDenseGEMM(LLVM, merge=False)
    single = relax.transform.DeadCodeElimination(["main"])(p(before))
    q = InsertDenseGEMM(LLVM)
    q(before)
    assert q.merged == {"main": runs} and p.merged == {"main": []}
    calls = [b.value for blk in merged["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    names = [c.args[0].name_hint for c in calls]
    assert names.count(f"dense_gemm_x{runs[0]}") == 1 and len(calls) == len(widths) - runs[0] + 1
    multi = calls[names.index(f"dense_gemm_x{runs[0]}")]
    params = merged["main"].params
    assert [a.same_as(params[len(params) - len(widths) + i]) for i, a in enumerate(multi.args[1].fields[1:])] == [True] * runs[0]
    assert [int(t.shape.values[1]) for t in multi.ty.fields] == list(widths[:runs[0]])
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((5, 128)).astype(BF16) for _ in range(1 + second_input)]
    ws = [rng.standard_normal((n, 128)).astype(BF16) for n in widths]
    outs = []
    for mod in (merged, single, before):
        vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
        outs.append([t.numpy() for t in vm["main"](*[tvm.runtime.tensor(a) for a in xs + ws])])
    for a, b, c in zip(*outs):
        np.testing.assert_array_equal(a, b)  # the merged kernel runs the one-weight kernel's sums
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)


def _two_entries(widths, k=128):
    """``prefill`` and ``decode`` entries of ``_parallel_entry``'s layers (a model's two entries)."""
    one = _parallel_entry(widths, k)["main"]
    return tvm.IRModule({"prefill": one.with_attr("global_symbol", "prefill"), "decode": one.with_attr("global_symbol", "decode")})


@pytest.mark.parametrize("prefill_tiled", [False, True])
def test_ir_prefill_tiled(prefill_tiled):
    # prefill_tiled: on CUDA the prefill entry's layers the block-tiled form takes (multiples of 128 x 32, not LM-head
    # wide) become one dense_gemm_tiled call each, not merged; the decode entry, and layers it cannot take (48 outputs,
    # the LM head's 32000), keep the streamed kernels, merged as before (3 + 2 in decode, the last 2 in prefill)
    before = _two_entries((256, 128, 128, 48, 32000))
    p = InsertDenseGEMM(make_target("cuda", "sm_90"), prefill_tiled=prefill_tiled)
    after = relax.transform.DeadCodeElimination(["prefill", "decode"])(p(before))

    def kernels(entry):
        return [b.value.args[0].name_hint for blk in after[entry].body.blocks for b in blk.bindings
                if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]

    assert kernels("decode") == ["dense_gemm_x3", "dense_gemm_x2"]
    if prefill_tiled:
        names = kernels("prefill")
        assert [n.startswith("dense_gemm_tiled") for n in names] == [True, True, True, False] and names[3] == "dense_gemm_x2"
        assert names[1] == names[2] != names[0]  # one kernel per shape
        assert p.tiled == {"prefill": 3} and p.merged == {"prefill": [2], "decode": [3, 2]}
        assert {key for key in p.kernels if key[2]} == {(compiled_spec(256, 128), None, True), (compiled_spec(128, 128), None, True)}
        prim = after[names[0]]
        assert int(prim.attrs["op_pattern"]) == 8 and "ldmatrix" in prim.script()  # opaque to FuseOps, the tiled kernel
    else:
        assert kernels("prefill") == kernels("decode") and p.tiled == {}
    assert p.manifest()["tiled"] == p.tiled
    # the llvm form ignores it: no tensor cores there
    q = InsertDenseGEMM(LLVM, prefill_tiled=True)
    q(before)
    assert q.tiled == {} and not any(key[2] for key in q.kernels)


@pytest.mark.parametrize("kw,why", [(dict(x_dtype="float32", w_dtype="float32"), "float32"),
                                    (dict(x_dtype="float32"), "differ in dtype"),
                                    (dict(k=96), "multiple of 64")])
def test_ir_ineligible_stays(kw, why):
    before = _entry(**kw)
    p = InsertDenseGEMM(LLVM)
    after = p(before)
    assert "relax.matmul" in _ops(after["main"]) and "dense_gemm" not in [gv.name_hint for gv in after.get_global_vars()]
    assert p.replaced == {"main": 0} and len(p.skipped["main"]) == 1 and why in p.skipped["main"][0]


def test_compiled_spec():
    # four cp.async stages everywhere; LM-head-wide layers take 8 token tiles a block (3 stages fit then)
    proj, head = compiled_spec(2048, 2048), compiled_spec(50304, 2048)
    assert (proj.stages, proj.n_tiles, launch_config(proj)["stages"]) == (4, 4, 4)
    assert (head.stages, head.n_tiles, launch_config(head)["stages"]) == (4, 8, 3)
    assert compiled_spec(2048, 2048, "float16", "float16", "float16").out_dtype == "float16"
    proj.check(), head.check()


def test_refusals():
    with pytest.raises(MoecError, match="tvm.target.Target"):
        InsertDenseGEMM("llvm")
    with pytest.raises(MoecError, match="num_input"):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((2, 64), "bfloat16"))
        with bb.function("main", [x]):
            bb.emit_func_output(x)
        InsertDenseGEMM(LLVM).transform_module(bb.get(), None)
    with pytest.raises(MoecError, match="dense_gemm must be True or False"):
        moec.compile("unused.pt2", "/nonexistent/out", dense_gemm="yes")


# ---------------------------------------------------------------------------- compiled bf16 model


@pytest.fixture(scope="module")
def bf16_olmoe(tmp_path_factory):
    """HF OLMoE (the benchmark's tiny shape) in bfloat16, exported with torch.export."""
    from moec.compiler.serve_bench import build_hf
    from moec.models.export import save_pt2

    model = build_hf("tiny-olmoe", "bfloat16", "cpu")
    path = tmp_path_factory.mktemp("dense") / "model.pt2"
    save_pt2(model, model.config.vocab_size, path, max_seq=64)
    return model, path


def test_compiled_bf16_model_uses_dense_gemm(bf16_olmoe, tmp_path):
    import torch

    from moec.compiler.importers import import_model

    model, path = bf16_olmoe
    imported = import_model(path)  # once for both builds (the .pt2 import is most of a build's time)
    on = moec.compile(imported, tmp_path / "on", target="llvm")
    off = moec.compile(imported, tmp_path / "off", target="llvm", dense_gemm=False)
    mon, moff = (json.loads((a / "manifest.json").read_text()) for a in (on, off))
    # per layer q, k, v, o (2 layers) and the LM head, in both entries
    assert mon["options"]["dense_gemm"]["replaced"] == {"decode": 9, "prefill": 9} and "InsertDenseGEMM" in mon["passes"]
    assert mon["options"]["dense_gemm"]["merged"] == {"decode": [3, 3], "prefill": [3, 3]}  # q, k, v of each layer
    assert moff["options"]["dense_gemm"] is None
    assert mon["options"]["prefill_gemm"] == "auto" and mon["options"]["dense_gemm"]["tiled"] == {}  # (llvm: no tiles)
    with pytest.raises(MoecError, match="prefill GEMMs must be 'auto', 'streamed' or 'tiled'"):
        moec.compile(imported, tmp_path / "bad", target="llvm", prefill_gemm="blocked")
    assert not (tmp_path / "bad").exists()
    assert any(v == "kernel:schedules/kernels/dense_gemm.py" for v in mon["schedules"].values())
    (lon, hist), (loff, _) = _run(on), _run(off)
    scale = np.abs(loff).max()
    # the same float32 sums in another order; bf16 activations between layers may round the other way
    assert np.abs(lon - loff).max() <= 0.02 * scale
    with torch.no_grad():
        ref = model.float()(input_ids=torch.tensor([hist[0]])).logits[0, -1].numpy()
    model.to(torch.bfloat16)
    assert np.abs(lon[-1][0] - ref).max() <= 0.05 * np.abs(ref).max()


@pytest.mark.parametrize("n_tiles", [1, 2, 4])
def test_cuda_staged_form_emulated(n_tiles):
    """The cp.async form (compiled models' default; 8-, 16- and 32-token passes) on the CPU emulation of the generated
    CUDA code (tests/cuda_emu.py), against NumPy: one token (a pass mostly past M) and 37 (a partial last pass)."""
    from cuda_emu import EmulatedKernel

    spec = DenseSpec(out_features=96, in_features=128, stages=4, n_tiles=n_tiles)
    src = tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec, "cuda")}), target=make_target("cuda")).mod.imports[0].inspect_source()
    kern = EmulatedKernel(src, "dense_gemm_kernel")
    cfg = launch_config(spec)
    for m in (1, 37):
        rng = np.random.default_rng(m)
        x = rng.standard_normal((m, 128)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((96, 128)).astype(ml_dtypes.bfloat16)
        y = np.zeros((m, 96), np.float32)
        kern((-(-m // cfg["tokens_per_block"]), cfg["blocks"][1], 1), cfg["threads"], x=x.view(np.uint16), w=w.view(np.uint16), y=y, M=m)
        np.testing.assert_allclose(y, reference(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tile_k, stages, k", [(32, 2, 96), (32, 3, 96), (32, 4, 224), (64, 4, 64)])
def test_cuda_tiled_form_emulated(tile_k, stages, k):
    """The block-tiled prefill form (128 x 128 tiles, a ring of cp.async stages, ldmatrix fragments) on the CPU
    emulation of its generated code, against NumPy: two feature blocks, a full and a partial token block, one token;
    fewer k-steps than stages (64 / 64 at 4), as many (96 / 32 at 3), more (224 / 32 at 4: 7 steps wrap the ring). Past
    48 KB the stages are dynamic shared memory."""
    from cuda_emu import EmulatedKernel

    from moec.schedules.kernels.dense_gemm import TILE_TOKENS, make_dense_tiled, tiled_eligible
    from moec.schedules.kernels.grouped_experts import tile_shared_bytes

    n = 256
    src = tvm.compile(tvm.IRModule({"dense_gemm_tiled": make_dense_tiled(n, k, tile_k=tile_k, stages=stages)}),
                      target=make_target("cuda")).mod.imports[0].inspect_source()
    assert "ldmatrix" in src and "cp.async" in src and "__launch_bounds__(256)" in src
    assert ("extern __shared__" in src) == (tile_shared_bytes(tile_k, stages) > 49152)
    assert f"cp.async.wait_group {stages - 2}" in src
    kern = EmulatedKernel(src, "dense_gemm_tiled_kernel")
    for m in (1, 150):
        rng = np.random.default_rng(m)
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
        y = np.full((m, n), np.nan, np.float32)  # every element must be written
        kern((-(-m // TILE_TOKENS), n // 128, 1), 256, x=x.view(np.uint16), w=w.view(np.uint16), y=y, M=m)
        np.testing.assert_allclose(y, reference(x, w), rtol=1e-5, atol=1e-4)


def test_tiled_form_refusals():
    from moec.schedules.kernels.dense_gemm import make_dense_tiled, tiled_eligible

    assert tiled_eligible(2048, 2048, "bfloat16") is None and "multiples" in tiled_eligible(2000, 2048, "bfloat16")
    assert "multiples of 128 x 64" in tiled_eligible(256, 96, "bfloat16", tile_k=64)
    with pytest.raises(MoecError, match="operand dtype"):
        make_dense_tiled(256, 96, dtype="float32")
    with pytest.raises(MoecError, match="tile_k must be one of 32, 64"):
        make_dense_tiled(256, 96, tile_k=16)
    with pytest.raises(MoecError, match="tile_stages must be an integer in 2..6"):
        make_dense_tiled(256, 96, stages=1)


@pytest.mark.parametrize("stages, n_tiles", [(8, 8), (12, 2), (16, 4)])
def test_cuda_dynamic_shared_stages_emulated(stages, n_tiles):
    """More cp.async stages than 48 KB of static shared memory hold (``dyn_shared``: the stages in dynamic shared
    memory, up to 227 KB on sm_90): the generated code declares them ``extern __shared__`` and waits for the group
    ``stages - 2`` back, nvcc accepts it, and on the CPU emulation it matches NumPy with fewer and more k-steps (2,
    10, 20) than stages."""
    from cuda_emu import EmulatedKernel
    from tvm.support import nvcc

    from moec.schedules.kernels.dense_gemm import pipe_stages

    per = 4 * 16 * 64 * 2 + 8 * n_tiles * 64 * 2
    for k in (128, 640, 1280):
        spec = DenseSpec(out_features=96, in_features=k, stages=stages, n_tiles=n_tiles, dyn_shared=stages * per)
        assert pipe_stages(spec) == (stages, per) and launch_config(spec)["shared_bytes"] == stages * per
        src = tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec, "cuda")}), target=make_target("cuda")).mod.imports[0].inspect_source()
        assert "extern __shared__" in src and f"cp.async.wait_group {stages - 2}" in src
        if k == 640:
            with make_target("cuda", "sm_90"):
                assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
        kern = EmulatedKernel(src, "dense_gemm_kernel")
        cfg = launch_config(spec)
        for m in (1, 37):
            rng = np.random.default_rng(m + k)
            x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
            w = rng.standard_normal((96, k)).astype(ml_dtypes.bfloat16)
            y = np.zeros((m, 96), np.float32)
            kern((-(-m // cfg["tokens_per_block"]), cfg["blocks"][1], 1), cfg["threads"], x=x.view(np.uint16), w=w.view(np.uint16), y=y, M=m)
            np.testing.assert_allclose(y, reference(x, w), rtol=1e-5, atol=1e-3)
    with pytest.raises(MoecError, match="dyn_shared must be"):
        DenseSpec(64, 64, stages=8, dyn_shared=1024).check()  # at most 48 KB is static shared memory
    with pytest.raises(MoecError, match="dyn_shared must be"):
        DenseSpec(64, 64, stages=8, dyn_shared=300000).check()
    with pytest.raises(MoecError, match="stages must be"):
        DenseSpec(64, 64, stages=17, dyn_shared=100000).check()
    assert pipe_stages(DenseSpec(64, 64, stages=16, n_tiles=n_tiles, dyn_shared=5 * per)) == (5, per)  # as many as fit


@pytest.mark.parametrize("warps, row_tiles, n_tiles, stages, k, parts, k_splits, ahead",
                         [(4, 1, 4, 4, 640, None, 1, False), (2, 2, 2, 3, 128, None, 1, False), (4, 1, 8, 4, 256, None, 1, False),
                          (1, 1, 1, 2, 192, None, 1, False), (4, 1, 4, 4, 384, (32, 32, 32), 1, False),
                          (4, 1, 16, 4, 512, None, 2, False), (4, 1, 4, 4, 640, None, 1, True), (2, 2, 2, 3, 192, None, 1, True),
                          (4, 1, 4, 3, 64, (32, 32, 32), 1, True), (4, 1, 16, 5, 512, None, 2, True),
                          (1, 1, 2, 2, 320, None, 1, True)])
def test_cuda_ldmatrix_form_emulated(warps, row_tiles, n_tiles, stages, k, parts, k_splits, ahead):
    """``ldmatrix``: the cp.async form with chunk-swizzled stages and fragments by ldmatrix (both operands, no register
    moves), every token tile multiplied; ``frag_ahead``: the next k-step's fragments loaded under this step's mma. On
    the CPU emulation of the generated code, against NumPy: one token, a partial last pass (37) and three passes, one
    to three weights, k splits, fewer k-steps than stages and odd counts of k-steps; nvcc accepts it for sm_90."""
    from cuda_emu import EmulatedKernel
    from tvm.support import nvcc

    spec = DenseSpec(out_features=96, in_features=k, stages=stages, warps=warps, row_tiles=row_tiles, n_tiles=n_tiles,
                     ldmatrix=True, frag_ahead=ahead, k_splits=k_splits, dyn_shared=232448 if n_tiles > 8 else 0)
    assert "ldmatrix fragments" in launch_config(spec)["form"] and ("a k-step ahead" in launch_config(spec)["form"]) == ahead
    src = tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec, "cuda", parts)}), target=make_target("cuda")).mod.imports[0].inspect_source()
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src
    if k == 640:
        with make_target("cuda", "sm_90"):
            assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
    name = {None: "dense_gemm", 3: "dense_gemm3"}[parts and len(parts)]
    kern = EmulatedKernel(src, f"{name}_kernel")
    add = EmulatedKernel(src, f"{name}_kernel_1") if k_splits > 1 else None
    cfg = launch_config(spec)
    for m in (1, 37, 3 * 8 * n_tiles):
        rng = np.random.default_rng(m + k)
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((96, k)).astype(ml_dtypes.bfloat16)
        ref = reference(x, w)
        widths = list(parts) if parts else [96]
        grid = (-(-m // cfg["tokens_per_block"]), sum(-(-n // cfg["rows_per_block"]) for n in widths), k_splits)
        if parts is None:
            y = np.full((m, 96), np.nan, np.float32)
            args = {"x": x.view(np.uint16), "w": w.view(np.uint16), "y": y}
            outs = [(y, ref)]
        else:
            ws = np.split(w, np.cumsum(parts)[:-1])
            ys = [np.full((m, n), np.nan, np.float32) for n in parts]
            args = {"x": x.view(np.uint16), **{f"w{i + 1}": wi.view(np.uint16) for i, wi in enumerate(ws)},
                    **{f"y{i + 1}": yi for i, yi in enumerate(ys)}}
            outs = list(zip(ys, np.split(ref, np.cumsum(parts)[:-1], axis=1)))
        if k_splits > 1:
            args["sums"] = np.full((m, k_splits, 96), np.nan, np.float32)
        kern(grid, cfg["threads"], M=m, **args)
        if add is not None:
            add((-(-(m * 96 // 4) // 256), 1, 1), 256, M=m, **args)
        for y, r in outs:
            np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-3)
    with pytest.raises(MoecError, match="ldmatrix fragments need"):
        DenseSpec(64, 64, ldmatrix=True).check()
    with pytest.raises(MoecError, match="ldmatrix fragments need"):
        DenseSpec(64, 256, stages=4, k_groups=2, ldmatrix=True).check()
    with pytest.raises(MoecError, match="frag_ahead loads ldmatrix fragments"):
        DenseSpec(64, 256, stages=4, frag_ahead=True).check()


@pytest.mark.parametrize("k_groups, warps, stages, n_tiles, k", [(2, 4, 4, 4, 128), (2, 4, 3, 2, 640), (4, 2, 4, 4, 1024),
                                                                    (8, 1, 2, 8, 512)])
def test_cuda_k_groups_emulated(k_groups, warps, stages, n_tiles, k):
    """``k_groups``: G groups of warps a block, each over its own k range with its own token stages, summed through
    shared memory. On the CPU emulation of the generated code, against NumPy: a group with one k-step (fewer than its
    stages: 128 / 2), with more (640 / 2: 5), a partial last pass and one token; the k-groups' sums are in static
    shared memory, the stages in dynamic shared memory where past 48 KB; nvcc accepts it."""
    from cuda_emu import EmulatedKernel
    from tvm.support import nvcc

    from moec.schedules.kernels.dense_gemm import pipe_stages, reduce_bytes

    n = 96
    per = (warps * 16 * 64 * 2 + 8 * n_tiles * 64 * 2) * k_groups
    dyn = stages * per if stages * per > 49152 else 0
    spec = DenseSpec(out_features=n, in_features=k, warps=warps, stages=stages, n_tiles=n_tiles, k_groups=k_groups, dyn_shared=dyn)
    assert pipe_stages(spec) == (stages, per)
    cfg = launch_config(spec)
    assert cfg["threads"] == 32 * warps * k_groups and cfg["steps"] == k // 64 // k_groups
    assert cfg["shared_bytes"] == stages * per + reduce_bytes(spec)
    src = tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec, "cuda")}), target=make_target("cuda")).mod.imports[0].inspect_source()
    assert f"__launch_bounds__({32 * warps * k_groups})" in src and ("extern __shared__" in src) == bool(dyn)
    if k_groups == 4:
        with make_target("cuda", "sm_90"):
            assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
    kern = EmulatedKernel(src, "dense_gemm_kernel")
    for m in (1, 37):
        rng = np.random.default_rng(m + k)
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
        y = np.full((m, n), np.nan, np.float32)  # every element must be written
        kern((-(-m // cfg["tokens_per_block"]), cfg["blocks"][1], 1), cfg["threads"], x=x.view(np.uint16), w=w.view(np.uint16), y=y, M=m)
        np.testing.assert_allclose(y, reference(x, w), rtol=1e-5, atol=1e-3)


def test_cuda_k_groups_merged_emulated():
    """The q/k/v launch (three weights) with k groups: each row block's groups sum into the right weight's output."""
    from cuda_emu import EmulatedKernel

    parts, k = (64, 32, 32), 256
    spec = DenseSpec(out_features=sum(parts), in_features=k, stages=2, n_tiles=2, k_groups=2)  # static shared memory
    src = tvm.compile(tvm.IRModule({"dense_gemm3": make_dense(spec, "cuda", parts)}), target=make_target("cuda")).mod.imports[0].inspect_source()
    kern = EmulatedKernel(src, "dense_gemm3_kernel")
    cfg = launch_config(spec)
    m = 19
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    ws = [rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16) for n in parts]
    ys = [np.full((m, n), np.nan, np.float32) for n in parts]
    blocks = sum(-(-n // 64) for n in parts)
    kern((-(-m // cfg["tokens_per_block"]), blocks, 1), cfg["threads"], x=x.view(np.uint16), w1=ws[0].view(np.uint16),
         w2=ws[1].view(np.uint16), w3=ws[2].view(np.uint16), y1=ys[0], y2=ys[1], y3=ys[2], M=m)
    for w, y in zip(ws, ys):
        np.testing.assert_allclose(y, reference(x, w), rtol=1e-5, atol=1e-3)


def test_k_groups_refusals():
    with pytest.raises(MoecError, match="k_groups must be one of"):
        DenseSpec(64, 128, stages=4, k_groups=3).check()
    with pytest.raises(MoecError, match="needs cp.async stages"):
        DenseSpec(64, 128, k_groups=2).check()
    with pytest.raises(MoecError, match="exceed 1024 threads"):
        DenseSpec(64, 1024, warps=8, stages=2, k_groups=8, dyn_shared=200000).check()
    with pytest.raises(MoecError, match="static shared memory"):
        DenseSpec(64, 1024, warps=4, n_tiles=8, stages=2, k_groups=8, dyn_shared=200000).check()
    assert "do not split into 4 k groups" in eligible(DenseSpec(64, 192, stages=4, k_groups=4))


@pytest.mark.parametrize("k_splits, parts, n_tiles, warps, k, k_groups", [
    (2, None, 4, 4, 256, 1), (4, (64, 32, 32), 16, 4, 512, 1), (8, (48, 64), 8, 2, 512, 1), (4, None, 16, 2, 2048, 1),
    (2, None, 8, 2, 1024, 4), (2, (64, 32, 32), 16, 4, 512, 2)])  # (with k groups in each split's blocks)
def test_cuda_k_splits_emulated(k_splits, parts, n_tiles, warps, k, k_groups):
    """``k_splits``: KS blocks (grid axis z) over their own k ranges, each storing its float32 sums to the workspace,
    then a second kernel adding them in split order into the outputs (one to three weights). On the CPU emulation of
    both generated kernels, against NumPy and bit for bit against the llvm form (the same sums in the same order up
    to the order within a split): one token, a partial pass and two passes; the workspace starts as NaN, so a sum read
    before it was written shows; nvcc accepts the code."""
    from cuda_emu import EmulatedKernel
    from tvm.support import nvcc

    n = sum(parts) if parts else 96
    name = f"dense_gemm{len(parts)}" if parts else "dense_gemm"
    per = (warps * 16 * 64 * 2 + 8 * n_tiles * 64 * 2) * k_groups
    spec = DenseSpec(out_features=n, in_features=k, warps=warps, stages=3, n_tiles=n_tiles, k_splits=k_splits,
                     k_groups=k_groups, dyn_shared=3 * per if 3 * per > 40000 else 0)
    cfg = launch_config(spec)
    assert cfg["blocks"][2] == k_splits and cfg["steps"] == k // 64 // k_splits // k_groups and cfg["k_splits"] == k_splits
    src = tvm.compile(tvm.IRModule({name: make_dense(spec, "cuda", parts)}), target=make_target("cuda")).mod.imports[0].inspect_source()
    assert f"{name}_kernel_1" in src and "blockIdx.z" in src
    if k_splits == 4:
        with make_target("cuda", "sm_90"):
            assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
    gemm, add = EmulatedKernel(src, f"{name}_kernel"), EmulatedKernel(src, f"{name}_kernel_1")
    cpu = tvm.compile(make_dense(spec, "llvm", parts), target="llvm")
    widths = list(parts) if parts else [n]
    for m in (1, 37, 2 * 8 * n_tiles):
        rng = np.random.default_rng(m + k)
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        ws = [rng.standard_normal((nw, k)).astype(ml_dtypes.bfloat16) for nw in widths]
        ys = [np.full((m, nw), np.nan, np.float32) for nw in widths]
        sums = np.full((m, k_splits, n), np.nan, np.float32)
        wargs = {f"w{i + 1}": w.view(np.uint16) for i, w in enumerate(ws)} if parts else {"w": ws[0].view(np.uint16)}
        yargs = {f"y{i + 1}": y for i, y in enumerate(ys)} if parts else {"y": ys[0]}
        row_blocks = sum(-(-nw // cfg["rows_per_block"]) for nw in widths)  # (each weight's own row blocks)
        gemm((-(-m // cfg["tokens_per_block"]), row_blocks, k_splits), cfg["threads"], x=x.view(np.uint16), sums=sums,
             M=m, **wargs, **yargs)
        assert not np.isnan(sums).any()
        add((-(-m * n // 4 // 256), 1, 1), 256, sums=sums, M=m, **yargs)
        for w, y in zip(ws, ys):
            np.testing.assert_allclose(y, reference(x, w), rtol=1e-5, atol=1e-3)
        # the llvm form: each split's sum, then their sum in split order
        out = [tvm.runtime.tensor(np.zeros((m, nw), np.float32)) for nw in widths]
        cs = tvm.runtime.tensor(np.zeros((m, k_splits, n), np.float32))
        cpu(tvm.runtime.tensor(x), *[tvm.runtime.tensor(w) for w in ws], *out, cs)
        for w, y, o in zip(ws, ys, out):
            np.testing.assert_allclose(o.numpy(), reference(x, w), rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(cs.numpy(), sums, rtol=1e-5, atol=1e-4)


def test_k_splits_refusals():
    with pytest.raises(MoecError, match="k_splits must be one of"):
        DenseSpec(64, 1024, stages=2, k_splits=3).check()
    with pytest.raises(MoecError, match="k_splits > 1 needs cp.async stages"):
        DenseSpec(64, 1024, k_splits=2).check()
    with pytest.raises(MoecError, match="at most 8 token tiles"):
        DenseSpec(64, 1024, n_tiles=16).check()  # 16 only with stages
    assert "do not split into 4 k splits x 1 k groups" in eligible(DenseSpec(64, 192, stages=4, k_splits=4))
    assert eligible(DenseSpec(64, 256, stages=4, k_splits=4)) is None


@pytest.mark.parametrize("row_tiles, n_tiles, stages, k, parts, k_splits, out_dtype, ahead",
                         [(1, 16, 4, 640, None, 1, "float32", False), (2, 8, 3, 128, None, 1, "bfloat16", False),
                          (1, 4, 6, 256, None, 2, "float32", False), (2, 16, 4, 512, None, 4, "float32", False),
                          (1, 8, 2, 192, (64, 32, 32), 1, "float32", False),
                          (1, 16, 4, 256, (128, 64, 64), 2, "bfloat16", False), (1, 4, 6, 640, None, 1, "float32", True),
                          (1, 16, 3, 128, (64, 32, 32), 1, "float32", True), (2, 8, 4, 192, None, 1, "bfloat16", True)])
def test_cuda_wgmma_form_emulated(row_tiles, n_tiles, stages, k, parts, k_splits, out_dtype, ahead):
    """``wgmma``: one warpgroup a block, its operands staged by cp.async into the 128-byte swizzle of dynamic shared
    memory, 4 k16 wgmma a row tile and k-step. On the CPU emulation of the generated code (the emulated wgmma reads the
    tiles through their descriptors and the hardware's swizzle), against NumPy: one token, a partial last pass (37) and
    three passes; rows past the weight's end (96 rows in 64- and 128-row blocks), one to three weights, k splits, fewer
    k-steps than stages and 16-bit outputs; ``wgmma_ahead`` (a step's wgmma waited for a step later, its stage refilled a
    step later). nvcc accepts it for sm_90a."""
    from cuda_emu import EmulatedKernel
    from tvm.support import nvcc

    n_out = sum(parts) if parts else 96
    spec = DenseSpec(out_features=n_out, in_features=k, stages=stages, row_tiles=row_tiles, n_tiles=n_tiles,
                     wgmma=True, k_splits=k_splits, dyn_shared=232448, out_dtype=out_dtype, wgmma_ahead=ahead)
    cfg = launch_config(spec)
    assert cfg["form"].startswith(f"wgmma m64n{8 * n_tiles}k16") and cfg["threads"] == 128
    assert cfg["rows_per_block"] == 64 * row_tiles and cfg["stages"] == stages
    src = tvm.compile(tvm.IRModule({"dense_gemm": make_dense(spec, "cuda", parts)}),
                      target=make_target("cuda", "sm_90a")).mod.imports[0].inspect_source()
    assert f"moec_wgmma_m64n{8 * n_tiles}k16_bf16(" in src and "wgmma.mma_async.sync.aligned" in src
    assert ("moec_wgmma_wait1();" in src) == ahead
    if k == 640:  # ptxas takes wgmma for sm_90a only: the build's fatbin is that one code generation, no compute_90 PTX
        from moec.compiler.build import nvcc_arch

        assert nvcc_arch("sm_90a") == ["-gencode", "arch=compute_90a,code=sm_90a"] and nvcc_arch("sm_90") == "sm_90"
        with make_target("cuda", "sm_90a"):
            assert len(nvcc.compile_cuda(src, target_format="fatbin", arch=nvcc_arch("sm_90a"), compiler="nvcc")) > 0
            with pytest.raises(RuntimeError, match="not supported on .target 'sm_90'"):
                nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90a", compiler="nvcc")
    name = {None: "dense_gemm", 3: "dense_gemm3"}[parts and len(parts)]
    kern = EmulatedKernel(src, f"{name}_kernel")
    add = EmulatedKernel(src, f"{name}_kernel_1") if k_splits > 1 else None
    for m in (1, 37, 3 * 8 * n_tiles):
        rng = np.random.default_rng(m + k)
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((n_out, k)).astype(ml_dtypes.bfloat16)
        ref = reference(x, w)
        widths = list(parts) if parts else [n_out]
        grid = (-(-m // cfg["tokens_per_block"]), sum(-(-n // cfg["rows_per_block"]) for n in widths), k_splits)
        odt = np.float32 if out_dtype == "float32" else ml_dtypes.bfloat16
        ys = [np.full((m, n), np.nan, odt) for n in widths]
        args = {"x": x.view(np.uint16)}
        if parts is None:
            args.update(w=w.view(np.uint16), y=ys[0] if out_dtype == "float32" else ys[0].view(np.uint16))
        else:
            ws = np.split(w, np.cumsum(parts)[:-1])
            args.update({f"w{i + 1}": wi.view(np.uint16) for i, wi in enumerate(ws)})
            args.update({f"y{i + 1}": yi if out_dtype == "float32" else yi.view(np.uint16) for i, yi in enumerate(ys)})
        if k_splits > 1:
            args["sums"] = np.full((m, k_splits, n_out), np.nan, np.float32)
        kern(grid, cfg["threads"], M=m, **args)
        if add is not None:
            add((-(-(m * n_out // 4) // 256), 1, 1), 256, M=m, **args)
        tol = (1e-5, 1e-3) if out_dtype == "float32" else (1e-2, 1e-1)
        for y, r in zip(ys, np.split(ref, np.cumsum(widths)[:-1], axis=1)):
            np.testing.assert_allclose(y.astype(np.float32), r, rtol=tol[0], atol=tol[1])


def test_wgmma_form_refusals():
    with pytest.raises(MoecError, match="one warpgroup"):
        DenseSpec(128, 128, wgmma=True, stages=4, warps=2, dyn_shared=232448).check()
    with pytest.raises(MoecError, match="token tiles"):
        DenseSpec(128, 128, wgmma=True, stages=4, n_tiles=2, dyn_shared=232448).check()
    with pytest.raises(MoecError, match="dynamic shared memory"):
        DenseSpec(128, 128, wgmma=True, stages=4).check()
    with pytest.raises(MoecError, match="no ldmatrix"):
        DenseSpec(128, 128, wgmma=True, stages=4, ldmatrix=True, dyn_shared=232448).check()
    assert "multiple of 64" in eligible(DenseSpec(128, 160, wgmma=True, stages=4, dyn_shared=232448))
    assert "k splits" in eligible(DenseSpec(128, 256, wgmma=True, stages=4, k_splits=8, dyn_shared=232448))
    with pytest.raises(MoecError, match="wgmma_ahead"):
        DenseSpec(128, 128, wgmma=True, stages=2, wgmma_ahead=True, dyn_shared=232448).check()
    with pytest.raises(MoecError, match="wgmma_ahead"):
        DenseSpec(128, 128, stages=4, wgmma_ahead=True).check()


def test_ir_wgmma_target_takes_the_wgmma_form():
    # an sm_90a target compiles every linear layer to the wgmma form: 32-token passes in the decode entries, 128-token
    # passes for LM heads and in the prefill (which then takes no tiled kernel); sm_90 keeps the mma.sync forms
    specs = {n: compiled_spec(n, 2048, wgmma=True) for n in (2048, 4096, 6144, 50304)}
    assert [(s.wgmma, s.n_tiles, s.stages, s.wgmma_ahead, s.k_splits) for s in specs.values()] == [
        (True, 4, 8, True, 1), (True, 4, 8, True, 1), (True, 4, 6, False, 1), (True, 16, 4, False, 1)]
    pre = compiled_spec(2048, 2048, wgmma=True, prefill=True)
    assert (pre.n_tiles, pre.wgmma_ahead) == (16, True)
    for s_ in list(specs.values()) + [pre]:
        s_.check()
        assert launch_config(s_)["stages"] == s_.stages  # (all the stages fit)
    widths = (64, 32, 32, 48)
    for entry, tok in (("main", 4), ("prefill", 16)):
        before = _parallel_entry(widths)
        if entry == "prefill":
            before = tvm.IRModule({"prefill": before["main"]})
        p = InsertDenseGEMM(make_target("cuda", "sm_90a"), prefill_tiled=True)
        after = relax.transform.DeadCodeElimination([entry])(p(before))
        calls = {b.value.args[0].name_hint: b.value for blk in after[entry].body.blocks for b in blk.bindings
                 if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"}
        assert sorted(calls) == ["dense_gemm", "dense_gemm_x3"] and p.tiled == {}  # (no tiled kernel)
        assert all(s.wgmma and s.n_tiles == tok for (s, _, _) in p.kernels)
        assert f"moec_wgmma_m64n{8 * tok}k16_bf16" in after["dense_gemm"].script()
    q = InsertDenseGEMM(make_target("cuda", "sm_90"))
    q(_parallel_entry(widths))
    assert not any(s.wgmma for (s, _, _) in q.kernels)
