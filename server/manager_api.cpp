// The manager socket: verify, dispatch to one handler per request type, reply.
#include "manager_api.hpp"

#include <algorithm>
#include <span>

#include <spdlog/spdlog.h>

#include "cellblock/error_names.hpp"
#include "cellblock/session_policy.hpp"
#include "file_transfer.hpp"
#include "multipart.hpp"

namespace cellblock {

using nlohmann::json;

namespace {

// A message that failed to decode, as far as its sender proved it holds the
// key (the signature over its four JSON frames verifies): its identities and
// header, to address a refusal to. nullopt when the sender is not
// authenticated or the message is a replay: those get the log line only, as
// on a kernel's channels (no signed answer to whoever cannot sign).
std::optional<WireMessage> authenticated_parent(std::span<const std::string_view> frames,
                                                const Signer& signer, const std::string& error) {
    if (error == "bad signature" || error == "replayed message") return std::nullopt;
    const auto delimiter = std::find(frames.begin(), frames.end(), kDelimiter);
    if (delimiter == frames.end()) return std::nullopt;
    const WireLayout at{static_cast<std::size_t>(delimiter - frames.begin())};
    if (frames.size() < at.first_buffer() ||
        !signer.verify(frames[at.signature()], frames[at.header()], frames[at.parent()],
                       frames[at.metadata()], frames[at.content()])) {
        return std::nullopt;
    }
    WireMessage parent;
    parent.identities.assign(frames.begin(), delimiter);
    if (auto header = parse_json_frame(frames[at.header()], WireLimits{}.max_json_depth);
        header && header->is_object()) {
        parent.header = std::move(*header);
    }
    return parent;
}

}  // namespace

ManagerApi::ManagerApi(zmq::context_t& context, std::string key)
    : socket_(context, zmq::socket_type::router), key_(std::move(key)), signer_(key_) {
    socket_.set(zmq::sockopt::linger, 1000);
    // Frames up to the ceiling are read and answered (MessageTooLarge past the
    // real limit, see on_readable); past it libzmq cuts the connection.
    socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kManagerFrameCeiling));
    socket_.set(zmq::sockopt::router_handover, 1);
}

void ManagerApi::handle(const std::string& msg_type, Handler handler) {
    handlers_[msg_type] = std::move(handler);
}

void ManagerApi::set_key(std::string key) {
    key_ = std::move(key);
    signer_ = Signer(key_);
}

std::string ManagerApi::bind(const std::string& endpoint) {
    socket_.bind(endpoint);
    endpoint_ = socket_.get(zmq::sockopt::last_endpoint);
    return endpoint_;
}

void ManagerApi::reply(const WireMessage& request, json content, std::vector<std::string> buffers) {
    if (watch_) watch_(request, content);
    WireMessage msg =
        make_reply(request, reply_type(request.msg_type()), std::move(content), "cellblock-server");
    // The buffers (a download's chunk, megabytes) are not signed: they go out
    // as frames that own their string, without a copy; the rest is small.
    auto frames = to_frames(encode(msg, signer_));
    for (auto& buffer : buffers) frames.emplace_back(std::move(buffer));
    send_multipart(socket_, frames);
}

void ManagerApi::reply_error(const WireMessage& request, const std::string& ename,
                             const std::string& evalue) {
    reply(request, {{"status", "error"}, {"ename", ename}, {"evalue", evalue}});
}

void ManagerApi::refuse(const WireMessage& request, const std::string& ename,
                        const std::string& evalue) {
    spdlog::warn("manager: refused {} from {}: {}: {}", request.msg_type(),
                 identity_text(request.identities.empty() ? "" : request.identities[0]), ename,
                 evalue);
    reply_error(request, ename, evalue);
}

void ManagerApi::on_readable() {
    for (int i = 0; i < 64 && recv_multipart(socket_, scratch_, kManagerMaxFrames); ++i) {
        const auto views = scratch_.views();
        const std::string_view sender = views.empty() ? std::string_view() : views[0];
        WireLimits limits;  // up to the socket's ceiling: read, then refused with a reply
        limits.max_total_bytes = kManagerFrameCeiling * 2;
        // The buffers are not signed and stay where they are: only the routing,
        // the signature and the four JSON frames are decoded.
        const auto delimiter = std::find(views.begin(), views.end(), kDelimiter);
        const std::size_t first_buffer =
            WireLayout{static_cast<std::size_t>(delimiter - views.begin())}.first_buffer();
        const std::span<const std::string_view> all(views);
        const auto head = delimiter == views.end() || views.size() <= first_buffer
                              ? all
                              : all.first(first_buffer);
        auto decoded = decode(head, signer_, &replay_, limits);
        if (!decoded.message) {
            spdlog::warn("manager: rejected message from {}: {}", identity_text(sender),
                         decoded.error);
            if (auto parent = authenticated_parent(views, signer_, decoded.error)) {
                const bool large = decoded.error.find("too large") != std::string::npos;
                reply_error(*parent, large ? ename::MessageTooLarge : ename::InvalidRequest,
                            "refused: " + decoded.error);
            }
            continue;
        }
        Request request{std::move(*decoded.message), {views.begin() + head.size(), views.end()}};
        if (scratch_.dropped_frames > 0) {
            refuse(request.message, ename::InvalidRequest,
                   std::to_string(scratch_.frames.size() + scratch_.dropped_frames) +
                       " frames, over the " + std::to_string(kManagerMaxFrames) +
                       " a manager request may have");
            continue;
        }
        if (scratch_.total_bytes > max_request_bytes_) {
            refuse(request.message, ename::MessageTooLarge,
                   "the message is " + std::to_string(scratch_.total_bytes) + " bytes, over the " +
                       std::to_string(max_request_bytes_) +
                       " a manager request may carry; send big files in chunks "
                       "(file_put_begin_request)");
            continue;
        }
        dispatch(request);
    }
}

void ManagerApi::dispatch(Request& request) {
    const std::string type = request.message.msg_type();
    if (type.size() < 9 || !type.ends_with("_request")) {
        return refuse(request.message, ename::InvalidRequest, "'" + type + "' is not a request");
    }
    auto handler = handlers_.find(type);
    if (handler == handlers_.end()) {
        return refuse(request.message, ename::UnknownRequest,
                      "the manager does not know '" + type + "'");
    }
    std::vector<std::string> buffers;
    try {
        json content = handler->second(request, buffers);
        if (!content.is_null()) reply(request.message, std::move(content), std::move(buffers));
    } catch (const RequestError& e) {
        reply_error(request.message, e.ename, e.evalue);
    } catch (const FileRequestError& e) {
        reply_error(request.message, e.ename(), e.what());
    } catch (const PolicyError& e) {
        reply_error(request.message, e.ename(), e.what());
    } catch (const std::exception& e) {
        spdlog::error("manager {}: {}", type, e.what());
        reply_error(request.message, ename::ServerError, e.what());
    }
}

}  // namespace cellblock
