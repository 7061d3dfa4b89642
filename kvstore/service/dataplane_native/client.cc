// The data plane's client (see server.cc): one channel per sidecar, a blocking ReadSlots call per
// read on its own completion queue, each received slice copied once into the caller's buffers.
// Its C ABI is loaded with ctypes by kvstore/service/dataplane.py.

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "wire.h"

namespace kvdp {
namespace {

struct DataPlaneClient {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
  std::string bearer;
  std::string client_id;
};

// Where received payload bytes go: the caller's buffers, filled in order.
class Destinations {
 public:
  Destinations(size_t n, uint8_t* const* dsts, const uint64_t* sizes) : dsts_(dsts, dsts + n), sizes_(sizes, sizes + n) {
    for (size_t i = 0; i < n; ++i) expected_ += sizes[i];
  }

  bool write(const uint8_t* p, size_t n) {
    while (n > 0) {
      if (index_ == dsts_.size()) return false;
      size_t here = std::min<uint64_t>(n, sizes_[index_] - offset_);
      std::memcpy(dsts_[index_] + offset_, p, here);
      p += here;
      n -= here;
      offset_ += here;
      received_ += here;
      if (offset_ == sizes_[index_]) {
        ++index_;
        offset_ = 0;
      }
    }
    return true;
  }

  uint64_t received() const { return received_; }
  uint64_t expected() const { return expected_; }

 private:
  std::vector<uint8_t*> dsts_;
  std::vector<uint64_t> sizes_;
  size_t index_ = 0;
  uint64_t offset_ = 0;
  uint64_t received_ = 0;
  uint64_t expected_ = 0;
};

// Copies the data fields of one SlotBytes message into dsts; false when it is malformed or overflows.
bool consume_message(grpc::ByteBuffer* buffer, Destinations* dsts) {
  std::vector<grpc::Slice> slices = slices_of(buffer);
  SliceReader reader(slices);
  while (!reader.done()) {
    uint64_t tag, n;
    if (!reader.varint(&tag)) return false;
    if (tag != (1 << 3 | 2)) {
      if (!reader.skip_field(tag & 7)) return false;
      continue;
    }
    if (!reader.varint(&n)) return false;
    if (!reader.take(n, [dsts](const uint8_t* p, size_t k) { return dsts->write(p, k); })) return false;
  }
  return true;
}

// The blocking ReadSlots call on its own completion queue (thread-safe: one queue per call).
class ReadCall {
 public:
  explicit ReadCall(DataPlaneClient* client, double timeout_s) {
    if (timeout_s > 0)
      context_.set_deadline(std::chrono::system_clock::now() +
                            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                std::chrono::duration<double>(timeout_s)));
    if (!client->bearer.empty()) context_.AddMetadata("authorization", "Bearer " + client->bearer);
    if (!client->client_id.empty()) context_.AddMetadata("kvstore-client", client->client_id);
    call_ = client->stub->PrepareCall(&context_, kMethod, &queue_);
  }

  ~ReadCall() {
    queue_.Shutdown();
    void* tag;
    bool ok;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  bool start(const std::string& request) {
    grpc::Slice slice(request);
    grpc::ByteBuffer buffer(&slice, 1);
    call_->StartCall(nullptr);
    if (!wait()) return false;
    call_->Write(buffer, nullptr);
    if (!wait()) return false;
    call_->WritesDone(nullptr);
    return wait();
  }

  bool read(grpc::ByteBuffer* buffer) {
    call_->Read(buffer, nullptr);
    return wait();
  }

  grpc::Status finish() {
    grpc::Status status;
    call_->Finish(&status, nullptr);
    wait();
    return status;
  }

  void cancel() { context_.TryCancel(); }

 private:
  bool wait() {
    void* tag;
    bool ok = false;
    return queue_.Next(&tag, &ok) && ok;
  }

  grpc::ClientContext context_;
  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
};

// A listener that stopped accepting still completes TCP connects (the kernel does), and a call
// would wait out its whole deadline for the server's HTTP/2 settings: a connection that is not
// ready within this (or the call's timeout, if shorter) fails the read kNotConnected instead.
// A channel in TRANSIENT_FAILURE (its last connect failed: refused, reset) fails at once, as a
// call without wait-for-ready would.
constexpr double kConnectTimeoutS = 3.0;

bool connected(DataPlaneClient* client, double timeout_s) {
  double bound = timeout_s > 0 ? std::min(timeout_s, kConnectTimeoutS) : kConnectTimeoutS;
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(bound));
  grpc_connectivity_state state = client->channel->GetState(true);  // an idle channel starts connecting
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) return false;
    if (!client->channel->WaitForStateChange(state, deadline)) return false;
    state = client->channel->GetState(true);
  }
  return true;
}

grpc::ChannelArguments channel_arguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt("grpc.http2.lookahead_bytes", kLookaheadBytes);
  args.SetInt("grpc.http2.bdp_probe", 0);  // the fixed window above beats probing on loopback
  args.SetInt("grpc.keepalive_time_ms", 30000);  // a peer gone silently fails a read without a deadline
  args.SetInt("grpc.keepalive_timeout_ms", 10000);
  // The server closes a connection idle for its stream_idle_timeout_s (transport.h), and a call
  // that crosses its GOAWAY fails UNAVAILABLE or, rarely, hangs until its deadline. Closing ours
  // first, after 1 to 2 s idle (gRPC's least), leaves no such race for a timeout above 2 s.
  args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, 1000);
  return args;
}

}  // namespace
}  // namespace kvdp

using namespace kvdp;  // the C ABI below wraps the classes above

extern "C" {

// A channel to a data plane at target (HOST:PORT). root_pem: TLS roots, or NULL for plaintext.
void* kvdp_client_open(const char* target, const char* root_pem, const char* bearer, const char* client_id,
                       char* err, size_t errlen) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (root_pem != nullptr) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = root_pem;
    credentials = grpc::SslCredentials(options);
  }
  auto channel = grpc::CreateCustomChannel(target, credentials, channel_arguments());
  if (channel == nullptr) {
    set_error(err, errlen, std::string("cannot create a channel to ") + target);
    return nullptr;
  }
  auto* client = new DataPlaneClient{channel, std::make_unique<grpc::GenericStub>(channel), bearer ? bearer : "",
                                     client_id ? client_id : ""};
  return client;
}

// ReadSlots with grant, its slots [first_slot, first_slot + n): the stream's bytes fill dsts[0..n)
// (sizes[i] bytes each) in order. Returns
// 0 when exactly that many bytes arrived, a gRPC status code when the call failed, -1 when the
// stream's bytes did not fit the buffers (dsts then hold partial bytes the caller must discard),
// or -2 when no connection was ready (kNotConnected: nothing was sent).
int kvdp_client_read(void* handle, const uint8_t* grant, size_t grant_len, uint32_t first_slot, size_t n,
                     uint8_t* const* dsts, const uint64_t* sizes, uint32_t chunk_bytes, double timeout_s, char* err,
                     size_t errlen) {
  auto* client = static_cast<DataPlaneClient*>(handle);
  if (n == 0) return 0;  // num_slots 0 would mean "through the last"
  if (!connected(client, timeout_s)) {
    int bound_ms = static_cast<int>(1000 * (timeout_s > 0 ? std::min(timeout_s, kConnectTimeoutS) : kConnectTimeoutS));
    set_error(err, errlen, "no connection to the data plane was ready within " + std::to_string(bound_ms) +
                               " ms (refused, or its listener is not accepting)");
    return kNotConnected;
  }
  Destinations destinations(n, dsts, sizes);
  ReadCall call(client, timeout_s);
  bool fits = true;
  ReadRequest request{std::string(reinterpret_cast<const char*>(grant), grant_len), chunk_bytes, first_slot,
                      clamp32(n)};
  if (call.start(encode_request(request))) {
    grpc::ByteBuffer buffer;
    while (call.read(&buffer)) {
      if (!consume_message(&buffer, &destinations)) {
        fits = false;
        call.cancel();
        break;
      }
    }
  }
  grpc::Status status = call.finish();
  if (!fits) {
    set_error(err, errlen, "the ReadSlots stream sent more bytes than the " + std::to_string(destinations.expected()) +
                               " expected, or a malformed message");
    return kProtocolError;
  }
  if (!status.ok()) {
    set_error(err, errlen, status.error_message());
    return static_cast<int>(status.error_code());
  }
  if (destinations.received() != destinations.expected()) {
    set_error(err, errlen, "the ReadSlots stream ended after " + std::to_string(destinations.received()) + " of " +
                               std::to_string(destinations.expected()) + " bytes");
    return kProtocolError;
  }
  return 0;
}

void kvdp_client_close(void* handle) { delete static_cast<DataPlaneClient*>(handle); }

}  // extern "C"
