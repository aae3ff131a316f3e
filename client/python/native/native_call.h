// The Python client's native send path (issue 12, targets 1 and 2): a C ABI over gRPC C++ that
// sends a unary call whose message is a list of caller-owned buffers, without copying them.
//
// Why: grpcio copies every request into a slice while holding the GIL, after the package's own
// copy into a bytes object, so one Python process tops out at ~300 K tokens/s of bf16 H 4096
// hidden states on the H200 host whatever the server does (docs/PERFORMANCE.md), while the C++
// client moves 600-900 K. Here the message's large pieces become gRPC slices that point at the
// caller's memory (numpy arrays): no copy in user space, and ctypes releases the GIL for every
// call into this library, so the Python threads that issue chunks run in parallel.
//
// Loaded by logitserve/_native.py with ctypes; the library links only gRPC C++ (no protobuf):
// the package encodes the message, this library moves its bytes.
//
// Lifetime contract (what makes zero copy safe): a call keeps the caller's pieces referenced by
// gRPC until its transport lets go of the slices, which can be after the call completed (a
// cancelled call's frames may still be in a socket write). ls_call_released says when that has
// happened; until then the caller keeps every piece alive and unchanged, and only then calls
// ls_call_free. A call freed earlier (or a channel destroyed with calls in flight) is a
// use-after-free of the pieces' memory.
//
// Thread safety: every function may be called from any thread; a call handle is used by one
// thread at a time except ls_call_cancel, which may race with ls_call_wait.
#pragma once

#include <cstddef>
#include <cstdint>

// The library is built with hidden visibility; these are its only exported symbols.
#define LS_NATIVE_API __attribute__((visibility("default")))

extern "C" {

typedef struct ls_channel ls_channel;
typedef struct ls_call ls_call;

// ABI version of this header; the Python side refuses a library with another.
LS_NATIVE_API int ls_native_abi_version(void);

// A channel to `target` (any gRPC target: "host:port", "dns:///...", "unix:/path"). Channel
// arguments: n_args (key, value) pairs, string-valued where arg_strings[i] is non-null, else the
// integer arg_ints[i]. use_tls: 0 = plaintext; else TLS with the PEM strings given (null or
// empty root_certs = the system roots; client cert and key both or neither). Returns null and
// writes a message into error (error_size bytes, NUL-terminated) when the options are invalid.
LS_NATIVE_API ls_channel* ls_channel_create(const char* target, int use_tls, const char* root_certs,
                                            const char* client_cert, const char* client_key,
                                            int n_args, const char* const* arg_keys,
                                            const char* const* arg_strings, const int64_t* arg_ints,
                                            char* error, size_t error_size);
LS_NATIVE_API void ls_channel_destroy(ls_channel* channel);

// Starts a unary call of `method` ("/package.Service/Method") whose request message is the
// concatenation of n_pieces buffers (pieces[i], sizes[i] bytes): pieces of at least 64 KiB are
// sent in place (see the lifetime contract), smaller ones are copied. timeout_s <= 0: no
// deadline. Metadata: n_metadata (key, value) pairs. Never null.
LS_NATIVE_API ls_call* ls_call_start(ls_channel* channel, const char* method, int n_pieces,
                                     const void* const* pieces, const size_t* sizes,
                                     double timeout_s, int n_metadata,
                                     const char* const* metadata_keys,
                                     const char* const* metadata_values);

// Blocks until the call completed; returns its gRPC status code (0 = OK).
LS_NATIVE_API int ls_call_wait(ls_call* call);
// Asks gRPC to cancel the call (a no-op once it completed).
LS_NATIVE_API void ls_call_cancel(ls_call* call);
// After ls_call_wait: the status message (NUL-terminated) and the response message's bytes
// (valid until ls_call_free).
LS_NATIVE_API const char* ls_call_message(ls_call* call);
LS_NATIVE_API const void* ls_call_response(ls_call* call, size_t* size);
// Whether the call completed and gRPC holds none of its pieces any more.
LS_NATIVE_API int ls_call_released(ls_call* call);
// Drops the caller's handle. Requires ls_call_released (else the pieces' memory may still be
// read).
LS_NATIVE_API void ls_call_free(ls_call* call);

}  // extern "C"
