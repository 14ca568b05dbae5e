// Tensor-pipe rate probe (sm_90a): how fast the instruction shapes the fused kernel could use run on
// this GPU, and a layout check of the wgmma operands the kernel relies on.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe bench/tensor_rate_probe.cu
//   /tmp/probe
//
// Prints, per instruction form, the achieved dense TF32 rate with the whole GPU issuing it back to back
// (independent accumulator chains per warp / warpgroup, operands fixed, nothing else in the loop).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));       \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// sm_90 matrix descriptor, no swizzle: start address, leading and stride byte offsets (all >> 4).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// D(64x16) += A(64x8, registers) * B(8x16, shared memory), TF32 in, FP32 accumulate.
__device__ __forceinline__ void wgmma_n16_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Same shape, A from shared memory too.
__device__ __forceinline__ void wgmma_n16_ss(float (&d)[8], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b));
}

__device__ __forceinline__ void wgmma_n32_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

__device__ __forceinline__ void mma_k4(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ void mma_k8(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

constexpr int kSteps = 11;  // k-steps of 8 per 81-tap product (the fused kernel's K, padded)
constexpr uint32_t kLbo = 128, kSbo = 256;

// FORM: 0 = wgmma n16 RS, 1 = wgmma n16 SS, 2 = wgmma n32 RS.
template <int FORM, int CH>
__global__ void rate_wgmma(float* out, int iters) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* s = reinterpret_cast<float*>(smem);
  for (int i = threadIdx.x; i < 9216; i += blockDim.x) s[i] = 0.0009765625f * (i % 7);
  __syncthreads();
  const uint32_t base = smem_addr(smem);
  uint32_t a[4];
  for (int i = 0; i < 4; ++i) a[i] = __float_as_uint(0.001f * (threadIdx.x % 9 + i));
  constexpr int NACC = FORM == 2 ? 16 : 8;
  float d[CH][NACC];
  for (int c = 0; c < CH; ++c)
    for (int i = 0; i < NACC; ++i) d[c][i] = 0.f;
  wg_fence();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      const uint64_t bd = make_desc(base + st * 1024, kLbo, kSbo);
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        if constexpr (FORM == 0) wgmma_n16_rs(*reinterpret_cast<float(*)[8]>(d[c]), a, bd);
        if constexpr (FORM == 1)
          wgmma_n16_ss(*reinterpret_cast<float(*)[8]>(d[c]), make_desc(base + 12288 + st * 2048, kLbo, kSbo), bd);
        if constexpr (FORM == 2) wgmma_n32_rs(*reinterpret_cast<float(*)[16]>(d[c]), a, bd);
      }
    }
    wg_commit();
    wg_wait<1>();
  }
  wg_wait<0>();
  float acc = 0.f;
  for (int c = 0; c < CH; ++c)
    for (int i = 0; i < NACC; ++i) acc += d[c][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// FORM: 0 = m16n8k4, 1 = m16n8k8; CH independent accumulators per warp.
template <int FORM, int CH>
__global__ void rate_mma(float* out, int iters) {
  uint32_t a[4];
  for (int i = 0; i < 4; ++i) a[i] = __float_as_uint(0.001f * (threadIdx.x % 9 + i));
  const uint32_t b0 = __float_as_uint(0.5f), b1 = __float_as_uint(0.25f);
  float c[CH][4];
  for (int k = 0; k < CH; ++k)
    for (int i = 0; i < 4; ++i) c[k][i] = 0.f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int st = 0; st < kSteps; ++st)
#pragma unroll
      for (int k = 0; k < CH; ++k) {
        if constexpr (FORM == 0) mma_k4(c[k], a[st & 3], a[(st + 1) & 3], b0);
        if constexpr (FORM == 1) mma_k8(c[k], a, b0, b1);
      }
  }
  float acc = 0.f;
  for (int k = 0; k < CH; ++k)
    for (int i = 0; i < 4; ++i) acc += c[k][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// Layout check: one warpgroup computes D = A * B with A (64x8) from registers, B (8x16) from shared
// memory in the no-swizzle K-major layout: element (k, n) at (n/8)*SBO + (k/4)*LBO + (n%8)*16 + (k%4)*4.
__global__ void check_n16_rs(const float* A, const float* B, float* D, uint32_t lbo, uint32_t sbo) {
  __shared__ __align__(128) float sb[2048];
  const int tid = threadIdx.x;
  for (int i = tid; i < 2048; i += blockDim.x) sb[i] = 0.f;
  __syncthreads();
  if (tid < 128) {
    for (int k = 0; k < 8; ++k) {
      const int n = tid % 16;
      if (tid < 16) sb[((n / 8) * kSbo + (k / 4) * kLbo + (n % 8) * 16 + (k % 4) * 4) / 4] = B[k * 16 + n];
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int w = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int r0 = 16 * w + g;
  uint32_t a[4] = {__float_as_uint(A[r0 * 8 + t]), __float_as_uint(A[(r0 + 8) * 8 + t]),
                   __float_as_uint(A[r0 * 8 + t + 4]), __float_as_uint(A[(r0 + 8) * 8 + t + 4])};
  float d[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  wg_fence();
  wgmma_n16_rs(d, a, make_desc(smem_addr(sb), lbo, sbo));
  wg_commit();
  wg_wait<0>();
  for (int i = 0; i < 8; ++i) {
    const int row = r0 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * t + (i % 2);
    D[row * 16 + col] = d[i];
  }
}

template <typename K>
double time_kernel(K kernel, int grid, int block, int smem, int iters, float* out) {
  if (smem > 48 * 1024) CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, block, smem>>>(out, 2);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int rep = 0; rep < 3; ++rep) {
    cudaEventRecord(e0);
    kernel<<<grid, block, smem>>>(out, iters);
    cudaEventRecord(e1);
    CHECK(cudaEventSynchronize(e1));
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (ms < best) best = ms;
  }
  return best * 1e-3;
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs\n", prop.name, sms);

  // Layout check, both readings of the two byte offsets.
  {
    std::vector<float> A(64 * 8), B(8 * 16), D(64 * 16), ref(64 * 16, 0.f);
    for (int i = 0; i < 64 * 8; ++i) A[i] = static_cast<float>((i * 7) % 13 - 6);
    for (int i = 0; i < 8 * 16; ++i) B[i] = static_cast<float>((i * 5) % 11 - 5);
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 16; ++n)
        for (int k = 0; k < 8; ++k) ref[m * 16 + n] += A[m * 8 + k] * B[k * 16 + n];
    float *dA, *dB, *dD;
    CHECK(cudaMalloc(&dA, A.size() * 4));
    CHECK(cudaMalloc(&dB, B.size() * 4));
    CHECK(cudaMalloc(&dD, D.size() * 4));
    CHECK(cudaMemcpy(dA, A.data(), A.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice));
    const uint32_t forms[2][2] = {{kLbo, kSbo}, {kSbo, kLbo}};
    for (auto& f : forms) {
      CHECK(cudaMemset(dD, 0, D.size() * 4));
      check_n16_rs<<<1, 128>>>(dA, dB, dD, f[0], f[1]);
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost));
      int bad = 0;
      for (int i = 0; i < 64 * 16; ++i) bad += D[i] != ref[i];
      std::printf("layout check n16 RS, desc lbo=%u sbo=%u (data: k-blocks %u B apart, n-blocks %u B apart): "
                  "%d of 1024 wrong\n", f[0], f[1], kLbo, kSbo, bad);
    }
  }

  float* out;
  CHECK(cudaMalloc(&out, 64 << 20));
  std::printf("\n| form | warps/SM | chains | TFLOPS (dense TF32) |\n| --- | --- | --- | --- |\n");
  auto report = [&](const char* name, int warps_per_sm, int chains, double macs, double secs) {
    std::printf("| %s | %d | %d | %.0f |\n", name, warps_per_sm, chains, 2.0 * macs / secs * 1e-12);
  };
  const int iters = 2000;
  for (int wg = 1; wg <= 4; wg *= 2) {
    const int grid = sms * wg, block = 128;  // one warpgroup per block, wg blocks per SM
    const double per_wgmma16 = 64.0 * 16 * 8, per_wgmma32 = 64.0 * 32 * 8;
    double s;
    s = time_kernel(rate_wgmma<0, 1>, grid, block, 36 * 1024, iters, out);
    report("wgmma m64n16k8 RS", 4 * wg, 1, per_wgmma16 * grid * iters * kSteps, s);
    s = time_kernel(rate_wgmma<0, 2>, grid, block, 36 * 1024, iters, out);
    report("wgmma m64n16k8 RS", 4 * wg, 2, per_wgmma16 * grid * iters * kSteps * 2, s);
    s = time_kernel(rate_wgmma<0, 4>, grid, block, 36 * 1024, iters, out);
    report("wgmma m64n16k8 RS", 4 * wg, 4, per_wgmma16 * grid * iters * kSteps * 4, s);
    s = time_kernel(rate_wgmma<1, 2>, grid, block, 36 * 1024, iters, out);
    report("wgmma m64n16k8 SS", 4 * wg, 2, per_wgmma16 * grid * iters * kSteps * 2, s);
    s = time_kernel(rate_wgmma<2, 2>, grid, block, 36 * 1024, iters, out);
    report("wgmma m64n32k8 RS", 4 * wg, 2, per_wgmma32 * grid * iters * kSteps * 2, s);
  }
  for (int warps = 4; warps <= 16; warps *= 2) {
    const int grid = sms * (warps / 4), block = 128;
    double s;
    s = time_kernel(rate_mma<0, 4>, grid, block, 0, iters, out);
    report("mma.sync m16n8k4", warps, 4, 16.0 * 8 * 4 * grid * 4 * iters * kSteps * 4, s);
    s = time_kernel(rate_mma<1, 4>, grid, block, 0, iters, out);
    report("mma.sync m16n8k8", warps, 4, 16.0 * 8 * 8 * grid * 4 * iters * kSteps * 4, s);
  }
  return 0;
}
