// CudaBackend: the Backend on NVIDIA GPUs. One process drives every device: the vocabulary is
// sharded over the devices in whole blocks (MakeShardLayout; a shard may be empty), each shard is
// a rank with its own host thread, stream, cuBLASLt handle and NCCL communicator, and for each
// fixed-size row tile
//
//   every rank computes per-(row, block) statistics of its shard (logits mode: straight from the
//     request's logits; hidden mode: cuBLASLt GEMM per 8192-id chunk into an L2-sized fp32 tile,
//     then the same statistics kernel reads it back, or, with hidden_fused on a Hopper GPU, one
//     fused GEMM + statistics kernel per row tile), its top-k candidates and its target logits;
//     hidden mode runs the GEMMs on a second stream into two alternating tiles, so the statistics
//     of chunk c (and the tile's all-gather and fold) overlap the GEMMs of the next chunks;
//   the ranks all-gather those small records (NCCL);
//   every rank folds them in global block order (identical bits on every rank); rank 0 writes
//     the outputs;
//   JSD only: a second pass over the tile with the global normalisation; partials all-gathered and
//     summed in global block order;
//   rank 0 copies the tile's slice of every output back to pinned host memory.
//
// Logits mode runs its row tiles as a pipeline (rank_worker.h): the statistics of tile t + 1 (on
// a low-priority stream) read the logits while tile t's latency-bound tail (top-k selection,
// all-gather, fold, JSD pass, output copy) runs beside them, events only between them, so only
// the last tile's tail adds to the job's time (how many tiles: logits_tile_rows below). Hidden
// mode pipelines its GEMMs instead (above).
//
// Nothing of size [N, V] is ever allocated. Results are bitwise independent of the batch, of the
// row's position, of the number of devices and of the input dtype carrying the same values (see
// cuda_kernels.h and cuda_tile_gemm.h for why).
//
// Inputs: MatrixView data may be host memory (copied per tile) or device memory of any device
// (unified addressing). Logits already resident on a rank's own device are read in place, with no
// copy (benchmarks use this). Hidden states in pageable host memory are staged per tile through
// two pinned buffers by the rank's host thread while the GPU works on earlier tiles; pageable
// host logits are copied per tile with one tile in flight (the copy waits for the stream); pinned
// host memory is copied asynchronously.
//
// Stops and failures: before every row tile each rank calls job.stop (ScoreJob::CheckStop); a
// stop, like a failure, is agreed by every rank at the same checkpoint (JobFailure), so all end at
// the same tile and Score returns the stop's own status (CANCELLED, DEADLINE_EXCEEDED). A rank
// keeps at most two tiles queued ahead of its host thread in hidden mode (one with pageable
// inputs) and at most 8192 rows' worth of tiles in logits mode (about one read of a large job),
// so a stop takes effect within that much work. A fatal device error - a sticky CUDA error, any
// NCCL error, or a stream / NCCL call without progress for CudaBackendOptions::collective_timeout
// (the watchdog; every wait on the GPU polls with that deadline instead of blocking) - fails the
// job, aborts every NCCL communicator and takes the backend out of service: Health(), Score and
// PrepareHead return that INTERNAL error from then on.
//
// Thread safety: PrepareHead and Score may be called from any thread. Score calls are serialised
// (a job uses every device and every communicator); the scheduler batches requests instead.
// Health and MemoryUsage may be called from any thread at any time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"

namespace logitserve {

struct CudaBackendOptions {
  // CUDA device ordinals to use, each at most once; empty = every visible device.
  std::vector<int> devices;
  // Vocabulary shards (ranks); 0 = one per device. With more shards than devices, shards share
  // devices round-robin and exchange through device copies instead of NCCL (NCCL allows one rank
  // per GPU): a test configuration for uneven and empty shard layouts on a single GPU.
  int shards = 0;
  // Explicit shard sizes in blocks of kVocabBlock (tests: uneven / empty shards); empty = even.
  std::vector<int64_t> shard_weights;
  // Device memory a rank may use for staging host logits per row tile (logits mode); the tile's
  // row count follows from it and never changes a result.
  size_t logits_staging_bytes = size_t{1} << 30;
  // Logits mode: rows per row tile; 0 = by job (TopKTileRows(k) with top-k, else one tile
  // of up to kMaxLogitsTileRows). The staging and JSD caps below may lower it. The tiles run as a
  // pipeline: the statistics of tile t + 1 read the logits while tile t's latency-bound tail
  // (top-k selection, all-gather, fold, JSD pass, output copy-back) runs on a second stream, so
  // only the last tile's tail is exposed. Tile size never changes a result (rows are
  // independent). Each tile costs ~17 us of host time and a few us of GPU time (H200, measured
  // by logitserve-kernel-bench --logits-tile-rows): it pays off when the tail is long (top-k: the
  // selection and megabytes of output copy-back), not for logprobs / entropy / KL / JSD, whose
  // tails (gather, fold, small copies) are mostly fixed latency.
  int64_t logits_tile_rows = 0;
  // Logits mode with a JSD pass (0 < beta < 1): the row tile holds at most this many bytes of
  // both distributions, so the second pass re-reads it from L2 (H200: 50 MB). 0 = no cap. Tile
  // size never changes a result; smaller tiles cost more launches and, across GPUs, more
  // all-gathers. Off by default: the one H200 run with a 32 MiB cap (together with experimental
  // kernels since reverted) measured JSD at 8.6 ms against 3.6 ms uncapped ([8192 x 75968] bf16);
  // the cap alone has not been measured yet.
  size_t jsd_tile_bytes = 0;
  // Hidden mode: run the tile GEMMs on a second stream so that they overlap the statistics of
  // the previous chunk (double-buffered logits tiles), or both on one stream. Either way the same
  // kernels read the same inputs: the bits do not change.
  bool overlap_hidden_gemms = true;
  // Hidden mode: GEMM chunks (kCudaVocabChunk columns each) whose logits lie side by side in one
  // slot and go through one statistics launch. A 512 x 8192 chunk alone is 2048 warp items, 1.3
  // waves of the fp32 pair kernel: launches that small ran at a third of its streaming rate.
  // Each chunk costs row tile x 8192 x 4 bytes per slot (two slots per distribution; with a JSD
  // pass every slot of the shard). H200, policy + reference at N 8192, V 151936
  // (logitserve-kernel-bench --hidden-configs), cuBLASLt's first-choice tiles: H 4096, row tile
  // 1024 with 2 chunks 31.8 ms (306 MB of workspace), 3: 32.7, 4: 31.8 (575 MB); row tile 512
  // with 4 chunks 33.4, 8: 34.5; row tile 2048 with 1-2 chunks 33.2-33.5. With the preferred
  // 168 x 128 tiles, row tile 2048; two chunks a slot with one slot (hidden_slots) measured best
  // while GEMMs and statistics took turns on the whole GPU (H200, H 2048: 16.70 / 16.75 ms against
  // 17.37 / 17.49; H 4096 32.33 / 32.51 against 32.62 / 33.12; docs/performance-history.md). With
  // SMs left to the statistics (hidden_stats_sms) one chunk in each of two slots is the default
  // (the same 64 MB a distribution): see there. The GEMM shape is fixed per backend, so a row's
  // bits do not depend on the batch.
  int hidden_stats_chunks = 1;
  // Hidden mode with overlap_hidden_gemms, both distributions' hidden states: 2 = the reference
  // distribution's GEMMs on a stream of their own, beside the policy's, so that each chunk's two
  // GEMMs fill each other's last wave (one more 32 MiB cuBLASLt workspace per rank); 1 = both on
  // one stream. H200, N 8192, V 151936 pair, three alternations (logitserve-kernel-bench
  // --hidden-configs 1024:2,1024:2:2s): H 2048 18.65-18.84 ms against 19.20-19.81, H 4096
  // 31.96-32.15 against 32.39-35.29. The same kernels read the same inputs: the bits do not change.
  int hidden_gemm_streams = 2;
  // Hidden mode, cuBLASLt tiles: logits slots per distribution that the GEMMs fill in turn (chunk
  // g in slot g % hidden_slots), in [1, 4]. With two, chunk g + 2's GEMMs wait until the
  // statistics of chunk g are done; a third lets them start beside those statistics; with one,
  // the GEMMs and the statistics take turns. Each slot is row tile x hidden_stats_chunks x 8192 x
  // 4 bytes per distribution. The job trace (LOGITSERVE_CUDA_TRACE) showed the overlap buying
  // little: a slot's statistics end just before the next slot's GEMMs (H200, H 2048, 2048-row
  // slots: one chunk every 217-221 us with two slots, against 180 us of GEMMs + 50 us of
  // statistics taking turns on one stream). With one slot of two chunks the turns are half as
  // many. Three slots: no gain. With hidden_stats_sms the statistics of one slot run beside the
  // GEMMs of the other: two is the default. Never changes a result.
  int hidden_slots = 2;
  // Hidden mode, cuBLASLt tiles: SMs the tile GEMMs leave to the statistics (0: none; -1, the
  // default: by the head's hidden size, 24 for H <= 2048 and 8 above, HiddenStatsSms in
  // cuda_tile_gemm.h, which says what was measured). cuBLASLt then plans each GEMM for the
  // device's SMs minus this (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), and the GEMM streams get a
  // higher priority than the statistics stream, so that with hidden_slots >= 2 a slot's
  // statistics read it on the SMs left free while the next slot's GEMMs run, instead of the two
  // taking turns on the whole GPU. A GPU of at most twice this many SMs keeps them all for the
  // GEMMs. N 8192, V 151936 pair, 2048-row tiles of one chunk, two slots, two GEMM streams
  // (logitserve-kernel-bench --hidden-configs 2048:1:2s:slots2:freeN, alternated with the
  // previous default 2048:2:2s:slots1:free0; docs/PERFORMANCE.md), H 4096: H100 8 SMs
  // 29.75-30.33 ms against 31.03-33.80 (four runs, six; 4 SMs 33.45, 12 31.01-32.50, 16
  // 31.80-32.42); H200 29.02-31.54 against 29.64-32.99 (faster in 8 of 11 pairs). The GEMM
  // algorithm is chosen for this SM count and fixed per head: a row's bits never depend on the
  // batch (they may differ from a backend's with another value, by rounding).
  int hidden_stats_sms = -1;
  // Hidden mode, cuBLASLt tiles, hidden_stats_chunks > 1: one GEMM per slot (hidden_stats_chunks x
  // kCudaVocabChunk columns; a head shard's last slot may hold fewer chunks and runs the same
  // algorithm on fewer columns) rather than one per kCudaVocabChunk chunk: fewer, larger GEMMs,
  // each with one partly idle last wave (H200, 1024-row tiles x 2 chunks, the GEMMs alone with
  // the preferred tile: H 1024 7.70 ms against 8.29, H 2048 / 4096 even). The pinned algorithm is
  // the one for the slot's shape, so the bits may differ from the per-chunk GEMMs' (by rounding),
  // and are again the same for every batch and layout. Where cuBLASLt does not run that algorithm
  // on a slot's fewer columns, per chunk.
  bool hidden_slot_gemms = true;
  // Hidden mode, cuBLASLt tiles: which of cuBLASLt's heuristic results without split-K the tile
  // GEMMs pin: -1 = the first with a preferred tile shape (kPreferredTileShapes, cuda_tile_gemm.h),
  // else its first; N >= 0 = its N-th (benchmarks). Fixed per backend, like the algorithm itself.
  int hidden_gemm_candidate = -1;
  // Hidden mode: rows of the tile GEMMs (the row tile); 0 = kCudaRowTile. Fixed per backend; a job
  // of fewer rows multiplies one of the short tiles of cuda_tile_gemm.h instead, the same pinned
  // algorithm (batch invariance: a row gets the same bits in either).
  int64_t hidden_row_tile = 0;
  // Hidden mode on GPUs of compute capability 9.0 (H100, H200; a build for sm_90): the fused
  // kernel (kernels/cuda/hidden_stats_kernel.cu) computes each row tile's logits on the tensor
  // cores and reduces them to the block statistics in registers, so no logits tile reaches device
  // memory (with top-k or JSD it also writes them for the second read), instead of the cuBLASLt
  // tiles above and the statistics kernel. hidden_fused: for every job whose distributions are
  // all in hidden mode, on every GPU of the backend or on none; the two paths agree to rounding,
  // not bit for bit, and each is batch-, layout- and dtype-invariant on its own. Off by default
  // for large heads: correct (every GPU suite passes on it) but slower there, H100, N 8192,
  // V 151936 pair: H 4096 33.1 ms (2x1 clusters) against 31.6 ms for the tiles, bound by operand
  // delivery from L2; docs/PERFORMANCE.md has the measurements.
  bool hidden_fused = false;
  // ... and without hidden_fused, for every all-hidden job whose heads' hidden sizes are all at
  // most this (0: never). H100, N 8192, V 151936 pair (six-slot ring, no L2 prefetch, session of
  // 2026-12-06 05:23 UTC): H 1024 fused 8.55 ms against 11.99 for the tiles, H 2048 16.00
  // against 17.45, H 4096 33.05 against 31.56. Chosen per job from the heads alone (never from
  // the rows), so a head's rows always take one path: batch invariance holds.
  int64_t hidden_fused_max_hidden = 2048;
  // Fused path: rows per pipelined row tile (a multiple of 128; 0 = kFusedTileRows, fewer when
  // top-k or JSD keep the logits), and CTAs per cluster sharing operand tiles by multicast,
  // "RxB" for R row tiles x B vocabulary blocks: 1x1, 2x1, 1x2 or 2x2, or "auto": per launch, 2x1
  // from kFusedAutoClusterRows (job_plan.h) rows on, else 2x2 (H200, H 1024, V 151936 pair: N
  // 8192 10.71 ms 2x1 against 11.35 2x2, N 1024 1.474 against 1.503, N 128 0.785 against 0.716).
  // Neither changes a result (the kernel's bits do not depend on the cluster shape:
  // hidden_stats_test).
  int64_t hidden_fused_tile_rows = 0;
  std::string hidden_fused_cluster = "auto";
  // Hidden mode, inputs in host memory: the first row tile of a job is copied to pinned memory
  // and up to every rank's device before the job takes the ranks, beside the running job's
  // kernels (server/backend/cuda/prestage.h), when it holds at most this many bytes a
  // distribution; two such tiles at once, each distribution's on every device. 0 = off (the
  // ranks stage every tile once the job holds them). The same bytes: never changes a result.
  size_t prestage_bytes = size_t{32} << 20;
  // Testing only: rank `test_fail_rank` (-1 = none) reports an INTERNAL error at its checkpoint
  // number `test_fail_step` of every job that reaches it (checkpoints are numbered from 0 in the
  // order the ranks meet before each all-gather: one per row tile, two with a JSD pass). Exercises
  // the ranks' agreement to stop together after one of them fails.
  int test_fail_rank = -1;
  int64_t test_fail_step = -1;
  // Watchdog: a rank whose stream (or an NCCL call in progress) makes no progress for this long
  // is a fatal device error, like a sticky CUDA error or an NCCL error: the job fails, the NCCL
  // communicators are aborted (ncclCommAbort), and Health() / every later Score / PrepareHead
  // return that error (INTERNAL) for good. Far above any row tile (milliseconds).
  absl::Duration collective_timeout = absl::Seconds(60);
  // Testing only (the server's --test-fault): a real fault on rank R in the first row tile of every
  // job, to exercise the fatal-error paths. "" = none; anything else is INVALID_ARGUMENT.
  //   "skip-collective:R"  rank R makes only the first all-gather of each job and skips the others;
  //                        its peers' next gather never completes on the GPU -> watchdog timeout
  //                        -> ncclCommAbort. Needs one shard per GPU (NCCL; >= 2 GPUs).
  //   "stall:R"            rank R's stream busy-waits 3 x collective_timeout -> watchdog timeout.
  //   "sticky-error:R"     rank R runs a kernel that stores through a null pointer: a real
  //                        cudaErrorIllegalAddress, sticky (that device's context is lost for the
  //                        rest of the process).
  std::string test_fault;
};

// OK when every device in `devices` (empty = all visible) can run this build's kernels.
// FAILED_PRECONDITION naming the device, its compute capability and the architectures this
// binary was built for (CMAKE_CUDA_ARCHITECTURES) otherwise, or when no device is visible or the
// driver is too old. For `--backend auto|cuda` at start-up: never a kernel launch failure later.
absl::Status CheckCudaDevices(const std::vector<int>& devices = {});

// The CUDA architectures this binary holds code for, e.g. "90".
const char* CudaArchitecturesBuilt();

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options);

}  // namespace logitserve
