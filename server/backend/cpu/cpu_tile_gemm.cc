#include "server/backend/cpu/cpu_tile_gemm.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace logitserve {

using dnnl::memory;

bool CpuHasNativeBf16Gemm() {
  // cpu_isa values are feature masks: an ISA includes another when it has all its bits.
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (isa & bf16) == bf16;
}

struct TileGemm::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  memory::desc a_md, w_plain_md, c_md;
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};

TileGemm::TileGemm(GemmPrecision precision, std::unique_ptr<Impl> impl)
    : precision_(precision), impl_(std::move(impl)) {}
TileGemm::~TileGemm() = default;

absl::StatusOr<std::unique_ptr<TileGemm>> TileGemm::Create(GemmPrecision precision, int64_t k,
                                                           int64_t n, int64_t ldc) {
  const auto in =
      precision == GemmPrecision::kBf16 ? memory::data_type::bf16 : memory::data_type::f32;
  // oneDNN reports failures as dnnl::error exceptions; they stop here and become a Status.
  try {
    auto impl = std::make_unique<Impl>();
    impl->a_md = memory::desc({kGemmRows, k}, in, memory::dims{k, 1});
    // W [n, k] row-major is the [k, n] weights matrix with strides {1, k}.
    impl->w_plain_md = memory::desc({k, n}, in, memory::dims{1, k});
    impl->c_md = memory::desc({kGemmRows, n}, memory::data_type::f32, memory::dims{ldc, 1});
    const memory::desc w_any({k, n}, in, memory::format_tag::any);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::desc desc(impl->a_md, w_any, impl->c_md);
    impl->pd = dnnl::matmul::primitive_desc(desc, attr, impl->engine);
    impl->prim = dnnl::matmul(impl->pd);
    return std::unique_ptr<TileGemm>(new TileGemm(precision, std::move(impl)));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul ", kGemmRows, "x", k, "x", n,
                                            precision == GemmPrecision::kBf16 ? " bf16" : " fp32",
                                            ": ", e.what()));
  }
}

std::string TileGemm::implementation() const { return impl_->pd.impl_info_str(); }

absl::StatusOr<std::vector<uint8_t>> TileGemm::PackWeights(const void* w) const {
  try {
    const memory::desc packed_md = impl_->pd.weights_desc();
    std::vector<uint8_t> packed(packed_md.get_size());
    memory src(impl_->w_plain_md, impl_->engine, const_cast<void*>(w));
    memory dst(packed_md, impl_->engine, packed.data());
    dnnl::stream stream(impl_->engine);
    dnnl::reorder(src, dst).execute(stream, src, dst);
    stream.wait();
    return packed;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("oneDNN weight packing: ", e.what()));
  }
}

size_t TileGemm::scratchpad_bytes() const { return impl_->pd.scratchpad_desc().get_size(); }

absl::Status TileGemm::Run(const void* a, const void* packed, float* c, void* scratch) const {
  try {
    memory am(impl_->a_md, impl_->engine, const_cast<void*>(a));
    memory wm(impl_->pd.weights_desc(), impl_->engine, const_cast<void*>(packed));
    memory cm(impl_->c_md, impl_->engine, c);
    memory sm(impl_->pd.scratchpad_desc(), impl_->engine, scratch);
    dnnl::stream stream(impl_->engine);
    impl_->prim.execute(stream, {{DNNL_ARG_SRC, am},
                                 {DNNL_ARG_WEIGHTS, wm},
                                 {DNNL_ARG_DST, cm},
                                 {DNNL_ARG_SCRATCHPAD, sm}});
    stream.wait();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul: ", e.what()));
  }
}

}  // namespace logitserve
