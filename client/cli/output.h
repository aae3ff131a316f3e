// logitserve-cli's output: human tables and JSON for Score and ListHeads results.
//
// JSON: an object with every array the server returned (empty arrays omitted), named as in
// logitserve.v1.ScoreResponse. Numbers are written with enough digits to read back the exact
// fp32 value; non-finite values, which JSON cannot carry as numbers, are the strings "nan",
// "inf" and "-inf". Every value is in nats.
//
// Thread safety: free functions without shared state.
#pragma once

#include <string>

#include "client/client.h"
#include "logitserve/v1/logitserve.pb.h"
#include "nlohmann/json.hpp"

namespace logitserve::client {

// One line per token: token index, then only the requested columns (target id and log-prob,
// entropy, reference entropy, forward KL, reverse KL, JSD, top-k list), under header lines that
// state the units (nats) and the KL directions. Per-sequence sums follow when present.
// `request` supplies the target ids and the names shown in the header.
std::string FormatScoreTable(const v1::ScoreRequest& request, const ScoreOutput& output);

nlohmann::ordered_json ScoreToJson(const ScoreOutput& output);

std::string FormatHeadsTable(const ListHeadsOutput& heads);
nlohmann::ordered_json HeadsToJson(const ListHeadsOutput& heads);

}  // namespace logitserve::client
