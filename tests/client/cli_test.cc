// logitserve-cli run as a subprocess against the real server: health, heads, make-input, score
// (--json checked against fp64 computed from the input file; the table's header and rows), and
// clear failures for bad input files and unreachable servers.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/safetensors/safetensors.h"
#include "common/version/build_info.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/heads/head_loader.h"
#include "tests/client/output_expect.h"
#include "tests/support/server_process.h"

#ifndef LOGITSERVE_CLI_BINARY
#error "LOGITSERVE_CLI_BINARY must name the logitserve-cli executable"
#endif

namespace logitserve::client {
namespace {

using ::logitserve::testing::ServerProcess;
using testing::ExpectMatchesReference;
using ::testing::HasSubstr;
using ::testing::Not;

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string Quote(const std::string& s) {
  std::string q(1, '\'');
  for (char c : s) {
    if (c == '\'') {
      q.append("'\\''");
    } else {
      q.push_back(c);
    }
  }
  q.push_back('\'');
  return q;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/logitserve_cli_" + std::to_string(getpid()) + "_" + name;
}

// Runs logitserve-cli with `args`; stdout and stderr captured separately.
CommandResult RunCli(const std::vector<std::string>& args) {
  const std::string err_path = TempPath("stderr.txt");
  std::string cmd = Quote(LOGITSERVE_CLI_BINARY);
  for (const std::string& a : args) {
    cmd.push_back(' ');
    cmd.append(Quote(a));
  }
  cmd.append(" 2>").append(Quote(err_path));
  CommandResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.err = ReadAll(err_path);
  std::remove(err_path.c_str());
  return r;
}

// A JSON number, or the strings "nan" / "inf" / "-inf" the CLI writes for non-finite values.
float JsonFloat(const nlohmann::json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "nan") return NAN;
    return s == "inf" ? INFINITY : -INFINITY;
  }
  return static_cast<float>(v.get<double>());
}

std::vector<float> JsonFloats(const nlohmann::json& j, const char* key) {
  std::vector<float> out;
  if (!j.contains(key)) return out;
  for (const nlohmann::json& v : j[key]) out.push_back(JsonFloat(v));
  return out;
}

// Tensor `name` of a safetensors file as a wire tensor of `dtype` (the file's bytes as they are).
v1::Tensor FileTensor(const SafetensorsFile& f, const char* name, v1::DataType dtype) {
  v1::Tensor t;
  const SafetensorsTensor* st = f.Find(name);
  EXPECT_NE(st, nullptr) << name;
  if (st == nullptr) return t;
  t.set_dtype(dtype);
  for (int64_t d : st->shape) t.add_shape(d);
  t.mutable_data()->assign(reinterpret_cast<const char*>(st->data), st->bytes);
  return t;
}

// The target ids of a file (I32) as int64.
std::vector<int64_t> FileIds(const SafetensorsFile& f) {
  const SafetensorsTensor* t = f.Find("target_ids");
  std::vector<int32_t> v(t->num_elements());
  std::memcpy(v.data(), t->data, t->bytes);
  return std::vector<int64_t>(v.begin(), v.end());
}

// `score --json`'s output as the client library's ScoreOutput (every array, sequence sums too).
ScoreOutput OutputOfJson(const nlohmann::json& j) {
  ScoreOutput out;
  out.rows = j["rows"];
  out.target_ids_per_row = j["target_ids_per_row"];
  out.top_k = j["top_k"];
  out.target_logprobs = JsonFloats(j, "target_logprobs");
  out.top_k_logprobs = JsonFloats(j, "top_k_logprobs");
  if (j.contains("top_k_ids")) {
    for (const nlohmann::json& id : j["top_k_ids"]) out.top_k_ids.push_back(id);
  }
  out.entropy = JsonFloats(j, "entropy");
  out.reference_entropy = JsonFloats(j, "reference_entropy");
  out.forward_kl = JsonFloats(j, "forward_kl");
  out.reverse_kl = JsonFloats(j, "reverse_kl");
  out.jsd = JsonFloats(j, "jsd");
  if (j.contains("sequence_sums")) {
    const nlohmann::json& js = j["sequence_sums"];
    SequenceStatsOutput& sums = out.sequence_sums.emplace();
    sums.target_logprobs = JsonFloats(js, "target_logprobs");
    sums.entropy = JsonFloats(js, "entropy");
    sums.reference_entropy = JsonFloats(js, "reference_entropy");
    sums.forward_kl = JsonFloats(js, "forward_kl");
    sums.reverse_kl = JsonFloats(js, "reverse_kl");
    sums.jsd = JsonFloats(js, "jsd");
    for (const nlohmann::json& c : js["token_count"]) sums.token_count.push_back(c);
  }
  return out;
}

constexpr int64_t kVocab = 500, kHidden = 32;

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start({"--backend", "cpu", "--threads", "2", "--synthetic-head",
                                        "policy:vocab=500,hidden=32,seed=1", "--synthetic-head",
                                        "reference:vocab=500,hidden=32,seed=2"});
    if (!server.ok()) {
      start_error_ = server.status().ToString();
      return;
    }
    server_ = *std::move(server);
  }
  static void TearDownTestSuite() { server_.reset(); }
  void SetUp() override { ASSERT_NE(server_, nullptr) << "no server: " << start_error_; }
  static std::string Target() { return server_->address(); }

  static inline std::unique_ptr<ServerProcess> server_;
  static inline std::string start_error_;
};

TEST_F(CliTest, HealthPrintsServing) {
  const CommandResult r = RunCli({"health", "--target", Target()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
}

TEST_F(CliTest, HeadsTableAndJson) {
  CommandResult r = RunCli({"heads", "--target", Target()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("backend cpu"));
  // The server's build: the same values as this test's own (one build tree).
  const BuildInfo& build = GetBuildInfo();
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("# server logitserve ", build.version, " (commit ",
                                            build.git_commit, ")")));
  EXPECT_THAT(r.out, HasSubstr("policy"));
  EXPECT_THAT(r.out, HasSubstr("reference"));

  r = RunCli({"heads", "--target", Target(), "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["server_version"], std::string(build.version));
  EXPECT_EQ(j["server_git_commit"], std::string(build.git_commit));
  ASSERT_EQ(j["heads"].size(), 2u);
  for (const nlohmann::json& h : j["heads"]) {
    EXPECT_EQ(h["vocab_size"], kVocab);
    EXPECT_EQ(h["hidden_size"], kHidden);
  }
}

TEST(CliVersionTest, VersionFlagPrintsVersionAndCommit) {
  const CommandResult r = RunCli({"--version"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const BuildInfo& build = GetBuildInfo();
  EXPECT_EQ(r.out, VersionText("logitserve-cli") + "\n");
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("logitserve-cli ", build.version, " (commit ",
                                            build.git_commit, ", ")));
  EXPECT_THAT(r.out, HasSubstr("backends: cpu"));
}

TEST_F(CliTest, MakeInputIsDeterministic) {
  const std::string a = TempPath("a.safetensors"), b = TempPath("b.safetensors");
  for (const std::string& path : {a, b}) {
    const CommandResult r =
        RunCli({"make-input", "--output", path, "--rows", "5", "--hidden-size", "32", "--vocab",
                "500", "--seed", "9", "--reference", "--targets-per-row", "2"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  EXPECT_EQ(ReadAll(a), ReadAll(b));
  auto file = SafetensorsFile::Open(a);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("hidden")->shape, (std::vector<int64_t>{5, 32}));
  EXPECT_EQ(file->Find("hidden")->dtype, SafetensorsDType::kBFloat16);
  EXPECT_EQ(file->Find("reference_hidden")->shape, (std::vector<int64_t>{5, 32}));
  EXPECT_EQ(file->Find("target_ids")->shape, (std::vector<int64_t>{5, 2}));
  for (int64_t id : FileIds(*file)) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, kVocab);
  }
  std::remove(a.c_str());
  std::remove(b.c_str());
}

TEST_F(CliTest, ScoreJsonMatchesFp64) {
  constexpr int64_t kRows = 6, kV = 400;
  const std::string input = TempPath("logits.safetensors");
  CommandResult r = RunCli({"make-input", "--output", input, "--rows", std::to_string(kRows),
                            "--vocab", std::to_string(kV), "--logits", "--reference", "--dtype",
                            "f32", "--scale", "3", "--seed", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunCli({"score", "--target", Target(), "--input", input, "--entropy", "--reference-entropy",
              "--forward-kl", "--reverse-kl", "--jsd-beta", "0.25", "--top-k", "3", "--temperature",
              "2", "--sequence-lengths", "2,4", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["units"], "nats");
  EXPECT_EQ(j["rows"], kRows);
  ASSERT_TRUE(j.contains("sequence_sums"));
  const ScoreOutput out = OutputOfJson(j);

  // The request the command line describes, built from the file's tensors as written.
  auto file = SafetensorsFile::Open(input);
  ASSERT_TRUE(file.ok()) << file.status();
  v1::ScoreRequest request;
  *request.mutable_logits() = FileTensor(*file, "logits", v1::DATA_TYPE_FLOAT32);
  *request.mutable_reference_logits() =
      FileTensor(*file, "reference_logits", v1::DATA_TYPE_FLOAT32);
  *request.mutable_target_ids() = FileTensor(*file, "target_ids", v1::DATA_TYPE_INT32);
  request.set_temperature(2.0f);
  request.set_top_k(3);
  request.set_entropy(true);
  request.set_reference_entropy(true);
  request.set_forward_kl(true);
  request.set_reverse_kl(true);
  request.set_jsd_beta(0.25f);
  request.add_sequence_lengths(2);
  request.add_sequence_lengths(4);
  ExpectMatchesReference(request, out);
  std::remove(input.c_str());
}

// make-input --dtype f16 writes F16 tensors that the server scores in hidden mode, K = 2 ids.
TEST_F(CliTest, ScoreJsonOfFloat16HiddenInputMatchesFp64) {
  constexpr int64_t kRows = 5;
  const std::string input = TempPath("hidden_f16.safetensors");
  CommandResult r =
      RunCli({"make-input", "--output", input, "--rows", std::to_string(kRows), "--hidden-size",
              std::to_string(kHidden), "--vocab", std::to_string(kVocab), "--reference", "--dtype",
              "f16", "--targets-per-row", "2", "--seed", "7"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto file = SafetensorsFile::Open(input);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->Find("hidden")->dtype, SafetensorsDType::kFloat16);
  ASSERT_EQ(file->Find("reference_hidden")->dtype, SafetensorsDType::kFloat16);

  r = RunCli({"score", "--target", Target(), "--head", "policy", "--reference-head", "reference",
              "--input", input, "--entropy", "--reverse-kl", "--jsd-beta", "0.5", "--top-k", "4",
              "--sequence-lengths", "3,2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const ScoreOutput out = OutputOfJson(nlohmann::json::parse(r.out));

  v1::ScoreRequest request;
  request.set_head("policy");
  request.set_reference_head("reference");
  *request.mutable_hidden() = FileTensor(*file, "hidden", v1::DATA_TYPE_FLOAT16);
  *request.mutable_reference_hidden() =
      FileTensor(*file, "reference_hidden", v1::DATA_TYPE_FLOAT16);
  *request.mutable_target_ids() = FileTensor(*file, "target_ids", v1::DATA_TYPE_INT32);
  request.set_top_k(4);
  request.set_entropy(true);
  request.set_reverse_kl(true);
  request.set_jsd_beta(0.5f);
  request.add_sequence_lengths(3);
  request.add_sequence_lengths(2);
  // The server's synthetic heads, rebuilt bit for bit (MakeSyntheticHead is deterministic).
  e2e::HeadMap heads;
  for (const auto& [name, seed] :
       {std::pair<std::string, uint64_t>{"policy", 1}, {"reference", 2}}) {
    absl::StatusOr<std::shared_ptr<HeadWeights>> w = MakeSyntheticHead(name, kVocab, kHidden, seed);
    ASSERT_TRUE(w.ok()) << w.status();
    heads[name] = std::make_shared<PreparedHead>(*std::move(w));
  }
  ExpectMatchesReference(request, out, heads);
  std::remove(input.c_str());
}

TEST_F(CliTest, ScoreTablePrintsOneLinePerTokenAndStatesUnits) {
  const std::string input = TempPath("hidden.safetensors");
  CommandResult r =
      RunCli({"make-input", "--output", input, "--rows", "8", "--hidden-size",
              std::to_string(kHidden), "--vocab", std::to_string(kVocab), "--reference"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = RunCli({"score", "--target", Target(), "--head", "policy", "--reference-head", "reference",
              "--input", input, "--entropy", "--forward-kl", "--reverse-kl", "--jsd-beta", "0.5",
              "--top-k", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  std::vector<std::string> header, rows;
  for (const std::string& line : lines) (line[0] == '#' ? header : rows).push_back(line);
  std::string all_header;
  for (const std::string& h : header) all_header += h + "\n";
  EXPECT_THAT(all_header, HasSubstr("nats"));
  EXPECT_THAT(all_header, HasSubstr("fwd KL = KL(ref || model)"));
  EXPECT_THAT(all_header, HasSubstr("rev KL = KL(model || ref)"));
  EXPECT_THAT(all_header, HasSubstr("beta = 0.5"));
  ASSERT_EQ(rows.size(), 9u) << r.out;  // column titles + 8 tokens
  EXPECT_THAT(rows[0], HasSubstr("target"));
  EXPECT_THAT(rows[0], HasSubstr("logprob"));
  EXPECT_THAT(rows[0], HasSubstr("entropy"));
  EXPECT_THAT(rows[0], HasSubstr("fwd KL"));
  EXPECT_THAT(rows[0], HasSubstr("rev KL"));
  EXPECT_THAT(rows[0], HasSubstr("JSD"));
  EXPECT_THAT(rows[0], HasSubstr("top-3"));
  EXPECT_THAT(rows[0], Not(HasSubstr("ref entropy")));  // not requested
  for (size_t i = 1; i < rows.size(); ++i) {
    const std::vector<std::string> cells = absl::StrSplit(rows[i], ' ', absl::SkipEmpty());
    // token, target, logprob, entropy, fwd KL, rev KL, JSD, then 3 id:logprob pairs.
    ASSERT_EQ(cells.size(), 10u) << rows[i];
    EXPECT_EQ(cells[0], std::to_string(i - 1));
    EXPECT_THAT(cells[9], HasSubstr(":"));
  }
  std::remove(input.c_str());
}

TEST_F(CliTest, BadInputFilesFailClearly) {
  const std::string garbage = TempPath("garbage.safetensors");
  std::ofstream(garbage) << "this is not a safetensors file";
  CommandResult r =
      RunCli({"score", "--target", Target(), "--head", "policy", "--input", garbage, "--entropy"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("logitserve-cli: error:"));
  EXPECT_THAT(r.err, HasSubstr(garbage));
  EXPECT_TRUE(r.out.empty());

  r = RunCli({"score", "--target", Target(), "--head", "policy", "--input",
              TempPath("missing.safetensors")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("missing.safetensors"));

  // A valid file without a model input tensor.
  const std::string no_model = TempPath("ids_only.safetensors");
  const std::vector<int32_t> ids = {1, 2};
  const std::vector<SafetensorsTensorToWrite> tensors = {
      {"target_ids",
       SafetensorsDType::kInt32,
       {2},
       absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(ids.data()), 8)}};
  ASSERT_TRUE(WriteSafetensors(no_model, tensors).ok());
  r = RunCli({"score", "--target", Target(), "--head", "policy", "--input", no_model});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("'hidden'"));
  EXPECT_THAT(r.err, HasSubstr("target_ids"));  // lists what the file has

  // Hidden states without a head name.
  const std::string hidden = TempPath("nohead.safetensors");
  ASSERT_EQ(
      RunCli({"make-input", "--output", hidden, "--rows", "2", "--hidden-size", "32"}).exit_code,
      0);
  r = RunCli({"score", "--target", Target(), "--input", hidden});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--head"));

  // A server-side rejection (wrong hidden size for the head) exits 1 with the server's message.
  r = RunCli({"score", "--target", Target(), "--head", "reference", "--input", hidden,
              "--hidden-size-is-not-a-flag"});
  EXPECT_EQ(r.exit_code, 2);  // unknown flag: usage error
  const std::string wide = TempPath("wide.safetensors");
  ASSERT_EQ(
      RunCli({"make-input", "--output", wide, "--rows", "2", "--hidden-size", "33"}).exit_code, 0);
  r = RunCli({"score", "--target", Target(), "--head", "policy", "--input", wide});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT"));
  for (const std::string& p : {garbage, no_model, hidden, wide}) std::remove(p.c_str());
}

TEST(CliNoServerTest, UnreachableServerExitsOneWithUnavailable) {
  const CommandResult r = RunCli({"health", "--target", "127.0.0.1:1", "--attempts", "2"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
}

}  // namespace
}  // namespace logitserve::client
