"""Device greedy sampling (schedules/kernels/sampling.py): the llvm form against numpy.argmax (ties, -inf,
vocabularies smaller and larger than a block), the CUDA form built for sm_90, and on a GPU (marker ``gpu``)
the CUDA form against numpy."""

import re

import ml_dtypes
import numpy as np
import pytest
import tvm

from moec.compiler.targets import make_target
from moec.schedules.kernels.sampling import THREADS, make_argmax

from moec_testing import require_cuda

_BUILT = {}


def _build(vocab, dtype, target, out_dtype="int32"):
    key = (vocab, dtype, target, out_dtype)
    if key not in _BUILT:
        tgt = tvm.target.Target({"kind": "llvm"}) if target == "llvm" else make_target("cuda", "sm_90")
        prim = make_argmax(vocab, dtype, target, out_dtype)
        _BUILT[key] = tvm.compile(tvm.IRModule({"argmax_rows": prim}), target=tgt)
    return _BUILT[key]


def _rows(n, vocab, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, n, vocab)).astype(np.float32)
    x[0, 0, :] = 0.0  # all tied: the first index wins
    if n > 1:
        x[0, 1, [3 % vocab, vocab - 1]] = 9.0  # a tie between two far apart indices
    if n > 2:
        x[0, 2, :] = -np.inf  # nothing finite: token 0, as numpy
        x[0, 2, vocab // 2] = -1e30
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16)
    return x


def _run(ex, x, dev, out_dtype=np.int32):
    out = tvm.runtime.tensor(np.full((1, x.shape[1]), -5, out_dtype), dev)
    ex["argmax_rows"](tvm.runtime.tensor(x, dev), out)
    return out.numpy()


@pytest.mark.parametrize("vocab,dtype", [(7, "float32"), (512, "float32"), (3000, "bfloat16")])
def test_llvm_matches_numpy(vocab, dtype):
    x = _rows(5, vocab, dtype, seed=vocab)
    got = _run(_build(vocab, dtype, "llvm"), x, tvm.cpu())
    np.testing.assert_array_equal(got, np.argmax(x.astype(np.float32), axis=-1))
    assert got[0, 0] == 0 and (vocab < 2 or got[0, 1] == 3 % vocab)


def test_int64_token_ids():
    """The decode's token dtype (int64 from the exporters), so a step's tokens feed the next step as they are."""
    x = _rows(4, 300, "float32", seed=3)
    got = _run(_build(300, "float32", "llvm", "int64"), x, tvm.cpu(), np.int64)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    with pytest.raises(ValueError, match="int32 or int64"):
        make_argmax(300, "float32", "llvm", "float32")
    with pytest.raises(ValueError, match="loads a thread in flight"):
        make_argmax(300, "float32", "cuda", "int32", loads=0)
    src = _cuda_modules_src(_build(300, "float32", "cuda", "int64"))
    assert "int64_t* __restrict__" in src or "long long* __restrict__" in src


def _cuda_modules_src(ex):
    from moec.compiler.build import _cuda_modules

    return _cuda_modules(ex.mod)[0].inspect_source("cuda")


def test_cuda_builds_for_sm90():
    from moec.compiler.build import _cuda_modules

    src = _cuda_modules(_build(50304, "float32", "cuda").mod)[0].inspect_source("cuda")
    assert set(re.findall(r"__launch_bounds__\((\d+)\) (\w+)\(", src)) == {(str(THREADS), "argmax_rows_kernel")}
    assert src.count("__shfl_xor_sync") >= 2 * (5 + 5)  # value and index, in-warp then across the 32 warps
    small = _cuda_modules(_build(100, "bfloat16", "cuda").mod)[0].inspect_source("cuda")
    assert "__launch_bounds__(128)" in small  # a block no wider than the vocabulary needs


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,dtype", [(100, "bfloat16"), (50304, "float32"), (32000, "float32")])
def test_cuda_matches_numpy_on_gpu(vocab, dtype):
    require_cuda()
    x = _rows(131, vocab, dtype, seed=1)
    got = _run(_build(vocab, dtype, "cuda"), x, tvm.cuda())
    np.testing.assert_array_equal(got, np.argmax(x.astype(np.float32), axis=-1))
    got64 = _run(_build(vocab, dtype, "cuda", "int64"), x, tvm.cuda(), np.int64)
    np.testing.assert_array_equal(got64, got)


@pytest.mark.parametrize("vocab,dtype", [(7, "float32"), (3000, "bfloat16"), (50304, "float32")])
def test_cuda_form_emulated(vocab, dtype):
    """The CUDA form's generated code on the CPU emulator against numpy.argmax: ties to the first index, rows with
    nothing finite, a vocabulary shorter than a block, and OLMoE's (eight loads a thread in flight, then a partial
    group past the row's end)."""
    from cuda_emu import EmulatedKernel

    src = _cuda_modules_src(_build(vocab, dtype, "cuda"))
    kern = EmulatedKernel(src, "argmax_rows_kernel")
    x = _rows(4, vocab, dtype, seed=vocab)
    out = np.full((1, 4), -5, np.int32)
    threads = min(THREADS, max(32, 1 << (vocab - 1).bit_length()))
    xb = x.view(np.uint16) if dtype == "bfloat16" else x
    kern((4, 1, 1), threads, x=xb, out=out, N=4)
    np.testing.assert_array_equal(out, np.argmax(x.astype(np.float32), axis=-1))
