// ManagerApi over real ZMQ sockets: a client DEALER sends signed requests to
// the manager's ROUTER; what reaches a handler, and what comes back, for good
// requests and for each kind of bad one (docs/manager-api.md).
#include "manager_api.hpp"

#include <gtest/gtest.h>

#include <stdexcept>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "cellblock/error_names.hpp"
#include "cellblock/session_policy.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "file_transfer.hpp"

namespace cellblock {
namespace {
using nlohmann::json;

constexpr const char* kKey = "manager-api-test-key";

struct ManagerApiTest : ::testing::Test {
    zmq::context_t context;
    ManagerApi api{context, kKey};
    zmq::socket_t client{context, zmq::socket_type::dealer};
    Signer signer{kKey};
    int calls = 0;

    void SetUp() override {
        const std::string endpoint = api.bind("tcp://127.0.0.1:*");
        ASSERT_EQ(endpoint.rfind("tcp://127.0.0.1:", 0), 0u) << endpoint;
        client.set(zmq::sockopt::linger, 0);
        client.connect(endpoint);
        api.handle("echo_request", [this](ManagerApi::Request& r, std::vector<std::string>& out) {
            ++calls;
            json buffer_sizes = json::array();
            for (auto b : r.buffers) buffer_sizes.push_back(b.size());
            for (auto b : r.buffers) out.emplace_back(std::string(b) + "!");
            return json{{"status", "ok"},
                        {"said", r.message.content.value("say", "")},
                        {"buffer_sizes", buffer_sizes}};
        });
    }

    static WireMessage request(const std::string& msg_type, json content = json::object()) {
        WireMessage m;
        m.header = make_header(msg_type, "test-client");
        m.content = std::move(content);
        return m;
    }
    std::vector<std::string> encoded(const WireMessage& m, const Signer& with) {
        return encode(m, with);
    }
    void send(const std::vector<std::string>& frames) {
        std::vector<zmq::const_buffer> parts;
        for (const auto& f : frames) parts.emplace_back(f.data(), f.size());
        ASSERT_TRUE(zmq::send_multipart(client, parts));
    }
    void send(const WireMessage& m) { send(encoded(m, signer)); }

    // Turns the manager until the client has a reply (at most 5 s).
    std::optional<WireMessage> next_reply() {
        for (int i = 0; i < 500; ++i) {
            zmq::pollitem_t items[] = {{api.socket().handle(), 0, ZMQ_POLLIN, 0},
                                       {client.handle(), 0, ZMQ_POLLIN, 0}};
            zmq::poll(items, 2, std::chrono::milliseconds(10));
            if (items[0].revents & ZMQ_POLLIN) api.on_readable();
            std::vector<zmq::message_t> parts;
            if (!zmq::recv_multipart(client, std::back_inserter(parts), zmq::recv_flags::dontwait))
                continue;
            std::vector<std::string> kept;
            for (auto& p : parts) kept.push_back(p.to_string());
            std::vector<std::string_view> views(kept.begin(), kept.end());
            auto decoded = decode(views, signer, nullptr);
            EXPECT_TRUE(decoded.message) << decoded.error;
            if (!decoded.message) return std::nullopt;
            auto m = std::move(*decoded.message);
            const WireLayout at{static_cast<std::size_t>(
                std::find(views.begin(), views.end(), kDelimiter) - views.begin())};
            m.buffers.assign(kept.begin() + at.first_buffer(), kept.end());
            return m;
        }
        return std::nullopt;
    }
    // The reply to a good request sent after `m`: `m` was given no answer
    // of its own when this is the first reply the client reads.
    void expect_no_answer_to(const std::string& what) {
        const auto probe = request("echo_request", {{"say", "probe"}});
        send(probe);
        auto got = next_reply();
        ASSERT_TRUE(got) << what;
        EXPECT_EQ(got->parent_msg_id(), probe.msg_id()) << what << " was answered";
    }
};

TEST_F(ManagerApiTest, ASignedRequestReachesItsHandlerAndItsReplyCarriesTheBuffers) {
    auto m = request("echo_request", {{"say", "hello"}});
    auto frames = encoded(m, signer);
    frames.push_back("abc");
    frames.push_back(std::string(1000, 'x'));
    send(frames);
    auto got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(got->msg_type(), "echo_reply");
    EXPECT_EQ(got->parent_msg_id(), m.msg_id());
    EXPECT_EQ(got->content["said"], "hello");
    EXPECT_EQ(got->content["buffer_sizes"], json({3, 1000}));
    ASSERT_EQ(got->buffers.size(), 2u);
    EXPECT_EQ(got->buffers[0], "abc!");
    EXPECT_EQ(got->buffers[1], std::string(1000, 'x') + "!");
}

TEST_F(ManagerApiTest, AnUnknownRequestAndAMessageThatIsNoRequestAreRefusedByName) {
    send(request("frobnicate_request"));
    auto got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->msg_type(), "frobnicate_reply");
    EXPECT_EQ(got->content["ename"], ename::UnknownRequest);
    send(request("echo_reply"));
    got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->msg_type(), "error_reply");
    EXPECT_EQ(got->content["ename"], ename::InvalidRequest);
    EXPECT_EQ(calls, 0);
}

TEST_F(ManagerApiTest, ABadSignatureAndAReplayGetNoAnswerAndReachNoHandler) {
    Signer other("another-key");
    send(encoded(request("echo_request", {{"say", "forged"}}), other));
    expect_no_answer_to("a message signed with another key");
    EXPECT_EQ(calls, 1);  // the probe only

    const auto once = encoded(request("echo_request", {{"say", "once"}}), signer);
    send(once);
    auto got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->content["said"], "once");
    send(once);
    expect_no_answer_to("the same bytes again");
    EXPECT_EQ(calls, 3);
}

TEST_F(ManagerApiTest, AnAuthenticatedMessageThatDoesNotDecodeIsAnsweredInvalidRequest) {
    // Signed with the key, but its content is not a JSON object.
    auto m = request("echo_request");
    auto frames = encoded(m, signer);
    const WireLayout at{0};  // the DEALER sends no identities: the delimiter is first
    ASSERT_EQ(frames.size(), at.first_buffer());
    ASSERT_EQ(frames[at.delimiter], kDelimiter);
    frames[at.content()] = "[1, 2]";
    frames[at.signature()] = signer.sign(frames[at.header()], frames[at.parent()],
                                         frames[at.metadata()], frames[at.content()]);
    send(frames);
    auto got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->parent_msg_id(), m.msg_id());
    EXPECT_EQ(got->content["ename"], ename::InvalidRequest);
    EXPECT_EQ(calls, 0);
}

TEST_F(ManagerApiTest, ARequestOverTheSizeOrTheFrameCountIsRefusedBeforeItsHandler) {
    api.set_max_request_bytes(4096);
    auto big = encoded(request("echo_request"), signer);
    big.push_back(std::string(8192, 'b'));
    send(big);
    auto got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->content["ename"], ename::MessageTooLarge);

    auto many = encoded(request("echo_request"), signer);
    for (std::size_t i = 0; i < kManagerMaxFrames; ++i) many.push_back("f");
    send(many);
    got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->content["ename"], ename::InvalidRequest);
    EXPECT_NE(got->content["evalue"].get<std::string>().find("frames"), std::string::npos);
    EXPECT_EQ(calls, 0);
}

TEST_F(ManagerApiTest, WhatAHandlerThrowsBecomesTheReplysError) {
    api.handle("request_error_request",
               [](ManagerApi::Request&, std::vector<std::string>&) -> json {
                   throw RequestError{ename::NoSuchSession, "no session x"};
               });
    api.handle("file_error_request", [](ManagerApi::Request&, std::vector<std::string>&) -> json {
        throw FileRequestError(ename::FileTooLarge, "too big");
    });
    api.handle("policy_error_request", [](ManagerApi::Request&, std::vector<std::string>&) -> json {
        throw PolicyError(ename::InvalidLimits, "no such limit");
    });
    api.handle("crash_request", [](ManagerApi::Request&, std::vector<std::string>&) -> json {
        throw std::runtime_error("it broke");
    });
    const std::pair<const char*, std::string> cases[] = {
        {"request_error_request", ename::NoSuchSession},
        {"file_error_request", ename::FileTooLarge},
        {"policy_error_request", ename::InvalidLimits},
        {"crash_request", ename::ServerError}};
    for (const auto& [type, expected] : cases) {
        send(request(type));
        auto got = next_reply();
        ASSERT_TRUE(got) << type;
        EXPECT_EQ(got->content["status"], "error") << type;
        EXPECT_EQ(got->content["ename"], expected) << type;
    }
    expect_no_answer_to("nothing more");  // the manager still serves
}

TEST_F(ManagerApiTest, AHandlerThatAnswersLaterRepliesThroughTheApiAndTheWatchSeesIt) {
    std::optional<WireMessage> held;
    api.handle("later_request", [&](ManagerApi::Request& r, std::vector<std::string>&) -> json {
        held = r.message;
        return nullptr;
    });
    std::vector<std::string> watched;
    api.watch_replies([&](const WireMessage& request, const json& content) {
        watched.push_back(request.msg_type() + ":" + content.value("status", ""));
    });
    const auto m = request("later_request");
    send(m);
    expect_no_answer_to("a request its handler holds");
    ASSERT_TRUE(held);
    api.reply(*held, {{"status", "ok"}, {"late", true}});
    auto got = next_reply();
    ASSERT_TRUE(got);
    EXPECT_EQ(got->parent_msg_id(), m.msg_id());
    EXPECT_EQ(got->content["late"], true);
    EXPECT_EQ(watched, (std::vector<std::string>{"echo_request:ok", "later_request:ok"}));
}

TEST_F(ManagerApiTest, AfterSetKeyOnlyTheNewKeySigns) {
    api.set_key("the-last-servers-key");
    EXPECT_EQ(api.key(), "the-last-servers-key");
    send(request("echo_request", {{"say", "old key"}}));
    signer = Signer("the-last-servers-key");
    expect_no_answer_to("a request under the replaced key");
    EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace cellblock
