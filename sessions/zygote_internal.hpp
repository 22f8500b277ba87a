// What a zygote's start (zygote.cpp) and its forks (zygote_fork.cpp) share:
// the control socket's request and reply, and the limits of one step.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace cellblock::zygote_detail {

// How long one step of the zygote's protocol may take before it is abandoned.
constexpr std::chrono::seconds kStepTimeout{10};

// The zygote's own RLIMIT_NOFILE hard limit, which a fork cannot raise.
int zygote_nofile();

// Waits until `fd` is readable or `timeout` passes.
bool wait_readable(int fd, std::chrono::milliseconds timeout);

// One request on the control socket, with the descriptors it passes (in the
// order sandbox_protocol.hpp names). Throws SandboxError.
void send_request(int socket, const std::string& data, const std::vector<int>& fds);

// The zygote's reply, a JSON object without an "error". Throws SandboxError.
nlohmann::json receive_reply(int socket, std::chrono::milliseconds timeout);

}  // namespace cellblock::zygote_detail
