#include "native_call.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "grpcpp/completion_queue.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/slice.h"

namespace {

constexpr int kAbiVersion = 1;
// Pieces below this are copied: a slice of its own costs more than the copy.
constexpr size_t kInPlaceBytes = size_t{64} << 10;

}  // namespace

// A channel and the completion queue of its calls, drained by a thread of its own. Not gRPC's
// callback API: that one shares a process-wide queue and "nexting" threads among every channel,
// created and torn down with the channels, which crashed when channels came and went in a process
// that also runs grpcio (a second gRPC core; tests/test_native.py's churn test).
struct ls_channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
  grpc::CompletionQueue cq;
  std::thread poller;  // runs Poll() until cq is shut down (ls_channel_destroy)

  void Poll();
};

// One unary call. References: the caller's handle, the completion (dropped by the poller), and
// one per in-place slice (gRPC drops those when its transport is done with the bytes); the last
// one deletes the call.
struct ls_call {
  grpc::ClientContext context;
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  grpc::Status status;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
  std::atomic<int> refs{2};
  std::atomic<int> slices_held{0};

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
  int code = 0;
  std::string message;  // a copy: grpc::Status::error_message() returns by value
  std::string response_bytes;

  void Unref() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
  // On the poller thread, once Finish's tag came back.
  void Complete();
};

namespace {

void ReleaseSlice(void* user_data) {
  auto* call = static_cast<ls_call*>(user_data);
  call->slices_held.fetch_sub(1, std::memory_order_acq_rel);
  call->Unref();
}

void WriteError(const std::string& text, char* error, size_t error_size) {
  if (error == nullptr || error_size == 0) return;
  const size_t n = std::min(text.size(), error_size - 1);
  text.copy(error, n);
  error[n] = '\0';
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  out.reserve(buffer.Length());
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

}  // namespace

void ls_channel::Poll() {
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) static_cast<ls_call*>(tag)->Complete();
}

void ls_call::Complete() {
  std::string bytes = Flatten(response);
  response.Clear();
  request.Clear();  // gRPC's own references to the slices may outlive this one
  {
    std::lock_guard<std::mutex> lock(mu);
    code = status.error_code();
    message = status.error_message();
    response_bytes = std::move(bytes);
    done = true;
  }
  cv.notify_all();
  Unref();
}

extern "C" {

int ls_native_abi_version(void) { return kAbiVersion; }

ls_channel* ls_channel_create(const char* target, int use_tls, const char* root_certs,
                              const char* client_cert, const char* client_key, int n_args,
                              const char* const* arg_keys, const char* const* arg_strings,
                              const int64_t* arg_ints, char* error, size_t error_size) {
  if (target == nullptr || *target == '\0') {
    WriteError("empty target", error, error_size);
    return nullptr;
  }
  const bool has_cert = client_cert != nullptr && *client_cert != '\0';
  const bool has_key = client_key != nullptr && *client_key != '\0';
  if (has_cert != has_key) {
    WriteError("client_cert and client_key must be given together", error, error_size);
    return nullptr;
  }
  grpc::ChannelArguments args;
  for (int i = 0; i < n_args; ++i) {
    if (arg_keys[i] == nullptr) continue;
    if (arg_strings[i] != nullptr) {
      args.SetString(arg_keys[i], arg_strings[i]);
    } else {
      // Channel arguments are C ints; a value outside is the caller's error, clamped here.
      const int64_t v = std::clamp<int64_t>(arg_ints[i], INT32_MIN, INT32_MAX);
      args.SetInt(arg_keys[i], static_cast<int>(v));
    }
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (use_tls != 0) {
    grpc::SslCredentialsOptions ssl;
    if (root_certs != nullptr) ssl.pem_root_certs = root_certs;
    if (has_cert) {
      ssl.pem_cert_chain = client_cert;
      ssl.pem_private_key = client_key;
    }
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  auto* channel = new ls_channel;
  channel->channel = grpc::CreateCustomChannel(target, credentials, args);
  channel->stub = std::make_unique<grpc::GenericStub>(channel->channel);
  channel->poller = std::thread([channel] { channel->Poll(); });
  return channel;
}

void ls_channel_destroy(ls_channel* channel) {
  channel->cq.Shutdown();  // every call has completed (the caller's contract): Poll returns
  channel->poller.join();
  delete channel;
}

ls_call* ls_call_start(ls_channel* channel, const char* method, int n_pieces,
                       const void* const* pieces, const size_t* sizes, double timeout_s,
                       int n_metadata, const char* const* metadata_keys,
                       const char* const* metadata_values) {
  auto* call = new ls_call;
  if (timeout_s > 0) {
    call->context.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                   std::chrono::duration<double>(timeout_s)));
  }
  for (int i = 0; i < n_metadata; ++i) {
    call->context.AddMetadata(metadata_keys[i], metadata_values[i]);
  }
  // Consecutive small pieces share one copied slice; large ones are referenced in place.
  std::vector<grpc::Slice> slices;
  std::string small;
  for (int i = 0; i < n_pieces; ++i) {
    const char* p = static_cast<const char*>(pieces[i]);
    if (sizes[i] < kInPlaceBytes) {
      small.append(p, sizes[i]);
      continue;
    }
    if (!small.empty()) slices.emplace_back(std::exchange(small, std::string()));
    call->refs.fetch_add(1, std::memory_order_relaxed);
    call->slices_held.fetch_add(1, std::memory_order_relaxed);
    slices.emplace_back(const_cast<char*>(p), sizes[i], &ReleaseSlice, call);
  }
  if (!small.empty()) slices.emplace_back(std::move(small));
  call->request = grpc::ByteBuffer(slices.data(), slices.size());
  slices.clear();  // the ByteBuffer holds its own references
  call->reader =
      channel->stub->PrepareUnaryCall(&call->context, method, call->request, &channel->cq);
  call->reader->StartCall();
  call->reader->Finish(&call->response, &call->status, call);
  return call;
}

int ls_call_wait(ls_call* call) {
  std::unique_lock<std::mutex> lock(call->mu);
  call->cv.wait(lock, [call] { return call->done; });
  return call->code;
}

void ls_call_cancel(ls_call* call) { call->context.TryCancel(); }

const char* ls_call_message(ls_call* call) { return call->message.c_str(); }

const void* ls_call_response(ls_call* call, size_t* size) {
  *size = call->response_bytes.size();
  return call->response_bytes.data();
}

int ls_call_released(ls_call* call) {
  std::lock_guard<std::mutex> lock(call->mu);
  return call->done && call->slices_held.load(std::memory_order_acquire) == 0 ? 1 : 0;
}

void ls_call_free(ls_call* call) { call->Unref(); }

}  // extern "C"
