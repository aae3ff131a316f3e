#include "tests/service/e2e_support.h"

#include <chrono>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/wire/dtype.h"
#include "gtest/gtest.h"
#include "server/heads/head_loader.h"
#include "tests/kernels/expect_reference.h"

namespace logitserve::e2e {

namespace {

MatrixView ViewOf(const v1::Tensor& t) {
  const std::optional<kernels::FloatType> type = wire::FloatTypeOf(t.dtype());
  EXPECT_TRUE(type.has_value()) << wire::DTypeName(t.dtype()) << " is not a float dtype";
  return MatrixView{type.value_or(kernels::FloatType::kFloat32), t.shape(0), t.shape(1),
                    t.data().data()};
}

std::vector<int32_t> IdsOf(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) {
    if (t.dtype() == v1::DATA_TYPE_INT64) {
      int64_t v;
      std::memcpy(&v, t.data().data() + 8 * i, 8);
      ids[i] = static_cast<int32_t>(v);
    } else {
      std::memcpy(&ids[i], t.data().data() + 4 * i, 4);
    }
  }
  return ids;
}

template <typename T>
std::vector<T> VectorOf(const google::protobuf::RepeatedField<T>& field) {
  return std::vector<T>(field.begin(), field.end());
}

// The outputs a ScoreResponse and its SequenceStats both carry, under the same field names.
template <typename Message>
ScoreResult PerTokenOutputs(const Message& m) {
  ScoreResult r;
  r.target_logprobs = VectorOf(m.target_logprobs());
  r.entropy = VectorOf(m.entropy());
  r.reference_entropy = VectorOf(m.reference_entropy());
  r.forward_kl = VectorOf(m.forward_kl());
  r.reverse_kl = VectorOf(m.reverse_kl());
  r.jsd = VectorOf(m.jsd());
  return r;
}

}  // namespace

std::string SyntheticHead::Flag() const {
  return absl::StrCat(name, ":vocab=", vocab, ",hidden=", hidden, ",seed=", seed);
}

std::shared_ptr<const PreparedHead> ReferenceHead(const SyntheticHead& head) {
  absl::StatusOr<std::shared_ptr<HeadWeights>> w =
      MakeSyntheticHead(head.name, head.vocab, head.hidden, head.seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return std::make_shared<PreparedHead>(*std::move(w));
}

std::unique_ptr<testing::ServerProcess> StartServerProcess(std::vector<std::string> args) {
  absl::StatusOr<std::unique_ptr<testing::ServerProcess>> server =
      testing::ServerProcess::Start(std::move(args));
  if (!server.ok()) {
    ADD_FAILURE() << "cannot start logitserve: " << server.status();
    return nullptr;
  }
  return *std::move(server);
}

std::shared_ptr<grpc::Channel> Connect(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

grpc::Status CallScore(v1::Scorer::Stub& stub, const v1::ScoreRequest& request,
                       v1::ScoreResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return stub.Score(&context, request, response);
}

ScoreJob JobOf(const v1::ScoreRequest& r, const HeadMap& heads) {
  ScoreJob job;
  auto side = [&](const std::string& head, const v1::Tensor& hidden, bool has_hidden,
                  const v1::Tensor& logits, float temperature, const char* field,
                  DistributionInput* in) {
    in->temperature = temperature;
    in->field = field;
    if (has_hidden) {
      in->head = heads.at(head);
      in->hidden = ViewOf(hidden);
      job.rows = hidden.shape(0);
      job.vocab = in->head->weights().vocab_size;
    } else {
      in->logits = ViewOf(logits);
      job.rows = logits.shape(0);
      job.vocab = logits.shape(1);
    }
  };
  job.forward_kl = r.forward_kl();
  job.reverse_kl = r.reverse_kl();
  job.reference_entropy = r.reference_entropy();
  if (r.has_jsd_beta()) job.jsd_beta = r.jsd_beta();
  if (job.NeedsReference()) {
    side(r.reference_head(), r.reference_hidden(), r.has_reference_hidden(), r.reference_logits(),
         r.has_reference_temperature() ? r.reference_temperature() : 1.0f,
         r.has_reference_hidden() ? "reference_hidden" : "reference_logits", &job.reference);
  }
  side(r.head(), r.hidden(), r.has_hidden(), r.logits(),
       r.has_temperature() ? r.temperature() : 1.0f, r.has_hidden() ? "hidden" : "logits",
       &job.model);
  job.entropy = r.entropy();
  job.top_k = static_cast<int32_t>(r.top_k());
  job.ignore_index = r.has_ignore_index() ? r.ignore_index() : -100;
  if (r.has_target_ids()) {
    job.target_ids = IdsOf(r.target_ids());
    job.ids_per_row =
        r.target_ids().shape_size() == 2 ? static_cast<int32_t>(r.target_ids().shape(1)) : 1;
  }
  return job;
}

void ExpectOutputsMatchReference(const v1::ScoreRequest& request, const ScoreResult& got,
                                 const SequenceSums* sums, const HeadMap& heads) {
  const ScoreJob job = JobOf(request, heads);
  testing::ExpectMatchesReference(job, got);
  if (request.sequence_lengths_size() > 0) {
    ASSERT_NE(sums, nullptr) << "sequence_lengths were sent, but no sequence sums came back";
    const std::vector<int64_t> lengths(request.sequence_lengths().begin(),
                                       request.sequence_lengths().end());
    testing::ExpectSequenceSumsMatchReference(job, lengths, sums->sums, sums->token_count);
    if (sums->means.has_value()) {
      testing::ExpectSequenceSumsMatchReference(job, lengths, *sums->means, sums->token_count,
                                                /*means=*/true);
    }
  }
}

void ExpectMatchesReference(const v1::ScoreRequest& request, const v1::ScoreResponse& response,
                            const HeadMap& heads) {
  EXPECT_EQ(response.request_id(), request.request_id());
  const int64_t k =
      request.has_target_ids()
          ? (request.target_ids().shape_size() == 2 ? request.target_ids().shape(1) : 1)
          : 0;
  EXPECT_EQ(response.target_ids_per_row(), static_cast<uint32_t>(k));
  EXPECT_EQ(response.top_k(), request.top_k());
  EXPECT_GE(response.queue_us(), 0);
  EXPECT_GE(response.compute_us(), 0);

  ScoreResult got = PerTokenOutputs(response);
  got.top_k_ids = VectorOf(response.top_k_ids());
  got.top_k_logprobs = VectorOf(response.top_k_logprobs());
  if (request.sequence_lengths_size() == 0) {
    EXPECT_FALSE(response.has_sequence_sums());
    ExpectOutputsMatchReference(request, got, nullptr, heads);
    return;
  }
  EXPECT_TRUE(response.has_sequence_means());
  EXPECT_EQ(VectorOf(response.sequence_means().token_count()),
            VectorOf(response.sequence_sums().token_count()));
  const SequenceSums sums{PerTokenOutputs(response.sequence_sums()),
                          VectorOf(response.sequence_sums().token_count()),
                          PerTokenOutputs(response.sequence_means())};
  ExpectOutputsMatchReference(request, got, &sums, heads);
}

}  // namespace logitserve::e2e
