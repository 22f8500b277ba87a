#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "cellblock/session_dir.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "inner_channels.hpp"
#include "multipart.hpp"

namespace cellblock {
using Clock = std::chrono::steady_clock;

namespace {

std::string log_tail(const Sandbox& sandbox) {
    std::string text = sandbox.log_tail();
    if (text.size() > 1500) text = text.substr(text.size() - 1500);
    return text;
}

zmq::socket_t inner_socket(zmq::context_t& ctx, zmq::socket_type type, int max_frame_bytes) {
    zmq::socket_t s(ctx, type);
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(max_frame_bytes));
    s.set(zmq::sockopt::reconnect_ivl, 10);
    return s;
}

// The kernel binds its ipc sockets in ipc/, which the sandbox can write. The
// server must never connect there by path: the sandbox could swap a socket
// for a symlink to any unix socket on the host, and the server (root) would
// follow it on a reconnect. So, before any untrusted code runs, each socket
// is hard-linked into ipc/.server/ (root's, 0700, on the same tmpfs; the
// sticky ipc/ keeps the sandbox from renaming it), the link is checked to be
// a socket, and the server connects to the links only. Returns the ipc "ip"
// prefix of the links.
std::string link_kernel_sockets(Sandbox& sandbox, Clock::time_point deadline,
                                const std::function<void()>& check_abandoned) {
    const HostProcess* host = sandbox.host_process();
    if (!host) {
        throw SandboxError("session " + sandbox.session_id() + ": an ipc connection from the " +
                           sandbox.runtime() + " backend, whose sandboxes have no directory here");
    }
    const SessionDir& paths = host->session_dir();
    const std::filesystem::path ipc = paths.ipc();
    const std::filesystem::path server_dir = paths.server_links();
    int linked = 0;
    bool done[6] = {};
    while (linked < 5) {
        for (int port = 1; port <= 5; ++port) {
            if (done[port]) continue;
            const std::string name = "k-" + std::to_string(port);
            const auto source = ipc / name;
            const auto target = server_dir / name;
            struct stat st {};
            if (::lstat(source.c_str(), &st) != 0) continue;  // not bound yet
            if (!S_ISSOCK(st.st_mode)) {
                throw SandboxError("kernel of session " + sandbox.session_id() + ": ipc/" + name +
                                   " is not a socket");
            }
            if (::link(source.c_str(), target.c_str()) != 0 && errno != EEXIST) {
                throw SandboxError("link " + source.string() + ": " + std::strerror(errno));
            }
            if (::lstat(target.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
                ::unlink(target.c_str());
                throw SandboxError("kernel of session " + sandbox.session_id() + ": .server/" +
                                   name + " is not a socket");
            }
            done[port] = true;
            ++linked;
        }
        if (linked == 5) break;
        check_abandoned();
        if (Clock::now() >= deadline) {
            throw SandboxError("kernel of session " + sandbox.session_id() +
                               " did not create its sockets in time; log: " + log_tail(sandbox));
        }
        pollfd lifeline{sandbox.lifeline_fd(), POLLIN, 0};
        if (::poll(&lifeline, 1, 2) > 0 && !sandbox.read_lifeline()) {
            throw SandboxError("kernel of session " + sandbox.session_id() +
                               " exited while starting: " + sandbox.exit_description() +
                               "; log: " + log_tail(sandbox));
        }
    }
    return (server_dir / "k").string();
}

// The five sockets through libzmq, connected; CURVE clients of a kernel
// that names its public key (a Swarm node's: the channels cross a network).
void connect_libzmq(InnerChannels& ch, zmq::context_t& context, const ConnectionInfo& linked,
                    const std::string& identity, int max_frame_bytes) {
    char public_key[41] = {}, secret_key[41] = {};
    const bool curve = !linked.curve_server_key.empty();
    if (curve && zmq_curve_keypair(public_key, secret_key) != 0) {
        throw SandboxError("the kernel's channels need CurveZMQ, which this libzmq lacks: " +
                           std::string(zmq_strerror(zmq_errno())));
    }
    auto connect = [&](zmq::socket_t& s, Channel channel) {
        if (curve) {
            s.set(zmq::sockopt::curve_serverkey, linked.curve_server_key);
            s.set(zmq::sockopt::curve_publickey, std::string(public_key));
            s.set(zmq::sockopt::curve_secretkey, std::string(secret_key));
        }
        s.connect(linked.endpoint(channel));
    };
    auto dealer = [&](Channel channel, int max_bytes, const std::string& id) {
        zmq::socket_t s = inner_socket(context, zmq::socket_type::dealer, max_bytes);
        if (!id.empty()) s.set(zmq::sockopt::routing_id, id);
        connect(s, channel);
        return make_zmq_relay_socket(std::move(s));
    };
    ch.shell = dealer(Channel::shell, max_frame_bytes, identity);
    ch.control = dealer(Channel::control, max_frame_bytes, identity);
    ch.stdin_ = dealer(Channel::stdin_, max_frame_bytes, identity);
    zmq::socket_t iopub = inner_socket(context, zmq::socket_type::sub, max_frame_bytes);
    iopub.set(zmq::sockopt::subscribe, "");
    connect(iopub, Channel::iopub);
    ch.iopub = make_zmq_relay_socket(std::move(iopub));
    ch.hb = dealer(Channel::hb, 1024, "");
}

// The five connections spoken in ZMTP by whichever thread holds them.
void connect_zmtp(InnerChannels& ch, const ConnectionInfo& linked, const std::string& identity,
                  int max_frame_bytes, const std::string& session_id, Clock::time_point deadline) {
    auto open = [&](Channel channel, const char* type, std::size_t max_bytes,
                    const std::string& id) {
        const std::string path = linked.ip + "-" + std::to_string(linked.port(channel));
        try {
            return connect_zmtp_kernel_socket(
                path, type, id, zmtp::Limits{max_bytes, 4096},
                "session " + session_id + " kernel " + channel_name(channel), deadline);
        } catch (const std::runtime_error& e) {
            throw SandboxError(e.what());
        }
    };
    const auto frame_cap = static_cast<std::size_t>(max_frame_bytes);
    ch.shell = open(Channel::shell, "DEALER", frame_cap, identity);
    ch.control = open(Channel::control, "DEALER", frame_cap, identity);
    ch.stdin_ = open(Channel::stdin_, "DEALER", frame_cap, identity);
    ch.iopub = open(Channel::iopub, "SUB", frame_cap, "");
    ch.hb = open(Channel::hb, "DEALER", 1024, "");
}

}  // namespace

std::unique_ptr<InnerChannels> probe_kernel(zmq::context_t& context, Sandbox& sandbox,
                                            std::chrono::milliseconds timeout, int max_frame_bytes,
                                            const std::atomic<bool>* abandoned,
                                            RelayTransport transport, bool warm_up,
                                            bool on_control) {
    const ConnectionInfo& inner = sandbox.inner_connection();
    const Signer signer(inner.key, inner.signature_scheme);
    auto ch = std::make_unique<InnerChannels>();
    // The kernel routes input_request to the shell sender's identity, so the
    // stdin socket shares the shell socket's identity. Control has it too: a
    // kernel keeps the replies it could not route while no server relayed
    // (cellblock_unrelayed.KeptReplies), and sends them when a relay connects
    // under the identity they were sent to (an adopting server's).
    const std::string identity = "cellblock-" + sandbox.session_id();
    const auto check_abandoned = [&] {
        if (abandoned && abandoned->load()) {
            throw SandboxError("kernel of session " + sandbox.session_id() +
                               ": its start was abandoned (the server is stopping)");
        }
    };
    // Connect only to links the sandbox cannot touch (see link_kernel_sockets);
    // a backend's tcp ports (a Swarm node's) are the engine's, not the sandbox's.
    const auto deadline = Clock::now() + timeout;
    ConnectionInfo linked = inner;
    if (inner.transport == "ipc") {
        linked.ip = link_kernel_sockets(sandbox, deadline, check_abandoned);
    }
    if (inner.transport == "ipc" && transport == RelayTransport::zmtp) {
        connect_zmtp(*ch, linked, identity, max_frame_bytes, sandbox.session_id(), deadline);
    } else {
        connect_libzmq(*ch, context, linked, identity, max_frame_bytes);
    }

    const std::string probe_session = make_uuid();
    // The channel the probe's requests go on and are answered on.
    const auto asked = [&]() -> RelaySocket& { return on_control ? *ch->control : *ch->shell; };
    auto send = [&](std::string_view msg_type, nlohmann::json content) {
        WireMessage msg;
        msg.header = make_header(msg_type, probe_session);
        msg.content = std::move(content);
        ch->probe_msg_ids.push_back(msg.msg_id());
        auto frames = to_frames(encode(msg, signer));
        asked().send(frames);
        return msg.msg_id();
    };
    auto fail = [&](const std::string& why) {
        return SandboxError("kernel of session " + sandbox.session_id() + " " + why +
                            "; log: " + log_tail(sandbox));
    };
    // Waits until the request's reply (of reply_type) has come on shell and
    // its idle status on iopub; resend() is called every 250 ms while the
    // reply is in but the status is not (a subscription that joined late).
    Multipart scratch;
    auto exchange = [&](std::string request_id, std::string_view reply_type,
                        const std::function<std::string()>& resend) {
        bool replied = false, idle = false;
        nlohmann::json reply;
        auto resend_at = Clock::now() + std::chrono::milliseconds(250);
        while (true) {
            check_abandoned();
            const auto now = Clock::now();
            if (now >= deadline)
                throw fail("did not answer within " + std::to_string(timeout.count() / 1000) +
                           " s");
            if (resend && replied && now >= resend_at) {
                replied = false;
                request_id = resend();
                resend_at = now + std::chrono::milliseconds(250);
            }
            {
                while (asked().receive(scratch, 64)) {
                    const auto views = scratch.views();
                    auto decoded = decode(views, signer, nullptr);
                    if (decoded.message && decoded.message->parent_msg_id() == request_id &&
                        decoded.message->msg_type() == reply_type) {
                        replied = true;
                        reply = std::move(decoded.message->content);
                        resend_at = Clock::now() + std::chrono::milliseconds(100);
                    }
                }
            }
            {
                while (ch->iopub->receive(scratch, 64)) {
                    const auto views = scratch.views();
                    auto decoded = decode(views, signer, nullptr);
                    if (!decoded.message || decoded.message->parent_msg_id() != request_id)
                        continue;
                    // kernel_info: any message of ours proves the subscription.
                    if (resend || (decoded.message->msg_type() == "status" &&
                                   decoded.message->content.value("execution_state", "") == "idle"))
                        idle = true;
                }
            }
            if (replied && idle) break;
            {
                // Every waiting message was read above (a ZMQ_FD signals only
                // a change), so this waits for something new.
                pollfd items[] = {asked().poll_item(),
                                  ch->iopub->poll_item(),
                                  {sandbox.lifeline_fd(), POLLIN, 0}};
                // At most 100 ms at a time, so an abandoned start is noticed soon.
                const auto wait = std::min<Clock::duration>(
                    (resend ? std::min(deadline, resend_at) : deadline) - now,
                    std::chrono::milliseconds(100));
                const auto wait_ms =
                    std::chrono::duration_cast<std::chrono::milliseconds>(wait).count();
                ::poll(items, 3, static_cast<int>(std::max<long long>(0, wait_ms) + 1));
                if ((items[2].revents & POLLIN) && !sandbox.read_lifeline())
                    throw fail("exited while starting: " + sandbox.exit_description());
            }
        }
        return reply;
    };
    const auto kernel_info = [&] { return send("kernel_info_request", nlohmann::json::object()); };
    exchange(kernel_info(), "kernel_info_reply", kernel_info);
    if (!warm_up || on_control) return ch;

    // Warm-up: a fresh interpreter's first execution costs about twice a
    // later one (lazy imports and first-use caches in IPython's execution
    // path), and an image's preload modules are imported here, not in the
    // session's first cell. store_history=false keeps the execution counter
    // at 0; the displayhook flush then resets _ and Out, so a session
    // starts from a clean namespace apart from the preloaded modules.
    std::string code;
    for (const auto& module : sandbox.preload()) code += "import " + module + "\n";
    code += "1+1\n";
    auto execute = [&](const std::string& source, bool silent) {
        return send("execute_request", {{"code", source},
                                        {"silent", silent},
                                        {"store_history", false},
                                        {"user_expressions", nlohmann::json::object()},
                                        {"allow_stdin", false},
                                        {"stop_on_error", false}});
    };
    const auto reply = exchange(execute(code, false), "execute_reply", {});
    if (reply.value("status", "") != "ok") {
        throw fail("failed its warm-up (" + reply.value("ename", std::string("?")) + ": " +
                   reply.value("evalue", std::string()) + ")");
    }
    exchange(execute("get_ipython().displayhook.flush()", true), "execute_reply", {});
    return ch;
}

}  // namespace cellblock
