#include "server/backend/cpu/cpu_tile_gemm.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace logitserve {

using dnnl::memory;

struct TileGemm::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  memory::desc a_md, w_plain_md, c_md;
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};

TileGemm::TileGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TileGemm::~TileGemm() = default;

absl::StatusOr<std::unique_ptr<TileGemm>> TileGemm::Create(int64_t k, int64_t n, int64_t ldc) {
  // oneDNN reports failures as dnnl::error exceptions; they stop here and become a Status.
  try {
    auto impl = std::make_unique<Impl>();
    impl->a_md = memory::desc({kRowTile, k}, memory::data_type::f32, memory::dims{k, 1});
    // W [n, k] row-major is the [k, n] weights matrix with strides {1, k}.
    impl->w_plain_md = memory::desc({k, n}, memory::data_type::f32, memory::dims{1, k});
    impl->c_md = memory::desc({kRowTile, n}, memory::data_type::f32, memory::dims{ldc, 1});
    const memory::desc w_any({k, n}, memory::data_type::f32, memory::format_tag::any);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::desc desc(impl->a_md, w_any, impl->c_md);
    impl->pd = dnnl::matmul::primitive_desc(desc, attr, impl->engine);
    impl->prim = dnnl::matmul(impl->pd);
    return std::unique_ptr<TileGemm>(new TileGemm(std::move(impl)));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN matmul ", kRowTile, "x", k, "x", n, ": ", e.what()));
  }
}

absl::StatusOr<std::vector<float>> TileGemm::PackWeights(const float* w) const {
  try {
    const memory::desc packed_md = impl_->pd.weights_desc();
    std::vector<float> packed((packed_md.get_size() + sizeof(float) - 1) / sizeof(float));
    memory src(impl_->w_plain_md, impl_->engine, const_cast<float*>(w));
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

absl::Status TileGemm::Run(const float* a, const float* packed, float* c, void* scratch) const {
  try {
    memory am(impl_->a_md, impl_->engine, const_cast<float*>(a));
    memory wm(impl_->pd.weights_desc(), impl_->engine, const_cast<float*>(packed));
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
