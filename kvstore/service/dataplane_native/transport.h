// What bounds the data plane's connections and the requests on them (see server.cc): the settings
// of the gRPC server under its one service. streams.h bounds the streams on them. Knows nothing of
// grants or of the bytes.
//
// A connection that opens no stream makes no call, so no token is ever checked on it, and gRPC
// 1.51 neither caps connections nor reaps one that only answers pings. Each holds a descriptor
// of the sidecar's process, and once an accept fails for want of one, gRPC 1.51 logs "Failed
// accept4: Too many open files" and never accepts again (grpc/grpc#20418). So a connection with
// no stream for stream_idle_timeout_s is closed (GOAWAY; a client reconnects at its next call,
// and client.cc closes its own idle connections sooner, so that no call crosses the GOAWAY).
// A peer that opens connections faster than they are closed can still exhaust the descriptors:
// the sidecar raises its soft limit to the hard one, and the port belongs behind a firewall
// (README, "Another host: the native data plane").

#pragma once

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <climits>

#include "common.h"

namespace kvdp {

inline void bound_transport(grpc::ServerBuilder* builder, double idle_timeout_s) {
  builder->SetMaxReceiveMessageSize(64 << 10);  // requests are a token and three numbers
  // gRPC inflates a compressed message before it checks that size: a 64 KB gzip request would
  // become a 63 MiB buffer. A compressed request is UNIMPLEMENTED ("... is disabled").
  for (int algorithm = GRPC_COMPRESS_NONE + 1; algorithm < GRPC_COMPRESS_ALGORITHMS_COUNT; ++algorithm)
    builder->SetCompressionAlgorithmSupportStatus(static_cast<grpc_compression_algorithm>(algorithm), false);
  builder->AddChannelArgument("grpc.http2.lookahead_bytes", kLookaheadBytes);
  builder->AddChannelArgument("grpc.so_reuseport", 0);  // a port in use is an error, not a shared port
  builder->AddChannelArgument("grpc.keepalive_time_ms", 60000);  // dead peers; live ones that stall: Reaper
  builder->AddChannelArgument("grpc.keepalive_timeout_ms", 20000);
  double idle_ms = std::min(idle_timeout_s * 1000, static_cast<double>(INT_MAX));  // 30 days do not fit
  builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, static_cast<int>(idle_ms));
}

}  // namespace kvdp
