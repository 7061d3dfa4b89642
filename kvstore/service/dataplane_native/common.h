// Constants and helpers shared by the data plane's server and client (see server.cc).

#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvdp {

constexpr char kMethod[] = "/kvstore.v1.BlockData/ReadSlots";
constexpr int kProtocolError = -1;  // the stream's bytes do not match what the caller expects
constexpr uint32_t kMaxChunkBytes = 16u << 20;
constexpr int kLookaheadBytes = 64 << 20;  // HTTP/2 stream window: a whole transfer in flight

using Clock = std::chrono::steady_clock;

inline void set_error(char* err, size_t errlen, const std::string& message) {
  if (err != nullptr && errlen > 0) std::snprintf(err, errlen, "%s", message.c_str());
}

}  // namespace kvdp
