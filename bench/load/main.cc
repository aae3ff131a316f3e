// logitserve-bench: load generator for a running logitserve server.
//
//   closed loop:  logitserve-bench --target 127.0.0.1:50051 --head policy --concurrency 32
//                   --duration 20s --tokens 128 --json out.json
//   open loop:    logitserve-bench --target ... --head policy --rate 500 --duration 20s
//
// Prints a progress line on stderr once per second and a summary on stdout; --json writes the
// report (count, rps, tokens_per_s, latency_p50_ms / p90 / p99, status_counts by gRPC code name).
// Exit status: 0 when the run happened (whatever the statuses), 1 for a usage, connection or head
// error before the run, 3 with --fail-on-error when any call was not OK, 4 when an OK response
// had output sizes that do not match the request.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "bench/load/load_generator.h"

int main(int argc, char** argv) {
  namespace lb = logitserve::bench;
  CLI::App app{"logitserve-bench: closed- or open-loop load on a logitserve server"};
  lb::LoadOptions o;
  std::string duration = "20s", warmup = "0s", timeout = "60s", arrivals = "poisson", json_path;
  bool quiet = false, fail_on_error = false;
  app.add_option("--target", o.target, "Server HOST:PORT")->capture_default_str();
  app.add_option("--head", o.head,
                 "Model head to score with (its hidden size comes from ListHeads)")
      ->required();
  app.add_option("--concurrency,-c", o.concurrency,
                 "Closed loop: workers sending back-to-back (ignored with --rate)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--rate", o.rate,
                 "Open loop: requests per second (0 = closed loop); latency counts from the "
                 "scheduled arrival")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--arrivals", arrivals, "Open-loop arrival process: poisson or fixed")
      ->check(CLI::IsMember({"poisson", "fixed"}))
      ->capture_default_str();
  app.add_option("--duration,-d", duration, "How long to send (20s, 500ms, 2m)")
      ->capture_default_str();
  app.add_option("--warmup", warmup, "Calls finishing in this first part are not counted")
      ->capture_default_str();
  app.add_option("--timeout", timeout, "Deadline of each call (of each stream with --stream)")
      ->capture_default_str();
  app.add_option("--connections", o.connections,
                 "HTTP/2 connections (workers spread over them; with --stream --rate: streams)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--tokens,-n", o.tokens, "Token rows N per request")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--hidden-dtype", o.hidden_dtype, "Hidden-state dtype: bf16 or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  app.add_option("--target-ids", o.target_ids,
                 "Target ids per row K (0 = none, 1 = shape [N], >1 = [N, K])")
      ->check(CLI::Range(0, 1 << 16))
      ->capture_default_str();
  app.add_option("--top-k", o.top_k, "top_k per row")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_flag("--entropy", o.entropy, "Ask for the model entropy");
  app.add_option("--reference-head", o.reference_head, "Reference head (sends reference_hidden)");
  app.add_option("--kl", o.kl, "KL outputs: none, forward, reverse, both (needs --reference-head)")
      ->check(CLI::IsMember({"none", "forward", "reverse", "both"}))
      ->capture_default_str();
  app.add_option("--distinct-requests", o.distinct_requests,
                 "Random request bodies built up front and cycled through")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of the request contents and arrivals")
      ->capture_default_str();
  app.add_flag("--stream", o.stream, "Use ScoreStream instead of Score");
  app.add_option("--tls-ca", o.tls_ca_file, "PEM root certificates: connect with TLS");
  app.add_option("--tls-cert", o.tls_cert_file, "PEM client certificate (mutual TLS)");
  app.add_option("--tls-key", o.tls_key_file, "PEM client private key (mutual TLS)");
  app.add_option("--tls-server-name", o.tls_server_name,
                 "Expected server certificate name when it differs from the target host");
  app.add_option("--token-file", o.token_file,
                 "File holding a bearer token, sent as `authorization: Bearer TOKEN`");
  app.add_option("--json", json_path, "Write the report as JSON to this file");
  app.add_flag("--quiet,-q", quiet, "No progress line");
  app.add_flag("--fail-on-error", fail_on_error, "Exit 3 when any call was not OK");
  CLI11_PARSE(app, argc, argv);

  for (auto [text, out] : {std::pair{&duration, &o.duration}, std::pair{&warmup, &o.warmup},
                           std::pair{&timeout, &o.timeout}}) {
    auto parsed = lb::ParseDuration(*text);
    if (!parsed.ok()) {
      std::fprintf(stderr, "logitserve-bench: %s\n",
                   std::string(parsed.status().message()).c_str());
      return 1;
    }
    *out = *parsed;
  }
  o.poisson = arrivals == "poisson";
  if (!quiet) {
    const bool tty = isatty(STDERR_FILENO) != 0;
    o.progress = [tty](const std::string& line) {
      std::fprintf(stderr, tty ? "\r%s\x1b[K" : "%s\n", line.c_str());
      std::fflush(stderr);
    };
  }

  absl::StatusOr<lb::LoadReport> report = lb::RunLoad(o);
  if (!quiet && isatty(STDERR_FILENO)) std::fprintf(stderr, "\n");
  if (!report.ok()) {
    std::fprintf(stderr, "logitserve-bench: %s\n", report.status().ToString().c_str());
    return 1;
  }
  const nlohmann::json j = report->ToJson();
  std::printf(
      "%s: %llu calls in %.2f s: %.1f req/s, %.0f tokens/s; latency p50 %.3f ms, "
      "p90 %.3f ms, p99 %.3f ms; server compute %.0f us, queue %.0f us (mean); "
      "status %s; wrong %llu\n",
      o.rate > 0 ? "open loop" : "closed loop", static_cast<unsigned long long>(report->count),
      report->elapsed_s, report->rps, report->tokens_per_s, report->latency_p50_ms,
      report->latency_p90_ms, report->latency_p99_ms, report->server_compute_us_mean,
      report->server_queue_us_mean, j["status_counts"].dump().c_str(),
      static_cast<unsigned long long>(report->wrong));
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << j.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "logitserve-bench: cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  if (report->wrong > 0) {
    std::fprintf(stderr, "logitserve-bench: %llu OK responses had the wrong output sizes\n",
                 static_cast<unsigned long long>(report->wrong));
    return 4;
  }
  if (fail_on_error) {
    const auto it = report->status_counts.find("OK");
    const uint64_t ok = it == report->status_counts.end() ? 0 : it->second;
    if (ok != report->count) return 3;
  }
  return 0;
}
