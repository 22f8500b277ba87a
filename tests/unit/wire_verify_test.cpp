// The one verification of a received message (protocol's verify()), as both
// its callers use it: decode() and the relay's verify_frames().
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cellblock/replay_guard.hpp"
#include "cellblock/signer.hpp"
#include "cellblock/wire_message.hpp"
#include "wire_receive.hpp"

namespace cellblock {
namespace {
using nlohmann::json;
using Frames = std::vector<std::string>;

const Signer kSigner("verify-key");

Frames message(const std::string& header, const std::string& parent = "{}",
               const std::string& metadata = "{}", const std::string& content = "{}") {
    return {"client",
            std::string(kDelimiter),
            kSigner.sign(header, parent, metadata, content),
            header,
            parent,
            metadata,
            content};
}

std::string header(const json& fields = {{"msg_id", "m1"}, {"msg_type", "execute_request"}}) {
    return fields.dump();
}

WireVerify run(const Frames& frames, const VerifyRules& rules, ReplayGuard* replay = nullptr) {
    const std::vector<std::string_view> views(frames.begin(), frames.end());
    return verify(views, kSigner, replay, rules);
}

VerifyRules relay_rules(bool parse_all) {
    VerifyRules rules;
    rules.parse_all = parse_all;
    rules.ids = parse_all ? VerifyRules::Ids::non_empty : VerifyRules::Ids::any;
    rules.wording = VerifyRules::Wording::places;
    return rules;
}

// What the relay says of `frames`, through its own step.
std::string relay_why(const Frames& frames, bool parse_all = true) {
    Multipart in;
    in.frames = to_frames(Frames(frames));
    InboundMessage out;
    std::string why;
    const ReceiveRules rules{&kSigner, nullptr, {}, parse_all};
    return verify_frames(in, rules, out, why) ? "ok" : why;
}

std::string decode_why(const Frames& frames) {
    const std::vector<std::string_view> views(frames.begin(), frames.end());
    const WireDecode d = decode(views, kSigner, nullptr);
    return d.message ? "ok" : d.error;
}

TEST(WireVerify, AGoodMessageIsParsedWhole) {
    const WireVerify v = run(message(header(), "{}", R"({"m":1})", R"({"code":"1+1"})"), {});
    ASSERT_TRUE(v.ok) << v.error;
    EXPECT_EQ(v.layout.delimiter, 1u);
    EXPECT_EQ(v.header["msg_id"], "m1");
    EXPECT_EQ(v.metadata["m"], 1);
    EXPECT_EQ(v.content["code"], "1+1");
    // The kernel's messages: header and parent only.
    const WireVerify kernel = run(message(header(), "{}", "{}", "[1]"), relay_rules(false));
    ASSERT_TRUE(kernel.ok) << kernel.error;
    EXPECT_TRUE(kernel.content.is_null());
}

// Both callers refuse the same messages, each in its own words.
TEST(WireVerify, DecodeAndTheRelayRefuseAlike) {
    struct Case {
        Frames frames;
        std::string decode_says, relay_says;
    };
    Frames forged = message(header());
    forged[3][2] = 'X';
    const std::vector<Case> cases = {
        {message(header()), "ok", "ok"},
        {forged, "bad signature", "bad signature"},
        {{"no delimiter"}, "missing delimiter", "missing delimiter"},
        {message("{bad"), "header is not valid JSON", "frame 2 is not a JSON object"},
        {message(header(), "[]"), "parent_header is not a JSON object",
         "frame 3 is not a JSON object"},
        {message(header(), "{}", "\"s\""), "metadata is not a JSON object",
         "frame 4 is not a JSON object"},
        {message(header(), "{}", "{}", "{\"x\":NaN}"), "content is not valid JSON",
         "frame 5 is not a JSON object"},
        {message(header({{"msg_type", "t"}})), "header has no string msg_id",
         "header lacks msg_id or msg_type"},
        {message(header({{"msg_id", "m"}, {"msg_type", 7}})), "header has no string msg_type",
         "header lacks msg_id or msg_type"},
        // An empty msg_id is a string (decode), but no key for the relay's ledger.
        {message(header({{"msg_id", ""}, {"msg_type", "t"}})), "ok",
         "header lacks msg_id or msg_type"},
    };
    for (const auto& c : cases) {
        EXPECT_EQ(decode_why(c.frames), c.decode_says) << c.relay_says;
        EXPECT_EQ(relay_why(c.frames), c.relay_says) << c.decode_says;
    }
    // The kernel's side parses header and parent only, and asks no ids.
    EXPECT_EQ(relay_why(message(header({{"x", 1}}), "{}", "{}", "[1]"), false), "ok");
    EXPECT_EQ(relay_why(message(header(), "null"), false), "frame 3 is not a JSON object");
}

TEST(WireVerify, OnlyAnAcceptedMessageIsRemembered) {
    ReplayGuard replay;
    const Frames bad = message(header(), "{}", "{}", "{not json");
    EXPECT_FALSE(run(bad, {}, &replay).ok);
    EXPECT_EQ(replay.size(), 0u) << "a refused message can be sent again once fixed";
    const Frames good = message(header());
    EXPECT_TRUE(run(good, {}, &replay).ok);
    EXPECT_EQ(replay.size(), 1u);
    EXPECT_EQ(run(good, {}, &replay).error, "replayed message");
    EXPECT_EQ(run(good, relay_rules(true), &replay).error, "replayed message");
}

TEST(WireVerify, TheRelayRefusesFramesItsTransportDropped) {
    Multipart in;
    in.frames = to_frames(message(header()));
    in.dropped_frames = 1;
    InboundMessage out;
    std::string why;
    const ReceiveRules rules{&kSigner, nullptr, {}, true};
    EXPECT_FALSE(verify_frames(in, rules, out, why));
    EXPECT_EQ(why, "too many frames");
}

}  // namespace
}  // namespace cellblock
