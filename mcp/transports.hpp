// The two ways MCP reaches `cellblock mcp`: newline-delimited JSON-RPC on
// stdin/stdout, and Streamable HTTP (POST /mcp) with a bearer token.
#pragma once

#include <atomic>
#include <string>

#include <zmq.hpp>

#include "conversation.hpp"

namespace cellblock::mcp {

// Set by SIGINT/SIGTERM: the transports finish, cancel and close.
std::atomic<bool>& stop_requested();

// Serves one conversation on stdin/stdout until stdin ends or a stop is
// requested; returns the exit status.
int serve_stdio(const McpOptions& options, zmq::context_t& context);

struct HttpOptions {
    std::string listen = "127.0.0.1:8765";     // ADDR:PORT ([v6]:PORT); port 0 picks one
    std::string token;                         // "": no token (refused off loopback)
    std::vector<std::string> allowed_origins;  // besides http(s)://localhost|127.0.0.1|[::1]
    std::size_t max_body_bytes = 96u << 20;
    std::size_t max_conversations = 64;
    std::size_t max_connections = 64;
    int idle_timeout_s = 3600;  // an MCP session unused this long is closed
};

// Serves Streamable HTTP until a stop is requested; returns the exit status.
int serve_http(const McpOptions& options, const HttpOptions& http, zmq::context_t& context);

}  // namespace cellblock::mcp
