// logitserve-cli: health, list heads, score inputs from a safetensors file, make demo inputs.
//
//   logitserve-cli health --target 127.0.0.1:50051
//   logitserve-cli heads  --target 127.0.0.1:50051 [--json]
//   logitserve-cli make-input --output in.safetensors --rows 8 --hidden-size 1024 --vocab 32000
//   logitserve-cli score  --target 127.0.0.1:50051 --head policy --input in.safetensors
//       [--reference-head reference] [--entropy] [--forward-kl] [--reverse-kl] [--jsd-beta B]
//       [--top-k K] [--json]
//
// Exit status: 0 success (health: SERVING); 1 the server or the connection failed (health: not
// SERVING); 2 bad usage or a bad input file. Errors go to stderr, results to stdout.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "client/cli/input_file.h"
#include "client/cli/output.h"
#include "client/client.h"
#include "common/base/read_file.h"
#include "common/base/status_macros.h"
#include "common/version/build_info.h"

namespace logitserve::client {
namespace {

constexpr int kExitServerError = 1;
constexpr int kExitUsageError = 2;

struct ConnectionFlags {
  std::string target = "127.0.0.1:50051";
  double timeout_s = 60.0;
  int attempts = 5;
  std::string auth_token_file;
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
};

void AddConnectionFlags(CLI::App& app, ConnectionFlags& f) {
  app.add_option("--target", f.target, "Server address HOST:PORT (or any gRPC target)")
      ->capture_default_str();
  app.add_option("--timeout", f.timeout_s, "Deadline of each RPC, seconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--attempts", f.attempts, "Attempts per RPC while the server is UNAVAILABLE")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_option("--auth-token-file", f.auth_token_file,
                 "File holding a bearer token sent with every RPC")
      ->check(CLI::ExistingFile);
  app.add_flag("--tls", f.tls, "Connect with TLS");
  app.add_option("--tls-ca-file", f.tls_ca_file, "PEM root certificates (default: system roots)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-cert-file", f.tls_cert_file, "PEM client certificate (mutual TLS)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key-file", f.tls_key_file, "PEM client key (mutual TLS)")
      ->check(CLI::ExistingFile);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) return absl::NotFoundError("cannot read " + path);
  return contents;
}

int Fail(const absl::Status& status, int code) {
  std::fprintf(stderr, "logitserve-cli: error: %s: %s\n",
               std::string(absl::StatusCodeToString(status.code())).c_str(),
               std::string(status.message()).c_str());
  return code;
}

// A Client configured from the connection flags (reads the token and PEM files).
absl::StatusOr<std::unique_ptr<Client>> Connect(const ConnectionFlags& f,
                                                ClientOptions options = {}) {
  options.rpc_timeout = absl::Seconds(f.timeout_s);
  options.max_attempts = f.attempts;
  if (!f.auth_token_file.empty()) {
    LOGITSERVE_ASSIGN_OR_RETURN(std::string t, ReadFile(f.auth_token_file));
    while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
    options.bearer_token = t;
  }
  options.use_tls = f.tls || !f.tls_ca_file.empty() || !f.tls_cert_file.empty();
  for (auto [path, dst] : {std::pair{&f.tls_ca_file, &options.tls_root_certs},
                           std::pair{&f.tls_cert_file, &options.tls_client_cert},
                           std::pair{&f.tls_key_file, &options.tls_client_key}}) {
    if (path->empty()) continue;
    LOGITSERVE_ASSIGN_OR_RETURN(*dst, ReadFile(*path));
  }
  return Client::Create(f.target, std::move(options));
}

struct ScoreFlags {
  std::string head;
  std::string input;
  std::string reference_head;
  std::string request_id;
  bool entropy = false;
  bool reference_entropy = false;
  bool forward_kl = false;
  bool reverse_kl = false;
  float jsd_beta = 0.0f;
  uint32_t top_k = 0;
  float temperature = 1.0f;
  float reference_temperature = 1.0f;
  int32_t ignore_index = -100;
  std::vector<int64_t> sequence_lengths;
  int64_t max_rows_per_request = 0;
  bool no_split = false;
  bool json = false;
};

int RunScore(const ConnectionFlags& conn, const ScoreFlags& f, const CLI::App& cmd) {
  absl::StatusOr<ScoreInput> input = LoadScoreInput(f.input);
  if (!input.ok()) return Fail(input.status(), kExitUsageError);
  if (!input->ignored_tensors.empty()) {
    std::fprintf(stderr, "logitserve-cli: note: ignoring tensors %s of %s (not request tensors)\n",
                 absl::StrJoin(input->ignored_tensors, ", ").c_str(), f.input.c_str());
  }
  v1::ScoreRequest& r = input->request;
  const bool hidden_mode = r.has_hidden();
  const bool ref_hidden = r.has_reference_hidden();
  const bool ref_logits = r.has_reference_logits();
  std::string usage_error;
  if (hidden_mode && f.head.empty()) {
    usage_error = f.input + " holds 'hidden': name the head with --head";
  } else if (!hidden_mode && !f.head.empty()) {
    usage_error = f.input + " holds 'logits', which need no head: drop --head";
  } else if (ref_hidden && f.reference_head.empty()) {
    usage_error = f.input + " holds 'reference_hidden': name its head with --reference-head";
  } else if (!ref_hidden && !f.reference_head.empty()) {
    usage_error = "--reference-head needs a 'reference_hidden' tensor in " + f.input;
  } else if (!ref_hidden && !ref_logits &&
             (f.reference_entropy || f.forward_kl || f.reverse_kl || cmd.count("--jsd-beta") > 0)) {
    usage_error =
        "reference outputs (--reference-entropy, --forward-kl, --reverse-kl, "
        "--jsd-beta) need 'reference_hidden' or 'reference_logits' in " +
        f.input;
  }
  if (!usage_error.empty()) return Fail(absl::InvalidArgumentError(usage_error), kExitUsageError);

  r.set_request_id(f.request_id);
  r.set_head(f.head);
  r.set_reference_head(f.reference_head);
  r.set_entropy(f.entropy);
  r.set_reference_entropy(f.reference_entropy);
  r.set_forward_kl(f.forward_kl);
  r.set_reverse_kl(f.reverse_kl);
  r.set_top_k(f.top_k);
  if (cmd.count("--jsd-beta") > 0) r.set_jsd_beta(f.jsd_beta);
  if (cmd.count("--temperature") > 0) r.set_temperature(f.temperature);
  if (cmd.count("--reference-temperature") > 0) {
    r.set_reference_temperature(f.reference_temperature);
  }
  if (cmd.count("--ignore-index") > 0) r.set_ignore_index(f.ignore_index);
  for (int64_t len : f.sequence_lengths) r.add_sequence_lengths(len);

  ClientOptions options;
  options.split_requests = !f.no_split;
  options.max_rows_per_request = f.max_rows_per_request;
  absl::StatusOr<std::unique_ptr<Client>> client = Connect(conn, options);
  if (!client.ok()) return Fail(client.status(), kExitUsageError);
  absl::StatusOr<ScoreOutput> out = (*client)->Score(r);
  if (!out.ok()) return Fail(out.status(), kExitServerError);
  if (f.json) {
    std::cout << ScoreToJson(*out).dump(2) << "\n";
  } else {
    std::cout << FormatScoreTable(r, *out);
  }
  std::cout.flush();
  return std::cout ? 0 : kExitServerError;
}

int Main(int argc, char** argv) {
  CLI::App app{
      "logitserve-cli: command-line client of the logitserve logit-scoring service.\n"
      "Every value printed is in nats. Exit status: 0 ok, 1 server/connection error "
      "(health: not SERVING), 2 usage or input-file error."};
  app.require_subcommand(1);
  app.set_version_flag("--version", VersionText("logitserve-cli"),
                       "Print the version and commit of this client and exit");
  ConnectionFlags conn;

  CLI::App* health = app.add_subcommand("health", "grpc.health.v1 Check; prints the status");
  AddConnectionFlags(*health, conn);
  std::string health_service;
  health->add_option("--service", health_service, "Service to ask about (default: the server)");

  CLI::App* heads = app.add_subcommand("heads", "List the heads the server holds");
  AddConnectionFlags(*heads, conn);
  bool heads_json = false;
  heads->add_flag("--json", heads_json, "Print JSON instead of a table");

  CLI::App* score = app.add_subcommand(
      "score",
      "Score the tensors of a safetensors file: 'hidden' [N,H] or 'logits' [N,V], optional "
      "'reference_hidden' / 'reference_logits', optional 'target_ids' [N] or [N,K]");
  AddConnectionFlags(*score, conn);
  ScoreFlags sf;
  score->add_option("--input", sf.input, "Input .safetensors file")->required();
  score->add_option("--head", sf.head, "Model (policy / student) head, for 'hidden' inputs");
  score->add_option("--reference-head", sf.reference_head,
                    "Reference (teacher) head, for 'reference_hidden' inputs");
  score->add_option("--request-id", sf.request_id, "Tag echoed by the server");
  score->add_flag("--entropy", sf.entropy, "Entropy H(p) of the model distribution");
  score->add_flag("--reference-entropy", sf.reference_entropy, "Entropy H(q) of the reference");
  score->add_flag("--forward-kl", sf.forward_kl, "Forward KL = KL(ref || model)");
  score->add_flag("--reverse-kl", sf.reverse_kl, "Reverse KL = KL(model || ref)");
  score
      ->add_option("--jsd-beta", sf.jsd_beta,
                   "Generalized JSD with weight beta in [0, 1] (0 = forward KL, 1 = reverse KL)")
      ->check(CLI::Range(0.0f, 1.0f));
  score->add_option("--top-k", sf.top_k, "Most probable model tokens to return per row");
  score->add_option("--temperature", sf.temperature, "Model softmax temperature (default 1)");
  score->add_option("--reference-temperature", sf.reference_temperature,
                    "Reference softmax temperature (default 1)");
  score->add_option("--ignore-index", sf.ignore_index,
                    "Target id that yields exactly 0.0 (default -100)");
  score
      ->add_option("--sequence-lengths", sf.sequence_lengths,
                   "Comma-separated lengths of the packed sequences (sum = N): adds sums")
      ->delimiter(',');
  score
      ->add_option("--max-rows-per-request", sf.max_rows_per_request,
                   "Split into requests of at most this many rows (default: server's limit)")
      ->check(CLI::NonNegativeNumber);
  score->add_flag("--no-split", sf.no_split, "Never split the request");
  score->add_flag("--json", sf.json, "Print JSON (every returned array) instead of a table");

  CLI::App* make = app.add_subcommand(
      "make-input", "Write a demo input file of seeded random hidden states (or logits)");
  MakeInputOptions mo;
  std::string dtype = "bf16";
  make->add_option("--output", mo.output, "File to write")->required();
  make->add_option("--rows", mo.rows, "Token rows N")->capture_default_str();
  make->add_option("--hidden-size", mo.hidden_size, "Hidden size H")->capture_default_str();
  make->add_option("--vocab", mo.vocab, "Vocabulary size V (target ids < V; logits width)")
      ->capture_default_str();
  make->add_option("--seed", mo.seed, "Generator seed")->capture_default_str();
  make->add_option("--dtype", dtype, "Element type of the float tensors")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  make->add_option("--targets-per-row", mo.targets_per_row, "K target ids per row (0 = none)")
      ->capture_default_str();
  make->add_flag("--reference", mo.reference, "Also write reference_hidden (reference_logits)");
  make->add_option("--reference-hidden-size", mo.reference_hidden_size,
                   "H_ref of reference_hidden (default: H)");
  make->add_flag("--logits", mo.logits, "Write logits [N, V] instead of hidden [N, H]");
  make->add_option("--scale", mo.scale, "Standard deviation of the values")->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitUsageError;
  }

  if (health->parsed()) {
    absl::StatusOr<std::unique_ptr<Client>> client = Connect(conn);
    if (!client.ok()) return Fail(client.status(), kExitUsageError);
    absl::StatusOr<ServingStatus> status = (*client)->Health(health_service);
    if (!status.ok()) return Fail(status.status(), kExitServerError);
    std::printf("%s\n", ServingStatusName(*status));
    return *status == ServingStatus::kServing ? 0 : kExitServerError;
  }
  if (heads->parsed()) {
    absl::StatusOr<std::unique_ptr<Client>> client = Connect(conn);
    if (!client.ok()) return Fail(client.status(), kExitUsageError);
    absl::StatusOr<ListHeadsOutput> list = (*client)->ListHeads();
    if (!list.ok()) return Fail(list.status(), kExitServerError);
    if (heads_json) {
      std::cout << HeadsToJson(*list).dump(2) << "\n";
    } else {
      std::cout << FormatHeadsTable(*list);
    }
    return 0;
  }
  if (score->parsed()) return RunScore(conn, sf, *score);
  if (make->parsed()) {
    mo.dtype = dtype == "f32"   ? v1::DATA_TYPE_FLOAT32
               : dtype == "f16" ? v1::DATA_TYPE_FLOAT16
                                : v1::DATA_TYPE_BFLOAT16;
    if (absl::Status s = WriteDemoInput(mo); !s.ok()) return Fail(s, kExitUsageError);
    std::printf("wrote %s\n", mo.output.c_str());
    return 0;
  }
  return kExitUsageError;
}

}  // namespace
}  // namespace logitserve::client

int main(int argc, char** argv) {
  // The code above reports errors as absl::Status; only the standard library (allocation, I/O)
  // can still throw, and that must not escape as an abort.
  try {
    return logitserve::client::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "logitserve-cli: fatal: %s\n", e.what());
    return 1;
  }
}
