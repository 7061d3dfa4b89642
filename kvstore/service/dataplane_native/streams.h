// What bounds the data plane's streams (see server.cc): how many run at once (StreamLimits)
// and how long one may wait on its client (Reaper). Knows nothing of grants or of the bytes.

#pragma once

#include <grpc/grpc.h>
#include <grpcpp/support/status.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"

namespace kvdp {

// Streams in progress, in all and per client (its kvstore-client metadata, else its peer): past
// either limit a call is refused, not queued, like the KVStore service's Get and Put.
class StreamLimits {
 public:
  StreamLimits(uint32_t limit, uint32_t per_client) : limit_(limit), per_client_(per_client) {}

  // Empty when the stream may start (it then counts until end(client)); else why not.
  std::string begin(const std::string& client) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (active_ >= limit_)
      return "max_concurrent_transfers=" + std::to_string(limit_) +
             " streams are already running; retry shortly or raise the limit";
    if (by_client_[client] >= per_client_)
      return "max_streams_per_client=" + std::to_string(per_client_) +
             ": this client already runs that many streams; wait for one to finish";
    ++active_;
    ++by_client_[client];
    return "";
  }

  void end(const std::string& client) {
    std::lock_guard<std::mutex> lock(mutex_);
    --active_;
    if (--by_client_[client] == 0) by_client_.erase(client);
  }

 private:
  uint32_t limit_;
  uint32_t per_client_;
  std::mutex mutex_;
  uint32_t active_ = 0;
  std::map<std::string, uint32_t> by_client_;
};

// Ends the streams that waited on their client too long (Stream::overdue), scanning
// every idle_timeout / 4, within [10 ms, 1 s]: a stream ends between idle_timeout and that much
// later.
//
// Why this is race-free: a stream is in live_ from track() until untrack(), both under mutex_,
// and it calls untrack() in its OnDone, so its context (hence its grpc_call) is valid while it
// is in live_: gRPC destroys the context only after OnDone returns. The
// scan holds mutex_, so every reactor it reads is alive, and it takes a reference to the core
// call of each overdue one; it cancels them after letting go of mutex_. A referenced call
// outlives its reactor and cancelling one that already ended is a no-op, so a stream finishing
// meanwhile is harmless; and as no lock of ours is held while gRPC runs, whatever gRPC runs on
// this thread cannot deadlock on one. A stream that moves on just as it is judged overdue is
// still ended: it had waited the whole timeout, which then merely fired a moment late.
//
// The cancelled stream's pending operation completes with ok=false on gRPC's threads, and the
// reactor ends the usual way (a write so ended counts as cut short, a read as refused; OnDone
// gives the place back). The status goes out at once (as trailers, then RST_STREAM), not
// behind the stalled bytes.
//
// Stream: a reactor with std::optional<grpc::Status> overdue(Clock::time_point now,
// Clock::duration idle_timeout) (the status to end it with, if any; callable from any thread)
// and grpc_call* call() const; it calls track() once counted and untrack() in its OnDone.
template <typename Stream>
class Reaper {
 public:
  explicit Reaper(Clock::duration idle_timeout)
      : idle_timeout_(idle_timeout),
        period_(std::clamp<Clock::duration>(idle_timeout / 4, std::chrono::milliseconds(10), std::chrono::seconds(1))),
        thread_([this] { run(); }) {}

  ~Reaper() { stop(); }

  void track(Stream* reactor) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.insert(reactor);
  }

  // Once this returns the reaper no longer reads the reactor.
  void untrack(Stream* reactor) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.erase(reactor);
  }

  // Idempotent; no call reference is held once it returns.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, period_, [this] { return stopping_; })) {
      std::vector<std::pair<grpc_call*, grpc::Status>> overdue;
      Clock::time_point now = Clock::now();
      for (Stream* reactor : live_) {
        if (std::optional<grpc::Status> status = reactor->overdue(now, idle_timeout_)) {
          grpc_call_ref(reactor->call());
          overdue.emplace_back(reactor->call(), std::move(*status));
        }
      }
      lock.unlock();
      for (const auto& [call, status] : overdue) {
        grpc_call_cancel_with_status(call, static_cast<grpc_status_code>(status.error_code()),
                                     status.error_message().c_str(), nullptr);
        grpc_call_unref(call);
      }
      lock.lock();
    }
  }

  Clock::duration idle_timeout_;
  Clock::duration period_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::set<Stream*> live_;
  std::thread thread_;  // last: it starts once the rest is built
};

}  // namespace kvdp
