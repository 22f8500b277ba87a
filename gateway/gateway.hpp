// The egress gateway process (docs/network.md): one per server, unprivileged,
// under its own seccomp profile. The server hands it, over one control
// socket, a listening unix socket per session (the session's
// /run/cellblock/egress.sock) with that session's network limits; the gateway
// reads each connection's HTTP head, checks the allowlist, resolves the name,
// refuses reserved addresses, connects to the address it checked and relays.
// Every connection, allowed or refused, is reported back as one event.
//
// Control messages (SOCK_SEQPACKET, one JSON object each):
//   server -> gateway  {"op":"config","private":[CIDR...],"resolve":{name:addr}}
//                      {"op":"add","session":ID,"network":{NetworkLimits}} + the listener fd
//                      {"op":"remove","session":ID}
//   gateway -> server  {"op":"event","session":ID,"host","port","method","status",
//                       "bytes_up","bytes_down","duration_ms","verdict","reason"}
#pragma once

#include <string>

#include <sys/types.h>

#include <nlohmann/json.hpp>

#include "cellblock/unique_fd.hpp"

namespace cellblock::gateway {

inline constexpr std::size_t kMaxControlMessage = 64 * 1024;

// Serves until the control socket closes (the server is gone). Returns the
// process exit code.
int serve(int control_fd);

// Sends one control message, with `fd` attached when it is not -1. Throws
// std::system_error on failure.
void send_control(int control_fd, const nlohmann::json& message, int fd = -1);

// One recvmsg (EINTR retried): up to `size` bytes into `data`, the first
// descriptor attached kept in `fd` (any others closed at once), the message's
// MSG_* flags in `flags`. Returns what recvmsg returned (-1: errno says why).
// Shared by the control socket and the forwarder's hand-over.
ssize_t receive_with_fd(int socket, char* data, std::size_t size, UniqueFd& fd, int& flags);

// Receives one control message and the fd attached to it (-1: none; the
// caller owns it). Returns false at EOF. Throws on a malformed message.
bool receive_control(int control_fd, nlohmann::json& message, int& fd);

}  // namespace cellblock::gateway
