"""The CPU emulation of CUDA kernels (tests/cuda_emu.py) on hand-written kernels: warp shuffles, ballots, block
barriers, the mma.sync fragment layouts of the PTX ISA, and the errors it must raise."""

import numpy as np
import pytest

from cuda_emu import EmulatedKernel

HEADER = 'extern "C" __global__ void __launch_bounds__(64) '

REDUCE = HEADER + """k(float* __restrict__ x_ptr, float* __restrict__ out_ptr, int n) {
  __shared__ alignas(64) float part_ptr[2];
  float v = ((int)threadIdx.x) < n ? x_ptr[((int)blockIdx.x) * 64 + ((int)threadIdx.x)] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync((uint)4294967295, v, o, 32);
  if ((((int)threadIdx.x) & 31) == 0) part_ptr[((int)threadIdx.x) >> 5] = v;
  __syncthreads();
  if (((int)threadIdx.x) == 0) out_ptr[((int)blockIdx.x)] = part_ptr[0] + part_ptr[1];
  uint b = __ballot_sync((uint)4294967295, ((int)threadIdx.x) % 3 == 0);
  if (((int)threadIdx.x) == 1) out_ptr[3 + ((int)blockIdx.x)] = (float)__popc(b);
}"""


def test_shuffles_barriers_and_ballots():
    k = EmulatedKernel(REDUCE, "k")
    x = np.arange(3 * 64, dtype=np.float32)
    out = np.zeros(6, np.float32)
    k((3, 1, 1), 64, x=x, out=out, n=64)
    np.testing.assert_array_equal(out[:3], x.reshape(3, 64).sum(1))
    assert list(out[3:]) == [11, 11, 11]  # lanes 0, 3, ..., 30 of warp 0


DIVERGENT = HEADER + """k(float* __restrict__ x_ptr) {
  if (((int)threadIdx.x) % 2 == 0) {
    x_ptr[((int)threadIdx.x)] = (float)__popc(__ballot_sync((uint)4294967295, 1));
  } else {
    x_ptr[((int)threadIdx.x)] = __shfl_xor_sync((uint)4294967295, 1.0f, 1, 32);
  }
}"""

MISMATCHED_BARRIER = HEADER + """k(float* __restrict__ x_ptr) {
  if (((int)threadIdx.x) < 32) {
    x_ptr[0] = __shfl_xor_sync((uint)4294967295, 1.0f, 1, 32);
    __syncthreads();
  } else {
    __syncthreads();
  }
}"""


def test_divergent_collectives_are_errors():
    """Lanes meeting at different warp collectives (code the GPU does not define) and threads at different barriers."""
    with pytest.raises(RuntimeError, match="divergent warp collective"):
        EmulatedKernel(DIVERGENT, "k")((1, 1, 1), 64, x=np.zeros(64, np.float32))
    with pytest.raises(RuntimeError, match="threads wait at different barriers"):
        EmulatedKernel(MISMATCHED_BARRIER, "k")((1, 1, 1), 64, x=np.zeros(64, np.float32))


MMA = 'extern "C" __global__ void __launch_bounds__(32) ' + """k(uint* __restrict__ a_ptr, uint* __restrict__ b_ptr, float* __restrict__ d_ptr) {
  int l = ((int)threadIdx.x);
  float d0, d1, d2, d3;
  {
    __asm__ __volatile__(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\\n"
      :  "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
      : "r"(a_ptr[l * 4]), "r"(a_ptr[l * 4 + 1]), "r"(a_ptr[l * 4 + 2]), "r"(a_ptr[l * 4 + 3]), "r"(b_ptr[l * 2]), "r"(b_ptr[l * 2 + 1]), "f"(0.0f), "f"(0.0f), "f"(0.0f), "f"(0.0f));
  }
  d_ptr[l * 4] = d0; d_ptr[l * 4 + 1] = d1; d_ptr[l * 4 + 2] = d2; d_ptr[l * 4 + 3] = d3;
}"""


def test_mma_fragments_follow_the_ptx_layout():
    """m16n8k16 with bf16 operands: fragments packed per the PTX ISA tables (lane = 4 g + q; A: a0,a1 (g, 2q..),
    a2,a3 (g + 8, 2q..), a4,a5 (g, 2q + 8..), a6,a7 (g + 8, 2q + 8..); B: b0,b1 (k 2q.., n g), b2,b3 (k 2q + 8..);
    D: d0,d1 (g, 2q..), d2,d3 (g + 8, 2q..)) give A @ B."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, (16, 16)).astype(ml_dtypes.bfloat16)
    b = rng.integers(-4, 5, (16, 8)).astype(ml_dtypes.bfloat16)
    bits = lambda x: x.view(np.uint16).astype(np.uint32)  # noqa: E731
    af, bf = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, q = divmod(lane, 4)
        for r, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]):
            af[lane, r] = bits(a[row, col]) | (bits(a[row, col + 1]) << 16)
        for r, kk in enumerate([2 * q, 2 * q + 8]):
            bf[lane, r] = bits(b[kk, g]) | (bits(b[kk + 1, g]) << 16)
    d = np.zeros((32, 4), np.float32)
    EmulatedKernel(MMA, "k")((1, 1, 1), 32, a=af, b=bf, d=d)
    want = a.astype(np.float32) @ b.astype(np.float32)
    got = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, q = divmod(lane, 4)
        got[g, 2 * q: 2 * q + 2], got[g + 8, 2 * q: 2 * q + 2] = d[lane, :2], d[lane, 2:]
    np.testing.assert_array_equal(got, want)


def test_ldmatrix_follows_the_ptx_layout():
    """ldmatrix x4 as TVM generates it (``T.ptx_legacy.ldmatrix``): lanes 8 m .. 8 m + 7 address the rows of matrix m;
    lane 4 g + q receives row g's elements 2 q, 2 q + 1 of each matrix, or with .trans column g's elements of rows
    2 q, 2 q + 1. Here the four matrices are the quadrants of a 16 x 16 tile (an A fragment's order)."""
    import ml_dtypes
    import tvm
    from tvm.script import tirx as T

    from moec.compiler.targets import make_target

    @T.prim_func(s_tir=True)
    def f(a_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "f"})
        a = T.match_buffer(a_h, (16, 16), "bfloat16")
        o = T.match_buffer(o_h, (2, 32, 8), "bfloat16")
        for tx in T.thread_binding(32, thread="threadIdx.x"):
            with T.sblock("x"):
                T.reads()
                T.writes()
                s = T.sblock_alloc_buffer((16 * 24,), "bfloat16", scope="shared")
                fr = T.sblock_alloc_buffer((8,), "bfloat16", scope="local")
                for i in T.serial(8):
                    s[(tx // 2) * 24 + (tx % 2) * 8 + i] = a[tx // 2, (tx % 2) * 8 + i]
                T.tvm_storage_sync("shared")
                for tr in T.unroll(2):
                    T.evaluate(T.ptx_legacy.ldmatrix(tr == 1, 4, ".b16", fr.data, 0, s.data,
                                                     ((tx % 8) + 8 * ((tx // 8) % 2)) * 24 + (tx // 16) * 8, dtype="bfloat16"))
                    for i in T.serial(8):
                        o[tr, tx, i] = fr[i]

    src = tvm.compile(tvm.IRModule({"f": f}), target=make_target("cuda")).mod.imports[0].inspect_source()
    assert src.count("ldmatrix.sync.aligned.m8n8.x4") == 2
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    o = np.zeros((2, 32, 8), ml_dtypes.bfloat16)
    EmulatedKernel(src, "f_kernel")((1, 1, 1), 32, a=a.view(np.uint16), o=o.view(np.uint16))
    for lane in range(32):
        g, q = divmod(lane, 4)
        quads = [(0, 0), (8, 0), (0, 8), (8, 8)]  # matrix m: (first row, first column)
        want = [a[r0 + g, c0 + 2 * q + e] for r0, c0 in quads for e in (0, 1)]
        want_t = [a[r0 + 2 * q + e, c0 + g] for r0, c0 in quads for e in (0, 1)]
        np.testing.assert_array_equal(o[0, lane].astype(np.float32), np.array(want, np.float32))
        np.testing.assert_array_equal(o[1, lane].astype(np.float32), np.array(want_t, np.float32))
