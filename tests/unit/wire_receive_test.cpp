// The relay's one receive-and-verify step (server/wire_receive.hpp).
#include "wire_receive.hpp"

#include <gtest/gtest.h>

namespace cellblock {
namespace {
using nlohmann::json;

const Signer kSigner("wire-key");

Multipart frames_of(const std::vector<std::string>& frames) {
    Multipart m;
    for (const auto& f : frames) {
        m.total_bytes += f.size();
        m.frames.push_back(to_frame(f));
    }
    return m;
}

std::vector<std::string> signed_frames(const std::string& content_json) {
    const std::string header =
        json{{"msg_id", "m1"}, {"msg_type", "execute_request"}, {"session", "s"}}.dump();
    const std::string parent = "{}", metadata = "{}";
    return {"client",
            std::string(kDelimiter),
            kSigner.sign(header, parent, metadata, content_json),
            header,
            parent,
            metadata,
            content_json};
}

TEST(WireReceive, AClientMessageIsParsedWhole) {
    ReplayGuard replay;
    const ReceiveRules rules{&kSigner, &replay, {}, true};
    Multipart in = frames_of(signed_frames(R"({"code": "1+1"})"));
    InboundMessage msg;
    std::string why;
    ASSERT_TRUE(verify_frames(in, rules, msg, why)) << why;
    EXPECT_EQ(msg.msg_id, "m1");
    EXPECT_EQ(msg.msg_type, "execute_request");
    EXPECT_EQ(msg.content["code"], "1+1");
    EXPECT_EQ(msg.identities(), std::vector<std::string>{"client"});
    EXPECT_EQ(msg.frames.size(), 7u);
}

TEST(WireReceive, AMessageThatFailsToParseIsNotRememberedAsSeen) {
    ReplayGuard replay;
    const ReceiveRules rules{&kSigner, &replay, {}, true};
    InboundMessage msg;
    std::string why;
    // Signed correctly, but its content is not JSON: refused, and its
    // signature not recorded (the same bytes are refused for the same reason).
    Multipart bad = frames_of(signed_frames("{not json"));
    EXPECT_FALSE(verify_frames(bad, rules, msg, why));
    EXPECT_EQ(why, "frame 5 is not a JSON object");
    EXPECT_EQ(replay.size(), 0u);
    Multipart again = frames_of(signed_frames("{not json"));
    EXPECT_FALSE(verify_frames(again, rules, msg, why));
    EXPECT_EQ(why, "frame 5 is not a JSON object");
    // An accepted message is remembered; its replay is refused.
    Multipart good = frames_of(signed_frames("{}"));
    ASSERT_TRUE(verify_frames(good, rules, msg, why)) << why;
    Multipart replayed = frames_of(signed_frames("{}"));
    EXPECT_FALSE(verify_frames(replayed, rules, msg, why));
    EXPECT_EQ(why, "replayed message");
}

TEST(WireReceive, BadSignaturesAndExtraFramesAreRefused) {
    const ReceiveRules rules{&kSigner, nullptr, {}, false};
    InboundMessage msg;
    std::string why;
    auto frames = signed_frames("{}");
    frames[2][0] = frames[2][0] == 'a' ? 'b' : 'a';
    Multipart forged = frames_of(frames);
    EXPECT_FALSE(verify_frames(forged, rules, msg, why));
    EXPECT_EQ(why, "bad signature");
    Multipart many = frames_of(signed_frames("{}"));
    many.dropped_frames = 1;
    EXPECT_FALSE(verify_frames(many, rules, msg, why));
    EXPECT_EQ(why, "too many frames");
}

TEST(WireReceive, AKernelMessageNeedsOnlyHeaderAndParent) {
    const ReceiveRules rules{&kSigner, nullptr, {}, false};
    InboundMessage msg;
    std::string why;
    // Content is read only where a rule needs it (a 1 MB PNG is not parsed).
    Multipart in = frames_of(signed_frames("[1, 2]"));
    ASSERT_TRUE(verify_frames(in, rules, msg, why)) << why;
    EXPECT_TRUE(msg.content.is_null());
    EXPECT_FALSE(msg.parsed_content(8).has_value());
    const ReceiveRules client{&kSigner, nullptr, {}, true};
    Multipart from_client = frames_of(signed_frames("[1, 2]"));
    EXPECT_FALSE(verify_frames(from_client, client, msg, why));
    EXPECT_EQ(why, "frame 5 is not a JSON object");
}

}  // namespace
}  // namespace cellblock
