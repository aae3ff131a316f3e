// RankWorker's hidden-mode tile computations (see rank_worker.h): the fused kernel's launch
// (JobPlan::fused, one LaunchHiddenStats per pipelined row tile) and the cuBLASLt-tile path
// (ComputeHiddenTile: GEMMs per vocabulary chunk into double-buffered slots on gemm_stream, the
// reference's on gemm_stream_b beside them, the statistics kernel reading them back on `stream`).
// A third file of rank_worker.cc's class.
#include <cstring>

#include "common/base/status_macros.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/job_trace.h"
#include "server/backend/cuda/rank_worker.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

absl::Status RankWorker::LaunchFused(int64_t row0, int64_t rows, uint8_t* msg, cudaStream_t on) {
  const kc::TileMessage& m = plan_.msg;
  const size_t b = static_cast<size_t>(slot_);  // the tile's buffers and logits slot, t % 2
  auto operand = [&](const Dist& d) {
    const CudaHead& head = *d.head;
    const CudaHead::Shard& hs = head.shards[static_cast<size_t>(rank_.index)];
    kc::HiddenOperand o;
    o.x = d.x_parts + b * d.x_elems;
    o.x_parts = d.hidden_parts;
    o.x_rows = plan_.tile_rows;
    o.w = head.Part(rank_.index, 0);
    o.w_parts = head.parts;
    o.w_rows = hs.padded_rows;
    o.k_pad = head.k_pad;
    o.transform = d.transform;
    o.transform.bias = ShardBias(d);
    return o;
  };
  const kc::HiddenOperand a = operand(model_);
  kc::HiddenOperand r;
  if (plan_.pair) r = operand(ref_);
  kc::HiddenStatsArgs args;
  args.rows = rows;
  args.w_row0 = 0;
  args.col0 = shard_.begin;
  args.cols = shard_width_;
  args.stats = StatsOf(msg, m);
  args.stats_ld = m.max_blocks;
  args.stats_offset = 0;
  if (job_.ids_per_row > 0) {
    args.ids = ids_ + row0 * job_.ids_per_row;
    args.ids_per_row = job_.ids_per_row;
    args.targets = reinterpret_cast<float*>(msg + m.target_offset);
  }
  if (plan_.fused_logits) {
    args.logits_a = Slot(model_, slot_);
    if (plan_.pair) args.logits_b = Slot(ref_, slot_);
    args.logits_ld = plan_.chunk_cols;
  }
  args.cluster = plan_.fused_cluster.value_or(FusedAutoCluster(rows));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchHiddenStats(a, plan_.pair ? &r : nullptr, args, on));
  return absl::OkStatus();
}

absl::Status RankWorker::ComputeHiddenTile(int64_t row0, int64_t rows) {
  const kc::TileMessage& m = plan_.msg;
  // Two streams in hidden mode (see Rank). Chunk g of the job (over all tiles) goes to slot g % n
  // (n = JobPlan::hidden_slots): its GEMMs wait until the statistics of chunk g - n are done with
  // that slot, and its statistics
  // wait until its GEMMs are done. With a JSD pass every chunk of the tile keeps its own slot until
  // the pass, so the tile's GEMMs wait for the previous tile's pass instead. Both streams' order
  // and every kernel's inputs are those of one stream: the bits do not change.
  const bool split = plan_.any_hidden && plan_.overlap_gemms;
  auto wait = [](cudaStream_t waiter, const CudaEvent& e) {
    return CudaStatus(cudaStreamWaitEvent(waiter, e.get(), 0), "cudaStreamWaitEvent", __FILE__,
                      __LINE__);
  };
  auto record = [](const CudaEvent& e, cudaStream_t on) {
    return CudaStatus(cudaEventRecord(e.get(), on), "cudaEventRecord", __FILE__, __LINE__);
  };
  // With two GEMM streams (plan_.two_gemm_streams) the reference's GEMMs and inputs run on
  // gemm_stream_b, which waits and signals exactly as gemm_stream does.
  const bool two = plan_.two_gemm_streams;
  const cudaStream_t stream_b = rank_.gemm_stream_b.get();
  if (split && plan_.jsd_pass && row0 > 0) {
    LOGITSERVE_RETURN_IF_ERROR(wait(gemm_stream(), rank_.slots_released));
    if (two) LOGITSERVE_RETURN_IF_ERROR(wait(stream_b, rank_.slots_released));
  }
  LOGITSERVE_RETURN_IF_ERROR(BeginTile(model_, row0, rows, stream()));
  if (plan_.pair) {
    LOGITSERVE_RETURN_IF_ERROR(BeginTile(ref_, row0, rows, stream()));
  }
  uint8_t* msg = send_[0];
  k::PairBlockStats* stats = StatsOf(msg, m);
  auto* lists = reinterpret_cast<k::TopKEntry*>(msg + m.topk_offset);
  auto* counts = reinterpret_cast<int32_t*>(msg + m.count_offset);
  auto* targets = reinterpret_cast<float*>(msg + m.target_offset);
  bool cleared = false;  // the uploads are issued and the top-k counts cleared (below)
  for (int64_t c = 0; c < num_chunks_; ++c) {
    const int64_t g = chunk_seq_++;
    const int64_t n = plan_.hidden_slots;
    const size_t e = static_cast<size_t>(g % n);
    const int64_t slot = plan_.jsd_pass ? c : g % n;
    if (split && !plan_.jsd_pass && g >= n) {
      LOGITSERVE_RETURN_IF_ERROR(wait(gemm_stream(), rank_.slot_free[e]));
      if (two) LOGITSERVE_RETURN_IF_ERROR(wait(stream_b, rank_.slot_free[e]));
    }
    LOGITSERVE_ASSIGN_OR_RETURN(kc::LogitsSource a,
                                Source(model_, c, row0, /*compute=*/true, slot));
    kc::LogitsSource b;
    if (plan_.pair) {
      LOGITSERVE_ASSIGN_OR_RETURN(b, Source(ref_, c, row0, /*compute=*/true, slot));
    }
    JobTrace::Mark("chunk GEMMs a end", gemm_stream());
    if (two) JobTrace::Mark("chunk GEMMs b end", stream_b);
    if (split) {
      LOGITSERVE_RETURN_IF_ERROR(record(rank_.slot_filled[e], gemm_stream()));
      LOGITSERVE_RETURN_IF_ERROR(wait(stream(), rank_.slot_filled[e]));
      if (two) {
        LOGITSERVE_RETURN_IF_ERROR(record(rank_.slot_filled_b[e], stream_b));
        LOGITSERVE_RETURN_IF_ERROR(wait(stream(), rank_.slot_filled_b[e]));
      }
    }
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    const kc::LogitsSource* ref = plan_.pair ? &b : nullptr;
    if (c == 0) {  // the statistics read the target ids (and the top-k counts start at zero)
      cleared = true;
      LOGITSERVE_RETURN_IF_ERROR(IssueUploads());
    }
    if (job_.top_k > 0) {
      // Only the top-k counts need a defined start: every statistics record and every target
      // logit the fold reads is written by this tile's kernels (a target id is read from the
      // rank whose columns hold it).
      if (c == 0) {
        LOGITSERVE_RETURN_IF_CUDA_ERROR(
            cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(rows), stream()));
      }
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchBlockStatsTopK(a, ref, rows, stats, m.max_blocks,
                                                               local_block, job_.top_k, lists,
                                                               counts, topk_scratch_[0], stream()));
    } else {
      // The statistics kernel also writes the target logits (no gather launch a chunk).
      kc::TargetsOut out;
      if (job_.ids_per_row > 0) {
        out = kc::TargetsOut{ids_ + row0 * job_.ids_per_row, job_.ids_per_row, targets};
      }
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          kc::LaunchBlockStats(a, ref, rows, stats, m.max_blocks, local_block, stream(), out));
    }
    if (job_.ids_per_row > 0 && job_.top_k > 0) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchGatherTargets(
          a, rows, ids_ + row0 * job_.ids_per_row, job_.ids_per_row, targets, stream()));
    }
    JobTrace::Mark("chunk stats end", stream());
    if (split && !plan_.jsd_pass) {
      LOGITSERVE_RETURN_IF_ERROR(record(rank_.slot_free[e], stream()));
    }
  }
  if (!cleared && job_.top_k > 0) {  // a shard without columns: empty lists
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(rows), stream()));
  }
  return absl::OkStatus();
}

}  // namespace logitserve::cuda_internal
