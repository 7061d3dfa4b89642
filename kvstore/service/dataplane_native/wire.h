// The protobuf wire format of BlockData's two small messages, by hand (the payload is a byte
// string; a generated parser would copy it once more): ReadSlotsRequest both ways, SlotBytes
// framing, and a reader across the slices of one received message.

#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace kvdp {

inline void append_varint(std::string* out, uint64_t value) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Reads bytes across the slices of one received message.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  bool done() {
    skip_empty();
    return index_ == slices_.size();
  }

  bool byte(uint8_t* out) {
    skip_empty();
    if (index_ == slices_.size()) return false;
    *out = slices_[index_].begin()[offset_++];
    return true;
  }

  bool varint(uint64_t* out) {
    *out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!byte(&b)) return false;
      *out |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // Hands the next n bytes to sink(pointer, length) piece by piece; false if fewer remain.
  template <typename Sink>
  bool take(uint64_t n, Sink sink) {
    while (n > 0) {
      skip_empty();
      if (index_ == slices_.size()) return false;
      size_t here = std::min<uint64_t>(n, slices_[index_].size() - offset_);
      if (!sink(slices_[index_].begin() + offset_, here)) return false;
      offset_ += here;
      n -= here;
    }
    return true;
  }

  // Skips a field of the given wire type (its tag already read).
  bool skip_field(uint64_t wire_type) {
    uint64_t n;
    switch (wire_type) {
      case 0: return varint(&n);
      case 1: return take(8, [](const uint8_t*, size_t) { return true; });
      case 2: return varint(&n) && take(n, [](const uint8_t*, size_t) { return true; });
      case 5: return take(4, [](const uint8_t*, size_t) { return true; });
      default: return false;
    }
  }

 private:
  void skip_empty() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
};

inline std::vector<grpc::Slice> slices_of(grpc::ByteBuffer* buffer) {
  std::vector<grpc::Slice> slices;
  buffer->Dump(&slices);
  return slices;
}

struct ReadRequest {
  std::string grant;
  uint32_t chunk_bytes = 0;
  uint32_t first_slot = 0;
  uint32_t num_slots = 0;  // 0: through the grant's last slot
};

inline uint32_t clamp32(uint64_t value) { return static_cast<uint32_t>(std::min<uint64_t>(value, UINT32_MAX)); }

// ReadSlotsRequest { bytes grant = 1; uint32 chunk_bytes = 2; uint32 first_slot = 3; uint32 num_slots = 4; }
inline bool parse_request(grpc::ByteBuffer* buffer, ReadRequest* request) {
  std::string* grant = &request->grant;
  std::vector<grpc::Slice> slices = slices_of(buffer);
  SliceReader reader(slices);
  while (!reader.done()) {
    uint64_t tag, value;
    if (!reader.varint(&tag)) return false;
    if (tag == (1 << 3 | 2)) {
      grant->clear();
      if (!reader.varint(&value) || value > 1024) return false;
      if (!reader.take(value, [grant](const uint8_t* p, size_t n) {
            grant->append(reinterpret_cast<const char*>(p), n);
            return true;
          }))
        return false;
    } else if (tag == (2 << 3 | 0) || tag == (3 << 3 | 0) || tag == (4 << 3 | 0)) {
      if (!reader.varint(&value)) return false;
      uint32_t* field = tag == (2 << 3 | 0) ? &request->chunk_bytes
                        : tag == (3 << 3 | 0) ? &request->first_slot : &request->num_slots;
      *field = clamp32(value);
    } else if (!reader.skip_field(tag & 7)) {
      return false;
    }
  }
  return true;
}

inline std::string encode_request(const ReadRequest& request) {
  std::string out;
  out.push_back(1 << 3 | 2);
  append_varint(&out, request.grant.size());
  out += request.grant;
  const std::pair<int, uint32_t> numbers[] = {{2, request.chunk_bytes}, {3, request.first_slot}, {4, request.num_slots}};
  for (const auto& [field, value] : numbers) {
    if (value == 0) continue;
    out.push_back(static_cast<char>(field << 3 | 0));
    append_varint(&out, value);
  }
  return out;
}

}  // namespace kvdp
