// The sidecar's native data plane: the kvstore.v1.BlockData service (proto/.../kvstore.proto).
//
// Python's gRPC cannot move payload bytes fast enough across hosts: each side copies every
// message twice in user space and its event loop thread saturates (README, "Sidecar benchmark").
// This C++ gRPC server streams leased host-tier slots out of the shared-memory segment, and the
// C++ client copies each received slice once into the caller's buffers.
//
// Each chunk is copied out of the segment (one memcpy) under its grant's lock, after checking the
// grant is neither revoked nor past its deadline; revoking takes the same lock. So once revoke()
// returns (Release calls it before ending the lease) or the deadline passes (set before the
// lease's own expiry), no byte of those slots is read again, whatever the transport still holds
// or however slowly the client reads: a reused slot never reaches the old grant's holder. A
// zero-copy slice of the mapping would be read by the transport at send time, possibly after
// the slot was reused for another tenant's block.
//
// A stream holds one of the stream limits' places until it ends, so a client that stops reading
// (HTTP/2 flow control then stalls the server's write: keepalive pings find dead peers only) or
// never sends its request must not hold it for good. As on the Python Get and Put (StreamPace), a
// stream that waits on its client for stream_idle_timeout_s is ended DEADLINE_EXCEEDED, and so is
// one whose waits together pass stream_idle_timeout_s by more than one second per
// min_stream_bytes_per_s bytes it moved (a client that takes a message just inside the idle
// timeout each time); one whose write is stalled past its grant's deadline is ended NOT_FOUND. A
// reaper thread (Reaper, streams.h) finds them; a stalled write never completes, so the reactor
// itself never runs to notice.
//
// The control plane stays in Python: GetSlots leases the blocks and registers a grant here (a
// random token naming segment regions, valid until the lease ends or its TTL passes); each
// ReadSlots presents the token and a range of those regions and receives their bytes in order,
// chunked; the client then ends the lease with Release, whose NOT_FOUND (the lease expired, slots
// may have been reused mid-copy) voids the copies exactly as on the shared-memory path.
//
// A C ABI for ctypes (kvstore/service/dataplane.py), not a Python module: functions return 0 or
// a gRPC status code and write a message into the caller's error buffer.
//
// This file: the server (grants, the ReadSlots reactor) and its C ABI; streams.h bounds the
// streams (how many, how long), transport.h the connections, client.cc is the client, wire.h the
// messages.

#include <grpc/grpc.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "streams.h"
#include "transport.h"
#include "wire.h"

namespace kvdp {
namespace {

struct Region {
  uint64_t offset;
  uint64_t nbytes;
};

// Regions of the segment a lease pins, readable until revoked or past the deadline. mutex is held
// while a chunk is checked and copied out, and by revoke(), so the two never interleave.
struct Grant {
  std::vector<Region> regions;
  Clock::time_point deadline;
  std::mutex mutex;
  bool revoked = false;

  bool live_locked() const { return !revoked && Clock::now() < deadline; }
};

constexpr double kMaxTtlS = 30 * 24 * 3600.0;  // a finite bound for the duration arithmetic

struct Counters {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> failed{0};
};

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// `presented` is "<scheme> <token>" with the scheme "Bearer" in any case (RFC 9110), as the
// gRPC port's check (kvstore/service/security.py token_matches); the token compared in constant time.
bool bearer_matches(const std::string& presented, const std::string& token) {
  static const std::string kScheme = "bearer";
  size_t space = presented.find(' ');
  if (space != kScheme.size()) return false;
  for (size_t i = 0; i < space; ++i)
    if (std::tolower(static_cast<unsigned char>(presented[i])) != kScheme[i]) return false;
  return constant_time_equal(presented.substr(space + 1), token);
}

class DataPlaneServer;

// One ReadSlots call: read the request, take its grant, write every region in chunks, finish.
// One operation is outstanding at a time, so the callbacks never run concurrently.
class ReadSlotsReactor : public grpc::ServerGenericBidiReactor {
 public:
  ReadSlotsReactor(DataPlaneServer* server, grpc::GenericCallbackServerContext* context);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

  // The status to end the stream with, if it has waited on its client for idle_timeout by now,
  // or for longer in all than idle_timeout and its bytes' allowance (StreamPace's rule), or its
  // write is stalled past its grant's deadline. Called by the reaper (any thread).
  std::optional<grpc::Status> overdue(Clock::time_point now, Clock::duration idle_timeout);
  grpc_call* call() const { return call_; }

 private:
  enum class Waiting { kNothing, kRequest, kWrite };

  void refuse(grpc::StatusCode code, const std::string& message);
  void write_next();
  void wait_on(Waiting what);  // before the operation starts: it may complete at once
  void took(uint64_t nbytes);  // the client took a message of nbytes payload bytes
  std::optional<grpc::Status> too_slow(Clock::time_point now, Clock::duration idle_timeout);

  DataPlaneServer* server_;
  grpc_call* call_;
  std::string client_;
  bool counted_ = false;  // holds one of the stream limits' places, and is reaped, until OnDone
  std::mutex waiting_mutex_;  // the four below: the callbacks write, the reaper reads
  Waiting waiting_on_ = Waiting::kNothing;
  Clock::time_point waiting_since_;
  Clock::duration waited_{0};  // the waits on the client that ended
  uint64_t moved_ = 0;  // payload bytes of the writes the client took
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  std::shared_ptr<Grant> grant_;
  size_t end_ = 0;  // regions [region_, end_) of the grant remain
  uint32_t chunk_bytes_ = 0;
  uint64_t writing_ = 0;  // payload bytes of the write in progress
  size_t region_ = 0;
  uint64_t offset_ = 0;
};

// Whom a stream counts against in StreamLimits: its kvstore-client metadata, else its peer.
std::string client_of(grpc::GenericCallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("kvstore-client");
  return it != metadata.end() ? std::string(it->second.data(), it->second.size()) : context->peer();
}

class DataPlaneServer : public grpc::CallbackGenericService {
 public:
  DataPlaneServer(const uint8_t* base, size_t size, std::string bearer, uint32_t max_chunk_bytes,
                  uint32_t max_streams, uint32_t max_streams_per_client, double stream_idle_timeout_s,
                  double min_stream_bytes_per_s)
      : streams(max_streams, max_streams_per_client),
        reaper(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(stream_idle_timeout_s))),
        idle_limit(idle_limit_name(stream_idle_timeout_s)), min_bytes_per_s(min_stream_bytes_per_s), base_(base), size_(size), bearer_(std::move(bearer)),
        max_chunk_bytes_(max_chunk_bytes) {}

  ~DataPlaneServer() override {
    reaper.stop();
    if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), size_);
  }

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    return new ReadSlotsReactor(this, context);
  }

  // deadline_s: CLOCK_MONOTONIC seconds (Python's time.monotonic(); libstdc++'s steady_clock reads
  // the same clock), so the caller can end the grant at an exact instant before its lease's.
  int grant(const std::string& token, std::vector<Region> regions, double deadline_s, char* err, size_t errlen) {
    double now_s = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
    if (!(deadline_s >= 0)) deadline_s = 0;  // NaN or negative: expired at once
    deadline_s = std::min(deadline_s, now_s + kMaxTtlS);
    for (const Region& r : regions) {
      if (r.offset > size_ || r.nbytes > size_ - r.offset) {
        set_error(err, errlen, "region [" + std::to_string(r.offset) + ", +" + std::to_string(r.nbytes) +
                                   ") lies outside the " + std::to_string(size_) + "-byte segment");
        return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
      }
    }
    auto entry = std::make_shared<Grant>();
    entry->regions = std::move(regions);
    entry->deadline = Clock::time_point(std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(deadline_s)));
    std::lock_guard<std::mutex> lock(mutex_);
    purge_expired_locked();
    grants_[token] = std::move(entry);
    return 0;
  }

  // Once this returns, no stream copies another byte of the grant's regions.
  void revoke(const std::string& token) {
    std::shared_ptr<Grant> entry;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = grants_.find(token);
      if (it == grants_.end()) return;
      entry = std::move(it->second);
      grants_.erase(it);
    }
    std::lock_guard<std::mutex> lock(entry->mutex);  // waits for a copy in progress
    entry->revoked = true;
  }

  // The grant a request names and the range of its regions it asks for, or a status saying why not.
  grpc::Status regions(const ReadRequest& request, std::shared_ptr<Grant>* grant, size_t* first_out,
                       size_t* end_out) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = grants_.find(request.grant);
    if (it == grants_.end())
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "unknown grant: its lease was released or never issued; call GetSlots again");
    if (it->second->deadline <= Clock::now()) {
      grants_.erase(it);
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "the grant's lease expired; call GetSlots again");
    }
    const std::vector<Region>& all = it->second->regions;
    uint64_t first = request.first_slot;
    uint64_t count = request.num_slots == 0 && first <= all.size() ? all.size() - first : request.num_slots;
    if (first + count > all.size())
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                          "slots [" + std::to_string(first) + ", " + std::to_string(first + count) +
                              ") asked of a grant of " + std::to_string(all.size()));
    *grant = it->second;
    *first_out = first;
    *end_out = first + count;
    return grpc::Status::OK;
  }

  bool authorized(grpc::GenericCallbackServerContext* context) const {
    if (bearer_.empty()) return true;
    const auto& metadata = context->client_metadata();
    auto it = metadata.find("authorization");
    if (it == metadata.end()) return false;
    return bearer_matches(std::string(it->second.data(), it->second.size()), bearer_);
  }

  size_t active_grants() {
    std::lock_guard<std::mutex> lock(mutex_);
    purge_expired_locked();
    return grants_.size();
  }

  const uint8_t* base() const { return base_; }
  uint32_t chunk_bytes(uint32_t asked) const { return chunk_size(asked, max_chunk_bytes_); }

  Counters counters;
  StreamLimits streams;
  Reaper<ReadSlotsReactor> reaper;
  const std::string idle_limit;  // "stream_idle_timeout_s=30", as the Python path's errors name it
  const double min_bytes_per_s;  // min_stream_bytes_per_s: each second of waits past idle_limit costs this
  std::unique_ptr<grpc::Server> server;
  std::atomic<bool> shut_down{false};

 private:
  static std::string idle_limit_name(double seconds) {
    char text[64];
    std::snprintf(text, sizeof text, "stream_idle_timeout_s=%g", seconds);  // Python's :g
    return text;
  }

  void purge_expired_locked() {
    auto now = Clock::now();
    for (auto it = grants_.begin(); it != grants_.end();) it = it->second->deadline <= now ? grants_.erase(it) : ++it;
  }

  const uint8_t* base_;
  size_t size_;
  std::string bearer_;
  uint32_t max_chunk_bytes_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<Grant>> grants_;
};

ReadSlotsReactor::ReadSlotsReactor(DataPlaneServer* server, grpc::GenericCallbackServerContext* context)
    : server_(server), call_(context->c_call()) {
  server_->counters.calls++;
  if (context->method() != kMethod) {
    refuse(grpc::StatusCode::UNIMPLEMENTED, "the data plane serves " + std::string(kMethod) + " only");
  } else if (!server_->authorized(context)) {
    refuse(grpc::StatusCode::UNAUTHENTICATED, "missing or wrong bearer token (metadata authorization: Bearer TOKEN)");
  } else {
    client_ = client_of(context);
    std::string why = server_->streams.begin(client_);
    counted_ = why.empty();
    if (counted_) {
      server_->reaper.track(this);
      wait_on(Waiting::kRequest);
      StartRead(&request_);
    } else {
      refuse(grpc::StatusCode::RESOURCE_EXHAUSTED, why);
    }
  }
}

void ReadSlotsReactor::refuse(grpc::StatusCode code, const std::string& message) {
  server_->counters.refused++;
  Finish(grpc::Status(code, message));
}

void ReadSlotsReactor::wait_on(Waiting what) {
  std::lock_guard<std::mutex> lock(waiting_mutex_);
  Clock::time_point now = Clock::now();
  if (waiting_on_ != Waiting::kNothing) waited_ += now - waiting_since_;
  waiting_on_ = what;
  waiting_since_ = now;
}

void ReadSlotsReactor::took(uint64_t nbytes) {
  std::lock_guard<std::mutex> lock(waiting_mutex_);
  moved_ += nbytes;
}

std::optional<grpc::Status> ReadSlotsReactor::overdue(Clock::time_point now, Clock::duration idle_timeout) {
  std::lock_guard<std::mutex> lock(waiting_mutex_);
  if (waiting_on_ == Waiting::kRequest && now - waiting_since_ >= idle_timeout)
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        server_->idle_limit + ": the client sent no ReadSlotsRequest for that long; the stream is "
                                              "ended (send the request as the stream opens)");
  if (waiting_on_ != Waiting::kWrite) return std::nullopt;
  if (now - waiting_since_ >= idle_timeout)
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        server_->idle_limit + ": the client took no ReadSlots message for that long; the stream is "
                                              "ended (read without pausing, or fewer slots per call)");
  if (std::optional<grpc::Status> slow = too_slow(now, idle_timeout)) return slow;
  if (now >= grant_->deadline)  // grant_ was set before the first kWrite, under this mutex since
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "the grant's lease ended during the stream: discard what arrived");
  return std::nullopt;
}

// StreamPace's rule (kvstore/service/limits.py), waiting_mutex_ held: the waits so far, the one
// in progress included, may pass idle_timeout by one second per min_bytes_per_s bytes moved.
std::optional<grpc::Status> ReadSlotsReactor::too_slow(Clock::time_point now, Clock::duration idle_timeout) {
  double waited_s = std::chrono::duration<double>(waited_ + (now - waiting_since_)).count();
  double allowed_s = std::chrono::duration<double>(idle_timeout).count() + moved_ / server_->min_bytes_per_s;
  if (waited_s <= allowed_s) return std::nullopt;
  char rate[32], waited[32];
  std::snprintf(rate, sizeof rate, "%.0f", server_->min_bytes_per_s);
  std::snprintf(waited, sizeof waited, "%.1f", waited_s);
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                      std::string("min_stream_bytes_per_s=") + rate + ": the stream waited " + waited +
                          " s on its client for " + std::to_string(moved_) + " bytes; waits past " +
                          server_->idle_limit + " must be paid for at that rate (read faster, or fewer slots "
                                                "per call)");
}

void ReadSlotsReactor::OnReadDone(bool ok) {
  wait_on(Waiting::kNothing);
  ReadRequest request;
  if (!ok) return refuse(grpc::StatusCode::INVALID_ARGUMENT, "ReadSlots needs one ReadSlotsRequest");
  if (!parse_request(&request_, &request))
    return refuse(grpc::StatusCode::INVALID_ARGUMENT, "malformed ReadSlotsRequest");
  grpc::Status status = server_->regions(request, &grant_, &region_, &end_);
  if (!status.ok()) return refuse(status.error_code(), status.error_message());
  chunk_bytes_ = server_->chunk_bytes(request.chunk_bytes);
  write_next();
}

void ReadSlotsReactor::write_next() {
  const std::vector<Region>& regions = grant_->regions;  // immutable once granted
  while (region_ < end_ && offset_ == regions[region_].nbytes) {
    ++region_;
    offset_ = 0;
  }
  if (region_ == end_) return Finish(grpc::Status::OK);
  const Region& region = regions[region_];
  uint64_t n = std::min<uint64_t>(chunk_bytes_, region.nbytes - offset_);
  std::string header(1, static_cast<char>(1 << 3 | 2));  // SlotBytes { bytes data = 1; }
  append_varint(&header, n);
  grpc::Slice slices[2];
  {
    std::lock_guard<std::mutex> lock(grant_->mutex);
    if (!grant_->live_locked()) {
      server_->counters.failed++;
      return Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                 "the grant's lease ended during the stream: discard what arrived"));
    }
    slices[1] = grpc::Slice(server_->base() + region.offset + offset_, n);  // the copy, under the lock
  }
  slices[0] = grpc::Slice(header);
  response_ = grpc::ByteBuffer(slices, 2);
  offset_ += n;
  writing_ = n;
  server_->counters.bytes += n;
  wait_on(Waiting::kWrite);
  StartWrite(&response_);
}

void ReadSlotsReactor::OnWriteDone(bool ok) {
  wait_on(Waiting::kNothing);
  if (!ok) {  // the client went away, or the call was cancelled (by it, the reaper or shutdown)
    server_->counters.failed++;
    return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was cancelled"));
  }
  took(writing_);
  write_next();
}

void ReadSlotsReactor::OnDone() {
  if (counted_) {
    server_->reaper.untrack(this);  // before the context (so call_) and this reactor go
    server_->streams.end(client_);
  }
  delete this;
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const char* cert_pem, const char* key_pem) {
  if (cert_pem == nullptr || key_pem == nullptr) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({key_pem, cert_pem});
  return grpc::SslServerCredentials(options);
}

}  // namespace
}  // namespace kvdp

using namespace kvdp;  // the C ABI below wraps the classes above

extern "C" {

// Bumped whenever a signature below changes: dataplane.py refuses a library of another version.
int kvdp_abi_version() { return 7; }

// Starts a server on address (HOST:PORT, port 0 picks one) over the segment file at segment_path,
// mapped read-only. cert_pem/key_pem: TLS (both or neither); bearer: required token, or NULL.
// max_streams, max_streams_per_client: concurrent ReadSlots calls past which one is refused.
// stream_idle_timeout_s: how long a stream may wait on its client (for its request, or for a
// write to be taken) before it is ended DEADLINE_EXCEEDED, and a connection may go without a
// stream before it is closed; min_stream_bytes_per_s: all of a stream's waits may pass that by
// one second per this many bytes it moved, else it is ended DEADLINE_EXCEEDED too. Returns a
// handle and the bound port, or NULL with a message.
void* kvdp_server_start(const char* address, const char* segment_path, const char* cert_pem, const char* key_pem,
                        const char* bearer, uint32_t max_chunk_bytes, uint32_t max_streams,
                        uint32_t max_streams_per_client, double stream_idle_timeout_s,
                        double min_stream_bytes_per_s, int* port, char* err, size_t errlen) {
  if (max_chunk_bytes == 0 || max_chunk_bytes > kMaxChunkBytes) {
    set_error(err, errlen, "max_chunk_bytes must be in (0, 16 MiB]");
    return nullptr;
  }
  if (max_streams == 0 || max_streams_per_client == 0) {
    set_error(err, errlen, "the stream limits must be positive");
    return nullptr;
  }
  if (!(stream_idle_timeout_s > 0 && stream_idle_timeout_s <= kMaxTtlS)) {  // also refuses NaN
    set_error(err, errlen, "stream_idle_timeout_s must be in (0, 30 days]");
    return nullptr;
  }
  if (!(min_stream_bytes_per_s > 0)) {  // also refuses NaN
    set_error(err, errlen, "min_stream_bytes_per_s must be positive");
    return nullptr;
  }
  int fd = open(segment_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    set_error(err, errlen, std::string("cannot open the segment ") + segment_path + ": " + std::strerror(errno));
    return nullptr;
  }
  struct stat st;
  std::string why;
  void* base = MAP_FAILED;
  if (fstat(fd, &st) != 0) {
    why = std::strerror(errno);
  } else if (st.st_size == 0) {
    why = "it is empty";
  } else if ((base = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0)) == MAP_FAILED) {
    why = std::strerror(errno);
  }
  close(fd);
  if (base == MAP_FAILED) {
    set_error(err, errlen, std::string("cannot map the segment ") + segment_path + ": " + why);
    return nullptr;
  }
  auto* server = new DataPlaneServer(static_cast<const uint8_t*>(base), st.st_size, bearer ? bearer : "",
                                     max_chunk_bytes, max_streams, max_streams_per_client, stream_idle_timeout_s,
                                     min_stream_bytes_per_s);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, server_credentials(cert_pem, key_pem), port);
  bound_transport(&builder, stream_idle_timeout_s);
  builder.RegisterCallbackGenericService(server);
  server->server = builder.BuildAndStart();
  if (server->server == nullptr || *port == 0) {
    set_error(err, errlen, std::string("cannot listen on ") + address + ": is it in use?");
    server->server.reset();
    delete server;
    return nullptr;
  }
  return server;
}

// Lets ReadSlots calls with this token read the n regions (any range of them, in order) until
// deadline_s (CLOCK_MONOTONIC seconds) or until revoked.
int kvdp_server_grant(void* handle, const uint8_t* token, size_t token_len, size_t n, const uint64_t* offsets,
                      const uint64_t* sizes, double deadline_s, char* err, size_t errlen) {
  std::vector<Region> regions(n);
  for (size_t i = 0; i < n; ++i) regions[i] = Region{offsets[i], sizes[i]};
  return static_cast<DataPlaneServer*>(handle)->grant(std::string(reinterpret_cast<const char*>(token), token_len),
                                                       std::move(regions), deadline_s, err, errlen);
}

void kvdp_server_revoke(void* handle, const uint8_t* token, size_t token_len) {
  static_cast<DataPlaneServer*>(handle)->revoke(std::string(reinterpret_cast<const char*>(token), token_len));
}

// out[0..4]: calls, payload bytes sent, calls refused, streams cut short, live grants.
void kvdp_server_counters(void* handle, uint64_t* out) {
  auto* server = static_cast<DataPlaneServer*>(handle);
  out[0] = server->counters.calls;
  out[1] = server->counters.bytes;
  out[2] = server->counters.refused;
  out[3] = server->counters.failed;
  out[4] = server->active_grants();
}

// Stops serving: in-flight calls get grace_s to finish, then are cancelled. The handle stays
// valid (grants, revocations and counters still work) until kvdp_server_free. Idempotent.
void kvdp_server_shutdown(void* handle, double grace_s) {
  auto* server = static_cast<DataPlaneServer*>(handle);
  if (server->server == nullptr || server->shut_down.exchange(true)) return;
  server->reaper.stop();  // no call reference outlives the server; the grace's end cancels any stall
  grace_s = std::min(std::max(grace_s, 0.0), kMaxTtlS);
  server->server->Shutdown(std::chrono::system_clock::now() +
                           std::chrono::duration_cast<std::chrono::system_clock::duration>(
                               std::chrono::duration<double>(grace_s)));
  server->server->Wait();
}

// Frees a handle after kvdp_server_shutdown (which it calls with no grace if needed); the segment
// is unmapped last.
void kvdp_server_free(void* handle) {
  auto* server = static_cast<DataPlaneServer*>(handle);
  kvdp_server_shutdown(handle, 0);
  server->server.reset();
  delete server;
}

}  // extern "C"
