#include "kernel_channels.hpp"

#include "multipart.hpp"

namespace cellblock::mcp {
using nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// The server's wait between an interrupt and the kill at a timeout, and how
// much longer than its deadline this client waits (client.py's numbers).
constexpr double kKillGraceS = 3.0;
constexpr double kReplyMarginS = 15.0;

milliseconds until(Clock::time_point deadline) {
    return std::max(milliseconds(0),
                    std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

}  // namespace

KernelChannels::KernelChannels(zmq::context_t& context, const ConnectionInfo& info)
    : info_(info),
      signer_(info.key, info.signature_scheme),
      shell_(context, zmq::socket_type::dealer),
      iopub_(context, zmq::socket_type::sub),
      control_(context, zmq::socket_type::dealer) {
    for (auto* socket : {&shell_, &iopub_, &control_}) socket->set(zmq::sockopt::linger, 0);
    iopub_.set(zmq::sockopt::subscribe, "");
    shell_.connect(info_.endpoint(Channel::shell));
    iopub_.connect(info_.endpoint(Channel::iopub));
    control_.connect(info_.endpoint(Channel::control));
}

void KernelChannels::send(zmq::socket_t& socket, const WireMessage& msg) {
    const auto frames = encode(msg, signer_);
    for (std::size_t i = 0; i < frames.size(); ++i) {
        socket.send(zmq::buffer(frames[i]),
                    i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
}

std::optional<WireMessage> KernelChannels::receive(zmq::socket_t& socket) {
    Multipart parts;
    if (!recv_multipart(socket, parts, 1024)) return std::nullopt;
    auto decoded = decode(parts.views(), signer_, nullptr, WireLimits{});
    return std::move(decoded.message);
}

void KernelChannels::wait_ready(milliseconds timeout) {
    const std::lock_guard lock(run_mutex_);
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
        WireMessage request;
        request.header = make_header("kernel_info_request", session_, "cellblock-mcp");
        send(shell_, request);
        bool got_reply = false, got_iopub = false;
        const auto round = std::min(deadline, Clock::now() + std::chrono::seconds(1));
        while (Clock::now() < round && !(got_reply && got_iopub)) {
            zmq::pollitem_t items[] = {{shell_.handle(), 0, ZMQ_POLLIN, 0},
                                       {iopub_.handle(), 0, ZMQ_POLLIN, 0}};
            zmq::poll(items, 2, milliseconds(50));
            if (items[0].revents & ZMQ_POLLIN) {
                const auto reply = receive(shell_);
                got_reply |= reply && reply->parent_msg_id() == request.msg_id();
            }
            if (items[1].revents & ZMQ_POLLIN) got_iopub |= receive(iopub_).has_value();
        }
        if (got_reply && got_iopub) {
            // The rest of that round trip's status messages.
            zmq::pollitem_t item{iopub_.handle(), 0, ZMQ_POLLIN, 0};
            while (zmq::poll(&item, 1, milliseconds(100)) > 0) receive(iopub_);
            return;
        }
    }
    throw std::runtime_error("the session's kernel did not answer kernel_info in " +
                             std::to_string(timeout.count() / 1000) + " s");
}

Execution KernelChannels::execute(const std::string& code, double timeout_s,
                                  double session_timeout_s, const Hooks& hooks) {
    const std::lock_guard lock(run_mutex_);
    WireMessage request;
    request.header = make_header("execute_request", session_, "cellblock-mcp");
    request.content = {{"code", code},          {"silent", false},
                       {"store_history", true}, {"user_expressions", json::object()},
                       {"allow_stdin", false},  {"stop_on_error", true}};
    if (timeout_s > 0) request.metadata = {{"cellblock", {{"timeout_s", timeout_s}}}};
    Execution ex(request.msg_id());
    const double server_timeout = timeout_s > 0 ? timeout_s : session_timeout_s;
    const auto started = Clock::now();
    const auto deadline =
        started + std::chrono::duration_cast<Clock::duration>(
                      std::chrono::duration<double>(server_timeout + kKillGraceS + kReplyMarginS));
    send(shell_, request);
    std::optional<Clock::time_point> idle_grace;  // a reply whose idle got lost
    auto next_tick = started + hooks.tick;
    while (!ex.done()) {
        if (ex.replied() && !idle_grace) idle_grace = Clock::now() + std::chrono::seconds(2);
        const auto limit = idle_grace ? *idle_grace : deadline;
        if (Clock::now() >= limit) {
            if (ex.replied()) break;
            throw std::runtime_error(
                "no execute_reply in " +
                std::to_string(static_cast<int>(server_timeout + kKillGraceS + kReplyMarginS)) +
                " s");
        }
        zmq::pollitem_t items[] = {{shell_.handle(), 0, ZMQ_POLLIN, 0},
                                   {iopub_.handle(), 0, ZMQ_POLLIN, 0}};
        zmq::poll(items, 2,
                  std::min({until(limit), until(next_tick), milliseconds(250)}) + milliseconds(1));
        if (items[0].revents & ZMQ_POLLIN) {
            if (auto m = receive(shell_)) ex.on_reply(*m);
        }
        if (items[1].revents & ZMQ_POLLIN) {
            if (auto m = receive(iopub_)) ex.on_iopub(*m);
        }
        if (hooks.on_tick && Clock::now() >= next_tick) {
            hooks.on_tick(std::chrono::duration_cast<milliseconds>(Clock::now() - started));
            next_tick += hooks.tick;
        }
    }
    return ex;
}

json KernelChannels::interrupt(milliseconds timeout) {
    const std::lock_guard lock(control_mutex_);
    WireMessage request;
    request.header = make_header("interrupt_request", session_, "cellblock-mcp");
    send(control_, request);
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
        zmq::pollitem_t item{control_.handle(), 0, ZMQ_POLLIN, 0};
        zmq::poll(&item, 1, until(deadline) + milliseconds(1));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        const auto reply = receive(control_);
        if (reply && reply->parent_msg_id() == request.msg_id()) return reply->content;
    }
    throw std::runtime_error("no interrupt_reply in " + std::to_string(timeout.count() / 1000) +
                             " s");
}

}  // namespace cellblock::mcp
