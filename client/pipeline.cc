#include "client/pipeline.h"

#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace logitserve::client {

PipelineOutcome RunPipeline(v1::Scorer::Stub& stub, grpc::ClientContext& context, size_t chunks,
                            absl::FunctionRef<v1::ScoreRequest(size_t)> make_chunk, int depth) {
  PipelineOutcome outcome;
  std::vector<bool> answered(chunks, false);
  std::vector<v1::ScoreResponse> responses(chunks);
  std::unique_ptr<grpc::ClientReaderWriter<v1::ScoreRequest, v1::ScoreResponse>> stream =
      stub.ScoreStream(&context);

  // Shared with the writer thread.
  absl::Mutex mu;
  size_t sent = 0;      // chunks written (or being written)
  size_t received = 0;  // responses read
  bool stop = false;    // a chunk failed, or the stream broke: write nothing more
  const size_t window = static_cast<size_t>(depth < 1 ? 1 : depth);
  auto may_send = [&]() {  // REQUIRES: mu held
    return stop || sent - received < window;
  };

  std::thread writer([&] {
    for (size_t i = 0; i < chunks; ++i) {
      {
        absl::MutexLock lock(&mu, absl::Condition(&may_send));
        if (stop) break;
        ++sent;
      }
      v1::ScoreRequest chunk = make_chunk(i);
      chunk.set_request_id(absl::StrCat(i));
      if (!stream->Write(chunk)) break;  // the call ended (cancelled, failed): Finish says why
    }
    stream->WritesDone();
  });

  v1::ScoreResponse response;
  size_t done = 0;
  while (done < chunks && stream->Read(&response)) {
    size_t index = 0;
    if (!absl::SimpleAtoi(response.request_id(), &index) || index >= chunks || answered[index]) {
      outcome.failed_chunk = 0;
      outcome.chunk_error = absl::InternalError(absl::StrCat(
          "ScoreStream answered an unknown chunk request_id '", response.request_id(), "'"));
      break;
    }
    answered[index] = true;
    ++done;
    if (response.status_code() != 0) {
      const int code = response.status_code();
      outcome.failed_chunk = static_cast<int64_t>(index);
      outcome.chunk_error =
          absl::Status(code >= 1 && code <= 16 ? static_cast<absl::StatusCode>(code)
                                               : absl::StatusCode::kUnknown,
                       response.status_message());
      break;
    }
    responses[index] = std::move(response);
    response = v1::ScoreResponse();
    absl::MutexLock lock(&mu);
    ++received;
  }
  if (done < chunks) {
    // A failed chunk (or a broken stream): the server drops the chunks still queued, and the
    // writer stops (a pending Write returns false once the call is cancelled).
    {
      absl::MutexLock lock(&mu);
      stop = true;
    }
    context.TryCancel();
  }
  writer.join();
  if (done == chunks) {
    // Drain the (absent) rest so Finish reports the call's real status.
    while (stream->Read(&response)) {
    }
  }
  outcome.stream_status = stream->Finish();
  if (outcome.failed_chunk < 0 && outcome.stream_status.ok()) {
    if (done < chunks) {
      outcome.stream_status = grpc::Status(
          grpc::StatusCode::INTERNAL,
          absl::StrCat("ScoreStream ended after ", done, " of ", chunks, " chunk responses"));
    } else {
      outcome.responses = std::move(responses);
    }
  }
  return outcome;
}

}  // namespace logitserve::client
