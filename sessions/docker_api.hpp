// A client of the Docker Engine API over its unix socket: one HTTP/1.1
// request per connection, JSON in and out. What the Swarm backend needs and
// nothing more (swarm_backend.cpp).
#pragma once

#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

namespace cellblock {

struct DockerResponse {
    int status = 0;
    nlohmann::json body;  // null when the body is empty or not JSON
    std::string text;     // the raw body
};

class DockerApi {
  public:
    // `host`: "unix:///var/run/docker.sock" (the only scheme: the engine's
    // API is root on its node and is never put on a network here).
    explicit DockerApi(std::string host,
                       std::chrono::milliseconds timeout = std::chrono::seconds(30));

    // Throws SandboxError("docker API <method> <path>: <why>") when the
    // engine cannot be reached or answers garbage; any HTTP status returns.
    DockerResponse call(const std::string& method, const std::string& path,
                        const nlohmann::json* body = nullptr) const;
    // call() that throws SandboxError with the engine's message unless the
    // status is 2xx (or one of `also_ok`, e.g. 404 for a delete).
    nlohmann::json expect(const std::string& method, const std::string& path,
                          const nlohmann::json* body = nullptr, int also_ok = 0) const;

    const std::string& host() const { return host_; }

  private:
    std::string host_;
    std::string socket_path_;
    std::chrono::milliseconds timeout_;
};

// `{"label": ["a=b"]}` → the URL-encoded `filters=` query value the API takes.
std::string docker_filters(const nlohmann::json& filters);

}  // namespace cellblock
