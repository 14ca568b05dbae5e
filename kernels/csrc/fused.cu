// The whole model in one pass over the input:
//
//   out[n, c] = mean_{d,h,w} softmax_c( relu( hardswish( conv3d(x, W)[n, :, d, h, w] + b ) ) )
//
// Plain CUDA with a C launcher (no torch headers): Python loads the shared
// library with ctypes and launches on PyTorch's current stream.
//
// One kernel (chosen by make_plan) computes per-block partial sums of the softmax
// probabilities; the conv output never leaves registers. The partials of each
// sample are added in a fixed order (in double) and divided by the voxel count, so
// the same input gives the same bits on every run: by the sample's last block to
// finish (one launch: eager calls, on a per-stream scratch of the library's), or by
// a tiny second kernel (a caller's workspace: graphs and the serving path).
//
// - fused_wg_kernel (sm_90a) and fused_tc_kernel: the reference configuration on
//   the tensor cores (implicit GEMM, 3xTF32; described where they are defined):
//   the defaults for contiguous input on Hopper, and for contiguous float32
//   elsewhere.
// - fused_window_kernel: the reference configuration on the CUDA cores, sliding
//   along D (contiguous float32; kept for comparison).
// - fused_tile_kernel: compile-time (Cin, Cout, k), the reference (3, 16, 3).
//   A block owns a TY x (TX*V) tile of one output depth plane; the input halo
//   (Cin x k planes x (TY+k-1) rows x (TX*V+k-1) columns) is staged in shared
//   memory. Each thread keeps V consecutive voxels x Cout accumulators in
//   registers; every input row it loads feeds k*V*Cout FMAs. The weights are a
//   by-value kernel parameter (constant bank), so each FMA takes its weight as a
//   constant operand: no load instruction per weight.
// - fused_general_kernel: any Cin, Cout <= 64, k, read straight from global
//   memory (through L1/L2), one voxel per thread. Correct for every shape;
//   not tuned.
//
// Inputs are float32, float16 or bfloat16 with arbitrary strides, converted to
// float32 on load; arithmetic and accumulation are float32.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // the driver's function types only: driver calls go through cudaGetDriverEntryPointByVersion

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <mutex>
#include <type_traits>
#include <utility>

namespace {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct Shape {
  int n, cin, d, h, w;           // input sizes
  long long sn, sc, sd, sh, sw;  // input strides, in elements
  int cout, k;
  int od, oh, ow;                // output spatial sizes
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxThreads = 256;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kGeneralMaxCout = 64;
constexpr int kMaxDevices = 64;

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x to within 1 ulp (x is a softmax denominator: >= 1, finite or +inf).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// relu(hardswish(y)) = max(y * clamp(y/6 + 1/2, 0, 1), 0); the clamp is FFMA's saturate.
__device__ __forceinline__ float activation(float y) {
  return fmaxf(y * __saturatef(fmaf(y, 1.0f / 6.0f, 0.5f)), 0.0f);
}

// Softmax over the channels of one voxel, added into psum with weight `scale` (0 for padding
// voxels). The voxel's channels are spread over LANES adjacent lanes, C (valid_c valid) on each.
// Activations are >= 0, so 0 is a safe start for the max.
template <int C, int LANES = 1>
__device__ __forceinline__ void softmax_accumulate(float (&logit)[C], int valid_c, float scale, float (&psum)[C]) {
  float m = 0.0f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    logit[c] = activation(logit[c]);
    if (c < valid_c) m = fmaxf(m, logit[c]);
  }
#pragma unroll
  for (int off = 1; off < LANES; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  const float ml = m * kLog2e;
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    logit[c] = c < valid_c ? fast_exp2(fmaf(logit[c], kLog2e, -ml)) : 0.0f;
    sum += logit[c];
  }
#pragma unroll
  for (int off = 1; off < LANES; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float inv = scale * __frcp_rn(sum);
#pragma unroll
  for (int c = 0; c < C; ++c) psum[c] = fmaf(logit[c], inv, psum[c]);
}

// Sum psum over the block (fixed order: warp butterflies, then warps in index order) and write
// the valid_c channels to dst. With LANES > 1, lane l holds channels l*C .. l*C+C-1.
template <int C, int LANES = 1>
__device__ __forceinline__ void block_sum_to(float (&psum)[C], int valid_c, float* __restrict__ dst) {
  __shared__ float red[kMaxWarps][C * LANES];
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int nwarps = (blockDim.x * blockDim.y + 31) >> 5;
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int off = 16; off >= LANES; off >>= 1) psum[c] += __shfl_xor_sync(0xffffffffu, psum[c], off);
  }
  if (lane < LANES) {
#pragma unroll
    for (int c = 0; c < C; ++c) red[warp][lane * C + c] = psum[c];
  }
  __syncthreads();
  if (tid < valid_c) {
    float s = 0.0f;
    for (int wi = 0; wi < nwarps; ++wi) s += red[wi][tid];
    dst[tid] = s;
  }
}

// The mean of one sample's channel from its `tiles` per-block partials (p: the first, cout floats apart), added in
// order in double. Read through L2: in the one-launch path other blocks wrote them during this kernel.
__device__ __forceinline__ float sample_mean(const float* p, int tiles, int cout, double inv_voxels) {
  double s = 0.0;
  int t = 0;
  for (; t + 8 <= tiles; t += 8) {  // eight loads in flight, then the adds in order
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldcg(p + (long long)(t + j) * cout);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += v[j];
  }
  for (; t < tiles; ++t) s += __ldcg(p + (long long)t * cout);
  return static_cast<float>(s * inv_voxels);
}

// Where a launch's means go when each sample's last block writes them (the one-launch path). counters == nullptr:
// the partials are left for finalize_kernel.
struct Finish {
  float* out;          // (N, Cout)
  unsigned* counters;  // one per sample, 0 before the launch; the sample's last block sets it back to 0
  int blocks;          // blocks per sample
  double inv_voxels;
};

// After a block has written its partials of sample n: the block that finishes the sample last (each counts itself
// once) adds them up and writes the means, exactly as finalize_kernel would. Every thread of the block calls it.
__device__ __forceinline__ void finish_sample(const Finish& f, const float* partials, int n, int cout) {
  if (f.counters == nullptr) return;
  __shared__ int last;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  __threadfence();  // this block's partials are visible to every block before it counts itself done
  __syncthreads();
  if (tid == 0) last = atomicAdd(f.counters + n, 1u) == static_cast<unsigned>(f.blocks - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const float* p = partials + (long long)n * f.blocks * cout;
  for (int c = tid; c < cout; c += nthreads) {
    f.out[(long long)n * cout + c] = sample_mean(p + c, f.blocks, cout, f.inv_voxels);
  }
  if (tid == 0) f.counters[n] = 0;  // ready for the next launch on this stream
}

// ---------------------------------------------------------------------------
// Specialised kernels: compile-time (Cin, Cout, k), V voxels x Cout accumulators per thread

template <int CIN, int COUT, int K>
struct ConvWeights {
  float w[COUT * CIN * K * K * K];  // PyTorch layout (Cout, Cin, k, k, k)
  float b[COUT];
};

template <int K, int V, int TX>
struct TileGeometry {
  static constexpr int kTileW = TX * V;                     // output columns per block
  static constexpr int kRowLoad = (V + K - 1 + 3) / 4 * 4;  // floats a thread reads per row (whole float4s)
  // Floats per staged row: 16-byte aligned and wide enough for the last thread's float4 reads.
  static constexpr int kPitch = (kTileW - V + kRowLoad + 3) / 4 * 4;
};

// The weights as [tap][co] in shared memory (tap = ((ci*K + kd)*K + kh)*K + kw), so one float4 load
// brings 4 output channels' weights, each then used V times. (Read straight from the constant bank,
// every weight costs a uniform load of its own: measured slower, see kernels/NOTES.md.)
template <int CIN, int COUT, int K>
__device__ __forceinline__ void stage_weights(const ConvWeights<CIN, COUT, K>& p, float* __restrict__ s_w) {
  constexpr int kTaps = CIN * K * K * K;
  static_assert(COUT % 4 == 0, "float4 weight reads need Cout % 4 == 0");
  for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < kTaps * COUT; i += blockDim.x * blockDim.y) {
    const int tap = i / COUT, co = i - tap * COUT;
    s_w[i] = p.w[co * kTaps + tap];
  }
}

// acc[v][co] = bias[co] + sum over (ci, kd, kh, kw) of in(ci, kd, row + kh, col + v + kw) * w[tap][co], where
// plane_row(ci, kd, r) points at staged row r of input plane (ci, kd). The Cin x k plane loop is rolled
// at run time: the unrolled body (k rows x k taps x Cout x V FMAs) then fits the instruction cache;
// unrolling everything made the kernel 20% slower.
// The thread computes COUT output channels; s_w rows hold WSTRIDE channels (s_w and bias point at
// the thread's first channel).
template <int CIN, int COUT, int WSTRIDE, int K, int V, int ROWLOAD, typename PlaneRow>
__device__ __forceinline__ void conv_accumulate(float (&acc)[V][COUT], const float* bias,
                                                const float* __restrict__ s_w, int ty, int col, PlaneRow plane_row) {
  static_assert(V % 4 == 0 && COUT % 4 == 0, "V and the thread's channels must be multiples of 4");
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int co = 0; co < COUT; ++co) acc[v][co] = bias[co];
#pragma unroll 1
  for (int plane = 0; plane < CIN * K; ++plane) {  // plane = ci * K + kd
    const int ci = plane / K, kd = plane - ci * K;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      // Whole float4 reads, 16-byte aligned: a quarter-warp reads one contiguous 128-byte segment.
      const float* row = plane_row(ci, kd, ty + kh) + col;
      float in[ROWLOAD];
#pragma unroll
      for (int j = 0; j < ROWLOAD; j += 4) {
        const float4 q = *reinterpret_cast<const float4*>(row + j);
        in[j] = q.x; in[j + 1] = q.y; in[j + 2] = q.z; in[j + 3] = q.w;
      }
#pragma unroll
      for (int kw = 0; kw < K; ++kw) {
        const float* wt = s_w + ((plane * K + kh) * K + kw) * WSTRIDE;
#pragma unroll
        for (int co4 = 0; co4 < COUT; co4 += 4) {
          const float4 q = *reinterpret_cast<const float4*>(wt + co4);
          const float wv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < V; ++v) acc[v][co4 + j] = fmaf(in[v + kw], wv[j], acc[v][co4 + j]);
        }
      }
    }
  }
}

// Activation + softmax of the V voxels (ow = w_first + v, row oh), added to psum; voxels outside
// the output add nothing.
template <int COUT, int V, int LANES = 1>
__device__ __forceinline__ void epilogue(float (&acc)[V][COUT], const Shape& s, int oh, int w_first,
                                         float (&psum)[COUT]) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const float scale = (oh < s.oh && w_first + v < s.ow) ? 1.0f : 0.0f;
    softmax_accumulate<COUT, LANES>(acc[v], COUT, scale, psum);
  }
}

// Tile kernel: any input dtype and strides. A block owns TY x (TX*V) voxels of one output plane and
// stages the k input planes of every channel (converted to float32) in shared memory.
template <typename T, int CIN, int COUT, int K, int V, int TX>
__global__ void __launch_bounds__(kMaxThreads, 2)
    fused_tile_kernel(const T* __restrict__ x, const Shape s, const __grid_constant__ ConvWeights<CIN, COUT, K> p,
                      float* __restrict__ partials, int tiles_w, int tiles_hw, const Finish fin) {
  using G = TileGeometry<K, V, TX>;
  extern __shared__ __align__(16) float smem[];
  __shared__ __align__(16) float s_w[CIN * K * K * K * COUT];
  const int ty_count = blockDim.y;
  const int in_h = ty_count + K - 1;
  const int tile = blockIdx.x, od = blockIdx.y, n = blockIdx.z;
  const int h0 = (tile / tiles_w) * ty_count, w0 = (tile % tiles_w) * G::kTileW;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;

  stage_weights<CIN, COUT, K>(p, s_w);
  // smem[(ci*K + kd) plane][r][c] = x[n, ci, od + kd, h0 + r, w0 + c], zero outside the input.
  const T* base = x + n * s.sn + od * s.sd;
  const int per_plane = in_h * G::kPitch;
  for (int plane = 0; plane < CIN * K; ++plane) {
    const int ci = plane / K, kd = plane - ci * K;
    const T* src = base + ci * s.sc + kd * s.sd;
    float* dst = smem + plane * per_plane;
    for (int i = tid; i < per_plane; i += nthreads) {
      const int r = i / G::kPitch, c = i - r * G::kPitch;
      const int gh = h0 + r, gw = w0 + c;
      dst[i] = (gh < s.h && gw < s.w) ? to_f32(src[(long long)gh * s.sh + (long long)gw * s.sw]) : 0.0f;
    }
  }
  __syncthreads();

  float acc[V][COUT];
  conv_accumulate<CIN, COUT, COUT, K, V, G::kRowLoad>(
      acc, p.b, s_w, threadIdx.y, threadIdx.x * V,
      [&](int ci, int kd, int r) { return smem + ((ci * K + kd) * in_h + r) * G::kPitch; });

  float psum[COUT];
#pragma unroll
  for (int co = 0; co < COUT; ++co) psum[co] = 0.0f;
  epilogue<COUT, V>(acc, s, h0 + threadIdx.y, w0 + threadIdx.x * V, psum);
  const long long slot = (long long)n * tiles_hw * s.od + (long long)od * tiles_hw + tile;
  block_sum_to<COUT>(psum, COUT, partials + slot * COUT);
  finish_sample(fin, partials, n, COUT);
}

// Copy input plane d (all Cin channels, rows h0.., columns w0..) into ring slot `slot` with 16-byte
// cp.async (zero-filled outside the input), as one commit group. Float32, W-contiguous, 16-byte aligned.
template <int CIN, int PITCH>
__device__ __forceinline__ void prefetch_plane(const float* __restrict__ xn, const Shape& s, int d, int h0, int w0,
                                               int in_h, float* __restrict__ ring, int slot) {
  constexpr int Q = PITCH / 4;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  const int per_channel = in_h * Q;
  for (int i = tid; i < CIN * per_channel; i += nthreads) {
    const int ci = i / per_channel, rest = i - ci * per_channel;
    const int r = rest / Q, q = rest - r * Q;
    const int gh = h0 + r, gw = w0 + 4 * q;
    const bool inside = d < s.d && gh < s.h && gw < s.w;
    const float* src = inside ? xn + ci * s.sc + (long long)d * s.sd + (long long)gh * s.sh + gw : xn;
    float* dst = ring + ((slot * CIN + ci) * in_h + r) * PITCH + 4 * q;
    const unsigned dst_s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_s), "l"(src), "r"(inside ? 16 : 0));
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Window kernel: contiguous float32 input. A block owns a TY x (TX*V) tile of `planes` consecutive
// output planes and slides along D: a ring of K+1 staged input planes, the next plane's copy in flight
// (cp.async) while the current plane is computed. Each input plane is staged once per tile instead of
// K times, the copies overlap the FMAs, and the block reduction runs once per block, not per plane.
// CSPLIT = 2 splits a voxel's Cout channels over 2 adjacent lanes (blockDim.x = TX * CSPLIT): half the
// accumulators and registers, so 3 blocks fit on an SM instead of 2; the softmax then shuffles.
template <int CIN, int COUT, int K, int V, int TX, int CSPLIT>
__global__ void __launch_bounds__(kMaxThreads, CSPLIT == 1 ? 2 : 3)
    fused_window_kernel(const float* __restrict__ x, const Shape s, const __grid_constant__ ConvWeights<CIN, COUT, K> p,
                        float* __restrict__ partials, int tiles_w, int tiles_hw, int planes, int chunks,
                        const Finish fin) {
  using G = TileGeometry<K, V, TX>;
  constexpr int kSlots = K + 1;
  extern __shared__ __align__(16) float ring[];  // [kSlots][CIN][in_h][kPitch]
  __shared__ __align__(16) float s_w[CIN * K * K * K * COUT];
  const int ty_count = blockDim.y;
  const int in_h = ty_count + K - 1;
  const int tile = blockIdx.x, chunk = blockIdx.y, n = blockIdx.z;
  const int h0 = (tile / tiles_w) * ty_count, w0 = (tile % tiles_w) * G::kTileW;
  const int d_begin = chunk * planes, d_end = min(d_begin + planes, s.od);
  const float* xn = x + n * s.sn;

  // Group 0: input planes d_begin .. d_begin+K-1; group 1: plane d_begin+K.
  for (int kd = 0; kd < K; ++kd) {
    const int d = d_begin + kd;
    prefetch_plane<CIN, G::kPitch>(xn, s, d, h0, w0, in_h, ring, d % kSlots);
  }
  prefetch_plane<CIN, G::kPitch>(xn, s, d_begin + K, h0, w0, in_h, ring, (d_begin + K) % kSlots);
  stage_weights<CIN, COUT, K>(p, s_w);

  constexpr int kCT = COUT / CSPLIT;  // channels per thread
  const int cg = threadIdx.x % CSPLIT, col = (threadIdx.x / CSPLIT) * V;
  float psum[kCT];
#pragma unroll
  for (int co = 0; co < kCT; ++co) psum[co] = 0.0f;
  for (int od = d_begin; od < d_end; ++od) {
    asm volatile("cp.async.wait_group 1;\n" ::);  // all but the newest group: planes od .. od+K-1
    __syncthreads();
    float acc[V][kCT];
    conv_accumulate<CIN, kCT, COUT, K, V, G::kRowLoad>(
        acc, p.b + cg * kCT, s_w + cg * kCT, threadIdx.y, col,
        [&](int ci, int kd, int r) { return ring + ((((od + kd) % kSlots) * CIN + ci) * in_h + r) * G::kPitch; });
    __syncthreads();  // every thread is done with slot od % kSlots: refill it with plane od+K+1
    if (od + 1 < d_end) {
      prefetch_plane<CIN, G::kPitch>(xn, s, od + K + 1, h0, w0, in_h, ring, (od + K + 1) % kSlots);
    } else {
      asm volatile("cp.async.commit_group;\n" ::);  // keep one group per iteration
    }
    epilogue<kCT, V, CSPLIT>(acc, s, h0 + threadIdx.y, w0 + col, psum);
  }
  asm volatile("cp.async.wait_all;\n" ::);
  const long long slot = ((long long)n * tiles_hw + tile) * chunks + chunk;
  block_sum_to<kCT, CSPLIT>(psum, COUT, partials + slot * COUT);
  finish_sample(fin, partials, n, COUT);
}

// ---------------------------------------------------------------------------
// Tensor-core kernel (reference configuration, contiguous float32): implicit GEMM on mma.sync
// m16n8k4 TF32. TERMS = 3 keeps float32 accuracy with the 3xTF32 split
// (a*b ~ a_hi*b_lo + a_lo*b_hi + a_hi*b_hi, hi = tf32(a), lo = a - hi taken to TF32: by cvt.rna for the
// weights, by the MMA's truncation for the inputs, at most 2^-21 of a); TERMS = 1 is plain TF32
// (the tf32 precision mode).
//
// GEMM: M = 16 output channels, N = voxels, K = taps. The 81 taps are 27 input rows (ci, kd, kh) x 3 kw;
// lane tig (= lane % 4) holds the K slot of every k-step for the rows r = 4p + tig (p = 0..6), k-step
// q = 3p + kw (21 k-steps; 84 slots, the 3 padding slots have zero weights). The weights are the A
// operand: split once per block into per-lane fragments in shared memory, one 16-byte load per k-step
// (in registers they took 84 of 162 and capped the block count). The input is the B operand, one
// register per MMA: a warp computes one output row of 32 voxels at a time as 4 n-tiles, lane gid
// (= lane / 4) being voxel 4*gid + j of n-tile j, so for one input row a lane needs the 6 inputs
// 4*gid .. 4*gid+5 for all 12 (voxel, kw) pairs: two 16-byte shared-memory loads, split into hi / lo
// once per row and lane, each value used as is (no register moves to assemble operand fragments).
//
// Staging: a ring of K+1 raw input planes. Plane od+K is copied with cp.async into its ring slot
// (which held plane od-1) while plane od is computed. The ring's strides make every load
// conflict-free: row pitch 40 floats (= 8 mod 32), channel stride = 8 mod 32 floats, slot stride = 24
// mod 32, so the 4 rows a warp's 4 tig groups load at once start in 4 different 8-bank groups (row r's
// group is r mod 4 plus a constant, and r = tig mod 4).
// Epilogue: a voxel's 16 channels lie in the 8 lanes of one tig (2 per lane); softmax by shuffles.
constexpr int kTcPitch = 40;   // floats per staged row (34 used: 32 columns + K-1 halo, read as 2 x float4)
constexpr int kTcTileW = 32;   // output columns per block
constexpr int kTcRows = 27;    // input rows (ci, kd, kh) of the reference configuration
constexpr int kTcSteps = 21;   // k-steps of 4 slots: 7 rows x 3 kw per tig
constexpr int kTcMaxWarps = 6;
constexpr int kTcMaxThreads = 32 * kTcMaxWarps;
constexpr int kTcMaxTy = 18;  // rows per tile (shared memory: 4 planes x 3 channels x (ty + 2) rows)

struct TcLayout {
  int in_h, cs, ss, ring_floats;  // staged rows per plane, channel stride, slot stride, the ring
};

__host__ __device__ inline TcLayout tc_layout(int ty) {
  TcLayout l;
  l.in_h = ty + 2;
  l.cs = l.in_h * kTcPitch;
  l.cs += ((8 - l.cs % 32) + 32) % 32;  // channel stride = 8 (mod 32)
  l.ss = 3 * l.cs;                      // slot stride = 24 (mod 32)
  l.ring_floats = 4 * l.ss;
  return l;
}

__device__ __forceinline__ uint32_t tf32_bits(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32_k4(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// Issue the cp.async copies of input plane d (3 channels, rows h0.., columns w0..w0+35) into ring slot
// `slot`, as one commit group (zero-filled outside the input), in 16-byte pieces of 16 / sizeof(T) elements:
// float 9 pieces per row, 16-bit types 5 (40 columns, the row pitch). Piece (ci, r, q) = channel, staged
// row, piece: with R = blockDim.x / pieces, thread tid < pieces x R copies piece q = tid % pieces of rows
// tid / pieces, +R, +2R, ... (all 3 channels' rows in turn).
template <typename T>
__device__ __forceinline__ void tc_copy_plane(const T* __restrict__ xn, const Shape& s, int d, int h0, int w0,
                                              const TcLayout& l, T* __restrict__ ring, int slot) {
  constexpr int kPer = 16 / sizeof(T), kPieces = (36 + kPer - 1) / kPer;
  const int tid = threadIdx.x, rows_at_once = blockDim.x / kPieces;
  if (tid < rows_at_once * kPieces) {
    const T* plane = xn + (long long)d * s.sd;
    T* dst_slot = ring + slot * l.ss;
    const int q = tid % kPieces;
    int ci = 0, r = tid / kPieces;
    while (r >= l.in_h) { r -= l.in_h; ++ci; }
    while (ci < 3) {
      const int gh = h0 + r, gw = w0 + kPer * q;
      const bool inside = gh < s.h && gw < s.w;
      const T* src = inside ? plane + ci * s.sc + (long long)gh * s.sh + gw : xn;
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_slot + ci * l.cs + r * kTcPitch + kPer * q));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(inside ? 16 : 0));
      r += rows_at_once;
      while (r >= l.in_h) { r -= l.in_h; ++ci; }
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int TERMS>
__global__ void __launch_bounds__(kTcMaxThreads, 2)
    fused_tc_kernel(const float* __restrict__ x, const Shape s, const __grid_constant__ ConvWeights<3, 16, 3> p,
                    float* __restrict__ partials, int tiles_w, int tiles_hw, int planes, int chunks, int ty,
                    const Finish fin) {
  constexpr int kTaps = 81;
  extern __shared__ __align__(16) float tc_smem[];
  const TcLayout l = tc_layout(ty);
  float* ring = tc_smem;
  uint4* frag = reinterpret_cast<uint4*>(tc_smem + l.ring_floats);  // [k-step][lane]
  const int tile = blockIdx.x, chunk = blockIdx.y, n = blockIdx.z;
  const int h0 = (tile / tiles_w) * ty, w0 = (tile % tiles_w) * kTcTileW;
  const int d_begin = chunk * planes, d_end = min(d_begin + planes, s.od);
  const float* xn = x + n * s.sn;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;

  for (int kd = 0; kd < 3; ++kd) tc_copy_plane(xn, s, d_begin + kd, h0, w0, l, ring, (d_begin + kd) & 3);

  // The A fragments (weights), split, once per block while the first planes land (the block's threads
  // share the 21 x 32 fragments): k-step q is row 4*(q/3) + tig, kw = q % 3; a0 = channel gid, a1 =
  // channel gid + 8; {hi0, hi1, lo0, lo1}.
  for (int i = threadIdx.x; i < kTcSteps * 32; i += blockDim.x) {
    const int q = i >> 5, ln = i & 31, fg = ln >> 2, ft = ln & 3;
    const int row = 4 * (q / 3) + ft, kw = q % 3;
    uint32_t f[4] = {0u, 0u, 0u, 0u};
    if (row < kTcRows) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float w = p.w[(fg + 8 * h) * kTaps + 3 * row + kw];
        f[h] = tf32_bits(w);
        f[2 + h] = tf32_bits(w - __uint_as_float(f[h]));
      }
    }
    frag[i] = make_uint4(f[0], f[1], f[2], f[3]);
  }
  const float bias_lo = p.b[gid], bias_hi = p.b[gid + 8];
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();

  float psum[2] = {0.0f, 0.0f};  // channels gid, gid + 8
  for (int od = d_begin; od < d_end; ++od) {
    const bool more = od + 1 < d_end;
    if (more) tc_copy_plane(xn, s, od + 3, h0, w0, l, ring, (od + 3) & 3);
    // Row p of this lane: r = 4p + tig = (ci, kd, kh); the missing row (p = 6, tig = 3) reads row tig
    // (its weights are zero).
    int off[7];
#pragma unroll
    for (int pi = 0; pi < 7; ++pi) {
      const int r = (4 * pi + tig < kTcRows) ? 4 * pi + tig : tig;
      const int ci = r / 9, kd = (r / 3) % 3, kh = r % 3;
      off[pi] = ((od + kd) & 3) * l.ss + ci * l.cs + kh * kTcPitch + 4 * gid;
    }

    for (int y = warp; y < ty; y += nwarps) {
      float c[4][4];  // [n-tile][fragment]
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        c[j][0] = c[j][1] = bias_lo;
        c[j][2] = c[j][3] = bias_hi;
      }
      const int yoff = y * kTcPitch;
      // Inputs 4*gid .. 4*gid+5 of row p: two 16-byte loads, row p+1's issued before row p's MMAs, split
      // into hi = tf32(x) and lo = x - hi as they are used (lo's own rounding to TF32 is the MMA's
      // truncation: at most 2^-21 of x).
      float raw[2][8];
      auto load_row = [&](int pi, int buf) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float4 v = *reinterpret_cast<const float4*>(ring + off[pi] + yoff + 4 * half);
          raw[buf][4 * half] = v.x; raw[buf][4 * half + 1] = v.y; raw[buf][4 * half + 2] = v.z;
          raw[buf][4 * half + 3] = v.w;
        }
      };
      load_row(0, 0);
#pragma unroll
      for (int pi = 0; pi < 7; ++pi) {
        const int cur = pi & 1;
        if (pi + 1 < 7) load_row(pi + 1, cur ^ 1);
        uint32_t xh[6], xl[6];
#pragma unroll
        for (int u = 0; u < 6; ++u) {
          xh[u] = tf32_bits(raw[cur][u]);
          xl[u] = __float_as_uint(raw[cur][u] - __uint_as_float(xh[u]));
        }
#pragma unroll
        for (int kw = 0; kw < 3; ++kw) {
          const int q = 3 * pi + kw;
          const uint4 a = frag[q * 32 + lane];
          // Term-major order: consecutive MMAs update different accumulators.
          if (TERMS == 3) {
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_tf32_k4(c[j], a.x, a.y, xl[j + kw]);
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_tf32_k4(c[j], a.z, a.w, xh[j + kw]);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_tf32_k4(c[j], a.x, a.y, xh[j + kw]);
        }
      }
      // Column 2*tig + e of n-tile j is voxel 8*tig + 4*e + j; its channels gid and gid + 8 are here, the
      // other 14 in the lanes of the same tig. Activations are >= 0, so while every one in the warp is
      // <= 80, exp needs no max subtracted (no overflow; every term >= 1, so nothing underflows) and a
      // voxel's softmax costs 3 shuffles instead of 6.
      const int oh = h0 + y;
      const bool row_ok = oh < s.oh;
      float act[4][2][2];  // [n-tile][column][channel gid / gid + 8]
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          act[j][e][0] = activation(c[j][e]);
          act[j][e][1] = activation(c[j][2 + e]);
          amax = fmaxf(amax, fmaxf(act[j][e][0], act[j][e][1]));
        }
      const bool shift = !__all_sync(0xffffffffu, amax <= 80.0f);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float a = act[j][e][0], b = act[j][e][1];
          float ml = 0.0f;
          if (shift) {
            float m = fmaxf(a, b);
#pragma unroll
            for (int off2 = 4; off2 < 32; off2 <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off2));
            ml = m * kLog2e;
          }
          const float ea = fast_exp2(fmaf(a, kLog2e, -ml)), eb = fast_exp2(fmaf(b, kLog2e, -ml));
          float sum = ea + eb;
#pragma unroll
          for (int off2 = 4; off2 < 32; off2 <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off2);
          const bool ok = row_ok && w0 + 8 * tig + 4 * e + j < s.ow;
          const float inv = (ok ? 1.0f : 0.0f) * fast_rcp(sum);
          psum[0] = fmaf(ea, inv, psum[0]);
          psum[1] = fmaf(eb, inv, psum[1]);
        }
      }
    }
    if (more) asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
  }

  // Sum each channel over the 4 lanes of its gid, then over warps in order.
  __shared__ float red[kTcMaxWarps][16];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], 1);
    psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], 2);
  }
  if (tig == 0) {
    red[warp][gid] = psum[0];
    red[warp][gid + 8] = psum[1];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float sum = 0.0f;
    for (int wi = 0; wi < nwarps; ++wi) sum += red[wi][threadIdx.x];
    const long long slot = ((long long)n * tiles_hw + tile) * chunks + chunk;
    partials[slot * 16 + threadIdx.x] = sum;
  }
  finish_sample(fin, partials, n, 16);
}

// ---------------------------------------------------------------------------
// Warpgroup tensor-core kernel (sm_90a, reference configuration, contiguous float32): the same implicit
// GEMM with wgmma, which issues a 64-row product per warpgroup and runs at about twice mma.sync's rate
// when N >= 32 (bench/tensor_rate_probe.cu, H100: m64n32k8 480 TFLOPS, m64n16k8 285, mma.sync m16n8k4 234).
//
// GEMM: M = 64 voxels per warpgroup (2 output rows x 32 columns; warp w owns row w / 2, columns
// 16 (w % 2) .. +15), N = output channels, K = taps in 11 k-steps of 8. The input is the A operand, from
// registers: lane (gid, tig) holds voxels gid and gid + 8 of its warp and, in k-step s, the taps i = 2s
// (fragment registers 0, 1) and 2s + 1 (registers 2, 3) of its own tap list: i = 3p + kw, input row
// r = 4p + tig (the mma.sync kernel's assignment, whose ring strides make these loads conflict-free);
// i = 21 and r = 27 are padding with zero weights. The weights are the B operand in shared memory, per
// k-step an 8 x 32 matrix [W_hi | W_lo] (no swizzle, K-major core matrices: K halves 512 bytes apart,
// 8-channel groups 128 bytes apart).
// 3xTF32 with two instructions per k-step: m64n32k8 of x_hi with [W_hi | W_lo] gives x_hi W_hi and
// x_hi W_lo side by side in one accumulator, m64n16k8 of x_lo with W_hi (the first 16 columns of the
// same matrix) the third term. TERMS = 1: x_hi W_hi alone (m64n16k8).
// Pipeline: the k-steps run in chunks of 2; a chunk's A fragments are loaded and split while the
// previous chunk's products run (wgmma.wait_group 1), and a row pair's epilogue runs while the next
// pair's first chunk is in flight (two accumulator sets). Only sm_90a code has a body; the host offers
// this kernel where the library was built with it (VOXSERVE_WGMMA) and the GPU is compute capability 9.0.
// Staging (ring of K+1 raw planes, cp.async) and the block reduction as in fused_tc_kernel.
constexpr int kWgSteps = 11;         // k-steps of 8 taps (88 slots, 81 used)
constexpr int kWgMaxGroups = 2;      // warpgroups per block
constexpr int kWgMaxTy = 30;         // rows per block tile
constexpr int kWgBBytes = 1024;      // B matrix bytes per k-step (8 x 32 float)

// The ring holds the input in its own type T (float32, float16 or bfloat16: 16-bit inputs are exact in
// TF32, so they need neither the split nor the x_lo product).
__host__ __device__ inline size_t wg_smem_bytes(int ty, size_t elem_bytes) {
  const size_t ring = elem_bytes * tc_layout(ty).ring_floats;
  return (ring + 127) / 128 * 128 + kWgBBytes * kWgSteps;
}


#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kWgChunk = 2;  // k-steps per wgmma group

// sm_90 matrix descriptor without swizzle: start address, leading (K) and stride (M/N) byte offsets, >> 4.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t k_offset, uint32_t n_offset) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>((k_offset >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((n_offset >> 4) & 0x3FFF) << 32);
}

// d (64 x 32) (+)= a (64 x 8, registers) * B (8 x 32, shared memory); ACC = 0 overwrites d.
template <int ACC>
__device__ __forceinline__ void wgmma_n32(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ACC));
}

template <int ACC>
__device__ __forceinline__ void wgmma_n16(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ACC));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pin accumulator registers at this point of the program: reads of one accumulator set while another's
// products are in flight stay between the waits, and ptxas keeps the wgmmas pipelined (without these it
// serialises them, warning C7514).
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
#endif

// The activation + softmax of a finished tile (acc: x_hi [W_hi | W_lo], acc_lo: x_lo W_hi) added to psum.
// Voxel v of this lane is column col + 8v of output row oh; its channel 8j + 2 tig + e is in
// acc[4j + 2v + e] (+ acc[8 + 4j + 2v + e], + acc_lo[4j + 2v + e] with LO, with TERMS = 3; acc_lo alone
// with TERMS = 1); the voxel's other 12 channels are in the lanes of the same gid.
template <int TERMS, bool LO>
__device__ __forceinline__ void wg_epilogue(const float (&acc)[16], const float (&acc_lo)[8], const float (&bias)[4],
                                            bool row_ok, int col_left, float (&psum)[4]) {
  float act[2][4];
  float amax = 0.0f;
#pragma unroll
  for (int v = 0; v < 2; ++v)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int ix = 4 * (j >> 1) + 2 * v + (j & 1);
      const float logit = TERMS == 3 ? acc[ix] + acc[8 + ix] + (LO ? acc_lo[ix] : 0.0f) : acc_lo[ix];
      act[v][j] = activation(logit + bias[j]);
      amax = fmaxf(amax, act[v][j]);
    }
  // Activations are >= 0: while every one in the warp is <= 80, exp needs no max subtracted.
  const bool shift = !__all_sync(0xffffffffu, amax <= 80.0f);
  float ml[2] = {0.0f, 0.0f};
  if (shift) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      float m = fmaxf(fmaxf(act[v][0], act[v][1]), fmaxf(act[v][2], act[v][3]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      ml[v] = m * kLog2e;
    }
  }
  float ex[2][4], sum[2];
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    sum[v] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      ex[v][j] = fast_exp2(fmaf(act[v][j], kLog2e, -ml[v]));
      sum[v] += ex[v][j];
    }
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1)
#pragma unroll
    for (int v = 0; v < 2; ++v) sum[v] += __shfl_xor_sync(0xffffffffu, sum[v], off);
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    const bool ok = row_ok && 8 * v < col_left;
    const float inv = (ok ? 1.0f : 0.0f) * fast_rcp(sum[v]);
#pragma unroll
    for (int j = 0; j < 4; ++j) psum[j] = fmaf(ex[v][j], inv, psum[j]);
  }
}

template <int TERMS, int ROUNDS, typename T>
__global__ void __launch_bounds__(128 * kWgMaxGroups, 2)
    fused_wg_kernel(const T* __restrict__ x, const Shape s, const __grid_constant__ ConvWeights<3, 16, 3> p,
                    const float* __restrict__ w_dev, float* __restrict__ partials, int tiles_w, int tiles_hw,
                    int planes, int chunks, int ty, const Finish fin) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kTaps = 81;
  constexpr int kChunks = (kWgSteps + kWgChunk - 1) / kWgChunk;
  // x_lo x W_hi, the third 3xTF32 product: float32 input only (16-bit inputs are exact in TF32).
  constexpr bool kLo = TERMS == 3 && std::is_same<T, float>::value;
  extern __shared__ __align__(128) unsigned char wg_smem[];
  const TcLayout l = tc_layout(ty);
  T* ring = reinterpret_cast<T*>(wg_smem);
  // [k-step][K half][channel group][8 channels][4 K] floats, after the ring (128-byte aligned)
  float* bmat = reinterpret_cast<float*>(wg_smem + (sizeof(T) * l.ring_floats + 127) / 128 * 128);
  const int tile = blockIdx.x, chunk = blockIdx.y, n = blockIdx.z;
  const int h0 = (tile / tiles_w) * ty, w0 = (tile % tiles_w) * kTcTileW;
  const int d_begin = chunk * planes, d_end = min(d_begin + planes, s.od);
  const T* xn = x + n * s.sn;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp >> 2, ngroups = blockDim.x >> 7, wq = warp & 3;
  const int gid = lane >> 2, tig = lane & 3;

  for (int kd = 0; kd < 3; ++kd) tc_copy_plane(xn, s, d_begin + kd, h0, w0, l, ring, (d_begin + kd) & 3);

  // B, split into hi / lo, once per block while the first planes land (from the weights in global memory:
  // the by-value copy in the constant bank serialises loads whose addresses differ across a warp). K slot
  // k of step s is lane tig = k % 4's tap i = 2s + k / 4. All of a thread's loads are issued before the
  // first use (a batch-1 call waits on this prologue).
  {
    constexpr int kElems = kWgSteps * 8 * 32, kPerThread = kElems / 128;
    float wv[kPerThread];
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int e = threadIdx.x + u * (int)blockDim.x;
      const int st = e >> 8, k = (e >> 5) & 7, col = e & 31;
      const int i = 2 * st + (k >> 2), row = 4 * (i / 3) + (k & 3), kw = i % 3, co = col & 15;
      wv[u] = e < kElems && i < 21 && row < kTcRows ? __ldg(w_dev + co * kTaps + 3 * row + kw) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int e = threadIdx.x + u * (int)blockDim.x;
      if (e < kElems) {
        const int st = e >> 8, k = (e >> 5) & 7, col = e & 31;
        const float hi = __uint_as_float(tf32_bits(wv[u]));
        const float v = col < 16 ? hi : __uint_as_float(tf32_bits(wv[u] - hi));
        bmat[st * (kWgBBytes / 4) + (k >> 2) * 128 + (col >> 3) * 32 + (col & 7) * 4 + (k & 3)] = v;
      }
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  float bias[4];  // channels 2 tig, 2 tig + 1, 8 + 2 tig, 9 + 2 tig
#pragma unroll
  for (int j = 0; j < 4; ++j) bias[j] = p.b[8 * (j >> 1) + 2 * tig + (j & 1)];
  const uint32_t bbase = static_cast<uint32_t>(__cvta_generic_to_shared(bmat));
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();

  // Per plane, a warpgroup computes ROUNDS row pairs y = 2 (group + r x groups), r = 0 .. ROUNDS-1, unrolled:
  // each pair's products are issued before the previous pair's epilogue, which runs once the new pair's
  // first chunk is in flight (two accumulator sets). The plane ends with all products waited for, so no
  // product is in flight across the loop over planes (the compiler's register copies at a loop edge would
  // read an accumulator in flight, which makes ptxas serialise every wgmma).
  const int col0 = 16 * (wq & 1) + gid;  // this lane's first voxel column in the tile
  const int col_left = s.ow - w0 - col0;  // voxel v of this lane is inside the output while 8v < col_left
  float psum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float acc0[16], lo0[8], acc1[16], lo1[8];
  for (int od = d_begin; od < d_end; ++od) {
    const bool more = od + 1 < d_end;
    if (more) tc_copy_plane(xn, s, od + 3, h0, w0, l, ring, (od + 3) & 3);
    int off[7];  // row p of this lane: r = 4p + tig = (ci, kd, kh); the missing row 27 reads row tig
#pragma unroll
    for (int pi = 0; pi < 7; ++pi) {
      const int r = (4 * pi + tig < kTcRows) ? 4 * pi + tig : tig;
      const int ci = r / 9, kd = (r / 3) % 3, kh = r % 3;
      off[pi] = ((od + kd) & 3) * l.ss + ci * l.cs + kh * kTcPitch + col0;
    }
    // Issue row pair y into (ca, cl); with `previous`, finish the previous pair (pa, pl) after the first chunk.
    auto issue = [&](int y, float (&ca)[16], float (&cl)[8], bool previous, float (&pa)[16], float (&pl)[8],
                     bool previous_row_ok) {
      const T* base = ring + (y + (wq >> 1)) * kTcPitch;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        asm volatile("" ::: "memory");  // keep this chunk's loads here (hoisted, they cost registers and spill)
        uint32_t ah[kWgChunk][4], al[kWgChunk][4];
#pragma unroll
        for (int q = 0; q < kWgChunk; ++q) {
          const int st = c * kWgChunk + q;
          if (st < kWgSteps) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i = 2 * st + h < 21 ? 2 * st + h : 0;
              const T* src = base + off[i / 3] + i % 3;
#pragma unroll
              for (int v = 0; v < 2; ++v) {
                const float xv = to_f32(src[8 * v]);
                if (!std::is_same<T, float>::value) {  // a 16-bit value is a TF32 value as it is
                  ah[q][2 * h + v] = __float_as_uint(xv);
                } else if (TERMS == 3) {  // hi = x truncated to TF32, lo = x - hi exactly (TF32 by the MMA's truncation)
                  ah[q][2 * h + v] = __float_as_uint(xv) & 0xffffe000u;
                  al[q][2 * h + v] = __float_as_uint(xv - __uint_as_float(ah[q][2 * h + v]));
                } else {  // x rounded to TF32 (half away from zero; cvt.rna would add an Inf/NaN check)
                  ah[q][2 * h + v] = (__float_as_uint(xv) + 0x1000u) & 0xffffe000u;
                }
              }
            }
          }
        }
        wgmma_fence();
#pragma unroll
        for (int q = 0; q < kWgChunk; ++q) {
          const int st = c * kWgChunk + q;
          if (st < kWgSteps) {
            const uint64_t b = wg_desc(bbase + st * kWgBBytes, 512, 128);
            if (TERMS == 3) {
              if (st == 0) {
                wgmma_n32<0>(ca, ah[q], b);
                if (kLo) wgmma_n16<0>(cl, al[q], b);
              } else {
                wgmma_n32<1>(ca, ah[q], b);
                if (kLo) wgmma_n16<1>(cl, al[q], b);
              }
            } else if (st == 0) {
              wgmma_n16<0>(cl, ah[q], b);
            } else {
              wgmma_n16<1>(cl, ah[q], b);
            }
          }
        }
        wgmma_commit();
        wgmma_wait<1>();  // all but this chunk done: the previous pair, and the registers of chunk c - 1
        if (c == 0 && previous) {
          pin(pa);
          pin(pl);
          wg_epilogue<TERMS, kLo>(pa, pl, bias, previous_row_ok, col_left, psum);
        }
      }
    };
    // Output row of this warp in round r: h0 + 2 (group + r x groups) + wq / 2.
    const int row_first = h0 + 2 * group + (wq >> 1), row_step = 2 * ngroups;
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
      const int y = 2 * (group + r * ngroups);
      const bool prev_ok = row_first + (r - 1) * row_step < s.oh;
      if (r % 2 == 0) {
        issue(y, acc0, lo0, r > 0, acc1, lo1, prev_ok);
      } else {
        issue(y, acc1, lo1, true, acc0, lo0, prev_ok);
      }
    }
    wgmma_wait<0>();
    const bool last_ok = row_first + (ROUNDS - 1) * row_step < s.oh;
    if (ROUNDS % 2 == 1) {
      pin(acc0);
      pin(lo0);
      wg_epilogue<TERMS, kLo>(acc0, lo0, bias, last_ok, col_left, psum);
    } else {
      pin(acc1);
      pin(lo1);
      wg_epilogue<TERMS, kLo>(acc1, lo1, bias, last_ok, col_left, psum);
    }
    if (more) asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
  }

  // Sum each channel over the 8 lanes of its tig, then over warps in order.
  __shared__ float red[4 * kWgMaxGroups][16];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    psum[j] += __shfl_xor_sync(0xffffffffu, psum[j], 4);
    psum[j] += __shfl_xor_sync(0xffffffffu, psum[j], 8);
    psum[j] += __shfl_xor_sync(0xffffffffu, psum[j], 16);
  }
  if (gid == 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) red[warp][8 * (j >> 1) + 2 * tig + (j & 1)] = psum[j];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float sum = 0.0f;
    for (int wi = 0; wi < (int)(blockDim.x >> 5); ++wi) sum += red[wi][threadIdx.x];
    const long long slot = ((long long)n * tiles_hw + tile) * chunks + chunk;
    partials[slot * 16 + threadIdx.x] = sum;
  }
  finish_sample(fin, partials, n, 16);
#endif
}

// ---------------------------------------------------------------------------
// General kernel

template <typename T, int MAXC>
__global__ void __launch_bounds__(kMaxThreads)
    fused_general_kernel(const T* __restrict__ x, const Shape s, const float* __restrict__ weight,
                         const float* __restrict__ bias, float* __restrict__ partials, const Finish fin) {
  const int n = blockIdx.y;
  const long long voxels = (long long)s.od * s.oh * s.ow;
  const long long vox = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool valid = vox < voxels;
  const int k = s.k, cout = s.cout;
  const long long wstride = (long long)s.cin * k * k * k;  // between output channels

  float acc[MAXC];
#pragma unroll
  for (int c = 0; c < MAXC; ++c) acc[c] = c < cout ? __ldg(bias + c) : 0.0f;

  if (valid) {
    const int ow = static_cast<int>(vox % s.ow);
    const int oh = static_cast<int>((vox / s.ow) % s.oh);
    const int od = static_cast<int>(vox / ((long long)s.ow * s.oh));
    const T* xn = x + n * s.sn + od * s.sd + oh * s.sh + ow * s.sw;
    for (int ci = 0; ci < s.cin; ++ci) {
      for (int kd = 0; kd < k; ++kd) {
        for (int kh = 0; kh < k; ++kh) {
          const T* xr = xn + ci * s.sc + kd * s.sd + kh * s.sh;
          const float* wr = weight + ((ci * k + kd) * k + kh) * k;
          for (int kw = 0; kw < k; ++kw) {
            const float xv = to_f32(xr[kw * s.sw]);
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
              if (c < cout) acc[c] = fmaf(xv, __ldg(wr + c * wstride + kw), acc[c]);
            }
          }
        }
      }
    }
  }
  float psum[MAXC];
#pragma unroll
  for (int c = 0; c < MAXC; ++c) psum[c] = 0.0f;
  softmax_accumulate<MAXC>(acc, cout, valid ? 1.0f : 0.0f, psum);
  const long long slot = (long long)n * gridDim.x + blockIdx.x;
  block_sum_to<MAXC>(psum, cout, partials + slot * cout);
  finish_sample(fin, partials, n, cout);
}

// out[n, c] = sum_t partials[n, t, c] / voxels, summed in order in double.
__global__ void finalize_kernel(const float* __restrict__ partials, float* __restrict__ out, int tiles, int cout,
                                double inv_voxels) {
  const int n = blockIdx.x;
  for (int c = threadIdx.x; c < cout; c += blockDim.x) {
    out[(long long)n * cout + c] = sample_mean(partials + (long long)n * tiles * cout + c, tiles, cout, inv_voxels);
  }
}

// ---------------------------------------------------------------------------
// Host side

thread_local char g_error[512] = "";

int fail(const char* fmt, const char* detail) {
  snprintf(g_error, sizeof g_error, fmt, detail);
  return 1;
}

int check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof g_error, "%s launch failed: %s", what, cudaGetErrorString(err));
    return 1;
  }
  return 0;
}

// The reference configuration and its tiling: TX threads x V voxels = 32 columns, TY rows per block.
constexpr int kRefCin = 3, kRefCout = 16, kRefK = 3, kRefV = 4, kRefTX = 8;
using RefGeometry = TileGeometry<kRefK, kRefV, kRefTX>;

enum Kernel : int { kGeneral = 0, kTile = 1, kWindow = 2, kTensor = 3, kWindowSplit = 4, kWgmma = 5 };

struct Plan {
  Kernel kernel;
  int threads_x;             // specialised kernels: blockDim.x (kRefTX column groups x channel split;
                             // tensor-core kernels: 32 x warps)
  int terms;                 // tensor-core kernels: 3 (3xTF32, float32 accuracy) or 1 (TF32)
  int dtype;                 // the input's DType
  int tiles_w, tiles_h, ty;  // specialised kernels
  int planes, chunks;        // window kernel: output planes per block, blocks along D
  int blocks;                // per sample
  long long partial_floats;
};

int resident_blocks(int per_sm) {  // blocks of a kernel resident at once on this device
  int device = 0, sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return per_sm * sms;
}

// Raise a kernel's dynamic shared-memory limit (per kernel, per device) to what a launch needs. The
// recorded limit only grows, so a later launch never finds it lowered below its own need.
template <auto KERNEL>
int allow_smem(size_t dynamic_bytes) {
  static size_t configured[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) return fail("device index out of range%s", "");
  if (dynamic_bytes > configured[device]) {
    const cudaError_t err =
        cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dynamic_bytes);
    if (err != cudaSuccess) return fail("raising the shared-memory limit failed: %s", cudaGetErrorString(err));
    configured[device] = dynamic_bytes;
  }
  return 0;
}

// The ring of raw input planes, then the weight fragments (one 16-byte fragment per k-step and lane).
size_t tc_smem_bytes(int ty) {
  return sizeof(float) * tc_layout(ty).ring_floats + sizeof(uint4) * kTcSteps * 32;
}

// Blocks of the tensor-core kernel resident per SM for a block of `warps` warps and `ty` rows (cached per
// device: the launcher runs on every call).
template <int TERMS>
int tc_blocks_per_sm(int device, int warps, int ty) {
  static int cache[kMaxDevices][kTcMaxWarps + 1][kTcMaxTy + 1];
  if (device < 0 || device >= kMaxDevices || warps > kTcMaxWarps || ty > kTcMaxTy) return 1;
  int& slot = cache[device][warps][ty];
  if (slot == 0) {
    constexpr auto kernel = fused_tc_kernel<TERMS>;
    const size_t smem = tc_smem_bytes(ty);
    int blocks = 1;
    if (allow_smem<kernel>(smem) != 0 ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 32 * warps, smem) != cudaSuccess ||
        blocks < 1) {
      cudaGetLastError();
      blocks = 1;
    }
    slot = blocks;  // the same value whichever thread writes it
  }
  return slot;
}

int tc_blocks_per_sm(int terms, int device, int warps, int ty) {
  return terms == 3 ? tc_blocks_per_sm<3>(device, warps, ty) : tc_blocks_per_sm<1>(device, warps, ty);
}

// Tensor-core kernel tiling. A block has 4-6 warps and ty = warps x (1..4) rows per plane. Each plane
// costs a block its staging and barrier whatever its rows, so the cost of a tiling is its padded
// rows weighted by (1 + 1 / rows per warp); among equal costs, more rows per warp. (Measured on H100 at
// the reference shape, version 8c: 4 warps x 4 rows 147 us, 5 x 3 164 us, 4 x 2 162 us; bench/kernel_plan_sweep.py.)
// Small batches are latency-bound, so the candidates are those giving every SM a (tile, plane), else
// the tiling with the most tiles. Then choose_chunks cuts the D range.
void choose_chunks(const Shape& s, Plan& p, long long resident, int forced);

void plan_tensor(const Shape& s, Plan& p) {
  int sms = 132, device = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  p.tiles_w = (s.ow + kTcTileW - 1) / kTcTileW;
  struct Cand { int warps, ty, tiles, per_sm; double cost; };
  Cand best{0, 0, 0, 0, 1e30}, widest{0, 0, 0, 0, 1e30};
  for (int warps = 4; warps <= kTcMaxWarps; ++warps) {
    for (int rows = 4; rows >= 1; --rows) {
      const int ty = warps * rows, tiles = (s.oh + ty - 1) / ty;
      if (ty > kTcMaxTy) continue;
      const int per_sm = tc_blocks_per_sm(p.terms, device, warps, ty);
      const double cost = (double)tiles * ty * (1.0 + 1.0 / rows);
      const long long units = (long long)s.n * p.tiles_w * tiles * s.od;
      if (units >= sms && cost < best.cost - 1e-9) best = {warps, ty, tiles, per_sm, cost};
      if (widest.warps == 0 || tiles > widest.tiles || (tiles == widest.tiles && cost < widest.cost)) {
        widest = {warps, ty, tiles, per_sm, cost};
      }
    }
  }
  Cand c = best.warps != 0 ? best : widest;
  // VOXSERVE_TC_PLAN=warps,rows[,chunks] overrides the choice (for tuning benchmarks).
  static const char* forced = getenv("VOXSERVE_TC_PLAN");
  int f_warps = 0, f_ty = 0, f_chunks = 0;
  if (forced != nullptr && sscanf(forced, "%d,%d,%d", &f_warps, &f_ty, &f_chunks) >= 2 && f_warps >= 1 &&
      f_warps <= kTcMaxWarps && f_ty >= 4 && f_ty <= kTcMaxTy) {
    const int per_sm = tc_blocks_per_sm(p.terms, device, f_warps, f_ty);
    c = {f_warps, f_ty, (s.oh + f_ty - 1) / f_ty, per_sm, 0.0};
  }
  p.threads_x = 32 * c.warps;
  p.ty = c.ty;
  p.tiles_h = c.tiles;
  choose_chunks(s, p, (long long)c.per_sm * sms, f_chunks);
}

// Cut the D range into the chunk count that needs the fewest block-planes per SM (waves x planes per
// block, plus the K-1 halo planes each chunk restages); `forced` (>= 1) overrides it.
void choose_chunks(const Shape& s, Plan& p, long long resident, int forced) {
  const int tiles_hw = p.tiles_w * p.tiles_h;
  double best_cost = 1e30;
  for (int chunks = 1; chunks <= s.od; ++chunks) {
    const int planes = (s.od + chunks - 1) / chunks;
    if (chunks > 1 && (s.od + planes - 1) / planes < chunks) continue;  // same split as fewer chunks
    const long long blocks = (long long)s.n * tiles_hw * chunks;
    const double cost = (double)((blocks + resident - 1) / resident) * (planes + 0.3 * 2);
    if (cost < best_cost) {
      best_cost = cost;
      p.chunks = chunks;
      p.planes = planes;
    }
  }
  if (forced >= 1 && forced <= s.od) p.planes = (s.od + forced - 1) / forced;
  p.chunks = (s.od + p.planes - 1) / p.planes;
  p.blocks = tiles_hw * p.chunks;
}

// The warpgroup kernel runs where the library holds sm_90a code (VOXSERVE_WGMMA, set by the build when
// the architecture list has 9.0a) and the device is compute capability 9.0.
bool wgmma_available() {
#ifdef VOXSERVE_WGMMA
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// The warpgroup kernel for (input type, terms, rounds): one instantiation per row-pair count of a
// warpgroup per plane.
template <typename T>
using WgKernel = void (*)(const T*, Shape, ConvWeights<3, 16, 3>, const float*, float*, int, int, int, int, int,
                          Finish);
constexpr int kWgMaxRounds = 8;

template <typename T, int TERMS, int... R>
WgKernel<T> wg_kernel_of(int rounds, std::integer_sequence<int, R...>) {
  static const WgKernel<T> table[] = {fused_wg_kernel<TERMS, R + 1, T>...};
  return table[rounds - 1];
}

template <typename T>
WgKernel<T> wg_kernel(int terms, int rounds) {
  const auto seq = std::make_integer_sequence<int, kWgMaxRounds>{};
  return terms == 1 ? wg_kernel_of<T, 1>(rounds, seq) : wg_kernel_of<T, 3>(rounds, seq);
}

const void* wg_kernel_ptr(int dtype, int terms, int rounds) {
  switch (dtype) {
    case kF16: return reinterpret_cast<const void*>(wg_kernel<__half>(terms, rounds));
    case kBF16: return reinterpret_cast<const void*>(wg_kernel<__nv_bfloat16>(terms, rounds));
    default: return reinterpret_cast<const void*>(wg_kernel<float>(terms, rounds));
  }
}

size_t elem_bytes(int dtype) { return dtype == kF32 ? 4 : 2; }

// Raise the warpgroup kernel's dynamic shared-memory limit (per instantiation and device) to `bytes`.
int wg_allow_smem(int dtype, int terms, int rounds, size_t bytes) {
  static size_t configured[kMaxDevices][3][2][kWgMaxRounds + 1] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) return fail("device index out of range%s", "");
  size_t& slot = configured[device][dtype][terms == 1 ? 0 : 1][rounds];
  if (bytes > slot) {
    const cudaError_t err = cudaFuncSetAttribute(wg_kernel_ptr(dtype, terms, rounds),
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (err != cudaSuccess) return fail("raising the shared-memory limit failed: %s", cudaGetErrorString(err));
    slot = bytes;
  }
  return 0;
}

// Blocks of the warpgroup kernel resident per SM (cached per device).
int wg_blocks_per_sm(int dtype, int terms, int rounds, int device, int groups) {
  static int cache[kMaxDevices][3][2][kWgMaxRounds + 1][kWgMaxGroups + 1];
  if (device < 0 || device >= kMaxDevices) return 1;
  int& slot = cache[device][dtype][terms == 1 ? 0 : 1][rounds][groups];
  if (slot == 0) {
    const size_t smem = wg_smem_bytes(2 * groups * rounds, elem_bytes(dtype));
    int blocks = 1;
    if (wg_allow_smem(dtype, terms, rounds, smem) != 0 ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, wg_kernel_ptr(dtype, terms, rounds), 128 * groups,
                                                      smem) != cudaSuccess ||
        blocks < 1) {
      cudaGetLastError();
      blocks = 1;
    }
    slot = blocks;
  }
  return slot;
}

// Warpgroup kernel tiling: `groups` (1-2) warpgroups per block, each `rounds` (1-8) row pairs per plane, so
// ty = 2 x groups x rounds rows per tile; and the D chunks. The estimated time of a plan, in row-pair units:
// waves x (planes per block (+ the restaged halo) x (rounds + 1.5 for the plane's drain and barrier)
// x W / min(W, 4) + 4 for the block's start), W being the warpgroups an SM holds at once (about 4 keep
// its tensor cores busy; fewer run each faster). VOXSERVE_WG_PLAN=groups,rows[,chunks] overrides it.
void plan_wgmma(const Shape& s, Plan& p) {
  int sms = 132, device = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  p.tiles_w = (s.ow + kTcTileW - 1) / kTcTileW;
  double best = 1e300;
  int best_groups = 1, best_rounds = 1, best_chunks = 1;
  for (int groups = 1; groups <= kWgMaxGroups; ++groups) {
    for (int rounds = 1; rounds <= kWgMaxRounds; ++rounds) {
      const int ty = 2 * groups * rounds;
      if (ty > kWgMaxTy || ty - 2 * groups >= s.oh + 1) continue;  // no warpgroup round entirely outside
      const int tiles_h = (s.oh + ty - 1) / ty;
      const int per_sm = wg_blocks_per_sm(p.dtype, p.terms, rounds, device, groups);
      const long long resident = (long long)per_sm * sms;
      for (int chunks = 1; chunks <= s.od; ++chunks) {
        const int planes = (s.od + chunks - 1) / chunks;
        if (chunks > 1 && (s.od + planes - 1) / planes < chunks) continue;
        const long long blocks = (long long)s.n * p.tiles_w * tiles_h * chunks;
        const long long waves = (blocks + resident - 1) / resident;
        const long long per_sm_now = std::min<long long>(per_sm, (blocks + sms - 1) / sms);
        const double w = (double)(per_sm_now * groups);
        const double cost =
            waves * ((planes + (chunks > 1 ? 0.6 : 0.0)) * (rounds + 1.5) * w / std::min(w, 4.0) + 4.0);
        if (cost < best - 1e-9) {
          best = cost;
          best_groups = groups;
          best_rounds = rounds;
          best_chunks = chunks;
        }
      }
    }
  }
  static const char* forced = getenv("VOXSERVE_WG_PLAN");
  int f_groups = 0, f_ty = 0, f_chunks = 0;
  if (forced != nullptr && sscanf(forced, "%d,%d,%d", &f_groups, &f_ty, &f_chunks) >= 2 && f_groups >= 1 &&
      f_groups <= kWgMaxGroups && f_ty % (2 * f_groups) == 0 && f_ty / (2 * f_groups) >= 1 &&
      f_ty / (2 * f_groups) <= kWgMaxRounds && f_ty <= kWgMaxTy) {
    best_groups = f_groups;
    best_rounds = f_ty / (2 * f_groups);
    if (f_chunks >= 1 && f_chunks <= s.od) best_chunks = f_chunks;
  }
  p.threads_x = 128 * best_groups;
  p.ty = 2 * best_groups * best_rounds;
  p.tiles_h = (s.oh + p.ty - 1) / p.ty;
  p.planes = (s.od + best_chunks - 1) / best_chunks;
  p.chunks = (s.od + p.planes - 1) / p.planes;
  p.blocks = p.tiles_w * p.tiles_h * p.chunks;
}

// variant: 0 chooses (for contiguous float32 the warpgroup kernel where available, else (and for the
// smallest calls) the tensor-core kernel; else tile); 1 forces tile, 2 window, 3 the tensor-core kernel, 4 the window kernel with Cout
// split over 2 lanes, 5 the warpgroup kernel (3 where unavailable); 2-5 take contiguous float32 only.
// precision: 0 float32, 1 lets the tensor-core kernels use plain TF32.
Plan make_plan(const Shape& s, int variant, int precision, int dtype, bool window_ok, bool wg_ok) {
  Plan p{};
  p.dtype = dtype;
  bool planned = false;
  if (!(s.cin == kRefCin && s.cout == kRefCout && s.k == kRefK)) {
    p.kernel = kGeneral;
    const long long voxels = (long long)s.od * s.oh * s.ow;
    p.blocks = static_cast<int>((voxels + kMaxThreads - 1) / kMaxThreads);
    planned = true;
  } else if (variant == 0 || variant == 3 || variant == 5) {
    p.terms = precision == 1 ? 1 : 3;
    // Below ~16 K output voxels (batch 1 at the reference size) a float32 call is latency-bound and the
    // mma.sync kernel's shorter block start wins: H100 graph replay at batch 1 13.5 us vs 14.4 us; from
    // batch 2 (25 K voxels) on the warpgroup kernel is as fast or faster (16.6 vs 16.9 us, batch 8 17.2
    // vs 21.4). 16-bit inputs have no mma.sync kernel: the warpgroup kernel takes them at every size.
    const bool small = dtype == kF32 && (long long)s.n * s.od * s.oh * s.ow <= 16384;
    if (wg_ok && (variant == 5 || (variant == 0 && !small)) && wgmma_available()) {
      p.kernel = kWgmma;
      plan_wgmma(s, p);
      planned = true;
    } else if (window_ok) {
      p.kernel = kTensor;
      plan_tensor(s, p);
      planned = true;
    } else {
      p.terms = 0;
    }
  }
  if (!planned) {
    if (variant == 1 || !window_ok) {
      p.kernel = kTile;
    } else {
      p.kernel = variant == 2 ? kWindow : kWindowSplit;
    }
    p.threads_x = p.kernel == kWindowSplit ? 2 * kRefTX : kRefTX;
    p.tiles_w = (s.ow + RefGeometry::kTileW - 1) / RefGeometry::kTileW;
    // Rows per tile: up to 256 threads' worth; fewer when the batch is too small to give every SM a
    // block, since a small batch is latency-bound and each thread's work is fixed. Rows per tile are
    // whole warps (the block reduction shuffles full warps); among the tile counts near the minimum,
    // take the one that pads the fewest rows (30 rows: 3 tiles of 10, not 2 of 16).
    const int warp_rows = 32 / p.threads_x;
    const long long planes_total = (long long)s.n * p.tiles_w * s.od;
    int max_ty = kMaxThreads / p.threads_x;
    while (max_ty > 2 * warp_rows && planes_total * ((s.oh + max_ty - 1) / max_ty) < resident_blocks(1)) max_ty /= 2;
    const int min_tiles = (s.oh + max_ty - 1) / max_ty;
    double best = 1e30;
    for (int t = min_tiles; t <= min_tiles + 2 && t <= s.oh; ++t) {
      const int ty = ((s.oh + t - 1) / t + warp_rows - 1) / warp_rows * warp_rows;
      if (ty > max_ty) continue;
      const double cost = (double)t * ty + 0.25 * t * (kRefK - 1);  // padded rows, plus a little per halo
      if (cost < best) {
        best = cost;
        p.tiles_h = t;
        p.ty = ty;
      }
    }
    const int tiles_hw = p.tiles_w * p.tiles_h;
    if (p.kernel == kWindow || p.kernel == kWindowSplit) {
      // Enough planes per block to amortise the window, few enough that the grid fills the GPU.
      const long long units = (long long)s.n * tiles_hw * s.od;
      const int per_sm = p.kernel == kWindowSplit ? 3 : 2;  // blocks per SM
      const long long want = units / resident_blocks(per_sm);
      p.planes = static_cast<int>(want < 1 ? 1 : (want > s.od ? s.od : want));
      p.chunks = (s.od + p.planes - 1) / p.planes;
      p.planes = (s.od + p.chunks - 1) / p.chunks;  // even out the chunks
      p.blocks = tiles_hw * p.chunks;
    } else {
      p.blocks = tiles_hw * s.od;
    }
  }
  p.partial_floats = (long long)s.n * p.blocks * s.cout;
  return p;
}

ConvWeights<kRefCin, kRefCout, kRefK> ref_weights(const float* w_host, const float* b_host) {
  ConvWeights<kRefCin, kRefCout, kRefK> params;
  memcpy(params.w, w_host, sizeof params.w);
  memcpy(params.b, b_host, sizeof params.b);
  return params;
}

template <typename T>
int launch_tile(const void* x, const Shape& s, const Plan& plan, const float* w_host, const float* b_host,
                float* partials, const Finish& fin, cudaStream_t stream) {
  constexpr auto kernel = fused_tile_kernel<T, kRefCin, kRefCout, kRefK, kRefV, kRefTX>;
  const size_t smem = sizeof(float) * kRefCin * kRefK * (plan.ty + kRefK - 1) * RefGeometry::kPitch;
  if (allow_smem<kernel>(smem) != 0) return 1;
  const dim3 grid(plan.tiles_w * plan.tiles_h, s.od, s.n), block(kRefTX, plan.ty);
  kernel<<<grid, block, smem, stream>>>(static_cast<const T*>(x), s, ref_weights(w_host, b_host), partials,
                                        plan.tiles_w, plan.tiles_w * plan.tiles_h, fin);
  return check_launch("fused_tile_kernel");
}

template <int CSPLIT>
int launch_window(const void* x, const Shape& s, const Plan& plan, const float* w_host, const float* b_host,
                  float* partials, const Finish& fin, cudaStream_t stream) {
  constexpr auto kernel = fused_window_kernel<kRefCin, kRefCout, kRefK, kRefV, kRefTX, CSPLIT>;
  const size_t smem =
      sizeof(float) * (kRefK + 1) * kRefCin * (plan.ty + kRefK - 1) * RefGeometry::kPitch;
  if (allow_smem<kernel>(smem) != 0) return 1;
  const dim3 grid(plan.tiles_w * plan.tiles_h, plan.chunks, s.n), block(plan.threads_x, plan.ty);
  kernel<<<grid, block, smem, stream>>>(static_cast<const float*>(x), s, ref_weights(w_host, b_host), partials,
                                        plan.tiles_w, plan.tiles_w * plan.tiles_h, plan.planes, plan.chunks, fin);
  return check_launch("fused_window_kernel");
}

template <typename T>
int launch_general(const void* x, const Shape& s, const Plan& plan, const float* w_dev, const float* b_dev,
                   float* partials, const Finish& fin, cudaStream_t stream) {
  const dim3 grid(plan.blocks, s.n), block(kMaxThreads);
  const T* xt = static_cast<const T*>(x);
  if (s.cout <= 8) {
    fused_general_kernel<T, 8><<<grid, block, 0, stream>>>(xt, s, w_dev, b_dev, partials, fin);
  } else if (s.cout <= 16) {
    fused_general_kernel<T, 16><<<grid, block, 0, stream>>>(xt, s, w_dev, b_dev, partials, fin);
  } else if (s.cout <= 32) {
    fused_general_kernel<T, 32><<<grid, block, 0, stream>>>(xt, s, w_dev, b_dev, partials, fin);
  } else {
    fused_general_kernel<T, 64><<<grid, block, 0, stream>>>(xt, s, w_dev, b_dev, partials, fin);
  }
  return check_launch("fused_general_kernel");
}

template <int TERMS>
int launch_tensor(const void* x, const Shape& s, const Plan& plan, const float* w_host, const float* b_host,
                  float* partials, const Finish& fin, cudaStream_t stream) {
  constexpr auto kernel = fused_tc_kernel<TERMS>;
  const size_t smem = tc_smem_bytes(plan.ty);
  if (allow_smem<kernel>(smem) != 0) return 1;
  const dim3 grid(plan.tiles_w * plan.tiles_h, plan.chunks, s.n), block(plan.threads_x);
  kernel<<<grid, block, smem, stream>>>(static_cast<const float*>(x), s, ref_weights(w_host, b_host), partials,
                                        plan.tiles_w, plan.tiles_w * plan.tiles_h, plan.planes, plan.chunks, plan.ty,
                                        fin);
  return check_launch("fused_tc_kernel");
}

template <typename T>
int launch_wgmma(const void* x, const Shape& s, const Plan& plan, const float* w_dev, const float* w_host,
                 const float* b_host, float* partials, const Finish& fin, cudaStream_t stream) {
  const int rounds = plan.ty / (2 * (plan.threads_x / 128));
  const size_t smem = wg_smem_bytes(plan.ty, sizeof(T));
  if (wg_allow_smem(plan.dtype, plan.terms, rounds, smem) != 0) return 1;
  const dim3 grid(plan.tiles_w * plan.tiles_h, plan.chunks, s.n), block(plan.threads_x);
  wg_kernel<T>(plan.terms, rounds)<<<grid, block, smem, stream>>>(
      static_cast<const T*>(x), s, ref_weights(w_host, b_host), w_dev, partials, plan.tiles_w,
      plan.tiles_w * plan.tiles_h, plan.planes, plan.chunks, plan.ty, fin);
  return check_launch("fused_wg_kernel");
}

template <typename T>
int dispatch(const void* x, const Shape& s, const Plan& plan, const float* w_dev, const float* b_dev,
             const float* w_host, const float* b_host, float* partials, const Finish& fin, cudaStream_t stream) {
  switch (plan.kernel) {
    case kGeneral: return launch_general<T>(x, s, plan, w_dev, b_dev, partials, fin, stream);
    case kWindow: return launch_window<1>(x, s, plan, w_host, b_host, partials, fin, stream);
    case kWindowSplit: return launch_window<2>(x, s, plan, w_host, b_host, partials, fin, stream);
    case kTensor:
      return plan.terms == 1 ? launch_tensor<1>(x, s, plan, w_host, b_host, partials, fin, stream)
                             : launch_tensor<3>(x, s, plan, w_host, b_host, partials, fin, stream);
    case kWgmma:
      return launch_wgmma<T>(x, s, plan, w_dev, w_host, b_host, partials, fin, stream);
    default: return launch_tile<T>(x, s, plan, w_host, b_host, partials, fin, stream);
  }
}

int dispatch_dtype(const void* x, int dtype, const Shape& s, const Plan& plan, const float* w_dev, const float* b_dev,
                   const float* w_host, const float* b_host, float* partials, const Finish& fin, cudaStream_t stream) {
  switch (dtype) {
    case kF16: return dispatch<__half>(x, s, plan, w_dev, b_dev, w_host, b_host, partials, fin, stream);
    case kBF16: return dispatch<__nv_bfloat16>(x, s, plan, w_dev, b_dev, w_host, b_host, partials, fin, stream);
    default: return dispatch<float>(x, s, plan, w_dev, b_dev, w_host, b_host, partials, fin, stream);
  }
}

bool fill_shape(const long long* sizes, const long long* strides, int cout, int k, Shape* s) {
  for (int i = 0; i < 5; ++i) {
    if (sizes[i] < 1 || sizes[i] > INT32_MAX) return false;
  }
  s->n = (int)sizes[0]; s->cin = (int)sizes[1]; s->d = (int)sizes[2]; s->h = (int)sizes[3]; s->w = (int)sizes[4];
  s->sn = strides[0]; s->sc = strides[1]; s->sd = strides[2]; s->sh = strides[3]; s->sw = strides[4];
  s->cout = cout; s->k = k;
  s->od = s->d - k + 1; s->oh = s->h - k + 1; s->ow = s->w - k + 1;
  return k >= 1 && cout >= 1 && s->od >= 1 && s->oh >= 1 && s->ow >= 1;
}

// The window and tensor-core kernels copy 16-byte pieces of W-contiguous float32 rows.
bool window_ok(const void* x, int dtype, const Shape& s) {
  return dtype == kF32 && s.sw == 1 && s.w % 4 == 0 && s.sh % 4 == 0 && s.sd % 4 == 0 && s.sc % 4 == 0 &&
         s.sn % 4 == 0 && (reinterpret_cast<uintptr_t>(x) % 16) == 0;
}

// The warpgroup kernel copies 16-byte pieces of W-contiguous rows of any of the three types.
bool wg_input_ok(const void* x, int dtype, const Shape& s) {
  if (dtype == kF32) return window_ok(x, dtype, s);
  return (dtype == kF16 || dtype == kBF16) && s.sw == 1 && s.w % 8 == 0 && s.sh % 8 == 0 && s.sd % 8 == 0 &&
         s.sc % 8 == 0 && s.sn % 8 == 0 && (reinterpret_cast<uintptr_t>(x) % 16) == 0;
}

// Host function of voxserve_notify: one 8-byte write, which makes an eventfd readable (async-signal-safe, no
// CUDA call, no lock; a full counter or closed descriptor just loses the wake-up, which the caller backs up).
void CUDART_CB write_event(void* fd) {
  const uint64_t one = 1;
  const ssize_t written = write(static_cast<int>(reinterpret_cast<intptr_t>(fd)), &one, sizeof one);
  (void)written;
}

// The one-launch path's scratch, one per stream: the partials and a counter per sample (zeroed once; each launch
// leaves them at zero). Work on one stream runs in order, so a launch may take what the one before it on the same
// stream took. Keyed by the stream's id, unique for the process's lifetime (a handle reused by a new stream is a
// new entry). It grows stream-ordered (cudaMallocAsync / cudaFreeAsync on its own stream), and a launch is
// enqueued under its entry's lock, so another thread's growth is ordered after that launch. Entries are never
// given back: kScratchStreams of them at most (streams of the past keep theirs), each at most kScratchMaxFloats
// (4 MiB: a call needing more is large enough that a second launch costs it nothing), so at most 256 MiB and
// typically a few KB per stream. Beyond that, or while the stream is capturing a graph, voxserve_forward asks for
// the caller's workspace instead.
constexpr int kScratchStreams = 64;
constexpr long long kScratchMaxFloats = 1LL << 20;
constexpr int kMaxGridYZ = 65535;  // samples per launch (grid y or z)

struct Scratch {
  std::mutex lock;
  bool used = false;
  int device = -1;
  unsigned long long stream_id = 0;
  float* partials = nullptr;
  long long floats = 0;
  unsigned* counters = nullptr;
  long long samples = 0;
};

Scratch g_scratch[kScratchStreams];
std::mutex g_scratch_lock;

// The scratch entry of (device, stream), made on first use; nullptr when the table is full or the stream's id is
// unknown (CUDA's error cleared).
Scratch* scratch_for(int device, cudaStream_t stream) {
  unsigned long long id = 0;
  if (cudaStreamGetId(stream, &id) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  std::lock_guard<std::mutex> guard(g_scratch_lock);
  Scratch* free_entry = nullptr;
  for (Scratch& e : g_scratch) {
    if (e.used && e.device == device && e.stream_id == id) return &e;
    if (!e.used && free_entry == nullptr) free_entry = &e;
  }
  if (free_entry != nullptr) {
    free_entry->used = true;
    free_entry->device = device;
    free_entry->stream_id = id;
  }
  return free_entry;
}

// A failed free leaves its memory to the process (growth is geometric: rare) and CUDA's error cleared, so that no
// later check_launch is blamed for it.
void free_async(void* p, cudaStream_t stream) {
  if (p != nullptr && cudaFreeAsync(p, stream) != cudaSuccess) cudaGetLastError();
}

// scratch_reserve's allocations (see there).
bool scratch_grow(Scratch& e, long long floats, long long samples, cudaStream_t stream) {
  if (floats > e.floats) {
    const long long want = std::min(std::max(floats, 2 * e.floats), kScratchMaxFloats);
    void* p = nullptr;
    if (cudaMallocAsync(&p, static_cast<size_t>(want) * sizeof(float), stream) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    free_async(e.partials, stream);
    e.partials = static_cast<float*>(p);
    e.floats = want;
  }
  if (samples > e.samples) {
    const long long want = std::max(samples, 2 * e.samples);
    void* p = nullptr;
    if (cudaMallocAsync(&p, static_cast<size_t>(want) * sizeof(unsigned), stream) != cudaSuccess ||
        cudaMemsetAsync(p, 0, static_cast<size_t>(want) * sizeof(unsigned), stream) != cudaSuccess) {
      cudaGetLastError();
      free_async(p, stream);
      return false;
    }
    free_async(e.counters, stream);
    e.counters = static_cast<unsigned*>(p);
    e.samples = want;
  }
  return true;
}

// At least `floats` partials and `samples` zeroed counters in `e` (its lock held), allocated on `stream` (twice what
// is needed, within the cap, so that slowly growing shapes do not reallocate each call). false: CUDA refused (its
// error cleared); the entry keeps what it had.
bool scratch_reserve(Scratch& e, long long floats, long long samples, cudaStream_t stream) {
  if (floats <= e.floats && samples <= e.samples) return true;
  // Allowed even while another thread captures a graph in global mode (which refuses this thread's
  // potentially unsafe calls, and would be invalidated by them): these calls are ordered on a stream not captured.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  const bool ok = scratch_grow(e, floats, samples, stream);
  cudaThreadExchangeStreamCaptureMode(&mode);
  return ok;
}

// Whether `stream` is capturing a graph (or cannot tell: treated as capturing; CUDA's error cleared).
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

extern "C" {

// The last error message of this thread ("" when none).
const char* voxserve_last_error() { return g_error; }

// 1 when (Cin, Cout, k) runs the specialised kernel (it then needs host copies of the weights).
int voxserve_is_specialised(int cin, int cout, int k) { return cin == kRefCin && cout == kRefCout && k == kRefK; }

// Floats of scratch space voxserve_forward needs for this shape, or -1 for an invalid shape: the largest
// plan's, whatever the input's layout (the tile kernel's, or the tensor-core kernels' at their smallest
// tiles: 2 rows, one plane per block).
long long voxserve_workspace_floats(const long long* sizes, int cout, int k) {
  const long long strides[5] = {0, 0, 0, 0, 0};
  Shape s;
  if (!fill_shape(sizes, strides, cout, k, &s)) return -1;
  const long long tile = make_plan(s, 1, 0, kF32, false, false).partial_floats;
  const long long tensor = (long long)s.n * ((s.ow + kTcTileW - 1) / kTcTileW) * ((s.oh + 1) / 2) * s.od * s.cout;
  return tile > tensor ? tile : tensor;
}

// The plan voxserve_forward would run on the current device (for benchmarks and tests): out[0..7] =
// kernel (0 general, 1 tile, 2 window, 3 tensor-core, 4 split window, 5 warpgroup), threads per block, rows per tile,
// tiles along H, tiles along W, D chunks, blocks per sample, tensor-core terms (3 or 1; 0 otherwise).
// Returns 0, or 1 for an invalid shape.
int voxserve_plan(const void* x, int dtype, const long long* sizes, const long long* strides, int cout, int k,
                  int variant, int precision, int device, int* out) {
  Shape s;
  if (cudaSetDevice(device) != cudaSuccess || !fill_shape(sizes, strides, cout, k, &s)) return 1;
  const Plan p = make_plan(s, variant, precision, dtype, window_ok(x, dtype, s), wg_input_ok(x, dtype, s));
  const int fields[8] = {p.kernel, p.threads_x, p.ty, p.tiles_h, p.tiles_w, p.chunks, p.blocks, p.terms};
  for (int i = 0; i < 8; ++i) out[i] = fields[i];
  return 0;
}

// out (N, Cout) float32 = the model on x, enqueued on `stream`. Returns 0, or 1 with voxserve_last_error(), or 2
// (nothing enqueued) when workspace is NULL and the stream's scratch cannot serve (the stream is capturing a graph,
// the call needs more than the scratch's cap, or too many streams): then call again with a workspace.
// w_dev/b_dev: device float32 weights (Cout, Cin, k, k, k) and bias; w_host/b_host: the same values on the host,
// required when voxserve_is_specialised(). workspace: voxserve_workspace_floats() floats on the device, and two
// launches (the kernel, then finalize_kernel); or NULL: one launch on the library's scratch for this stream, the
// last block of each sample writing its means.
// variant: 0 lets make_plan choose the kernel; 1-5 force one where the input allows it (benchmarks
// compare them). precision: 0 float32 throughout; 1 lets the tensor-core kernel multiply in TF32.
// device: the CUDA device that x, out and stream belong to (this library has its own CUDA runtime, so the
// caller's current device is not known here).
int voxserve_forward(const void* x, int dtype, const long long* sizes, const long long* strides, int cout, int k,
                     const float* w_dev, const float* b_dev, const float* w_host, const float* b_host, float* out,
                     float* workspace, int variant, int precision, int device, void* stream_handle) {
  g_error[0] = '\0';
  const cudaError_t dev_err = cudaSetDevice(device);
  if (dev_err != cudaSuccess) return fail("cudaSetDevice failed: %s", cudaGetErrorString(dev_err));
  Shape s;
  if (!fill_shape(sizes, strides, cout, k, &s)) return fail("invalid shape for the fused kernel%s", "");
  if (cout > kGeneralMaxCout && !voxserve_is_specialised(s.cin, cout, k)) {
    return fail("Cout above 64 is not supported by the fused kernel%s", "");
  }
  const Plan plan = make_plan(s, variant, precision, dtype, window_ok(x, dtype, s), wg_input_ok(x, dtype, s));
  if (plan.kernel != kGeneral && (w_host == nullptr || b_host == nullptr)) {
    return fail("the specialised kernels need host copies of the weights%s", "");
  }
  if (dtype != kF32 && dtype != kF16 && dtype != kBF16) return fail("unsupported input dtype code%s", "");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const double inv_voxels = 1.0 / ((double)s.od * s.oh * s.ow);
  if (workspace != nullptr) {
    const int rc = dispatch_dtype(x, dtype, s, plan, w_dev, b_dev, w_host, b_host, workspace, Finish{}, stream);
    if (rc != 0) return rc;
    finalize_kernel<<<s.n, 32, 0, stream>>>(workspace, out, plan.blocks, cout, inv_voxels);
    return check_launch("finalize_kernel");
  }
  // (A batch beyond the grid's limit goes the workspace's way too, and fails there at its launch, as it always did.)
  // Capture first: a stream's id asked for while it captures invalidates the capture.
  if (plan.partial_floats > kScratchMaxFloats || s.n > kMaxGridYZ || capturing(stream)) return 2;
  Scratch* e = scratch_for(device, stream);
  if (e == nullptr) return 2;
  std::lock_guard<std::mutex> guard(e->lock);
  // Checked again under the lock, just before the launch: a capture begun on this stream by another thread after
  // this check is the caller's race (one stream used by two threads at once), as with any launch.
  if (capturing(stream) || !scratch_reserve(*e, plan.partial_floats, s.n, stream)) return 2;
  return dispatch_dtype(x, dtype, s, plan, w_dev, b_dev, w_host, b_host, e->partials,
                        Finish{out, e->counters, plan.blocks, inv_voxels}, stream);
}

// voxserve_forward's arguments that one argument layout fixes (kernels/cuda.py keeps one per layout, so an eager call
// passes pointers only: ctypes converts those several times faster than arrays and integers).
struct VoxLayout {
  long long sizes[5];
  long long strides[5];
  int dtype, cout, k, precision, device;
};

long long voxserve_layout_size() { return (long long)sizeof(VoxLayout); }

// voxserve_forward(x, layout..., w_dev, b_dev, w_host, b_host, out, workspace, variant, ..., stream), the same answers
// (workspace NULL: the one-launch path, or 2: call again with a workspace).
int voxserve_forward_layout(const VoxLayout* l, const void* x, const float* w_dev, const float* b_dev,
                            const float* w_host, const float* b_host, float* out, float* workspace, void* stream_handle,
                            int variant) {
  return voxserve_forward(x, l->dtype, l->sizes, l->strides, l->cout, l->k, w_dev, b_dev, w_host, b_host, out,
                          workspace, variant, l->precision, l->device, stream_handle);
}

// Enqueue on `stream` a write of 1 to the eventfd `fd`: it becomes readable once everything enqueued before
// has finished, so an event loop learns of a GPU execution's end without a thread blocking on it. device: the
// stream's CUDA device. Returns 0, or 1 with voxserve_last_error().
int voxserve_notify(void* stream_handle, int fd, int device) {
  g_error[0] = '\0';
  const cudaError_t dev_err = cudaSetDevice(device);
  if (dev_err != cudaSuccess) return fail("cudaSetDevice failed: %s", cudaGetErrorString(dev_err));
  const cudaError_t err = cudaLaunchHostFunc(static_cast<cudaStream_t>(stream_handle), write_event,
                                             reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  if (err != cudaSuccess) return fail("cudaLaunchHostFunc failed: %s", cudaGetErrorString(err));
  return 0;
}

// Copy `n` host spans (spans[2i]: address, spans[2i+1]: bytes) one after another into device memory from
// `dst` on, on `stream`: the inputs of one batch, gathered without a host copy. Spans that lie back to back
// on the host (consecutive requests of one front end's staging arena) go as one copy. The spans should be
// page-locked, or the copies are not asynchronous. Returns 0, or 1 with voxserve_last_error().
int voxserve_copy_spans(void* dst, const long long* spans, int n, void* stream_handle, int device) {
  g_error[0] = '\0';
  const cudaError_t dev_err = cudaSetDevice(device);
  if (dev_err != cudaSuccess) return fail("cudaSetDevice failed: %s", cudaGetErrorString(dev_err));
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  char* out = static_cast<char*>(dst);
  for (int i = 0; i < n;) {
    const long long start = spans[2 * i];
    long long bytes = spans[2 * i + 1];
    int j = i + 1;
    for (; j < n && spans[2 * j] == start + bytes; ++j) bytes += spans[2 * j + 1];
    const cudaError_t err = cudaMemcpyAsync(out, reinterpret_cast<const void*>(start), static_cast<size_t>(bytes),
                                            cudaMemcpyHostToDevice, stream);
    if (err != cudaSuccess) return fail("cudaMemcpyAsync failed: %s", cudaGetErrorString(err));
    out += bytes;
    i = j;
  }
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------
// One serving execution with one call (server/core/pipeline.py, native path): the host gather, the DMA, the
// kernel (or a captured graph of it), the result's DMA back, the timing events and the completion wake-up,
// enqueued without a Python call per step. The layout is mirrored by kernels/cuda.py (Execution).
// (at namespace scope: an extern "C" function taking a type of an unnamed namespace would not be exported)
struct VoxExecution {
  const long long* spans;  // nspans (address, bytes) pairs: the batch's request bytes, in order
  long long nspans;
  long long bytes;         // their total
  long long padded_bytes;  // the batch padded to its graph bucket with zero samples (>= bytes)
  long long host_copy_ns;  // out: the host gather's time (stage 1)
  void* staging;           // page-locked host memory of the slot (stages 1 and 2)
  void* dev_in;            // device memory of the slot: the (padded) batch
  void* graph_exec;        // a cudaGraphExec_t of voxserve_graph_capture over dev_in, or NULL: launch directly
  const float* w_dev;      // the direct launch's arguments, as voxserve_forward's
  const float* b_dev;
  const float* w_host;
  const float* b_host;
  float* out;              // the (padded N, Cout) result on the device (the graph's output buffer with a graph)
  float* workspace;
  float* host_out;         // page-locked destination of the first out_bytes of `out`
  long long out_bytes;
  void* copy_stream;
  void* compute_stream;
  void* events[5];         // h2d start, h2d end, compute start, compute end, result back (timing events)
  long long sizes[5];      // the padded batch's shape and strides
  long long strides[5];
  int dtype, cout, k, variant, precision, device;
  int stage;               // 0: DMA each span (page-locked sources); 1: gather them into staging, then one DMA;
                           // 2: staging already holds them (a multi-threaded copy by the caller), one DMA;
                           // 3: the spans lie in device memory (clients' CUDA regions): copied device to device
                           //    into dev_in, or, with no spans, dev_in is the request's own memory, read in place
  int notify_fd;           // >= 0: written once the execution has finished (voxserve_notify)
  const long long* out_spans;  // nout_spans (address, bytes) pairs cutting the first bytes of `out` in order: each
  long long nout_spans;        // piece is copied to its address in device memory (a client's CUDA region) before
                               // the result-back event; address 0: that piece has no such destination
};

namespace {

long long now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int cuda_fail(const char* what, cudaError_t err) {
  snprintf(g_error, sizeof g_error, "%s failed: %s", what, cudaGetErrorString(err));
  return 1;
}

#define VOX_CUDA(what, call)                        \
  do {                                              \
    const cudaError_t vox_err_ = (call);            \
    if (vox_err_ != cudaSuccess) return cuda_fail(what, vox_err_); \
  } while (0)

}  // namespace

extern "C" {

// sizeof(VoxExecution): the Python mirror checks its own layout against it.
long long voxserve_execution_size() { return (long long)sizeof(VoxExecution); }

// `n` timing events on `device` into events[0..n-1]. Returns 0, or 1 with voxserve_last_error().
int voxserve_events_create(int device, int n, void** events) {
  g_error[0] = '\0';
  VOX_CUDA("cudaSetDevice", cudaSetDevice(device));
  for (int i = 0; i < n; ++i) {
    cudaEvent_t e;
    VOX_CUDA("cudaEventCreate", cudaEventCreate(&e));
    events[i] = e;
  }
  return 0;
}

void voxserve_events_destroy(int n, void** events) {
  for (int i = 0; i < n; ++i) {
    if (events[i] != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(events[i]));
    events[i] = nullptr;
  }
}

// 0: the event has completed; 1: not yet; 2: the device failed (voxserve_last_error() says how).
int voxserve_event_query(void* event) {
  g_error[0] = '\0';
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaSuccess) return 0;
  if (err == cudaErrorNotReady) return 1;
  cuda_fail("cudaEventQuery", err);
  return 2;
}

// Block until the event has completed. Returns 0, or 1 with voxserve_last_error().
int voxserve_event_synchronize(void* event) {
  g_error[0] = '\0';
  VOX_CUDA("cudaEventSynchronize", cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return 0;
}

// *ms: the time from event `start` to event `end` (both completed), in milliseconds. Returns 0, or 1.
int voxserve_elapsed_ms(void* start, void* end, float* ms) {
  g_error[0] = '\0';
  VOX_CUDA("cudaEventElapsedTime", cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start),
                                                        static_cast<cudaEvent_t>(end)));
  return 0;
}

// Capture voxserve_forward with these arguments into a graph (*graph_exec) on `stream` (not the legacy default
// stream). The call is run once on the stream first and waited for, so that nothing is loaded lazily during the
// capture. Returns 0, or 1 with voxserve_last_error().
int voxserve_graph_capture(const void* x, int dtype, const long long* sizes, const long long* strides, int cout, int k,
                           const float* w_dev, const float* b_dev, const float* w_host, const float* b_host,
                           float* out, float* workspace, int variant, int precision, int device, void* stream_handle,
                           void** graph_exec) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  if (voxserve_forward(x, dtype, sizes, strides, cout, k, w_dev, b_dev, w_host, b_host, out, workspace, variant,
                       precision, device, stream) != 0) {
    return 1;
  }
  VOX_CUDA("cudaStreamSynchronize", cudaStreamSynchronize(stream));
  VOX_CUDA("cudaStreamBeginCapture", cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const int rc = voxserve_forward(x, dtype, sizes, strides, cout, k, w_dev, b_dev, w_host, b_host, out, workspace,
                                  variant, precision, device, stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);  // ended whatever happened, so the stream is usable
  if (rc != 0) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return 1;
  }
  if (end != cudaSuccess) return cuda_fail("cudaStreamEndCapture", end);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (inst != cudaSuccess) return cuda_fail("cudaGraphInstantiate", inst);
  *graph_exec = exec;
  return 0;
}

void voxserve_graph_destroy(void* graph_exec) {
  if (graph_exec != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_exec));
}

// Enqueue one execution (see VoxExecution). The host gather (stage 1) runs here, in the calling thread; the rest
// is enqueued without waiting. Returns 0, or 1 with voxserve_last_error() (nothing more of it is enqueued).
int voxserve_execute(VoxExecution* e) {
  g_error[0] = '\0';
  VOX_CUDA("cudaSetDevice", cudaSetDevice(e->device));
  cudaStream_t copy = static_cast<cudaStream_t>(e->copy_stream);
  cudaStream_t compute = static_cast<cudaStream_t>(e->compute_stream);
  cudaEvent_t* ev = reinterpret_cast<cudaEvent_t*>(e->events);
  char* dev_in = static_cast<char*>(e->dev_in);
  e->host_copy_ns = 0;
  if (e->stage == 3 && e->nspans == 0 && e->padded_bytes != e->bytes) {  // padding would write a client's memory
    snprintf(g_error, sizeof g_error, "voxserve_execute: an input read in place cannot be padded");
    return 1;
  }
  if (e->stage == 1) {
    const long long t0 = now_ns();
    char* dst = static_cast<char*>(e->staging);
    for (long long i = 0; i < e->nspans; ++i) {
      memcpy(dst, reinterpret_cast<const void*>(e->spans[2 * i]), static_cast<size_t>(e->spans[2 * i + 1]));
      dst += e->spans[2 * i + 1];
    }
    e->host_copy_ns = now_ns() - t0;
  }
  VOX_CUDA("cudaEventRecord", cudaEventRecord(ev[0], copy));
  if (e->stage == 0) {
    if (voxserve_copy_spans(dev_in, e->spans, static_cast<int>(e->nspans), copy, e->device) != 0) return 1;
  } else if (e->stage == 3) {
    char* dst = dev_in;
    for (long long i = 0; i < e->nspans; ++i) {
      VOX_CUDA("cudaMemcpyAsync", cudaMemcpyAsync(dst, reinterpret_cast<const void*>(e->spans[2 * i]),
                                                  static_cast<size_t>(e->spans[2 * i + 1]), cudaMemcpyDeviceToDevice,
                                                  copy));
      dst += e->spans[2 * i + 1];
    }
  } else {
    VOX_CUDA("cudaMemcpyAsync", cudaMemcpyAsync(dev_in, e->staging, static_cast<size_t>(e->bytes),
                                                cudaMemcpyHostToDevice, copy));
  }
  if (e->padded_bytes > e->bytes) {
    VOX_CUDA("cudaMemsetAsync", cudaMemsetAsync(dev_in + e->bytes, 0,
                                                static_cast<size_t>(e->padded_bytes - e->bytes), copy));
  }
  VOX_CUDA("cudaEventRecord", cudaEventRecord(ev[1], copy));
  VOX_CUDA("cudaStreamWaitEvent", cudaStreamWaitEvent(compute, ev[1], 0));
  VOX_CUDA("cudaEventRecord", cudaEventRecord(ev[2], compute));
  if (e->graph_exec != nullptr) {
    VOX_CUDA("cudaGraphLaunch", cudaGraphLaunch(static_cast<cudaGraphExec_t>(e->graph_exec), compute));
  } else if (voxserve_forward(dev_in, e->dtype, e->sizes, e->strides, e->cout, e->k, e->w_dev, e->b_dev, e->w_host,
                              e->b_host, e->out, e->workspace, e->variant, e->precision, e->device, compute) != 0) {
    return 1;
  }
  VOX_CUDA("cudaEventRecord", cudaEventRecord(ev[3], compute));
  const char* out = reinterpret_cast<const char*>(e->out);
  for (long long i = 0; i < e->nout_spans; ++i) {
    const long long to = e->out_spans[2 * i], bytes = e->out_spans[2 * i + 1];
    if (to != 0 && reinterpret_cast<const char*>(to) != out) {  // (the kernel may have written it there already)
      VOX_CUDA("cudaMemcpyAsync", cudaMemcpyAsync(reinterpret_cast<void*>(to), out, static_cast<size_t>(bytes),
                                                  cudaMemcpyDeviceToDevice, compute));
    }
    out += bytes;
  }
  if (e->out_bytes > 0) {
    VOX_CUDA("cudaMemcpyAsync", cudaMemcpyAsync(e->host_out, e->out, static_cast<size_t>(e->out_bytes),
                                                cudaMemcpyDeviceToHost, compute));
  }
  VOX_CUDA("cudaEventRecord", cudaEventRecord(ev[4], compute));
  if (e->notify_fd >= 0) {
    VOX_CUDA("cudaLaunchHostFunc", cudaLaunchHostFunc(compute, write_event,
                                                      reinterpret_cast<void*>(static_cast<intptr_t>(e->notify_fd))));
  }
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------
// CUDA shared memory (server/core/devicemem.py): another process's device memory, opened from its IPC handle.
// The two driver calls are fetched through the runtime, so the library still links without libcuda (CI builds it
// with nvcc alone). A failed call is an API error, not a device fault, but the runtime keeps it as its last error:
// it is cleared here, or the next check_launch on this thread would blame a kernel launch for it.

namespace {

// The name of the last IPC failure's error (the runtime's or the driver's own: their numbers differ).
thread_local char g_error_name[64] = "";

int ipc_fail(const char* what, cudaError_t err) {
  snprintf(g_error, sizeof g_error, "%s failed: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
  snprintf(g_error_name, sizeof g_error_name, "%s", cudaGetErrorName(err));
  cudaGetLastError();
  return static_cast<int>(err);
}

void* driver_entry(const char* symbol);

int driver_fail(const char* what, CUresult res) {
  const char* name = nullptr;
  auto get_name = reinterpret_cast<PFN_cuGetErrorName_v6000>(driver_entry("cuGetErrorName"));
  if (get_name == nullptr || get_name(res, &name) != CUDA_SUCCESS || name == nullptr) name = "CUDA_ERROR_UNKNOWN";
  snprintf(g_error, sizeof g_error, "%s failed: %s (CUDA driver error %d)", what, name, static_cast<int>(res));
  snprintf(g_error_name, sizeof g_error_name, "%s", name);
  cudaGetLastError();
  return static_cast<int>(res);
}

// The driver's `symbol` as of CUDA 12.0 (its ABI then), or nullptr with g_error set.
void* driver_entry(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    snprintf(g_error, sizeof g_error, "the CUDA driver has no %s (%s)", symbol,
             err != cudaSuccess ? cudaGetErrorName(err) : "symbol not found");
    cudaGetLastError();
    return nullptr;
  }
  return fn;
}

}  // namespace

extern "C" {

// Open the 64-byte cudaIpcMemHandle_t at `handle` (exported by another process) in `device`'s primary context:
// *ptr the mapped address, *base and *size the allocation that contains it (cuMemGetAddressRange: the exporter's
// allocation, so the caller can bound what a client claims), *ordinal the memory's device as this process numbers
// it. Returns 0, or the failing call's CUDA error number with voxserve_last_error() (nothing stays open).
int voxserve_ipc_open(const void* handle, int device, void** ptr, unsigned long long* base, unsigned long long* size,
                      int* ordinal) {
  g_error[0] = '\0';
  g_error_name[0] = '\0';
  *ptr = nullptr;
  static_assert(sizeof(cudaIpcMemHandle_t) == CUDA_IPC_HANDLE_SIZE, "a raw handle is CUDA_IPC_HANDLE_SIZE bytes");
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return ipc_fail("cudaSetDevice", err);
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof h);
  void* opened = nullptr;
  err = cudaIpcOpenMemHandle(&opened, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) return ipc_fail("cudaIpcOpenMemHandle", err);
  auto range = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(driver_entry("cuMemGetAddressRange"));
  auto attribute = reinterpret_cast<PFN_cuPointerGetAttribute_v4000>(driver_entry("cuPointerGetAttribute"));
  int rc = 1;
  if (range != nullptr && attribute != nullptr) {
    CUdeviceptr b = 0;
    size_t n = 0;
    const CUresult got_range = range(&b, &n, reinterpret_cast<CUdeviceptr>(opened));
    int dev = -1;
    const CUresult got_dev = got_range == CUDA_SUCCESS
        ? attribute(&dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, reinterpret_cast<CUdeviceptr>(opened))
        : got_range;
    if (got_range != CUDA_SUCCESS) {
      rc = driver_fail("cuMemGetAddressRange", got_range);
    } else if (got_dev != CUDA_SUCCESS) {
      rc = driver_fail("cuPointerGetAttribute(DEVICE_ORDINAL)", got_dev);
    } else {
      *ptr = opened;
      *base = static_cast<unsigned long long>(b);
      *size = static_cast<unsigned long long>(n);
      *ordinal = dev;
      return 0;
    }
  }
  cudaIpcCloseMemHandle(opened);  // the query failed: the caller gets nothing to close
  cudaGetLastError();
  return rc;
}

// Close a mapping of voxserve_ipc_open (opened in `device`'s context). Returns 0, or the CUDA error number with
// voxserve_last_error().
int voxserve_ipc_close(void* ptr, int device) {
  g_error[0] = '\0';
  g_error_name[0] = '\0';
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return ipc_fail("cudaSetDevice", err);
  err = cudaIpcCloseMemHandle(ptr);
  if (err != cudaSuccess) return ipc_fail("cudaIpcCloseMemHandle", err);
  return 0;
}

// CUDA's name for the error of the last of the two calls above that failed on this thread: the runtime's
// ("cudaErrorInvalidResourceHandle") or, for a driver call, the driver's ("CUDA_ERROR_INVALID_VALUE").
const char* voxserve_ipc_error_name() { return g_error_name; }

}  // extern "C"
