// stdio: one JSON-RPC message per line each way. Each request runs on its
// own thread, so a notifications/cancelled can reach the one it cancels.
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <list>
#include <thread>

#include <spdlog/spdlog.h>

#include "transports.hpp"

namespace cellblock::mcp {
using nlohmann::json;

namespace {

// Lines past this are answered with an error and skipped to their newline.
constexpr std::size_t kMaxLineBytes = 128u << 20;

class StdoutOutbox : public Outbox {
  public:
    void send(const json& message) override {
        // error_handler replace: a tool's output may hold invalid UTF-8.
        const std::string line =
            message.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
        const std::lock_guard lock(mutex_);
        std::size_t at = 0;
        while (at < line.size()) {
            const ssize_t n = ::write(STDOUT_FILENO, line.data() + at, line.size() - at);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) return;  // the client is gone; stdin's end follows
            at += static_cast<std::size_t>(n);
        }
    }

  private:
    std::mutex mutex_;
};

struct Worker {
    std::thread thread;
    std::atomic<bool> done{false};
};

}  // namespace

int serve_stdio(const McpOptions& options, zmq::context_t& context) {
    Conversation conversation(options, context);
    StdoutOutbox out;
    std::list<Worker> workers;
    const auto reap = [&](bool all) {
        for (auto it = workers.begin(); it != workers.end();) {
            if (all || it->done) {
                it->thread.join();
                it = workers.erase(it);
            } else {
                ++it;
            }
        }
    };
    const auto dispatch = [&](std::string line) {
        RpcMessage message = parse_message(line);
        if (message.kind != RpcMessage::Kind::request) {
            // Notifications (a cancellation among them) and errors are handled at once.
            if (auto reply = conversation.handle(message, out)) out.send(*reply);
            return;
        }
        auto& worker = workers.emplace_back();
        worker.thread = std::thread([&conversation, &out, &worker, message = std::move(message)] {
            if (auto reply = conversation.handle(message, out)) out.send(*reply);
            worker.done = true;
        });
    };

    std::string buffer;
    bool skipping = false;  // inside a line over the limit
    char chunk[65536];
    for (;;) {
        reap(false);
        if (stop_requested()) break;
        pollfd in{STDIN_FILENO, POLLIN, 0};
        const int ready = ::poll(&in, 1, 200);
        if (ready < 0 && errno != EINTR) break;
        if (ready <= 0) continue;
        const ssize_t n = ::read(STDIN_FILENO, chunk, sizeof chunk);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0) break;  // the client closed stdin: shutdown
        std::size_t start = 0;
        for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
            if (chunk[i] != '\n') continue;
            if (!skipping) {
                buffer.append(chunk + start, i - start);
                if (!buffer.empty() && buffer.back() == '\r') buffer.pop_back();
                if (!buffer.empty()) dispatch(std::move(buffer));
            }
            buffer.clear();
            skipping = false;
            start = i + 1;
        }
        if (!skipping) buffer.append(chunk + start, static_cast<std::size_t>(n) - start);
        if (!skipping && buffer.size() > kMaxLineBytes) {
            out.send(make_error(nullptr, rpc_error::kInvalidRequest,
                                "a message over " + std::to_string(kMaxLineBytes) + " bytes"));
            buffer.clear();
            buffer.shrink_to_fit();
            skipping = true;
        }
    }
    // A last line without its newline is still a message.
    if (!skipping && !buffer.empty() && !stop_requested()) dispatch(std::move(buffer));
    // Requests still running finish and answer (a client piping a script in
    // expects its replies), unless a signal says to stop: then they are cancelled.
    while (!workers.empty() && !stop_requested()) {
        reap(false);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    conversation.close();  // cancels what runs, then closes the sessions
    reap(true);
    spdlog::info("mcp: stdio closed");
    return 0;
}

}  // namespace cellblock::mcp
