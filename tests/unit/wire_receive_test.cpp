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
        m.frames.push_back(Frame::copy_of(f));
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

// The scan agrees with the parser on every object it answers for, and
// answers nullopt (so the caller parses) where the parser would refuse.
TEST(JsonStringMemberSize, AgreesWithTheParser) {
    const std::vector<std::string> objects = {
        R"({"name": "stdout", "text": "hello\n"})",
        R"({"text": "", "name": "stderr"})",
        R"({"name":"stdout","text":"tab\there \"quoted\" back\\slash \/ \b\f\r"})",
        R"({"text": "\u00e9\u4e2d\ud83d\ude00 and raw é中😀"})",
        R"({"a": {"b": [1, 2.5e3, true, false, null, {"c": "}"}], "d": "\"text\""}, "text": "x"})",
        R"(  { "text" : "spaced" }  )",
        R"({"name": "stdout", "text": ")" + std::string(70000, 'y') + R"("})",
    };
    for (const auto& text : objects) {
        const auto parsed = json::parse(text);
        const auto size = json_string_member_size(text, "text");
        ASSERT_TRUE(size.has_value()) << text.substr(0, 80);
        EXPECT_EQ(*size, parsed["text"].get<std::string>().size()) << text.substr(0, 80);
    }
}

// A raw control character, which JSON forbids, is not looked for (the scan
// is two memchr passes): its message is dropped whole either way, so only
// its counted size is at stake, and it is the bytes that are there.
TEST(JsonStringMemberSize, ARawControlCharacterIsCountedNotJudged) {
    EXPECT_EQ(json_string_member_size("{\"text\": \"raw\ncontrol\"}", "text"), 11u);
}

TEST(JsonStringMemberSize, DeclinesWhatItCannotVouchFor) {
    const std::vector<std::string> declined = {
        R"({"name": "stdout"})",                         // no such member
        R"({"text": 5})",                                // not a string
        R"({"text": "a", "text": "bb"})",                // a duplicate
        R"({"text": "\ud83d"})",                         // a lone high surrogate
        R"({"text": "\ude00"})",                         // a lone low surrogate
        R"({"text": "\q"})",                             // an unknown escape
        R"({"text": "open)",                             // unterminated
        R"({"text": "a"} trailing)",                     // bytes after the object
        R"(["text", "a"])",                              // not an object
        R"({"a": [[[[[[[[[[1]]]]]]]]]], "text": "x"})",  // deeper than allowed (depth 4)
        R"({"\u0074ext": "escaped key"})",               // a key spelled with escapes
        "",
    };
    for (const auto& text : declined) {
        EXPECT_FALSE(json_string_member_size(text, "text", 4).has_value()) << text;
    }
}

}  // namespace
}  // namespace cellblock
