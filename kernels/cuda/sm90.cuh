// Hopper (sm_90a) building blocks of the hidden-mode GEMM + statistics kernel, as thin wrappers
// over single PTX instructions (private to kernels/cuda): mbarriers, the bulk tensor copy engine
// (TMA) with and without cluster multicast, cluster barriers, warpgroup register reallocation and
// the warpgroup matrix multiply (wgmma). Every function is one instruction or a fixed short
// sequence; the kernel (hidden_stats_kernel.cu) says why each is used where it is.
//
// wgmma, setmaxnreg and multicast need the arch-specific target (sm_90a): their callers guard
// their bodies with LOGITSERVE_SM90A. The mbarriers and the plain bulk copy (BulkLoad) are sm_90
// instructions; the streamed (row, block) kernel of block_items.cuh uses them on any sm_90 build.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LOGITSERVE_SM90A 1
#else
#define LOGITSERVE_SM90A 0
#endif

namespace logitserve::kernels::cuda::sm90 {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers (shared::cta objects; remote arrivals through their shared::cluster address) ----

__device__ __forceinline__ void BarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
}

// Makes the initialised barriers visible to the cluster (and to the async proxy) before use.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives once and expects `bytes` more bytes of bulk copies in the current phase.
__device__ __forceinline__ void ArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "{\n\t.reg .b64 state;\n\t"
      "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 state, [%0], %1;\n\t}" ::"r"(
          SmemAddr(bar)),
      "r"(bytes)
      : "memory");
}

// Arrives once (this CTA's barrier).
__device__ __forceinline__ void Arrive(uint64_t* bar) {
  asm volatile(
      "{\n\t.reg .b64 state;\n\t"
      "mbarrier.arrive.release.cta.shared::cta.b64 state, [%0];\n\t}" ::"r"(SmemAddr(bar))
      : "memory");
}

// Arrives once on the barrier at the same offset in cluster CTA `cta` (itself included). Default
// (CTA-scope release) semantics, as CUTLASS's cluster barriers: the arrive only says that this
// CTA's reads of a stage are complete (wgmma.wait_group returned), which orders nothing else; a
// cluster-scope release would add a fence to every release of every stage.
__device__ __forceinline__ void ArriveCluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n\t.reg .b32 remote;\n\t"
      "mapa.shared::cluster.u32 remote, %0, %1;\n\t"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n\t}" ::"r"(SmemAddr(bar)),
      "r"(cta)
      : "memory");
}

// Waits until the phase of parity `parity` has completed (default acquire semantics: the copy
// engine's complete_tx makes the bytes of a phase visible to its waiters, multicast ones too).
__device__ __forceinline__ void Wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_%=;\n\t}" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

// ---- cluster ----------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t ClusterId() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t NumClusters() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster (a CTA on its own: its threads).
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

// ---- bulk copies (TMA) --------------------------------------------------------------------------

// `bytes` (a multiple of 16; both addresses 16-byte aligned) of contiguous global memory into this
// CTA's shared memory at dst, with an L2 eviction `policy` (EvictFirstPolicy); complete_tx on
// `bar`. No tensor map: one instruction, one thread.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar)), "l"(policy)
      : "memory");
}

// Orders this thread's generic-proxy accesses to shared memory (and those a barrier ordered before
// them) before its later async-proxy operations, e.g. a bulk copy into a stage just read.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// An L2 policy that evicts the lines it brings first (data read once).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Box (c0, c1, c2) of a 3-D tensor map into shared memory at dst; complete_tx on `bar`.
__device__ __forceinline__ void Load3d(const void* map, uint64_t* bar, void* dst, int32_t c0,
                                       int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// The same box to the same shared-memory offset of every CTA in `mask` (cluster ranks), each
// signalling its own barrier at bar's offset.
__device__ __forceinline__ void Load3dMulticast(const void* map, uint64_t* bar, void* dst,
                                                int32_t c0, int32_t c1, int32_t c2, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(mask)
      : "memory");
}

__device__ __forceinline__ void PrefetchTensorMap(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// ---- warpgroups ---------------------------------------------------------------------------------

template <uint32_t kRegs>
__device__ __forceinline__ void RegAlloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void RegDealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format") of a K-major bf16 tile
// stored as rows of 128 bytes (64 values) with the 128-byte swizzle, as the copy engine writes it
// with CU_TENSOR_MAP_SWIZZLE_128B: start address >> 4 in bits 0-13, leading-dimension byte offset
// (unused for swizzled K-major layouts; 1 by convention) in 16-29, stride byte offset between
// 8-row groups (8 x 128 = 1024 bytes) >> 4 in 32-45, swizzle mode 1 (128 B) in bits 62-63. The
// tile must start 1024-byte aligned (base offset 0). The k-th 16-value slice of the 64-value rows
// starts 32 k bytes further: the hardware applies the swizzle to the addresses it computes.
// Split into the constant high word and the start address word, so that a loop adds byte
// offsets / 16 to the low word only (shared-memory addresses stay below 2^18: no carry).
inline constexpr uint32_t kDesc128Hi =
    (1024u >> 4) | (1u << 30);  // stride offset; 128-byte swizzle
__device__ __forceinline__ uint32_t SmemDescLo(uint32_t smem_addr) {
  return ((smem_addr & 0x3FFFFu) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t SmemDesc(uint32_t lo) {
  return (static_cast<uint64_t>(kDesc128Hi) << 32) | lo;
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses of the accumulators across the asynchronous wgmma
// (CUTLASS's warpgroup_fence_operand): an empty asm that reads and writes each register.
template <int N>
__device__ __forceinline__ void FenceOperands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 128] (+)= A[64 x 16] . B[128 x 16]^T, bf16 inputs from shared memory (both K-major),
// fp32 accumulators in the m64nNk16 fragment layout: register 4 j + q of thread t holds row
// 16 (t / 32) + (t % 32) / 4 + 8 (q / 2), column 8 j + 2 (t % 4) + (q % 2).
// accumulate = 0 overwrites D.
__device__ __forceinline__ void WgmmaM64N128K16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                uint32_t accumulate) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "setp.ne.b32 p, %66, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n\t}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

}  // namespace logitserve::kernels::cuda::sm90
