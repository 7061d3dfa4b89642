// Constants and helpers shared by the data plane's server and client (see server.cc).

#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvdp {

constexpr char kMethod[] = "/kvstore.v1.BlockData/ReadSlots";
constexpr int kProtocolError = -1;  // the stream's bytes do not match what the caller expects
constexpr int kNotConnected = -2;  // no connection was ready within the client's connect bound
constexpr uint32_t kMaxChunkBytes = 16u << 20;
constexpr uint32_t kMinChunkBytes = 64u << 10;  // a request for smaller chunks gets these: chunk_size
constexpr int kLookaheadBytes = 64 << 20;  // HTTP/2 stream window: a whole transfer in flight

using Clock = std::chrono::steady_clock;

// The chunk size of a request's chunk_bytes: 0 asks for the most; below kMinChunkBytes (or the
// most, if less) it is raised, as every message costs the server a write round trip.
inline uint32_t chunk_size(uint32_t asked, uint32_t most) {
  return asked == 0 ? most : std::clamp(asked, std::min(kMinChunkBytes, most), most);
}

inline void set_error(char* err, size_t errlen, const std::string& message) {
  if (err != nullptr && errlen > 0) std::snprintf(err, errlen, "%s", message.c_str());
}

}  // namespace kvdp
