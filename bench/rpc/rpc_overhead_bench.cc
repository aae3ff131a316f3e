// logitserve-rpc-bench: what the Score RPC costs beyond its compute (SPEC §9: a hidden-mode Score
// over loopback costs <= compute + 1.3 x a raw gRPC transfer of the same bytes).
//
// For each --rows N it builds one hidden-mode request (bf16 [N, H] hidden states of --head, int32
// target ids [N], entropy) and alternates, --iters times:
//   Score     the request to the server at --target; wall time on the client, and the server's
//             compute_us / queue_us from the response;
//   transfer  the same serialized request bytes as one unary call to a generic echo-like service
//             inside this process (127.0.0.1, callback API, no parsing), which replies with the
//             serialized bytes of a real ScoreResponse for that request.
// Reported (medians): Score, compute, queue, transfer; the bound compute + 1.3 x transfer; the
// ratio Score / bound (<= 1 meets the target) and the overhead Score - compute - transfer; and,
// as one known part of that overhead, the client's serialization of the request (timed apart).
// Correctness: every Score response must hold N target log-probs and N entropies, and every echo
// must see exactly the request's bytes; mismatches are counted as `wrong` (exit 1 when any).
//
//   logitserve-rpc-bench --target 127.0.0.1:50051 --head policy --rows 256,1024,4096 [--json F]
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/rpc/echo_service.h"
#include "logitserve/kernels/dtype.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kTransferFactor = 1.3;  // SPEC §9

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

grpc::ChannelArguments UnlimitedArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  namespace v1 = logitserve::v1;
  CLI::App app{"logitserve RPC overhead: Score vs a raw gRPC transfer of the same bytes"};
  std::string target = "127.0.0.1:50051", head = "policy", json_path;
  std::vector<int64_t> rows_list = {256, 1024, 4096};
  int iters = 15;
  app.add_option("--target", target, "logitserve server HOST:PORT")->capture_default_str();
  app.add_option("--head", head, "Head to score with")->capture_default_str();
  app.add_option("--rows", rows_list, "Token rows N (comma-separated list)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--iters", iters, "Timed repetitions of each (medians are reported)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--json", json_path, "Also write the results as JSON");
  CLI11_PARSE(app, argc, argv);

  auto scorer = v1::Scorer::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), UnlimitedArgs()));
  v1::ListHeadsResponse heads;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = scorer->ListHeads(&ctx, {}, &heads);
    if (!s.ok()) {
      std::fprintf(stderr, "ListHeads on %s: %s\n", target.c_str(), s.error_message().c_str());
      return 1;
    }
  }
  int64_t vocab = 0, hidden = 0;
  for (const v1::HeadInfo& h : heads.heads()) {
    if (h.name() == head) {
      vocab = h.vocab_size();
      hidden = h.hidden_size();
    }
  }
  if (vocab == 0) {
    std::fprintf(stderr, "head '%s' is not served by %s\n", head.c_str(), target.c_str());
    return 1;
  }

  // The in-process raw-transfer server.
  logitserve::bench::EchoService echo;
  int echo_port = 0;
  std::unique_ptr<grpc::Server> echo_server = logitserve::bench::StartEchoServer(&echo, &echo_port);
  if (echo_server == nullptr) {
    std::fprintf(stderr, "cannot start the echo server\n");
    return 1;
  }
  grpc::GenericStub raw(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(echo_port),
                                                  grpc::InsecureChannelCredentials(),
                                                  UnlimitedArgs()));

  std::printf("backend %s, head %s (V = %lld, H = %lld), %d iterations, medians\n",
              heads.backend().c_str(), head.c_str(), static_cast<long long>(vocab),
              static_cast<long long>(hidden), iters);
  std::printf("%7s %9s %10s %10s %9s %11s %12s %7s %12s %13s %6s\n", "rows", "req_MiB", "score_ms",
              "compute_ms", "queue_ms", "transfer_ms", "bound_ms", "ratio", "overhead_ms",
              "serialize_ms", "wrong");
  nlohmann::json results = nlohmann::json::array();
  int64_t total_wrong = 0;
  for (int64_t rows : rows_list) {
    v1::ScoreRequest req;
    req.set_head(head);
    req.set_entropy(true);
    v1::Tensor* h = req.mutable_hidden();
    h->set_dtype(v1::DATA_TYPE_BFLOAT16);
    h->add_shape(rows);
    h->add_shape(hidden);
    std::vector<uint16_t> bits(static_cast<size_t>(rows * hidden));
    std::mt19937_64 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint16_t& b : bits) b = logitserve::kernels::FloatToBFloat16(normal(rng));
    h->set_data(bits.data(), bits.size() * sizeof(uint16_t));
    v1::Tensor* ids = req.mutable_target_ids();
    ids->set_dtype(v1::DATA_TYPE_INT32);
    ids->add_shape(rows);
    std::vector<int32_t> id_values(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i)
      id_values[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % vocab);
    ids->set_data(id_values.data(), id_values.size() * sizeof(int32_t));
    const std::string request_bytes = req.SerializeAsString();

    int64_t wrong = 0;
    auto score = [&](double* wall_ms, double* compute_ms, double* queue_ms) {
      grpc::ClientContext ctx;
      v1::ScoreResponse resp;
      const Clock::time_point t0 = Clock::now();
      const grpc::Status s = scorer->Score(&ctx, req, &resp);
      *wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (!s.ok() || resp.target_logprobs_size() != rows || resp.entropy_size() != rows) {
        if (!s.ok()) std::fprintf(stderr, "Score: %s\n", s.error_message().c_str());
        ++wrong;
      }
      *compute_ms = resp.compute_us() / 1e3;
      *queue_ms = resp.queue_us() / 1e3;
      return resp;
    };
    // One untimed Score: its serialized response is what the echo replies with.
    double w, c, q;
    const v1::ScoreResponse sample = score(&w, &c, &q);
    const std::string reply_bytes = sample.SerializeAsString();
    echo.Expect(request_bytes.size(), logitserve::bench::BufferOf(reply_bytes));
    const grpc::ByteBuffer request_buffer = logitserve::bench::BufferOf(request_bytes);
    auto transfer = [&]() {
      grpc::ClientContext ctx;
      grpc::ByteBuffer reply;
      std::promise<grpc::Status> done;
      const Clock::time_point t0 = Clock::now();
      raw.UnaryCall(&ctx, logitserve::bench::kEchoMethod, grpc::StubOptions(), &request_buffer,
                    &reply, [&done](grpc::Status s) { done.set_value(std::move(s)); });
      const grpc::Status s = done.get_future().get();
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (!s.ok() || reply.Length() != reply_bytes.size()) {
        if (!s.ok()) std::fprintf(stderr, "transfer: %s\n", s.error_message().c_str());
        ++wrong;
      }
      return ms;
    };
    transfer();  // warm the echo connection

    std::vector<double> score_ms, compute_ms, queue_ms, transfer_ms, serialize_ms;
    for (int i = 0; i < iters; ++i) {
      {
        std::string bytes;
        const Clock::time_point t0 = Clock::now();
        req.SerializeToString(&bytes);
        serialize_ms.push_back(
            std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        if (bytes.size() != request_bytes.size()) ++wrong;
      }
      score(&w, &c, &q);
      score_ms.push_back(w);
      compute_ms.push_back(c);
      queue_ms.push_back(q);
      transfer_ms.push_back(transfer());
    }
    const double s_ms = Median(score_ms), c_ms = Median(compute_ms), q_ms = Median(queue_ms),
                 x_ms = Median(transfer_ms), ser_ms = Median(serialize_ms);
    const double bound = c_ms + kTransferFactor * x_ms;
    const double mib = static_cast<double>(request_bytes.size()) / (1 << 20);
    std::printf("%7lld %9.2f %10.3f %10.3f %9.3f %11.3f %12.3f %7.3f %12.3f %13.3f %6lld\n",
                static_cast<long long>(rows), mib, s_ms, c_ms, q_ms, x_ms, bound, s_ms / bound,
                s_ms - c_ms - x_ms, ser_ms, static_cast<long long>(wrong));
    results.push_back({{"rows", rows},
                       {"request_bytes", request_bytes.size()},
                       {"response_bytes", reply_bytes.size()},
                       {"score_ms", s_ms},
                       {"compute_ms", c_ms},
                       {"queue_ms", q_ms},
                       {"transfer_ms", x_ms},
                       {"bound_ms", bound},
                       {"ratio_to_bound", s_ms / bound},
                       {"overhead_ms", s_ms - c_ms - x_ms},
                       {"client_serialize_ms", ser_ms},
                       {"wrong", wrong}});
    total_wrong += wrong;
  }
  std::printf("ratio = Score / (compute + %.1f x transfer); <= 1 meets SPEC §9\n", kTransferFactor);
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << nlohmann::json({{"backend", heads.backend()},
                           {"head", head},
                           {"vocab_size", vocab},
                           {"hidden_size", hidden},
                           {"iters", iters},
                           {"results", results}})
               .dump(2)
        << "\n";
  }
  echo_server->Shutdown();
  return total_wrong == 0 ? 0 : 1;
}
