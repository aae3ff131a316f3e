#include "server/backend/cuda/rank_worker.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "server/backend/cuda/cuda_status.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

namespace {

// A copy of `bytes` bytes from src to dst.
struct HostCopy {
  void* dst;
  const void* src;
  size_t bytes;
};

// The host side of the output copy-back, split over threads when large: one core copies ~10 GB/s,
// so the 4 MB of a top-k = 64 output for 8192 rows took as long on one as the top-k kernels
// (64 MB for k = 1024: ten times longer). Thread i copies bytes [i * share, (i + 1) * share) of
// the concatenated copies, whose sources lie in increasing order in one staging block; PieceEnd(i)
// is where the staging range that share reads ends, so the device-to-host copy of the block can go
// in those pieces and thread i start as soon as piece i has arrived.
class SplitCopy {
 public:
  explicit SplitCopy(std::vector<HostCopy> copies) : copies_(std::move(copies)) {
    constexpr size_t kPerThread = size_t{1} << 20;
    size_t total = 0;
    for (const HostCopy& c : copies_) total += c.bytes;
    const size_t most = std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 1, kMaxThreads);
    n_ = std::clamp<size_t>((total + kPerThread - 1) / kPerThread, 1, most);
    share_ = (total + n_ - 1) / n_;
  }
  static constexpr size_t kMaxThreads = kOutputPieces;
  size_t threads() const { return n_; }

  // Where the sources that share i reads end, as an offset from `base` (the staging block they
  // all lie in); 0 for an empty share.
  size_t PieceEnd(size_t i, const uint8_t* base) const {
    size_t end = 0;
    ForShare(i, [&](const HostCopy& c, size_t off, size_t bytes) {
      end = static_cast<size_t>(static_cast<const uint8_t*>(c.src) + off + bytes - base);
    });
    return end;
  }
  void Run(size_t i) const {
    ForShare(i, [](const HostCopy& c, size_t off, size_t bytes) {
      std::memcpy(static_cast<uint8_t*>(c.dst) + off, static_cast<const uint8_t*>(c.src) + off,
                  bytes);
    });
  }

 private:
  template <typename F>
  void ForShare(size_t i, F&& f) const {
    const size_t begin = i * share_, end = begin + share_;
    size_t at = 0;
    for (const HostCopy& c : copies_) {
      const size_t lo = std::max(begin, at), hi = std::min(end, at + c.bytes);
      if (lo < hi) f(c, lo - at, hi - lo);
      at += c.bytes;
    }
  }

  std::vector<HostCopy> copies_;
  size_t n_ = 1;
  size_t share_ = 0;
};

}  // namespace

void RankWorker::SetUpDist(Dist& d, const DistributionInput& in, bool zero_copy, Carver& carver,
                           std::vector<std::pair<Dist*, std::array<size_t, 4>>>& offsets) {
  d.in = &in;
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
      off[1] = carver.Add(rows * h * static_cast<size_t>(k::SizeOf(in.hidden.type)));
      off[2] = carver.Add(static_cast<size_t>(d.hidden_parts) * rows *
                          static_cast<size_t>(d.head->k_pad) * sizeof(uint16_t));
      // JSD's second pass reads the tile's logits again: keep every chunk rather than recompute.
      // Otherwise two slots: the GEMMs fill one while the statistics read the other.
      d.n_slots = plan_.jsd_pass ? num_chunks_ : 2;
      off[3] = carver.Add(static_cast<size_t>(d.n_slots) * rows *
                          static_cast<size_t>(kCudaVocabChunk) * sizeof(float));
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
  const size_t send_at = carver.Add(m.bytes);
  const size_t recv_at = num_ranks_ > 1 ? carver.Add(m.bytes * static_cast<size_t>(num_ranks_)) : 0;
  const size_t partial_bytes = rows * static_cast<size_t>(plan_.max_blocks) * sizeof(float);
  const size_t psend_at = plan_.jsd_pass ? carver.Add(partial_bytes) : 0;
  const size_t precv_at = plan_.jsd_pass && num_ranks_ > 1
                              ? carver.Add(partial_bytes * static_cast<size_t>(num_ranks_))
                              : 0;
  const size_t topk_scratch_at =
      job_.top_k > 0 ? carver.Add(kc::TopKScratchBytes(plan_.tile_rows, plan_.max_blocks)) : 0;
  const size_t fa_at = carver.Add(rows * sizeof(k::RowStats));
  const size_t fb_at = carver.Add(rows * sizeof(k::RowStats));
  const size_t ids_count = n * static_cast<size_t>(job_.ids_per_row);
  const size_t ids_at = carver.Add(ids_count * sizeof(int32_t));
  // The bad-row markers, then the requested outputs (rank 0 only), in one block laid out exactly
  // as its pinned staging after the ids: Finish brings it back in one copy per host thread, not
  // one per output (each copy is a few us of latency at the end of the job).
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
  send_ = base + send_at;
  recv_ = num_ranks_ > 1 ? base + recv_at : send_;
  partial_send_ = reinterpret_cast<float*>(base + psend_at);
  partial_recv_ = num_ranks_ > 1 ? reinterpret_cast<float*>(base + precv_at) : partial_send_;
  topk_scratch_ = reinterpret_cast<float*>(base + topk_scratch_at);
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
  if (ids_count > 0) {
    std::memcpy(rank_.host_io.data(), job_.target_ids.data(), ids_count * sizeof(int32_t));
  }
  // The job's small set-up copies (target ids up, the bad-row sentinel) go on the GEMM stream
  // now, where they run while the statistics kernel is launched and runs; the statistics stream
  // waits for them (IssueUploads) only after its first statistics launch. On the statistics
  // stream they sat between that kernel and the gather: ~4 us of copy latency on the critical
  // path.
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(first_bad_, 0x7f, 2 * sizeof(int32_t), rank_.gemm_stream.get()));
  if (ids_count > 0) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(ids_, rank_.host_io.data(), ids_count * sizeof(int32_t),
                        cudaMemcpyHostToDevice, rank_.gemm_stream.get()));
  }
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.uploaded.get(), rank_.gemm_stream.get()));
  uploads_pending_ = true;
  return absl::OkStatus();
}

// The statistics stream waits for Prepare's set-up copies: after the first statistics launch
// (nothing before the gather and the fold reads them, so that kernel never waits for them), and at
// the latest in Finish, so that nothing queued outlives the job.
absl::Status RankWorker::IssueUploads() {
  if (!uploads_pending_) return absl::OkStatus();
  uploads_pending_ = false;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream(), rank_.uploaded.get(), 0));
  return absl::OkStatus();
}

absl::Status RankWorker::BeginTile(Dist& d, int64_t row0, int64_t rows) {
  if (shard_width_ == 0) return absl::OkStatus();
  if (!d.hidden) {
    if (d.zero_copy) return absl::OkStatus();
    const int64_t es = k::SizeOf(d.in->logits.type);
    const auto* src =
        static_cast<const uint8_t*>(d.in->logits.data) + (row0 * job_.vocab + shard_.begin) * es;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpy2DAsync(
        d.staging, static_cast<size_t>(d.staging_ld * es), src,
        static_cast<size_t>(job_.vocab * es), static_cast<size_t>(shard_width_ * es),
        static_cast<size_t>(rows), cudaMemcpyDefault, stream()));
    return absl::OkStatus();
  }
  const MatrixView& h = d.in->hidden;
  const int64_t es = k::SizeOf(h.type);
  const size_t bytes = static_cast<size_t>(rows * h.cols * es);
  const uint8_t* src = static_cast<const uint8_t*>(h.data) + row0 * h.cols * es;
  if (d.pinned[0] != nullptr) {
    // Run() has waited for tile t - 2, the last reader of this pinned tile.
    uint8_t* pinned = d.pinned[static_cast<size_t>((row0 / plan_.tile_rows) % 2)];
    std::memcpy(pinned, src, bytes);
    src = pinned;
  }
  // On gemm_stream, behind the previous tile's GEMMs (the only readers of raw and x_parts).
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(d.raw, src, bytes, cudaMemcpyDefault, gemm_stream()));
  // Rows past `rows` become zeros: the GEMM always multiplies kCudaRowTile rows.
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchSplitToBf16(
      h.type, d.raw, h.cols, rows, h.cols, d.hidden_parts, d.x_parts, kCudaRowTile, d.head->k_pad,
      static_cast<size_t>(kCudaRowTile * d.head->k_pad), gemm_stream()));
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
  // Hidden mode: chunk c of the head shard (whole kCudaVocabChunk rows, zero-padded).
  float* slot = d.slots + slot_index * kCudaRowTile * kCudaVocabChunk;
  const CudaHead& head = *d.head;
  const CudaHead::Shard& hs = head.shards[static_cast<size_t>(rank_.index)];
  if (compute) {
    const size_t x_stride = static_cast<size_t>(kCudaRowTile * head.k_pad);
    for (int j = 0; j < d.hidden_parts; ++j) {
      for (int i = 0; i < head.parts; ++i) {
        const uint16_t* w = head.Part(rank_.index, i) + cc0 * head.k_pad;
        if (auto s = hs.gemm->Run(rank_.lt.get(), w, d.x_parts + j * x_stride, slot,
                                  /*accumulate=*/(i | j) != 0, rank_.cublas_workspace.data(),
                                  gemm_stream());
            !s.ok()) {
          return s;
        }
      }
    }
  }
  src.type = k::FloatType::kFloat32;
  src.data = slot;
  src.ld = kCudaVocabChunk;
  if (hs.bias.data() != nullptr) src.transform.bias = hs.bias.as<float>() + cc0;
  return src;
}

absl::Status RankWorker::ComputeTile(int64_t row0, int64_t rows) {
  const kc::TileMessage& m = plan_.msg;
  // Two streams in hidden mode (see Rank). Chunk g of the job (over all tiles) goes to slot g % 2:
  // its GEMMs wait until the statistics of chunk g - 2 are done with that slot, and its statistics
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
  if (split && plan_.jsd_pass && row0 > 0) {
    LOGITSERVE_RETURN_IF_ERROR(wait(gemm_stream(), rank_.slots_released));
  }
  LOGITSERVE_RETURN_IF_ERROR(BeginTile(model_, row0, rows));
  if (plan_.pair) {
    LOGITSERVE_RETURN_IF_ERROR(BeginTile(ref_, row0, rows));
  }
  k::PairBlockStats* stats = StatsOf(send_, m);
  auto* lists = reinterpret_cast<k::TopKEntry*>(send_ + m.topk_offset);
  auto* counts = reinterpret_cast<int32_t*>(send_ + m.count_offset);
  auto* targets = reinterpret_cast<float*>(send_ + m.target_offset);
  bool cleared = false;  // the uploads are issued and the top-k counts cleared (below)
  for (int64_t c = 0; c < num_chunks_; ++c) {
    const int64_t g = chunk_seq_++;
    const size_t e = static_cast<size_t>(g % 2);
    const int64_t slot = plan_.jsd_pass ? c : g % 2;
    if (split && !plan_.jsd_pass && g >= 2) {
      LOGITSERVE_RETURN_IF_ERROR(wait(gemm_stream(), rank_.slot_free[e]));
    }
    LOGITSERVE_ASSIGN_OR_RETURN(kc::LogitsSource a,
                                Source(model_, c, row0, /*compute=*/true, slot));
    kc::LogitsSource b;
    if (plan_.pair) {
      LOGITSERVE_ASSIGN_OR_RETURN(b, Source(ref_, c, row0, /*compute=*/true, slot));
    }
    if (split) {
      LOGITSERVE_RETURN_IF_ERROR(record(rank_.slot_filled[e], gemm_stream()));
      LOGITSERVE_RETURN_IF_ERROR(wait(stream(), rank_.slot_filled[e]));
    }
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    const kc::LogitsSource* ref = plan_.pair ? &b : nullptr;
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
                                                               counts, topk_scratch_, stream()));
    } else {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          kc::LaunchBlockStats(a, ref, rows, stats, m.max_blocks, local_block, stream()));
    }
    if (c == 0) {
      cleared = true;
      LOGITSERVE_RETURN_IF_ERROR(IssueUploads());
    }
    if (job_.ids_per_row > 0) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchGatherTargets(
          a, rows, ids_ + row0 * job_.ids_per_row, job_.ids_per_row, targets, stream()));
    }
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

absl::Status RankWorker::FoldTile(int64_t row0, int64_t rows) {
  if (auto s = IssueUploads(); !s.ok()) return s;  // a shard without columns launched nothing
  kc::GatheredTile tile;
  tile.messages = recv_;
  tile.layout = plan_.msg;
  tile.shards = plan_.shards;
  tile.num_blocks = plan_.num_blocks;
  tile.pair = plan_.pair;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      kc::LaunchFoldRows(tile, rows, row0, kc::FoldedRows{folded_a_, folded_b_}, first_bad_,
                         reports_ ? &outputs_ : nullptr, stream()));
  return absl::OkStatus();
}

absl::Status RankWorker::JsdTile(int64_t row0, int64_t rows) {
  const size_t bytes = static_cast<size_t>(plan_.tile_rows * plan_.max_blocks) * sizeof(float);
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(partial_send_, 0, bytes, stream()));
  for (int64_t c = 0; c < num_chunks_; ++c) {
    // Logits mode reads the staged (or resident) tile again; hidden mode its kept chunks.
    LOGITSERVE_ASSIGN_OR_RETURN(kc::LogitsSource s, Source(model_, c, row0, /*compute=*/false, c));
    LOGITSERVE_ASSIGN_OR_RETURN(kc::LogitsSource t, Source(ref_, c, row0, /*compute=*/false, c));
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchJsdPartials(s, t, rows, folded_a_, folded_b_,
                                                          *job_.jsd_beta, partial_send_,
                                                          plan_.max_blocks, local_block, stream()));
  }
  // The next tile's GEMMs may overwrite the kept chunks now.
  if (plan_.any_hidden) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.slots_released.get(), stream()));
  }
  return absl::OkStatus();
}

absl::Status RankWorker::JsdGatherAndFinish(int64_t row0, int64_t rows) {
  if (!reports_) return absl::OkStatus();
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchJsdFinish(
      partial_recv_, static_cast<size_t>(plan_.tile_rows * plan_.max_blocks), plan_.max_blocks,
      plan_.shards, plan_.num_blocks, folded_a_, folded_b_, rows, row0, outputs_.jsd, stream()));
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

absl::Status RankWorker::JoinGemmStream() {
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.gemm_idle.get(), gemm_stream()));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream(), rank_.gemm_idle.get(), 0));
  return absl::OkStatus();
}

absl::Status RankWorker::WaitIdle(const char* what) {
  LOGITSERVE_RETURN_IF_ERROR(JoinGemmStream());
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

absl::Status RankWorker::WaitTile(int64_t tile) {
  // At most `depth` tiles queued ahead of the host. Two keep the GPU busy while the host queues
  // the next tile; one where a pageable copy would wait for the stream inside the driver anyway.
  const int64_t depth = plan_.pageable_logits ? 1 : kTileEvents;
  if (tile < depth) return absl::OkStatus();
  return WaitFor(rank_.tile_done[static_cast<size_t>((tile - depth) % kTileEvents)].get(),
                 "row tile");
}

absl::Status RankWorker::Exchange(TileExchange what) {
  if (num_ranks_ == 1) return absl::OkStatus();
  // Test fault: only the job's first gather (NCCL connections are up; the peers then wait on
  // the GPU for gathers that never come).
  if (fault_ == TestFault::kSkipCollective && gathers_++ > 0) return absl::OkStatus();
  if (what == TileExchange::kStatistics) {
    return rank_.comm->AllGather(send_, recv_, plan_.msg.bytes);
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
  return CudaStatus(
      cudaEventRecord(rank_.tile_done[static_cast<size_t>(tile % kTileEvents)].get(), stream()),
      "cudaEventRecord", __FILE__, __LINE__);
}

void RankWorker::OnFailure(const absl::Status& status) {
  if (IsFatalDeviceError(status)) fatal_.Fail(status);
}

absl::Status RankWorker::Finish(bool copy, ScoreResult* result, int32_t* first_bad) {
  DeviceGuard guard(rank_.device);
  LOGITSERVE_RETURN_IF_ERROR(guard.status());
  LOGITSERVE_RETURN_IF_ERROR(IssueUploads());
  // Work still queued reads the request's memory and this rank's workspace: it must be done
  // before Score returns. The reporting rank's output copies go to pinned memory (asynchronous,
  // queued behind that work), so one wait after them covers both; every other rank waits here.
  if (!(copy && reports_)) {
    LOGITSERVE_RETURN_IF_ERROR(WaitIdle("job end"));
  }
  if (copy && reports_) {
    uint8_t* io = rank_.host_io.data() + io_outputs_at_;
    const std::pair<void*, size_t> dst[] = {
        {result->target_logprobs.data(), result->target_logprobs.size() * sizeof(float)},
        {result->top_k_ids.data(), result->top_k_ids.size() * sizeof(int32_t)},
        {result->top_k_logprobs.data(), result->top_k_logprobs.size() * sizeof(float)},
        {result->entropy.data(), result->entropy.size() * sizeof(float)},
        {result->reference_entropy.data(), result->reference_entropy.size() * sizeof(float)},
        {result->forward_kl.data(), result->forward_kl.size() * sizeof(float)},
        {result->reverse_kl.data(), result->reverse_kl.size() * sizeof(float)},
        {result->jsd.data(), result->jsd.size() * sizeof(float)}};
    std::vector<HostCopy> copies;
    for (size_t i = 0; i < out_bytes_.size(); ++i) {
      if (out_bytes_[i] == 0) continue;
      if (dst[i].second != out_bytes_[i]) {  // StartResult sized every requested output
        return absl::InternalError(absl::StrCat("output ", i, " has ", dst[i].second,
                                                " bytes, the job computed ", out_bytes_[i]));
      }
      copies.push_back({dst[i].first, io + out_at_[i], out_bytes_[i]});
    }
    // The output block into its pinned staging (see Prepare) in one asynchronous copy per host
    // thread's piece, each followed by its event; thread i waits for piece i only, so the PCIe
    // copy of later pieces overlaps the host copies of earlier ones. Piece 0 also brings the
    // bad-row markers at the start of the block; the last event follows everything queued.
    const SplitCopy split(std::move(copies));
    LOGITSERVE_RETURN_IF_ERROR(JoinGemmStream());
    size_t from = 0;  // offsets in the output block and its staging alike
    for (size_t i = 0; i < split.threads(); ++i) {
      const size_t end = i + 1 == split.threads() ? out_block_bytes_ : split.PieceEnd(i, io);
      if (end > from) {
        LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(io + from, out_block_ + from, end - from,
                                                        cudaMemcpyDeviceToHost, stream()));
        from = end;
      }
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.output_pieces[i].get(), stream()));
    }
    std::vector<absl::Status> waited(split.threads());
    auto run = [&](size_t i) {
      waited[i] = WaitFor(rank_.output_pieces[i].get(), "output copy");
      if (waited[i].ok()) split.Run(i);
    };
    std::vector<std::thread> threads;
    for (size_t i = 1; i < split.threads(); ++i) threads.emplace_back(run, i);
    run(0);
    for (std::thread& t : threads) t.join();
    for (absl::Status& w : waited) LOGITSERVE_RETURN_IF_ERROR(w);
    std::memcpy(first_bad, io, 2 * sizeof(int32_t));
  }
  if (rank_.nccl != nullptr) return rank_.nccl->AsyncError();
  return absl::OkStatus();
}

// ---- The backend -----------------------------------------------------------------------------

}  // namespace logitserve::cuda_internal
