#include "server/backend/cuda/rank_worker.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/job_trace.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

void RankWorker::SetUpDist(Dist& d, const DistributionInput& in, bool zero_copy, Carver& carver,
                           std::vector<std::pair<Dist*, std::array<size_t, 4>>>& offsets) {
  d.in = &in;
  d.index = &d == &ref_ ? 1 : 0;
  d.hidden = in.hidden_mode();
  std::array<size_t, 4> off{};  // staging, raw, x_parts, slots
  const size_t rows = static_cast<size_t>(plan_.tile_rows);
  if (!d.hidden) {
    d.zero_copy = zero_copy;
    d.transform.temperature = in.temperature;
    if (!zero_copy && shard_width_ > 0) {
      d.staging_ld = RoundUp(shard_width_, 8);
      off[0] = carver.Add(rows * static_cast<size_t>(d.staging_ld * k::SizeOf(in.logits.type)));
    }
  } else {
    d.head = static_cast<const CudaHead*>(in.head.get());
    d.hidden_parts = kc::PartsFor(in.hidden.type);
    d.transform = HeadLogitTransform(d.head->weights().transform, in.temperature);
    if (shard_width_ > 0) {
      const size_t h = static_cast<size_t>(in.hidden.cols);
      // Two raw buffers (tile t uploads into t % 2 while tile t - 1's are read); fused: two of
      // the parts too, one per pipelined tile in flight.
      const size_t bufs = plan_.fused ? 2 : 1;
      d.direct = plan_.fused && DeviceOf(in.hidden.data) == rank_.device;
      d.raw_bytes = d.direct ? 0 : rows * h * static_cast<size_t>(k::SizeOf(in.hidden.type));
      d.x_elems = static_cast<size_t>(d.hidden_parts) * rows * static_cast<size_t>(d.head->k_pad);
      off[1] = carver.Add(2 * d.raw_bytes);
      off[2] = carver.Add(bufs * d.x_elems * sizeof(uint16_t));
      // JSD's second pass reads the tile's logits again: keep every chunk rather than recompute.
      // Otherwise JobPlan::hidden_slots: the GEMMs fill one while the statistics read another.
      // Fused: two slots of the whole shard when top-k or JSD read the logits again (tile t in
      // slot t % 2), else none.
      if (plan_.fused) {
        d.n_slots = plan_.fused_logits ? 2 : 0;
      } else {
        d.n_slots = plan_.jsd_pass ? num_chunks_ : plan_.hidden_slots;
      }
      off[3] = carver.Add(static_cast<size_t>(d.n_slots) * rows *
                          static_cast<size_t>(plan_.chunk_cols) * sizeof(float));
    }
  }
  offsets.emplace_back(&d, off);
}

absl::Status RankWorker::Prepare() {
  DeviceGuard guard(rank_.device);
  LOGITSERVE_RETURN_IF_ERROR(guard.status());
  const kc::TileMessage& m = plan_.msg;
  const size_t rows = static_cast<size_t>(plan_.tile_rows);
  const size_t n = static_cast<size_t>(job_.rows);
  Carver carver;
  // Logits mode: message slots and lane-maxima scratches of the pipeline (see the header).
  const int slots = pipelined() ? Rank::kMessageSlots : 1;
  std::array<size_t, Rank::kMessageSlots> send_at{}, topk_scratch_at{};
  for (int i = 0; i < slots; ++i) send_at[static_cast<size_t>(i)] = carver.Add(m.bytes);
  const size_t recv_at = num_ranks_ > 1 ? carver.Add(m.bytes * static_cast<size_t>(num_ranks_)) : 0;
  const size_t partial_bytes = rows * static_cast<size_t>(plan_.max_blocks) * sizeof(float);
  const size_t psend_at = plan_.jsd_pass ? carver.Add(partial_bytes) : 0;
  const size_t precv_at = plan_.jsd_pass && num_ranks_ > 1
                              ? carver.Add(partial_bytes * static_cast<size_t>(num_ranks_))
                              : 0;
  for (int i = 0; i < slots && job_.top_k > 0; ++i) {
    topk_scratch_at[static_cast<size_t>(i)] =
        carver.Add(kc::TopKScratchBytes(plan_.tile_rows, plan_.max_blocks));
  }
  const size_t fa_at = carver.Add(rows * sizeof(k::RowStats));
  const size_t fb_at = carver.Add(rows * sizeof(k::RowStats));
  const size_t ids_count = n * static_cast<size_t>(job_.ids_per_row);
  const size_t ids_at = carver.Add(ids_count * sizeof(int32_t));
  // The bad-row markers, then the requested outputs (rank 0 only), in one block laid out exactly
  // as its pinned staging after the ids: each tile's slices come back as the tile ends
  // (CopyTileOutputs), neighbouring slices in one copy (each is a few us of latency).
  const size_t topk_count = n * static_cast<size_t>(job_.top_k);
  Carver block;
  block.Add(2 * sizeof(int32_t));  // first_bad_ at offset 0
  out_bytes_ = {};
  if (reports_) {
    out_bytes_ = {ids_count * sizeof(float),
                  topk_count * sizeof(int32_t),
                  topk_count * sizeof(float),
                  job_.entropy ? n * sizeof(float) : 0,
                  job_.reference_entropy ? n * sizeof(float) : 0,
                  job_.forward_kl ? n * sizeof(float) : 0,
                  job_.reverse_kl ? n * sizeof(float) : 0,
                  job_.jsd_beta ? n * sizeof(float) : 0};
  }
  for (size_t i = 0; i < out_bytes_.size(); ++i) {
    out_at_[i] = out_bytes_[i] > 0 ? block.Add(out_bytes_[i]) : 0;
  }
  if (reports_) {
    ScoreResult& r = *result_;
    const std::pair<void*, size_t> dst[] = {
        {r.target_logprobs.data(), r.target_logprobs.size() * sizeof(float)},
        {r.top_k_ids.data(), r.top_k_ids.size() * sizeof(int32_t)},
        {r.top_k_logprobs.data(), r.top_k_logprobs.size() * sizeof(float)},
        {r.entropy.data(), r.entropy.size() * sizeof(float)},
        {r.reference_entropy.data(), r.reference_entropy.size() * sizeof(float)},
        {r.forward_kl.data(), r.forward_kl.size() * sizeof(float)},
        {r.reverse_kl.data(), r.reverse_kl.size() * sizeof(float)},
        {r.jsd.data(), r.jsd.size() * sizeof(float)}};
    for (size_t i = 0; i < out_bytes_.size(); ++i) {
      out_dst_[i] = dst[i].first;
      if (out_bytes_[i] > 0 && dst[i].second != out_bytes_[i]) {  // StartResult sized them
        return absl::InternalError(absl::StrCat("output ", i, " has ", dst[i].second,
                                                " bytes, the job computes ", out_bytes_[i]));
      }
    }
  }
  out_block_bytes_ = block.total();
  const size_t block_at = carver.Add(out_block_bytes_);
  std::vector<std::pair<Dist*, std::array<size_t, 4>>> dist_offsets;
  SetUpDist(model_, job_.model, plan_.model_zero_copy[static_cast<size_t>(rank_.index)], carver,
            dist_offsets);
  if (plan_.pair) {
    SetUpDist(ref_, job_.reference, plan_.ref_zero_copy[static_cast<size_t>(rank_.index)], carver,
              dist_offsets);
  }
  LOGITSERVE_RETURN_IF_ERROR(rank_.workspace.Reserve(rank_.device, carver.total()));
  // Pinned tiles for pageable hidden states.
  {
    std::vector<std::pair<Dist*, size_t>> pinned;
    size_t pinned_total = 0;
    auto want = [&](Dist& d, const DistributionInput& in, bool pageable) {
      d.pinned = {};
      if (!pageable || !in.hidden_mode() || shard_width_ == 0) return;
      const size_t bytes =
          static_cast<size_t>(plan_.tile_rows * in.hidden.cols * k::SizeOf(in.hidden.type));
      pinned.emplace_back(&d, bytes);
      pinned_total += 2 * ((bytes + 255) / 256 * 256);
    };
    want(model_, job_.model, plan_.model_pageable_hidden);
    if (plan_.pair) want(ref_, job_.reference, plan_.ref_pageable_hidden);
    LOGITSERVE_RETURN_IF_ERROR(rank_.host_staging.Reserve(pinned_total));
    size_t at = 0;
    for (auto& [d, bytes] : pinned) {
      for (uint8_t*& p : d->pinned) {
        p = rank_.host_staging.data() + at;
        at += (bytes + 255) / 256 * 256;
      }
    }
  }
  uint8_t* base = rank_.workspace.as<uint8_t>();
  for (int i = 0; i < slots; ++i) {
    send_[static_cast<size_t>(i)] = base + send_at[static_cast<size_t>(i)];
    topk_scratch_[static_cast<size_t>(i)] =
        reinterpret_cast<float*>(base + topk_scratch_at[static_cast<size_t>(i)]);
  }
  recv_ = num_ranks_ > 1 ? base + recv_at : nullptr;  // one rank: Gathered() is send_[slot_]
  partial_send_ = reinterpret_cast<float*>(base + psend_at);
  partial_recv_ = num_ranks_ > 1 ? reinterpret_cast<float*>(base + precv_at) : partial_send_;
  folded_a_ = reinterpret_cast<k::RowStats*>(base + fa_at);
  folded_b_ = reinterpret_cast<k::RowStats*>(base + fb_at);
  out_block_ = base + block_at;
  first_bad_ = reinterpret_cast<int32_t*>(out_block_);
  ids_ = reinterpret_cast<int32_t*>(base + ids_at);
  for (auto& [d, off] : dist_offsets) {
    d->staging = base + off[0];
    d->raw = base + off[1];
    d->x_parts = reinterpret_cast<uint16_t*>(base + off[2]);
    d->slots = reinterpret_cast<float*>(base + off[3]);
  }
  if (reports_) {
    outputs_.target_ids = ids_;
    outputs_.ids_per_row = job_.ids_per_row;
    outputs_.ignore_index = job_.ignore_index;
    auto out = [&](size_t i) { return out_block_ + out_at_[i]; };
    if (ids_count > 0) outputs_.target_logprobs = reinterpret_cast<float*>(out(0));
    outputs_.top_k = job_.top_k;
    if (topk_count > 0) {
      outputs_.top_k_ids = reinterpret_cast<int32_t*>(out(1));
      outputs_.top_k_logprobs = reinterpret_cast<float*>(out(2));
    }
    if (job_.entropy) outputs_.entropy = reinterpret_cast<float*>(out(3));
    if (job_.reference_entropy) outputs_.reference_entropy = reinterpret_cast<float*>(out(4));
    if (job_.forward_kl) outputs_.forward_kl = reinterpret_cast<float*>(out(5));
    if (job_.reverse_kl) outputs_.reverse_kl = reinterpret_cast<float*>(out(6));
    if (job_.jsd_beta) outputs_.jsd = reinterpret_cast<float*>(out(7));
    outputs_.jsd_endpoint = plan_.jsd_endpoint;
  }
  // Pinned staging for the small host <-> device copies: a copy from or to pageable memory is
  // staged by the driver and synchronous (~10 us each on the H200 machine); these are
  // asynchronous and the job waits once, at its end. Layout: ids, then the output block.
  io_outputs_at_ = (ids_count * sizeof(int32_t) + 255) / 256 * 256;
  LOGITSERVE_RETURN_IF_ERROR(rank_.host_io.Reserve(io_outputs_at_ + out_block_bytes_));
  setup_ = SetUp::kReady;
  // Hidden mode's first kernels read the target ids (the fused kernel gathers the targets): the
  // set-up copies go first.
  return plan_.any_hidden ? IssueSetUpCopies() : absl::OkStatus();
}

// The job's small set-up copies go on the GEMM stream, where they run while the statistics kernel
// runs; `stream` waits for them (IssueUploads) only after the first statistics launch. On the
// statistics stream they sat between that kernel and the gather: ~4 us of copy latency on the
// critical path.
absl::Status RankWorker::IssueSetUpCopies() {
  setup_ = SetUp::kIssuing;
  const size_t ids_count = static_cast<size_t>(job_.rows) * static_cast<size_t>(job_.ids_per_row);
  if (ids_count > 0) {
    std::memcpy(rank_.host_io.data(), job_.target_ids.data(), ids_count * sizeof(int32_t));
  }
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(first_bad_, 0x7f, 2 * sizeof(int32_t), rank_.gemm_stream.get()));
  if (ids_count > 0) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(ids_, rank_.host_io.data(), ids_count * sizeof(int32_t),
                        cudaMemcpyHostToDevice, rank_.gemm_stream.get()));
  }
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.uploaded.get(), rank_.gemm_stream.get()));
  setup_ = SetUp::kPending;
  return absl::OkStatus();
}

// `stream` waits for the set-up copies: after the first statistics launch (nothing before the
// gather and the fold reads them, so that kernel never waits for them), and at the latest in
// Finish, so that nothing queued outlives the job.
absl::Status RankWorker::IssueUploads() {
  if (setup_ == SetUp::kReady) {
    LOGITSERVE_RETURN_IF_ERROR(IssueSetUpCopies());
  }
  if (setup_ != SetUp::kPending) return absl::OkStatus();
  setup_ = SetUp::kJoined;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream(), rank_.uploaded.get(), 0));
  return absl::OkStatus();
}

absl::Status RankWorker::BeginTile(Dist& d, int64_t row0, int64_t rows,
                                   cudaStream_t logits_stream) {
  if (shard_width_ == 0) return absl::OkStatus();
  if (!d.hidden) {
    if (d.zero_copy) return absl::OkStatus();
    const int64_t es = k::SizeOf(d.in->logits.type);
    const auto* src =
        static_cast<const uint8_t*>(d.in->logits.data) + (row0 * job_.vocab + shard_.begin) * es;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpy2DAsync(
        d.staging, static_cast<size_t>(d.staging_ld * es), src,
        static_cast<size_t>(job_.vocab * es), static_cast<size_t>(shard_width_ * es),
        static_cast<size_t>(rows), cudaMemcpyDefault, logits_stream));
    return absl::OkStatus();
  }
  const MatrixView& h = d.in->hidden;
  const int64_t es = k::SizeOf(h.type);
  const size_t bytes = static_cast<size_t>(rows * h.cols * es);
  const uint8_t* src = static_cast<const uint8_t*>(h.data) + row0 * h.cols * es;
  // Fused: the tile's buffers (t % 2), on the tile's statistics stream (its earlier user, tile
  // t - 2, ran on the same stream). Otherwise the upload into raw buffer t % 2 on upload_stream
  // (behind the split of tile t - 2, its last reader) and the split into the one x_parts on the
  // GEMM stream, behind the previous tile's GEMMs (its only readers). Tile 0's upload has no
  // GEMMs to run beside: it goes on the GEMM stream itself, one cross-stream hop less.
  const int64_t tile = row0 / plan_.tile_rows;
  const size_t parity = static_cast<size_t>(tile % 2);
  const size_t b = plan_.fused ? parity : 0;
  const cudaStream_t on = plan_.fused ? logits_stream : GemmStreamOf(d);
  const cudaStream_t up = plan_.fused || tile == 0 ? on : rank_.upload_stream.get();
  const size_t e = static_cast<size_t>(d.index) * 2 + parity;  // raw_ready / raw_free
  uint16_t* x_parts = d.x_parts + b * d.x_elems;
  const PrestagedTile* pre = tile == 0 ? plan_.prestaged : nullptr;
  const uint8_t* prestaged =
      pre != nullptr ? pre->device[static_cast<size_t>(rank_.index)][static_cast<size_t>(d.index)]
                     : nullptr;
  if (!d.direct && prestaged != nullptr) {  // uploaded before the job took the ranks
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaStreamWaitEvent(on, pre->ready[static_cast<size_t>(rank_.index)], 0));
    src = prestaged;
  } else if (!d.direct) {
    if (d.pinned[0] != nullptr) {
      // Run() has waited for tile t - 2, the last reader of this pinned tile.
      uint8_t* pinned = d.pinned[parity];
      JobTrace::Mark("hidden tile staging");
      // On the rank's copy threads: the first tile's staging is the job's start-up latency (the
      // GPU waits for it), and a later tile's must stay shorter than the GPU's work on the
      // previous one. Every rank stages the same rows, so each takes its share of the threads.
      CopyPool::Copy(rank_.copy_pool.get(), pinned, src, bytes, StagingThreads(num_ranks_),
                     kStagingBytesPerThread);
      JobTrace::Mark("hidden tile staged");
      src = pinned;
    }
    uint8_t* raw = d.raw + parity * d.raw_bytes;
    if (!plan_.fused && tile >= 2) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(up, rank_.raw_free[e].get(), 0));
    }
    JobTrace::Mark("hidden tile upload begin", up);
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(raw, src, bytes, cudaMemcpyDefault, up));
    JobTrace::Mark("hidden tile uploaded", up);
    if (up != on) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.raw_ready[e].get(), up));
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(on, rank_.raw_ready[e].get(), 0));
    }
    src = raw;
  }
  // Rows past `rows` become zeros: the GEMM always multiplies the row tile's rows.
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchSplitToBf16(
      h.type, src, h.cols, rows, h.cols, d.hidden_parts, x_parts, plan_.tile_rows, d.head->k_pad,
      static_cast<size_t>(plan_.tile_rows * d.head->k_pad), on));
  if (!d.direct && !plan_.fused) {  // every tile's: tile t + 2's upload waits for it
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.raw_free[e].get(), on));
  }
  return absl::OkStatus();
}

absl::StatusOr<kc::LogitsSource> RankWorker::Source(Dist& d, int64_t c, int64_t row0, bool compute,
                                                    int64_t slot_index) {
  const int64_t cc0 = c * plan_.chunk_cols;  // shard-local first column of the chunk
  kc::LogitsSource src;
  src.col0 = shard_.begin + cc0;
  src.cols = std::min(plan_.chunk_cols, shard_width_ - cc0);
  src.transform = d.transform;
  if (!d.hidden) {
    src.type = d.in->logits.type;
    const int64_t es = k::SizeOf(src.type);
    if (d.zero_copy) {
      src.data = static_cast<const uint8_t*>(d.in->logits.data) +
                 (row0 * job_.vocab + shard_.begin + cc0) * es;
      src.ld = job_.vocab;
    } else {
      src.data = d.staging + cc0 * es;
      src.ld = d.staging_ld;
    }
    return src;
  }
  // Hidden mode: the slot holds columns [cc0, cc0 + chunk_cols) of the head shard: the cuBLASLt
  // path's GEMM chunks (kCudaVocabChunk weight rows each, zero-padded) side by side, computed here
  // first when `compute` (the slot's chunks past the shard's padded rows are neither computed nor
  // read); or the logits the fused launch of this tile wrote (slot_index: the tile's slot, t % 2).
  float* slot = Slot(d, slot_index);
  const CudaHead& head = *d.head;
  const CudaHead::Shard& hs = head.shards[static_cast<size_t>(rank_.index)];
  if (plan_.fused) {
    if (d.n_slots == 0) return absl::InternalError("the fused job keeps no logits");
  } else {
    if (hs.gemm->shape().ld != plan_.chunk_cols || !hs.gemm->Runs(plan_.tile_rows)) {
      return absl::InternalError("the head's tile GEMM does not match the job's slot width");
    }
    if (compute) {
      const cudaStream_t on = GemmStreamOf(d);
      DeviceBuffer& workspace = OnStreamB(d) ? rank_.cublas_workspace_b : rank_.cublas_workspace;
      const size_t x_stride = static_cast<size_t>(plan_.tile_rows * head.k_pad);
      // A job's last row tile multiplies only the shortest short tile that holds its rows (the
      // same pinned algorithm: a row's bits do not depend on the GEMM's row count). Never more
      // than the job's tile: that one runs (checked above) and holds them.
      const int64_t gemm_rows = hs.gemm->RowsFor(std::min(plan_.tile_rows, job_.rows - row0));
      // One GEMM per kCudaVocabChunk chunk or per slot (the gemm's columns); the shard's padded
      // rows are whole chunks, so a last, narrower GEMM has whole chunks too.
      const int64_t step = hs.gemm->shape().cols;
      const int64_t end = std::min(cc0 + plan_.chunk_cols, hs.padded_rows);
      for (int64_t q = cc0; q < end; q += step) {
        for (int j = 0; j < d.hidden_parts; ++j) {
          for (int i = 0; i < head.parts; ++i) {
            const uint16_t* w = head.Part(rank_.index, i) + q * head.k_pad;
            if (auto s = hs.gemm->Run(rank_.lt.get(), w, d.x_parts + j * x_stride, slot + (q - cc0),
                                      /*accumulate=*/(i | j) != 0, workspace.data(), on, gemm_rows,
                                      std::min(step, end - q));
                !s.ok()) {
              return s;
            }
          }
        }
      }
    }
  }
  src.type = k::FloatType::kFloat32;
  src.data = slot;
  src.ld = plan_.chunk_cols;
  if (const float* bias = ShardBias(d); bias != nullptr) src.transform.bias = bias + cc0;
  return src;
}

absl::Status RankWorker::ComputeTile(int64_t row0, int64_t rows) {
  return pipelined() ? ComputeLogitsTile(row0, rows) : ComputeHiddenTile(row0, rows);
}

absl::Status RankWorker::ComputeLogitsTile(int64_t row0, int64_t rows) {
  const kc::TileMessage& m = plan_.msg;
  const int64_t tile = row0 / plan_.tile_rows;
  slot_ = static_cast<int>(tile % Rank::kMessageSlots);
  const size_t s = static_cast<size_t>(slot_);
  const bool single = single_logits_tile();
  const size_t side = static_cast<size_t>(tile % 2);  // the statistics stream (and its event)
  const cudaStream_t stats = single ? stream() : rank_.stats_streams[side].get();
  auto wait = [](cudaStream_t waiter, const CudaEvent& e) {
    return CudaStatus(cudaStreamWaitEvent(waiter, e.get(), 0), "cudaStreamWaitEvent", __FILE__,
                      __LINE__);
  };
  uint8_t* msg = send_[s];
  auto* lists = reinterpret_cast<k::TopKEntry*>(msg + m.topk_offset);
  auto* counts = reinterpret_cast<int32_t*>(msg + m.count_offset);
  if (num_chunks_ > 0) {
    // Slot s was last read by the tail of tile - 2; the single staging by that of tile - 1.
    if (tile >= Rank::kMessageSlots) {
      LOGITSERVE_RETURN_IF_ERROR(wait(stats, rank_.message_free[s]));
    }
    // (Fused hidden mode double-buffers its inputs: nothing to wait for.)
    const bool staged = !plan_.fused && (!model_.zero_copy || (plan_.pair && !ref_.zero_copy));
    if (staged && tile >= 1) {
      LOGITSERVE_RETURN_IF_ERROR(
          wait(stats, rank_.message_free[static_cast<size_t>((tile - 1) % Rank::kMessageSlots)]));
    }
    if (plan_.fused && tile < 2) {  // the fused kernel reads the target ids
      LOGITSERVE_RETURN_IF_ERROR(wait(stats, rank_.uploaded));
    }
    LOGITSERVE_RETURN_IF_ERROR(BeginTile(model_, row0, rows, stats));
    if (plan_.pair) {
      LOGITSERVE_RETURN_IF_ERROR(BeginTile(ref_, row0, rows, stats));
    }
    // Logits mode reads the widest shard in one chunk (JobPlan::chunk_cols); fused hidden mode
    // the logits its launch keeps for top-k / JSD, in the tile's slot.
    kc::LogitsSource a, b;
    if (!plan_.fused || plan_.fused_logits) {
      LOGITSERVE_ASSIGN_OR_RETURN(a, Source(model_, 0, row0, false, s));
      if (plan_.pair) {
        LOGITSERVE_ASSIGN_OR_RETURN(b, Source(ref_, 0, row0, false, s));
      }
    }
    const kc::LogitsSource* ref = plan_.pair ? &b : nullptr;
    k::PairBlockStats* records = StatsOf(msg, m);
    JobTrace::Mark("stats begin", stats);
    if (plan_.fused) {
      // Statistics and target logits from the fused kernel; top-k's lane maxima from its logits.
      LOGITSERVE_RETURN_IF_ERROR(LaunchFused(row0, rows, msg, stats));
      if (job_.top_k > 0) {
        LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchTopKLaneMax(
            a, nullptr, rows, nullptr, m.max_blocks, 0, job_.top_k, topk_scratch_[s], stats));
      }
    } else if (job_.top_k > 0) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchTopKLaneMax(a, ref, rows, records, m.max_blocks, 0,
                                                            job_.top_k, topk_scratch_[s], stats));
    } else {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          kc::LaunchBlockStats(a, ref, rows, records, m.max_blocks, 0, stats));
    }
    JobTrace::Mark("stats end", stats);
    // The target logits of the tile's rows, read from `a`, into the message (fused: done).
    auto gather = [&](cudaStream_t on) -> absl::Status {
      if (job_.ids_per_row == 0 || plan_.fused) return absl::OkStatus();
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          kc::LaunchGatherTargets(a, rows, ids_ + row0 * job_.ids_per_row, job_.ids_per_row,
                                  reinterpret_cast<float*>(msg + m.target_offset), on));
      return absl::OkStatus();
    };
    if (single && model_.zero_copy) {
      // The gather beside the statistics (it reads the model's logits in place, and the ids),
      // behind the set-up copies that bring the ids; `uploaded` then covers it too.
      LOGITSERVE_RETURN_IF_ERROR(IssueSetUpCopies());
      if (job_.ids_per_row > 0) {
        LOGITSERVE_RETURN_IF_ERROR(gather(gemm_stream()));
        LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.uploaded.get(), gemm_stream()));
      }
      return IssueUploads();
    }
    if (!single) {
      // The tail, on `stream`: behind the previous tile's tail, and this tile's statistics.
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.stats_done[side].get(), stats));
      LOGITSERVE_RETURN_IF_ERROR(wait(stream(), rank_.stats_done[side]));
    }
    LOGITSERVE_RETURN_IF_ERROR(IssueUploads());
    JobTrace::Mark("tail begin", stream());
    LOGITSERVE_RETURN_IF_ERROR(gather(stream()));
    if (job_.top_k > 0) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(rows), stream()));
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          kc::LaunchTopKSelect(a, rows, job_.top_k, lists, counts, topk_scratch_[s], stream()));
      JobTrace::Mark("select end", stream());
    }
  } else if (job_.top_k > 0) {  // a shard without columns: empty lists
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(rows), stream()));
  }
  return absl::OkStatus();
}

absl::Status RankWorker::FoldTile(int64_t row0, int64_t rows) {
  if (auto s = IssueUploads(); !s.ok()) return s;  // a shard without columns launched nothing
  kc::GatheredTile tile;
  tile.messages = Gathered();
  tile.layout = plan_.msg;
  tile.shards = plan_.shards;
  tile.num_blocks = plan_.num_blocks;
  tile.pair = plan_.pair;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      kc::LaunchFoldRows(tile, rows, row0, kc::FoldedRows{folded_a_, folded_b_}, first_bad_,
                         reports_ ? &outputs_ : nullptr, stream()));
  JobTrace::Mark("fold end", stream());
  return absl::OkStatus();
}

absl::Status RankWorker::JsdTile(int64_t row0, int64_t rows) {
  const size_t bytes = static_cast<size_t>(plan_.tile_rows * plan_.max_blocks) * sizeof(float);
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(partial_send_, 0, bytes, stream()));
  for (int64_t c = 0; c < num_chunks_; ++c) {
    // Logits mode reads the staged (or resident) tile again; hidden mode its kept chunks.
    // (Fused hidden mode: the tile's slot.)
    const int64_t slot = plan_.fused ? slot_ : c;
    LOGITSERVE_ASSIGN_OR_RETURN(kc::LogitsSource s,
                                Source(model_, c, row0, /*compute=*/false, slot));
    LOGITSERVE_ASSIGN_OR_RETURN(kc::LogitsSource t, Source(ref_, c, row0, /*compute=*/false, slot));
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchJsdPartials(s, t, rows, folded_a_, folded_b_,
                                                          *job_.jsd_beta, partial_send_,
                                                          plan_.max_blocks, local_block, stream()));
  }
  JobTrace::Mark("jsd partials end", stream());
  // The next tile's GEMMs may overwrite the kept chunks now.
  if (plan_.any_hidden && !plan_.fused) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.slots_released.get(), stream()));
  }
  return absl::OkStatus();
}

absl::Status RankWorker::JsdGatherAndFinish(int64_t row0, int64_t rows) {
  if (!reports_) return absl::OkStatus();
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchJsdFinish(
      partial_recv_, static_cast<size_t>(plan_.tile_rows * plan_.max_blocks), plan_.max_blocks,
      plan_.shards, plan_.num_blocks, folded_a_, folded_b_, rows, row0, outputs_.jsd, stream()));
  JobTrace::Mark("jsd finish end", stream());
  return absl::OkStatus();
}

absl::Status RankWorker::WaitFor(cudaEvent_t event, const char* what) {
  return PollUntil(
      [&]() -> absl::StatusOr<bool> {
        const cudaError_t q = cudaEventQuery(event);
        if (q == cudaSuccess) return true;
        if (q != cudaErrorNotReady) return CudaStatus(q, "cudaEventQuery", __FILE__, __LINE__);
        if (rank_.nccl != nullptr) {
          LOGITSERVE_RETURN_IF_ERROR(rank_.nccl->AsyncError());
        }
        return false;
      },
      timeout_, &fatal_,
      absl::StrCat(what, " on GPU ", rank_.device, " (vocabulary shard ", rank_.index, ")"));
}

absl::Status RankWorker::WaitIdle(const char* what) {
  LOGITSERVE_RETURN_IF_ERROR(JoinSideStreams(rank_, /*with_copies=*/true));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.idle.get(), stream()));
  return WaitFor(rank_.idle.get(), what);
}

absl::Status RankWorker::InjectFault() {
  switch (fault_) {
    case TestFault::kStall:
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchTestStall(
          static_cast<uint64_t>(absl::ToInt64Nanoseconds(3 * timeout_)), stream()));
      break;
    case TestFault::kStickyError:
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchTestIllegalStore(nullptr, stream()));
      break;
    case TestFault::kSkipCollective:  // in Run
    case TestFault::kNone:
      break;
  }
  return absl::OkStatus();
}

absl::Status RankWorker::Run() {
  DeviceGuard guard(rank_.device);
  LOGITSERVE_RETURN_IF_ERROR(guard.status());
  ShardedJobPlan tiles;
  tiles.tile_rows = plan_.tile_rows;
  tiles.jsd_pass = plan_.jsd_pass;
  tiles.rank = rank_.index;
  tiles.test_fail_step = test_fail_step_;
  return RunShardedJob(job_, tiles, failure_, *this);
}

int64_t RankWorker::Depth() const {
  // A pageable logits copy waits for the stream inside the driver anyway: one tile. Hidden mode:
  // two (the pinned hidden tiles are double-buffered; the GPU keeps the next tile queued). Logits
  // mode: as many tiles as hold kLogitsRowsAhead rows (rounded up: 2560-row tiles of an 8192-row
  // job queue all four), so that the host never waits for a tile's tail before it queues the next
  // tile's statistics, while stop checks and the watchdog stay within about one job of the device.
  constexpr int64_t kLogitsRowsAhead = 8192;
  if (plan_.pageable_logits) return 1;
  // Pageable hidden states: tile t reuses the pinned tile of t - 2.
  if (!pipelined() || plan_.model_pageable_hidden || plan_.ref_pageable_hidden) return 2;
  return std::clamp<int64_t>(CeilDiv(kLogitsRowsAhead, plan_.tile_rows), 2, kTileEvents);
}

absl::Status RankWorker::WaitTile(int64_t tile) {
  const int64_t depth = Depth();
  if (tile < depth) return absl::OkStatus();
  const int64_t done = tile - depth;
  LOGITSERVE_RETURN_IF_ERROR(
      WaitFor(rank_.tile_done[static_cast<size_t>(done % kTileEvents)].get(), "row tile"));
  JobTrace::Mark("waited for a tile");
  // Its outputs are in host_io (CopyTileOutputs): into the result now, on this thread, so that
  // Finish has only the last `depth` tiles left. (A job that fails after this discards them.)
  if (reports_ && copied_ == done) {
    for (const HostCopy& c : TileHostCopies(done)) std::memcpy(c.dst, c.src, c.bytes);
    copied_ = done + 1;
  }
  return absl::OkStatus();
}

absl::Status RankWorker::Exchange(TileExchange what) {
  if (num_ranks_ == 1) return absl::OkStatus();
  // Test fault: only the job's first gather (NCCL connections are up; the peers then wait on
  // the GPU for gathers that never come).
  if (fault_ == TestFault::kSkipCollective && gathers_++ > 0) return absl::OkStatus();
  if (what == TileExchange::kStatistics) {
    return rank_.comm->AllGather(send_[static_cast<size_t>(slot_)], recv_, plan_.msg.bytes);
  }
  return rank_.comm->AllGather(
      partial_send_, partial_recv_,
      static_cast<size_t>(plan_.tile_rows * plan_.max_blocks) * sizeof(float));
}

absl::Status RankWorker::EndTile(int64_t tile) {
  // Test faults go after the first tile's work: the next tile's wait (or Finish's) meets them.
  if (tile == 0) {
    LOGITSERVE_RETURN_IF_ERROR(InjectFault());
  }
  const bool last = tile + 1 == num_tiles_;
  if (pipelined() && !last) {  // the statistics of tile + n (staging: tile + 1) wait for it
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaEventRecord(rank_.message_free[static_cast<size_t>(slot_)].get(), stream()));
  }
  if (last) {
    // The last tile's event must cover all of the job's work. Logits mode's statistics streams
    // are joined already (each one's last work is a tile's statistics, which that tile's tail
    // waited for), and so are the set-up copies on gemm_stream (IssueUploads); hidden mode's
    // GEMMs are joined here. The earlier tiles' output copies are joined too: the last tile's
    // copies, on `stream`, must follow them (CopyTileOutputs: a merged copy may span its rows).
    auto join = [&](const CudaStream& side, const CudaEvent& e) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(e.get(), side.get()));
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream(), e.get(), 0));
      return absl::OkStatus();
    };
    if (!pipelined()) {
      LOGITSERVE_RETURN_IF_ERROR(join(rank_.gemm_stream, rank_.gemm_idle));
      if (plan_.two_gemm_streams) {
        LOGITSERVE_RETURN_IF_ERROR(join(rank_.gemm_stream_b, rank_.gemm_idle_b));
      }
    }
    if (reports_ && num_tiles_ > 1) {
      LOGITSERVE_RETURN_IF_ERROR(join(rank_.copy_stream, rank_.side_idle[2]));
    }
  }
  if (reports_) {
    return CopyTileOutputs(tile);
  }
  return CudaStatus(
      cudaEventRecord(rank_.tile_done[static_cast<size_t>(tile % kTileEvents)].get(), stream()),
      "cudaEventRecord", __FILE__, __LINE__);
}

void RankWorker::OnFailure(const absl::Status& status) {
  if (IsFatalDeviceError(status)) fatal_.Fail(status);
}

// ---- The backend -----------------------------------------------------------------------------

}  // namespace logitserve::cuda_internal
