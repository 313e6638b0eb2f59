"""Run a CUDA kernel that TVM generated on this machine's CPU: a test harness for machines without a GPU.

The kernel's source (``inspect_source`` of a compiled CUDA module) is compiled by the host C++ compiler
with a small prelude that supplies what the device would: ``threadIdx`` / ``blockIdx``, ``__syncthreads``,
warp shuffles, 16-bit float types, ``mma.sync`` and ``ldmatrix`` (each inline-asm ``mma`` or ``ldmatrix`` becomes a
call to an emulation that gathers the warp's fragments or rows as the PTX ISA lays them out), and moec's ``wgmma``
helpers (a warpgroup's products from swizzled shared-memory tiles). Threads are fibers
(``ucontext``) on one OS thread, switched only at barriers, so a run is deterministic; the blocks of
the grid run one after another, ``__shared__`` arrays being the function's statics.

It checks what the generated code computes (indexing, fragment layouts, masking, reductions, the
order of shared-memory phases), not speed or memory-model races. Unsupported constructs (other inline
assembly, atomics but a float ``atomicAdd``) make ``compile_kernel`` raise, so a test never passes by skipping them.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <ucontext.h>
#include <vector>
#include <memory>
#include <stdexcept>
#include <algorithm>
#include <string>
typedef unsigned char uchar;
typedef unsigned short ushort;
#define DYN_SHARED_BYTES 232448  // the most dynamic shared memory a block takes on sm_90
#define CUDART_INF_F INFINITY  // (math_constants.h)
typedef unsigned int uint;
struct dim3_ { int x, y, z; };
static dim3_ blockIdx, blockDim, gridDim;

static inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
struct nv_bfloat16 {
  uint16_t x;
  nv_bfloat16() : x(0) {}
  nv_bfloat16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { x = 0x7fc0; return; }
    x = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  nv_bfloat16(double f) : nv_bfloat16((float)f) {}
  nv_bfloat16(int f) : nv_bfloat16((float)f) {}
  operator float() const { return u2f(((uint32_t)x) << 16); }
};
struct half {
  uint16_t x;
  half() : x(0) {}
  half(float f) {
    uint32_t u = f2u(f), sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) { x = 0x7e00; return; }
    if (a >= 0x477ff000u) { x = (uint16_t)(sign | 0x7c00u); return; }  // rounds to inf
    if (a < 0x38800000u) {  // subnormal or zero: value / 2^-24, rounded to nearest even
      float v = u2f(a) * 16777216.0f;
      float r = std::nearbyint(v);
      x = (uint16_t)(sign | (uint32_t)r);
      return;
    }
    uint32_t e = ((a >> 23) - 112) << 10, m = a & 0x7fffffu;
    uint32_t h = e | (m >> 13);
    uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;
    x = (uint16_t)(sign | h);
  }
  half(double f) : half((float)f) {}
  half(int f) : half((float)f) {}
  operator float() const {
    uint32_t sign = ((uint32_t)(x & 0x8000u)) << 16, e = (x >> 10) & 31u, m = x & 1023u;
    if (e == 0) { float v = (float)m * 5.9604644775390625e-08f; return sign ? -v : v; }
    if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
    return u2f(sign | ((e + 112) << 23) | (m << 13));
  }
};
static inline float __half2float(half h) { return (float)h; }
static inline half __float2half(float f) { return half(f); }
static inline half __float2half_rn(float f) { return half(f); }
static inline float __bfloat162float(nv_bfloat16 h) { return (float)h; }
static inline nv_bfloat16 __float2bfloat16(float f) { return nv_bfloat16(f); }
static inline nv_bfloat16 __float2bfloat16_rn(float f) { return nv_bfloat16(f); }
struct float2 { float x, y; }; struct float4 { float x, y, z, w; };
struct uint2 { uint x, y; }; struct uint4 { uint x, y, z, w; };
struct int2 { int x, y; }; struct int4 { int x, y, z, w; };
struct uchar4 { uchar x, y, z, w; }; struct char4 { signed char x, y, z, w; };
// two 16-bit floats in 32 bits (the generated code declares 2-lane vector loads of 16-bit buffers with them)
struct nv_bfloat162 { nv_bfloat16 x, y; nv_bfloat162() {} nv_bfloat162(nv_bfloat16 a, nv_bfloat16 b) : x(a), y(b) {} };
struct nv_bfloat164 { nv_bfloat16 x, y, z, w; };  // (8-byte moves of four bfloat16)
struct half2 { half x, y; half2() {} half2(half a, half b) : x(a), y(b) {} };
static inline uint __pack_nv_bfloat162(nv_bfloat16 a, nv_bfloat16 b) { return (uint)a.x | ((uint)b.x << 16); }
static inline uint __pack_half2(half a, half b) { return (uint)a.x | ((uint)b.x << 16); }
// atomics and fences: the blocks run one after another and a block's threads switch only at barriers, so a float
// atomicAdd is a plain read-modify-write and a fence has nothing to order
static inline float atomicAdd(float *p, float v) { float o = *p; *p = o + v; return o; }
#define __threadfence() ((void)0)
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline int2 make_int2(int x, int y) { return {x, y}; }
static inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
static inline uint2 make_uint2(uint x, uint y) { return {x, y}; }
static inline uint4 make_uint4(uint x, uint y, uint z, uint w) { return {x, y, z, w}; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline uint max(uint a, uint b) { return a > b ? a : b; }
static inline uint min(uint a, uint b) { return a < b ? a : b; }
static inline float max(float a, float b) { return std::fmax(a, b); }
static inline float min(float a, float b) { return std::fmin(a, b); }
static inline float exp2f_(float x) { return std::exp2(x); }
#define __expf(x) std::exp((float)(x))
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline int __popc(uint v) { return __builtin_popcount(v); }
// FP8 e4m3 (bias 7, no infinities, S.1111.111 NaN) and the 4-byte vector the generated code widens to half4
struct __nv_fp8_e4m3 { uint8_t __x; };
struct __nv_fp8x4_e4m3 { uint32_t __x; };
static inline float e4m3_to_float_(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  float v = (e == 15 && m == 7) ? NAN : e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}
struct half4 {
  half x, y, z, w;
  half4() {}
  explicit half4(const __nv_fp8x4_e4m3 &v)
      : x(e4m3_to_float_(v.__x & 0xff)), y(e4m3_to_float_((v.__x >> 8) & 0xff)), z(e4m3_to_float_((v.__x >> 16) & 0xff)),
        w(e4m3_to_float_(v.__x >> 24)) {}
};
static inline uint prmt_(uint a, uint b, uint s) {  // PTX prmt.b32 (default mode): selector msb replicates the byte's sign
  uint64_t v = ((uint64_t)b << 32) | a;
  uint r = 0;
  for (int i = 0; i < 4; ++i) {
    uint n = (s >> (4 * i)) & 15, byte = (uint)(v >> (8 * (n & 7))) & 0xff;
    r |= ((n & 8) ? ((byte & 0x80) ? 0xffu : 0u) : byte) << (8 * i);
  }
  return r;
}
static inline uint __byte_perm(uint x, uint y, uint s) {  // result byte i = byte (s >> 4 i) & 7 of {y, x} (no sign mode)
  return prmt_(x, y, s & 0x7777u);
}
// moec's float16-pair helpers (schedules/cuda_prelude.py; PTX there): fma.rn.f16x2, cvt.rn.f16x2.f32, cvt.f32.f16
static inline half h_bits_(uint16_t b) { half h; h.x = b; return h; }
static inline uint moec_pack_h2(float lo, float hi) { return (uint)half(lo).x | ((uint)half(hi).x << 16); }
static inline float moec_h2_lo(uint a) { return (float)h_bits_((uint16_t)(a & 0xffff)); }
static inline float moec_h2_hi(uint a) { return (float)h_bits_((uint16_t)(a >> 16)); }
static inline uint moec_e4m3x2_lo(uint a) { return (uint)half(e4m3_to_float_(a & 0xff)).x | ((uint)half(e4m3_to_float_((a >> 8) & 0xff)).x << 16); }
static inline uint moec_e4m3x2_hi(uint a) { return moec_e4m3x2_lo(a >> 16); }
static inline uint moec_pack_bf2(float lo, float hi) { return (uint)nv_bfloat16(lo).x | ((uint)nv_bfloat16(hi).x << 16); }
static inline uint bf16_exact_(float f) { uint32_t u; memcpy(&u, &f, 4); return u >> 16; }  // (f exact in bfloat16)
static inline uint moec_e4m3x2_bf16_lo(uint a) { return bf16_exact_(e4m3_to_float_(a & 0xff)) | (bf16_exact_(e4m3_to_float_((a >> 8) & 0xff)) << 16); }
static inline uint moec_e4m3x2_bf16_hi(uint a) { return moec_e4m3x2_bf16_lo(a >> 16); }
static inline uint moec_e4m3x2_bf16s_lo(uint a) { return (prmt_(a, 0, 0x9180) << 4) & 0x87F087F0u; }
static inline uint moec_e4m3x2_bf16s_hi(uint a) { return (prmt_(a, 0, 0xB3A2) << 4) & 0x87F087F0u; }
static inline void moec_st_b32x2(void *p, uint lo, uint hi) {
  if ((uintptr_t)p % 8) throw std::runtime_error("moec_st_b32x2: address not 8-byte aligned");
  uint v[2] = {lo, hi}; std::memcpy(p, v, 8);
}
static inline uint moec_hfma2(uint a, uint b, uint c) {  // each half: a * b + c rounded once (exact in double)
  uint r = 0;
  for (int i = 0; i < 2; ++i) {
    double v = (double)(float)h_bits_((uint16_t)(a >> (16 * i))) * (double)(float)h_bits_((uint16_t)(b >> (16 * i))) +
               (double)(float)h_bits_((uint16_t)(c >> (16 * i)));
    r |= (uint)half((float)v).x << (16 * i);  // (double -> float -> half: a second rounding only in rare ties)
  }
  return r;
}

// ------------------------------------------------------------------ fibers and barriers
struct Fiber { ucontext_t ctx; int tid; int wait; bool done; dim3_ idx; int site; };
static const size_t STACK = 1 << 17;  // per thread; the stacks are kept for the next block (not zeroed)
static std::vector<std::unique_ptr<char[]>> stacks;
static ucontext_t sched_ctx;
static std::vector<Fiber> fibers;
static int cur = -1;
#define threadIdx (fibers[cur].idx)  // the running fiber's
static int block_threads = 0;
enum { RUN = 0, AT_BLOCK = 1, AT_WARP = 2 };
static void yield_() { swapcontext(&fibers[cur].ctx, &sched_ctx); }
static void syncthreads_(int site) { fibers[cur].wait = AT_BLOCK; fibers[cur].site = site; yield_(); }
#define __syncthreads() syncthreads_(__LINE__)
// a warp collective's barrier, tagged with its source line: lanes of one warp meeting at different collectives
// (a shuffle or mma reached in divergent code) are an error, not silently paired
static void warp_sync_(int site) { fibers[cur].wait = AT_WARP; fibers[cur].site = site; yield_(); }
static inline int lane_() { return threadIdx.x % 32; }
static inline int warp_() { return threadIdx.x / 32; }

struct WarpBuf { uint32_t a[32][4]; uint32_t b[32][2]; float c[32][4]; uint64_t v[32]; const uint16_t *p[32]; };
static std::vector<WarpBuf> warp_bufs;

template <typename T> static T shfl_xor_(T v, int m, int site) {
  WarpBuf &w = warp_bufs[warp_()];
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  w.v[lane_()] = bits;
  warp_sync_(site);
  uint64_t o = w.v[lane_() ^ m];
  warp_sync_(site);
  T r; std::memcpy(&r, &o, sizeof(T)); return r;
}
template <typename T> static T shfl_idx_(T v, int src, int site) {
  WarpBuf &w = warp_bufs[warp_()];
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  w.v[lane_()] = bits;
  warp_sync_(site);
  uint64_t o = w.v[src & 31];
  warp_sync_(site);
  T r; std::memcpy(&r, &o, sizeof(T)); return r;
}
template <typename T> static T shfl_down_(T v, int d, int site) {
  int l = lane_() + d; return shfl_idx_(v, l < 32 ? l : lane_(), site);
}
template <typename T> static T shfl_up_(T v, int d, int site) {
  int l = lane_() - d; return shfl_idx_(v, l >= 0 ? l : lane_(), site);
}
#define __shfl_xor_sync(mask, v, m, width) shfl_xor_(v, m, __LINE__)
#define __shfl_sync(mask, v, src, width) shfl_idx_(v, src, __LINE__)
#define __shfl_down_sync(mask, v, d, width) shfl_down_(v, d, __LINE__)
#define __shfl_up_sync(mask, v, d, width) shfl_up_(v, d, __LINE__)
static uint ballot_(int pred, int site) {
  uint r = 0;
  WarpBuf &w = warp_bufs[warp_()];
  w.v[lane_()] = pred ? 1 : 0;
  warp_sync_(site);
  for (int i = 0; i < 32; i++) r |= (uint)(w.v[i] ? 1u << i : 0u);
  warp_sync_(site);
  return r;
}
#define __ballot_sync(mask, pred) ballot_(pred, __LINE__)
#define __syncwarp(...) warp_sync_(__LINE__)
template <typename T> static uint match_any_(T v, int site) {
  WarpBuf &w = warp_bufs[warp_()];
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  w.v[lane_()] = bits;
  warp_sync_(site);
  uint r = 0;
  for (int i = 0; i < 32; i++) r |= (uint)(w.v[i] == bits ? 1u << i : 0u);
  warp_sync_(site);
  return r;
}
#define __match_any_sync(mask, v) match_any_(v, __LINE__)

static inline float half_bits_(uint32_t h, bool bf16) {
  if (bf16) { nv_bfloat16 b; b.x = (uint16_t)h; return (float)b; }
  half f; f.x = (uint16_t)h; return (float)f;
}
// mma.sync m16n8k16 row.col, f32 accumulators (PTX ISA fragment layouts: lane = 4 g + q)
static void emu_mma_m16n8k16(const uint32_t *a, const uint32_t *b, const float *c, float *d, bool bf16, int site) {
  WarpBuf &w = warp_bufs[warp_()];
  int l = lane_();
  for (int i = 0; i < 4; i++) { w.a[l][i] = a[i]; w.c[l][i] = c[i]; }
  for (int i = 0; i < 2; i++) w.b[l][i] = b[i];
  warp_sync_(site);
  int g = l / 4, q = l % 4;
  for (int i = 0; i < 4; i++) {
    int row = g + 8 * (i / 2), col = 2 * q + (i % 2);
    float acc = w.c[(row % 8) * 4 + col / 2][(row >= 8) * 2 + col % 2];
    for (int k = 0; k < 16; k++) {
      int al = (row % 8) * 4 + (k % 8) / 2, ar = (row >= 8) + 2 * (k >= 8);
      uint32_t ah = (w.a[al][ar] >> (16 * (k % 2))) & 0xffffu;
      int bl = col * 4 + (k % 8) / 2, br = (k >= 8);
      uint32_t bh = (w.b[bl][br] >> (16 * (k % 2))) & 0xffffu;
      acc += half_bits_(ah, bf16) * half_bits_(bh, bf16);
    }
    d[i] = acc;
  }
  warp_sync_(site);
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes 8 m .. 8 m + 7 give the 8 rows (8 contiguous 16-bit
// elements each) of matrix m; lane l = 4 g + q receives, in register m, row g's elements 2 q and 2 q + 1, or with
// .trans column g's elements of rows 2 q and 2 q + 1
static void emu_ldmatrix(int num, bool trans, const void *row, uint32_t *out, int site) {
  WarpBuf &w = warp_bufs[warp_()];
  int l = lane_();
  w.p[l] = (const uint16_t *)row;
  warp_sync_(site);
  int g = l / 4, q = l % 4;
  for (int m = 0; m < num; m++) {
    uint32_t lo, hi;
    if (trans) { lo = w.p[8 * m + 2 * q][g]; hi = w.p[8 * m + 2 * q + 1][g]; }
    else { lo = w.p[8 * m + g][2 * q]; hi = w.p[8 * m + g][2 * q + 1]; }
    out[m] = lo | (hi << 16);
  }
  warp_sync_(site);
}

// cp.async: copied at once (a valid schedule of an asynchronous copy); the group commits and waits do nothing
#define tvm_builtin_cuda_cvta_generic_to_shared(p) ((uintptr_t)(p))
static inline void emu_cp_async(int nbytes, uintptr_t dst, const void *src) { std::memcpy((void *)dst, src, nbytes); }

// wgmma.mma_async (schedules/cuda_prelude.py's helpers), a warpgroup collective (here the block's 128 threads): each
// thread adds A B^T to its accumulators d[0 .. n / 2) at the PTX ISA's fragment positions (warp w's rows 16 w .. + 15;
// d[4 i + c]: row 16 w + g + 8 (c / 2), column 8 i + 2 q + c % 2). A (64 x 16) and B (n x 16) are read from shared
// memory through their descriptors, here the tiles' addresses: K-major rows of 128 bytes in 8-row groups of 1024
// bytes, the 16-byte chunks swizzled as the hardware does it, address bits 4-6 XOR bits 7-9. The fences, commits and
// waits do nothing (the products are complete when the call returns).
static std::vector<uint64_t> wg_desc_;
static inline uint moec_smem_u32(const void *p) { return (uint)(uintptr_t)p; }
static inline uint64_t moec_wgmma_desc_sw128(const void *p) { return (uint64_t)(uintptr_t)p; }
static inline void moec_wgmma_fence() {}
static inline void moec_wgmma_commit() {}
static inline void moec_wgmma_wait0() {}
static inline void moec_wgmma_wait1() {}
static inline void moec_fence_proxy_async_smem() {}
static inline float sw128_(uint64_t start, int row, int k, bool bf16) {
  uint64_t a = start + (uint64_t)(row / 8) * 1024 + (uint64_t)(row % 8) * 128 + 2 * (uint64_t)k;
  a ^= ((a >> 7) & 7) << 4;
  return half_bits_(*(const uint16_t *)a, bf16);
}
static void emu_wgmma(float *d, uint64_t da, uint64_t db, int n, bool bf16, int site) {
  if (blockDim.x != 128) throw std::runtime_error("wgmma emulation: blocks of one warpgroup (128 threads) only");
  if ((da & 15) || (db & 15)) throw std::runtime_error("wgmma: a descriptor's start address is not 16-byte aligned");
  wg_desc_.resize(256);
  int t = threadIdx.x;
  wg_desc_[2 * t] = da; wg_desc_[2 * t + 1] = db;
  syncthreads_(site);
  for (int i = 0; i < 128; i++)
    if (wg_desc_[2 * i] != da || wg_desc_[2 * i + 1] != db)
      throw std::runtime_error("wgmma: the warpgroup's threads pass different descriptors");
  int w = t / 32, l = t % 32, g = l / 4, q = l % 4;
  for (int i = 0; i < n / 8; i++)
    for (int c = 0; c < 4; c++) {
      int row = 16 * w + g + 8 * (c / 2), col = 8 * i + 2 * q + c % 2;
      float acc = d[4 * i + c];
      for (int k = 0; k < 16; k++) acc += sw128_(da, row, k, bf16) * sw128_(db, col, k, bf16);
      d[4 * i + c] = acc;
    }
  syncthreads_(site);
}
#define moec_wgmma_m64n32k16_bf16(d, a, b) emu_wgmma(d, a, b, 32, true, __LINE__)
#define moec_wgmma_m64n64k16_bf16(d, a, b) emu_wgmma(d, a, b, 64, true, __LINE__)
#define moec_wgmma_m64n128k16_bf16(d, a, b) emu_wgmma(d, a, b, 128, true, __LINE__)
#define moec_wgmma_m64n32k16_f16(d, a, b) emu_wgmma(d, a, b, 32, false, __LINE__)
#define moec_wgmma_m64n64k16_f16(d, a, b) emu_wgmma(d, a, b, 64, false, __LINE__)
#define moec_wgmma_m64n128k16_f16(d, a, b) emu_wgmma(d, a, b, 128, false, __LINE__)

struct Launch { void (*entry)(void **); void **args; };
static Launch launch_;
static void fiber_main(int i) {
  launch_.entry(launch_.args);
  fibers[i].done = true;
  swapcontext(&fibers[i].ctx, &sched_ctx);
}
static void fiber_trampoline(unsigned lo, unsigned hi) { fiber_main((int)lo); }

static void run_block(int nthreads) {
  dim3_ bidx = blockIdx;
  fibers.assign(nthreads, Fiber());
  warp_bufs.assign((nthreads + 31) / 32, WarpBuf());
  for (int i = 0; i < nthreads; i++) {
    Fiber &f = fibers[i];
    f.tid = i; f.idx = {i, 0, 0}; f.wait = RUN; f.done = false;
    if ((size_t)i >= stacks.size()) stacks.emplace_back(new char[STACK]);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[i].get(); f.ctx.uc_stack.ss_size = STACK; f.ctx.uc_link = &sched_ctx;
    makecontext(&f.ctx, (void (*)())fiber_trampoline, 2, (unsigned)i, 0u);
  }
  for (;;) {
    bool any = false;
    for (int i = 0; i < nthreads; i++) {
      Fiber &f = fibers[i];
      if (f.done || f.wait != RUN) continue;
      any = true; cur = i; blockIdx = bidx;
      swapcontext(&sched_ctx, &f.ctx);
    }
    if (any) continue;
    bool alldone = true;
    for (auto &f : fibers) alldone &= f.done;
    if (alldone) break;
    // release a warp whose live lanes all wait at a warp barrier, else the block barrier once every live thread waits
    bool released = false;
    for (int w = 0; w * 32 < nthreads; w++) {
      bool all = true, some = false;
      for (int i = w * 32; i < std::min(nthreads, w * 32 + 32); i++) {
        if (fibers[i].done) continue;
        some = true; all &= fibers[i].wait == AT_WARP;
      }
      if (some && all) {
        int site = -1;
        for (int i = w * 32; i < std::min(nthreads, w * 32 + 32); i++) {
          if (fibers[i].done) continue;
          if (site >= 0 && fibers[i].site != site)
            throw std::runtime_error("divergent warp collective: lanes of warp " + std::to_string(w) + " wait at lines " +
                                     std::to_string(site) + " and " + std::to_string(fibers[i].site));
          site = fibers[i].site;
        }
        for (int i = w * 32; i < std::min(nthreads, w * 32 + 32); i++) fibers[i].wait = RUN;
        released = true;
      }
    }
    if (released) continue;
    bool all_block = true;
    int site = -1;
    for (auto &f : fibers) {
      if (f.done) continue;
      all_block &= f.wait == AT_BLOCK;
      if (site >= 0 && f.site != site) all_block = false;
      site = f.site;
    }
    if (!all_block) throw std::runtime_error("barrier mismatch: threads wait at different barriers");
    for (auto &f : fibers) if (!f.done) f.wait = RUN;
  }
}
"""

_LAUNCH = r"""
extern "C" int emu_launch(void **args, int gx, int gy, int gz, int bx, char *err, int errlen) {
  try {
    launch_.entry = &call_kernel_; launch_.args = args;
    blockDim = {bx, 1, 1}; gridDim = {gx, gy, gz};
    for (int z = 0; z < gz; z++) for (int y = 0; y < gy; y++) for (int x = 0; x < gx; x++) {
      blockIdx = {x, y, z};
      run_block(bx);
    }
  } catch (std::exception &e) { std::strncpy(err, e.what(), errlen - 1); return 1; }
  return 0;
}
"""

_MMA = re.compile(r'__asm__\s+__volatile__\(\s*"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\.(?:bf16|f16)\.f32"\s*"[^"]*"\s*:(.*?):(.*?)\);',
                  re.S)


_LDMATRIX = re.compile(r'\{\s*unsigned int addr = __cvta_generic_to_shared\((.*?)\);\s*__asm__\s+__volatile__\(\s*'
                       r'"ldmatrix\.sync\.aligned\.m8n8\.x(1|2|4)(\.trans)?\.shared\.b16"\s*"[^"]*"\s*:(.*?):\s*"r"\(addr\)\s*\);\s*\}', re.S)


def _replace_ldmatrix(m: re.Match) -> str:
    num, outs = int(m.group(2)), _operands(m.group(4))
    if len(outs) != num:
        raise ValueError(f"unexpected ldmatrix operands: {len(outs)} outputs for x{num}")
    body = (f"uint32_t _r[4]; emu_ldmatrix({num}, {'true' if m.group(3) else 'false'}, (const void *)({m.group(1)}), _r, "
            "__LINE__); " + " ".join(f"{o} = _r[{i}];" for i, o in enumerate(outs)))
    return "{ " + body + " }"


def _operands(text: str) -> list[str]:
    """The expressions of an inline-asm operand list: ``"=f"(expr), "r"(expr), ...``."""
    out, depth, start = [], 0, None
    for i, ch in enumerate(text):
        if ch == "(":
            if depth == 0:
                start = i + 1
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                out.append(text[start:i])
    return out


def _replace_mma(m: re.Match) -> str:
    bf16 = m.group(1) == "bf16"
    outs, ins = _operands(m.group(2)), _operands(m.group(3))
    if len(outs) != 4 or len(ins) != 10:
        raise ValueError(f"unexpected mma operands: {len(outs)} outputs, {len(ins)} inputs")
    a, b, c = ins[:4], ins[4:6], ins[6:]
    body = (f"uint32_t _a[4] = {{{', '.join(a)}}}; uint32_t _b[2] = {{{', '.join(b)}}}; float _c[4] = {{{', '.join(c)}}}; "
            f"float _d[4]; emu_mma_m16n8k16(_a, _b, _c, _d, {'true' if bf16 else 'false'}, __LINE__); ")
    body += " ".join(f"{o} = _d[{i}];" for i, o in enumerate(outs))
    return "{ " + body + " }"


def _kernel_text(source: str, name: str) -> tuple[str, list[tuple[str, str]]]:
    """The definition of ``name`` in ``source`` and its parameters (type, name)."""
    sig = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?' + re.escape(name) + r"\(([^()]*)\)\s*\{")
    m = sig.search(source)
    if m is None:
        raise ValueError(f"kernel {name} not found in the source")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        i += 1
    params = []
    for p in m.group(1).split(","):
        p = p.replace("__restrict__", "").strip()
        typ, pname = p.rsplit(None, 1)
        if pname.startswith("*"):
            typ, pname = typ + "*", pname[1:]
        params.append((typ.strip(), pname))
    body = source[m.end() - 1:i]
    return body, params


_CTYPE = {"int": np.int32, "int64_t": np.int64, "float": np.float32, "uint": np.uint32, "unsigned int": np.uint32}


class EmulatedKernel:
    """One kernel of a CUDA source, compiled for the host; call it with its parameters by name."""

    def __init__(self, source: str, name: str, cache_dir: Path | None = None) -> None:
        if shutil.which("g++") is None:
            raise RuntimeError("the CUDA emulation needs a host C++ compiler (g++)")
        body, self.params = _kernel_text(source, name)
        body = _MMA.sub(_replace_mma, body)
        body = _LDMATRIX.sub(_replace_ldmatrix, body)
        body = re.sub(r"\btvm_builtin_ptx_cp_async_(?:commit_group|wait_group)\w*\(\)", "(void)0", body)
        body = re.sub(r"\btvm_builtin_ptx_cp_async_\w*?_(\d+)\(", r"emu_cp_async(\1, ", body)
        for bad in ("asm", "atomic", "tvm_builtin_ptx"):
            if re.search({"asm": r"\b__asm__\b|\basm\b", "atomic": r"\batomic(?!Add\()\w*\(", "tvm_builtin_ptx": r"\btvm_builtin_ptx\w*"}[bad], body):
                raise ValueError(f"kernel {name}: the emulation does not support {bad} in the generated code")
        # dynamic shared memory (``extern __shared__ T name[];``): a static array of the largest size a block may take
        body = re.sub(r"extern\s+__shared__\s+__align__\((\d+)\)\s+(\w+)\s+(\w+)\[\];",
                      r"alignas(\1) static \2 \3[DYN_SHARED_BYTES];", body)
        body = re.sub(r"__shared__\s+(alignas\(\d+\)\s+)?", lambda m: (m.group(1) or "") + "static ", body).replace("exp2f(", "exp2f_(")
        decl = ", ".join(f"{t} {n}" for t, n in self.params)
        unpack = ", ".join(f"*({t}*)args[{i}]" for i, (t, _) in enumerate(self.params))
        code = (_PRELUDE + f"\nstatic void {name}({decl})\n" + body + "\n" +
                f"static void call_kernel_(void **args) {{ {name}({unpack}); }}\n" + _LAUNCH)
        key = hashlib.sha256(code.encode()).hexdigest()[:16]
        cache = cache_dir or Path(tempfile.gettempdir()) / "moec-cuda-emu"
        cache.mkdir(parents=True, exist_ok=True)
        lib = cache / f"{name}-{key}.so"
        if not lib.exists():
            src = cache / f"{name}-{key}.cpp"
            src.write_text(code)
            tmp = lib.with_suffix(".tmp.so")
            r = subprocess.run(["g++", "-O1", "-std=c++17", "-fno-strict-aliasing", "-shared", "-fPIC", "-w", "-o", str(tmp),
                                str(src)], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"compiling the emulated kernel {name} failed:\n{r.stderr[-4000:]}")
            tmp.rename(lib)
        self._lib = ctypes.CDLL(str(lib))
        self.name = name

    def __call__(self, grid: tuple[int, int, int], threads: int, **args) -> None:
        keep, ptrs = [], []
        for typ, pname in self.params:
            key = pname[:-4] if pname.endswith("_ptr") else pname
            if key not in args:
                raise KeyError(f"kernel {self.name}: missing argument {key}")
            v = args[key]
            if typ.endswith("*"):
                if not isinstance(v, np.ndarray) or not v.flags.c_contiguous:
                    raise TypeError(f"{key}: expected a C-contiguous numpy array")
                p = ctypes.c_void_p(v.ctypes.data)
            else:
                p = np.array([v], dtype=_CTYPE[typ])
                keep.append(p)
                p = ctypes.c_void_p(p.ctypes.data)
            keep.append(p)
            ptrs.append(ctypes.addressof(p) if typ.endswith("*") else p.value)
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        err = ctypes.create_string_buffer(512)
        rc = self._lib.emu_launch(arr, *[int(x) for x in grid], int(threads), err, 512)
        if rc:
            raise RuntimeError(f"kernel {self.name}: {err.value.decode()}")
