"""ProgrammaticDependentLaunch (``--pdl``): every device kernel waits for the grid before it first and is launched with
PDL; host code unchanged; refused off sm_90+; a whole model built with it (CPU: IR, CUDA source, nvcc; GPU: the same
results as without)."""

import json
import re

import numpy as np

import pytest
import tvm
from tvm.script import tirx as T

from moec.compiler.errors import MoecError
from moec.passes.pdl import LAUNCH_TAG, PIPELINE, ProgrammaticDependentLaunch, is_pdl_kernel, tir_pipeline

SM90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
PDL_HEAD = ["tvm_builtin_ptx_griddepcontrol_wait();", "tvm_builtin_ptx_griddepcontrol_launch_dependents();"]


def _kernel_heads(src: str) -> list[list[str]]:
    """The first two statements of every kernel defined in CUDA source ``src``."""
    bodies = re.findall(r'extern "C" __global__ void[^{;]*\{\n(.*?)\n\}', src, re.S)
    return [[ln.strip() for ln in body.splitlines() if ln.strip()][:2] for body in bodies]


def _module():
    @T.prim_func(s_tir=True)
    def twice(a: T.Buffer((256,), "float32"), b: T.Buffer((256,), "float32")):
        T.func_attr({"global_symbol": "twice", "tirx.noalias": True})
        for bx in T.thread_binding(2, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                with T.sblock("x"):
                    b[bx * 128 + tx] = a[bx * 128 + tx] * T.float32(2)

    @T.prim_func(s_tir=True)
    def reverse(var_a: T.handle, var_b: T.handle):  # dynamic shared memory: its launch tag must stay last
        T.func_attr({"global_symbol": "reverse", "tirx.noalias": True})
        n = T.int64()
        a = T.match_buffer(var_a, (n,), "float32")
        b = T.match_buffer(var_b, (n,), "float32")
        for bx in T.thread_binding(T.ceildiv(n, 128), thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                with T.sblock("r"):
                    s = T.sblock_alloc_buffer((128,), "float32", scope="shared.dyn")
                    if bx * 128 + tx < n:
                        s[tx] = a[bx * 128 + tx]
                    T.tvm_storage_sync("shared")
                    if bx * 128 + tx < n:
                        b[bx * 128 + tx] = s[127 - tx]

    return tvm.IRModule({"twice": twice, "reverse": reverse})


def _lowered(pdl: bool):
    """The module after TVM's default TIR lowering (host and device split), with the pass after it or not."""
    from tvm.tirx import compilation_pipeline as cp

    lower, _, _ = cp.get_tir_pipeline("default")
    with SM90:
        mod = tvm.tirx.transform.BindTarget(SM90.with_host("llvm"))(_module())
        mod = lower(mod)
        return ProgrammaticDependentLaunch()(mod) if pdl else mod


def test_every_kernel_waits_first_and_is_launched_with_pdl():
    before, after = _lowered(False), _lowered(True)
    kernels = [gv for gv, f in after.functions_items() if f.attrs is not None and f.attrs.get("tirx.kernel_launch_params") is not None]
    assert sorted(gv.name_hint for gv in kernels) == ["reverse_kernel", "twice_kernel"]
    for gv in kernels:
        f, old = after[gv], before[gv.name_hint]
        assert is_pdl_kernel(f) and not is_pdl_kernel(old)
        params, old_params = [str(p) for p in f.attrs["tirx.kernel_launch_params"]], [str(p) for p in old.attrs["tirx.kernel_launch_params"]]
        # the tag added once, before the dynamic shared memory's (which the runtime requires last); nothing else changes
        assert [p for p in params if p != LAUNCH_TAG] == old_params and params.count(LAUNCH_TAG) == 1
        if "tirx.use_dyn_shared_memory" in old_params:
            assert params[-2:] == [LAUNCH_TAG, "tirx.use_dyn_shared_memory"]
        else:
            assert params[-1] == LAUNCH_TAG
        own = list(old.body.seq) if isinstance(old.body, tvm.tirx.SeqStmt) else [old.body]
        assert len(f.body.seq) == 2 + len(own)  # the kernel's own statements after the two instructions
        for a, b in zip(f.body.seq[2:], own):
            tvm.ir.assert_structural_equal(a, b, map_free_vars=True)
    names = [gv.name_hint for gv in kernels]
    for gv, f in after.functions_items():  # host functions as they were
        if gv.name_hint not in names:
            assert f.script() == before[gv.name_hint].script(), gv.name_hint
    again = ProgrammaticDependentLaunch()(after)  # idempotent
    for gv in kernels:
        tvm.ir.assert_structural_equal(again[gv], after[gv])


def test_cuda_source_and_nvcc():
    from tvm.support import nvcc

    name = tir_pipeline(SM90)
    assert name == PIPELINE and tir_pipeline(SM90) == name  # registered once
    src = tvm.tirx.build(_module(), target=SM90, pipeline=name).imports[0].inspect_source()
    assert _kernel_heads(src) == [PDL_HEAD, PDL_HEAD]
    assert 'asm volatile("griddepcontrol.wait;"' in src
    with SM90:
        assert len(nvcc.compile_cuda(src, target_format="fatbin", arch="sm_90", compiler="nvcc")) > 0
    plain = tvm.tirx.build(_module(), target=SM90).imports[0].inspect_source()
    assert "griddepcontrol" not in plain and len(_kernel_heads(plain)) == 2


@pytest.mark.parametrize("target", [tvm.target.Target("llvm"), tvm.target.Target({"kind": "cuda", "arch": "sm_80"})])
def test_refused_before_hopper(target):
    with pytest.raises(MoecError, match="sm_90 or later"):
        tir_pipeline(target)


def test_model_built_with_pdl(zoo, tmp_path):
    """``moec.compile(..., pdl=True)`` for CUDA: every kernel of the artifact (decode graph, prefill, argmax...) waits
    first; the manifest says so; refused for the CPU target and with TVM's paged caches, nothing written."""
    import moec
    from moec.passes.pdl import PAGED_REASON

    with pytest.raises(MoecError, match="--pdl needs a CUDA target"):
        moec.compile(zoo.source("tiny", "onnx"), tmp_path / "cpu", target="llvm", kv_cache="tiered", pdl=True)
    for cache in ("paged", "bf16"):
        with pytest.raises(MoecError, match=f"--pdl with the {cache} KV cache") as err:
            moec.compile(zoo.source("tiny", "onnx"), tmp_path / cache, target="cuda", kv_cache=cache, pdl=True)
        assert PAGED_REASON in str(err.value)
    assert not [p for p in tmp_path.iterdir() if p.name in ("cpu", "paged", "bf16")]
    art = moec.compile(zoo.source("tiny", "onnx"), tmp_path / "art", target="cuda", kv_cache="tiered", pdl=True,
                       cuda_graph=False)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["options"]["pdl"] is True
    # the CUDA source as the library embeds it (it cannot be loaded without the CUDA runtime)
    heads = _kernel_heads((art / "lib.so").read_bytes().decode("latin-1"))
    assert len(heads) > 20 and all(h == PDL_HEAD for h in heads)
    # the launch tag reached the device module's function table (what TVM's CUDA runtime reads at launch)
    assert (art / "lib.so").read_bytes().count(LAUNCH_TAG.encode()) >= len(heads)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["tiered"])  # (TVM's paged cache is refused: PAGED_REASON)
def test_pdl_model_matches_plain_on_the_gpu(zoo, tmp_path, cache):
    """Built with PDL, the model computes what it computes without: the same prefill logits and greedy tokens over decode
    steps through the CUDA graphs (every kernel waits for its predecessor grid before touching memory)."""
    import moec
    from moec_testing import require_cuda

    require_cuda()
    src = zoo.source("tiny", "onnx")
    engines = [moec.load(moec.compile(src, tmp_path / f"art{p}", target="cuda", kv_cache=cache, pdl=p), device="cuda")
               for p in (False, True)]
    prompts = [[3 + (i * 7) % 200 for i in range(n)] for n in (300, 9, 41, 170)]
    runs = []
    for e in engines:
        seqs, logits = e.prefill(prompts)
        steps = list(e.decode_greedy_steps(seqs, list(logits.argmax(-1)), 24))
        runs.append((logits, np.stack(steps), e.graph_steps))
    (la, ta, ga), (lb, tb, gb) = runs
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-5 * float(np.abs(la).max()))
    np.testing.assert_array_equal(tb, ta)
    assert ga == gb >= 24  # both through the graphs
