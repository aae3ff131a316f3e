#include "client/session_stream.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/call_end.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "logitserve/v1/logitserve.grpc.pb.h"  // SerializationTraits for the messages

namespace logitserve::client {
namespace {

constexpr const char* kScoreStreamMethod = "/logitserve.v1.Scorer/ScoreStream";

void* TagPtr(intptr_t tag) { return reinterpret_cast<void*>(tag); }

}  // namespace

SessionStream::SessionStream(grpc::GenericStub& stub, const std::string& bearer_token) {
  if (!bearer_token.empty()) {
    context_.AddMetadata("authorization", absl::StrCat("Bearer ", bearer_token));
  }
  call_ = stub.PrepareCall(&context_, kScoreStreamMethod, &cq_);
  call_->StartCall(TagPtr(kStart));
  ++outstanding_;
}

SessionStream::~SessionStream() {
  CancelAndDrain(context_, cq_, call_.get(), outstanding_, TagPtr(kFinish));
}

bool SessionStream::Await(Tag tag, absl::Time deadline, bool* timed_out) {
  while ((arrived_ & tag) == 0) {
    void* got = nullptr;
    bool ok = false;
    const grpc::CompletionQueue::NextStatus st =
        cq_.AsyncNext(&got, &ok, absl::ToChronoTime(deadline));
    if (st != grpc::CompletionQueue::GOT_EVENT) {
      *timed_out = st == grpc::CompletionQueue::TIMEOUT;
      broken_ = true;
      return false;
    }
    --outstanding_;
    arrived_ |= reinterpret_cast<intptr_t>(got);
    if (!ok) broken_ = true;
  }
  arrived_ &= ~static_cast<intptr_t>(tag);
  return !broken_;
}

absl::StatusOr<v1::ScoreResponse> SessionStream::Call(const v1::ScoreRequest& request,
                                                      absl::Time deadline, bool* broken) {
  *broken = false;
  bool timed_out = false;
  auto fail = [&]() -> absl::Status {
    *broken = true;
    broken_ = true;
    return timed_out ? absl::DeadlineExceededError("Score on the session stream: deadline exceeded")
                     : absl::UnavailableError("the session stream failed");
  };
  if (broken_) return fail();
  if (!started_) {
    if (!Await(kStart, deadline, &timed_out)) return fail();
    started_ = true;
  }
  v1::ScoreStreamRequest message;
  *message.mutable_request() = request;  // no tensor bytes: a few hundred bytes
  grpc::ByteBuffer body;
  bool own = false;
  if (!grpc::SerializationTraits<v1::ScoreStreamRequest>::Serialize(message, &body, &own).ok()) {
    return absl::InternalError("could not serialize a ScoreStreamRequest");
  }
  grpc::ByteBuffer reply;
  call_->Write(body, TagPtr(kWrite));
  call_->Read(&reply, TagPtr(kRead));
  outstanding_ += 2;
  if (!Await(kWrite, deadline, &timed_out) || !Await(kRead, deadline, &timed_out)) return fail();
  v1::ScoreStreamResponse answer;
  if (!grpc::SerializationTraits<v1::ScoreStreamResponse>::Deserialize(&reply, &answer).ok()) {
    return fail();
  }
  if (answer.status_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(answer.status_code()),
                        answer.status_message());
  }
  return std::move(*answer.mutable_response());
}

}  // namespace logitserve::client
