#include "cellblock/wire_message.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/replay_guard.hpp"
#include "cellblock/signer.hpp"

namespace cellblock {
namespace {

using namespace std::string_literals;
using json = nlohmann::json;
using Frames = std::vector<std::string>;

std::vector<std::string_view> views(const Frames& frames) {
    return std::vector<std::string_view>(frames.begin(), frames.end());
}

WireCheck check(const Frames& frames, const Signer& signer, ReplayGuard* replay = nullptr,
                const WireLimits& limits = {}) {
    const auto v = views(frames);
    return check_wire(v, signer, replay, limits);
}

WireDecode dec(const Frames& frames, const Signer& signer, ReplayGuard* replay = nullptr,
               const WireLimits& limits = {}) {
    const auto v = views(frames);
    return decode(v, signer, replay, limits);
}

// A signed message with the given identities, JSON frame texts and buffers.
Frames signed_frames(const Signer& signer, Frames identities, const std::string& header,
                     const std::string& parent, const std::string& metadata,
                     const std::string& content, const Frames& buffers = {}) {
    Frames f = std::move(identities);
    f.emplace_back(kDelimiter);
    f.push_back(signer.sign(header, parent, metadata, content));
    f.insert(f.end(), {header, parent, metadata, content});
    f.insert(f.end(), buffers.begin(), buffers.end());
    return f;
}

std::string header_text(const std::string& msg_id,
                        const std::string& msg_type = "execute_request") {
    return json{{"msg_id", msg_id},
                {"msg_type", msg_type},
                {"session", "s"},
                {"username", "u"},
                {"date", "2024-01-01T00:00:00.000000Z"},
                {"version", "5.3"}}
        .dump();
}

Frames simple(const Signer& signer, const std::string& msg_id, const std::string& content = "{}") {
    return signed_frames(signer, {"id"}, header_text(msg_id), "{}", "{}", content);
}

// ---------------------------------------------------------------------------
// Vectors written by jupyter_client 7.4.9 (tests/fixtures/make_jupyter_client_vectors.py).

std::string base64_decode(std::string_view in) {
    auto value = [](char c) -> int {
        if (c >= 'A' && c <= 'Z') return c - 'A';
        if (c >= 'a' && c <= 'z') return c - 'a' + 26;
        if (c >= '0' && c <= '9') return c - '0' + 52;
        if (c == '+') return 62;
        if (c == '/') return 63;
        return -1;
    };
    std::string out;
    unsigned bits = 0;
    int nbits = 0;
    for (char c : in) {
        if (c == '=') break;
        const int v = value(c);
        if (v < 0) throw std::runtime_error("bad base64 in fixture");
        bits = (bits << 6) | static_cast<unsigned>(v);
        nbits += 6;
        if (nbits >= 8) {
            nbits -= 8;
            out.push_back(static_cast<char>((bits >> nbits) & 0xff));
        }
    }
    return out;
}

struct Vector {
    std::string name;
    std::string key;
    Frames frames;
    std::size_t identities = 0;
    std::size_t buffers = 0;
    json expect;
};

const json& fixture() {
    static const json doc = [] {
        std::ifstream in(std::string(CELLBLOCK_FIXTURES_DIR) + "/jupyter_client_vectors.json");
        if (!in) throw std::runtime_error("cannot open jupyter_client_vectors.json");
        return json::parse(in);
    }();
    return doc;
}

std::vector<Vector> vectors() {
    std::vector<Vector> out;
    for (const json& v : fixture().at("vectors")) {
        Vector vec;
        vec.name = v.at("name").get<std::string>();
        vec.key = base64_decode(v.at("key_b64").get<std::string>());
        for (const json& f : v.at("frames_b64"))
            vec.frames.push_back(base64_decode(f.get<std::string>()));
        vec.identities = v.at("identities").get<std::size_t>();
        vec.buffers = v.at("buffers").get<std::size_t>();
        vec.expect = v.at("expect");
        out.push_back(std::move(vec));
    }
    return out;
}

TEST(JupyterClientVectors, FixtureCameFromTheReference) {
    EXPECT_EQ(fixture().at("jupyter_client_version"), "7.4.9");
    const auto vs = vectors();
    ASSERT_GE(vs.size(), 8u);
    bool empty_key = false, identities = false, buffers = false;
    for (const auto& v : vs) {
        empty_key |= v.key.empty();
        identities |= v.identities > 0;
        buffers |= v.buffers > 0;
        EXPECT_EQ(v.frames.size(), v.identities + 6 + v.buffers) << v.name;
    }
    EXPECT_TRUE(empty_key && identities && buffers);
}

TEST(JupyterClientVectors, OurSignatureEqualsTheirs) {
    for (const auto& v : vectors()) {
        SCOPED_TRACE(v.name);
        const std::size_t d = v.identities;
        ASSERT_EQ(v.frames[d], kDelimiter);
        Signer signer(v.key);
        EXPECT_EQ(signer.sign(v.frames[d + 2], v.frames[d + 3], v.frames[d + 4], v.frames[d + 5]),
                  v.frames[d + 1]);
        EXPECT_TRUE(signer.verify(v.frames[d + 1], v.frames[d + 2], v.frames[d + 3],
                                  v.frames[d + 4], v.frames[d + 5]));
        EXPECT_EQ(v.frames[d + 1].size(), v.key.empty() ? 0u : 64u);
    }
}

TEST(JupyterClientVectors, CheckWireAcceptsThem) {
    for (const auto& v : vectors()) {
        SCOPED_TRACE(v.name);
        Signer signer(v.key);
        ReplayGuard guard;
        const WireCheck c = check(v.frames, signer, &guard);
        EXPECT_TRUE(c.ok) << c.error;
        EXPECT_EQ(c.layout.delimiter, v.identities);
        EXPECT_EQ(c.layout.first_buffer() + v.buffers, v.frames.size());
    }
}

TEST(JupyterClientVectors, DecodeMatchesWhatTheReferenceMeant) {
    for (const auto& v : vectors()) {
        SCOPED_TRACE(v.name);
        Signer signer(v.key);
        const WireDecode d = dec(v.frames, signer);
        ASSERT_TRUE(d.message) << d.error;
        const WireMessage& m = *d.message;
        EXPECT_EQ(m.msg_id(), v.expect.at("msg_id"));
        EXPECT_EQ(m.msg_type(), v.expect.at("msg_type"));
        EXPECT_EQ(m.parent_msg_id(), v.expect.at("parent_msg_id"));
        EXPECT_EQ(m.content, v.expect.at("content"));
        EXPECT_EQ(m.metadata, v.expect.at("metadata"));
        EXPECT_EQ(m.header.at("version"), "5.3");
        EXPECT_EQ(m.identities, Frames(v.frames.begin(), v.frames.begin() + v.identities));
        EXPECT_EQ(m.buffers, Frames(v.frames.end() - v.buffers, v.frames.end()));
    }
}

TEST(JupyterClientVectors, TamperedJsonFrameOrSignatureFails) {
    for (const auto& v : vectors()) {
        if (v.key.empty()) continue;
        SCOPED_TRACE(v.name);
        Signer signer(v.key);
        const std::size_t d = v.identities;
        for (std::size_t i = d + 2; i <= d + 5; ++i) {
            Frames t = v.frames;
            t[i][t[i].size() / 2] ^= 0x01;
            EXPECT_EQ(check(t, signer).error, "bad signature") << "frame " << i;
            EXPECT_EQ(dec(t, signer).error, "bad signature") << "frame " << i;
        }
        Frames t = v.frames;
        t[d + 1][0] = t[d + 1][0] == 'a' ? 'b' : 'a';
        EXPECT_EQ(check(t, signer).error, "bad signature");
        Frames wrong_key = v.frames;
        EXPECT_EQ(check(wrong_key, Signer(v.key + "x")).error, "bad signature");
    }
}

// Routing identities and buffers are outside the HMAC in the Jupyter spec.
TEST(JupyterClientVectors, IdentitiesAndBuffersAreNotSigned) {
    for (const auto& v : vectors()) {
        if (v.buffers == 0 || v.identities == 0 || v.key.empty()) continue;
        Signer signer(v.key);
        Frames t = v.frames;
        t.front() += "x";
        t.back() += "y";
        EXPECT_TRUE(check(t, signer).ok) << v.name;
        return;
    }
    FAIL() << "no vector with both identities and buffers";
}

TEST(JupyterClientVectors, ReplayOfAReferenceMessageIsRejected) {
    const auto vs = vectors();
    ReplayGuard guard;
    Signer signer(vs.front().key);
    EXPECT_TRUE(check(vs.front().frames, signer, &guard).ok);
    EXPECT_EQ(check(vs.front().frames, signer, &guard).error, "replayed message");
    EXPECT_EQ(dec(vs.front().frames, signer, &guard).error, "replayed message");
}

// jupyter_client ignores the signature frame when its key is empty; the spec
// (and we) accept only an empty signature then.
TEST(JupyterClientVectors, EmptyKeyAcceptsOnlyAnEmptySignature) {
    for (const auto& v : vectors()) {
        if (!v.key.empty()) continue;
        Signer signer(v.key);
        EXPECT_TRUE(check(v.frames, signer).ok);
        Frames t = v.frames;
        t[v.identities + 1] = std::string(64, 'a');
        EXPECT_EQ(check(t, signer).error, "bad signature");
        return;
    }
    FAIL() << "no empty-key vector";
}

// ---------------------------------------------------------------------------
// check_wire

TEST(CheckWire, AcceptsAMinimalMessage) {
    Signer s("k");
    const WireCheck c = check(signed_frames(s, {}, header_text("m"), "{}", "{}", "{}"), s);
    EXPECT_TRUE(c.ok) << c.error;
    EXPECT_EQ(c.layout.delimiter, 0u);
    EXPECT_EQ(c.layout.signature(), 1u);
    EXPECT_EQ(c.layout.content(), 5u);
    EXPECT_TRUE(c.error.empty());
}

TEST(CheckWire, MissingDelimiter) {
    Signer s("k");
    Frames f = simple(s, "m");
    f[1] = "<IDS|MSG> ";
    EXPECT_EQ(check(f, s).error, "missing delimiter");
    EXPECT_EQ(check(Frames{}, s).error, "missing delimiter");
    EXPECT_FALSE(check(f, s).ok);
}

TEST(CheckWire, TooFewFramesAfterDelimiter) {
    Signer s("k");
    Frames f = simple(s, "m");
    f.pop_back();
    EXPECT_EQ(check(f, s).error, "too few frames after delimiter");
    EXPECT_EQ(check(Frames{"<IDS|MSG>"}, s).error, "too few frames after delimiter");
}

TEST(CheckWire, TooManyFrames) {
    Signer s("k");
    WireLimits limits;
    limits.max_frames = 8;
    const Frames ok = signed_frames(s, {"id"}, header_text("m"), "{}", "{}", "{}", {"b"});
    EXPECT_TRUE(check(ok, s, nullptr, limits).ok);
    const Frames f = signed_frames(s, {"id"}, header_text("m"), "{}", "{}", "{}", {"b", "c"});
    EXPECT_EQ(check(f, s, nullptr, limits).error, "too many frames");
    EXPECT_EQ(check(Frames(2000, "x"), s).error, "too many frames");
}

TEST(CheckWire, TooManyIdentities) {
    Signer s("k");
    const Frames sixteen = signed_frames(s, Frames(16, "id"), header_text("m"), "{}", "{}", "{}");
    EXPECT_TRUE(check(sixteen, s).ok);
    const Frames seventeen = signed_frames(s, Frames(17, "id"), header_text("m"), "{}", "{}", "{}");
    EXPECT_EQ(check(seventeen, s).error, "too many identities");
}

TEST(CheckWire, FirstDelimiterWins) {
    Signer s("k");
    // An identity equal to the delimiter makes the real delimiter the
    // "signature": the message cannot verify.
    Frames f = signed_frames(s, {"<IDS|MSG>"}, header_text("m"), "{}", "{}", "{}");
    const WireCheck c = check(f, s);
    EXPECT_EQ(c.error, "bad signature");
    // A buffer equal to the delimiter is harmless.
    Frames g = signed_frames(s, {"id"}, header_text("m"), "{}", "{}", "{}", {"<IDS|MSG>"});
    const WireCheck cg = check(g, s);
    EXPECT_TRUE(cg.ok) << cg.error;
    EXPECT_EQ(cg.layout.delimiter, 1u);
}

TEST(CheckWire, JsonFrameTooLarge) {
    Signer s("k");
    WireLimits limits;
    limits.max_json_frame_bytes = 100;
    const std::string big = json{{"x", std::string(100, 'a')}}.dump();
    for (int which = 0; which < 4; ++which) {
        std::string parts[4] = {header_text("m"), "{}", "{}", "{}"};
        parts[which] = which == 0 ? header_text(std::string(100, 'm')) : big;
        const Frames f = signed_frames(s, {}, parts[0], parts[1], parts[2], parts[3]);
        EXPECT_EQ(check(f, s, nullptr, limits).error, "frame too large") << which;
    }
    // Buffers are not JSON frames: only the total applies to them.
    const Frames with_buffer =
        signed_frames(s, {}, "{}", "{}", "{}", "{}", {std::string(1000, 'b')});
    EXPECT_TRUE(check(with_buffer, s, nullptr, limits).ok);
}

TEST(CheckWire, MessageTooLarge) {
    Signer s("k");
    WireLimits limits;
    limits.max_total_bytes = 1000;
    const Frames small =
        signed_frames(s, {}, header_text("m"), "{}", "{}", "{}", {std::string(500, 'b')});
    EXPECT_TRUE(check(small, s, nullptr, limits).ok);
    const Frames f = signed_frames(s, {}, header_text("m"), "{}", "{}", "{}",
                                   {std::string(500, 'b'), std::string(500, 'c')});
    EXPECT_EQ(check(f, s, nullptr, limits).error, "message too large");
    // Identities count too.
    const Frames g = signed_frames(s, {std::string(990, 'i')}, "{}", "{}", "{}", "{}");
    EXPECT_EQ(check(g, s, nullptr, limits).error, "message too large");
}

TEST(CheckWire, WrongLengthAndUppercaseSignatures) {
    Signer s("k");
    Frames f = simple(s, "m");
    const std::string good = f[2];
    f[2] = good.substr(0, 63);
    EXPECT_EQ(check(f, s).error, "bad signature");
    f[2] = good + "0";
    EXPECT_EQ(check(f, s).error, "bad signature");
    f[2] = "";
    EXPECT_EQ(check(f, s).error, "bad signature");
    std::string up = good;
    for (char& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    ASSERT_NE(up, good);
    f[2] = up;
    EXPECT_EQ(check(f, s).error, "bad signature");
    f[2] = good;
    EXPECT_TRUE(check(f, s).ok);
}

TEST(CheckWire, ReplayRejectedOnlyWithAGuard) {
    Signer s("k");
    const Frames f = simple(s, "m");
    EXPECT_TRUE(check(f, s).ok);
    EXPECT_TRUE(check(f, s).ok);  // no guard: nothing remembered
    ReplayGuard guard;
    EXPECT_TRUE(check(f, s, &guard).ok);
    const WireCheck again = check(f, s, &guard);
    EXPECT_FALSE(again.ok);
    EXPECT_EQ(again.error, "replayed message");
    // A different route (identity) does not make it a new message.
    Frames rerouted = f;
    rerouted[0] = "other-client";
    EXPECT_EQ(check(rerouted, s, &guard).error, "replayed message");
    EXPECT_TRUE(check(simple(s, "m2"), s, &guard).ok);
}

// jupyter_client 7.4.9 stores a digest before checking it. Here, a message
// that carries a valid message's signature but fails verification must not
// get that signature remembered.
TEST(CheckWire, FailedMessagesAreNotRemembered) {
    Signer s("k");
    ReplayGuard guard;
    const Frames valid = simple(s, "m", "{\"code\":\"1\"}");
    Frames forged = valid;
    forged[6] = "{\"code\":\"2\"}";
    EXPECT_EQ(check(forged, s, &guard).error, "bad signature");
    WireLimits tight;
    tight.max_total_bytes = 10;
    EXPECT_EQ(check(valid, s, &guard, tight).error, "message too large");
    EXPECT_EQ(guard.size(), 0u);
    EXPECT_TRUE(check(valid, s, &guard).ok);
}

TEST(CheckWire, JunkFloodDoesNotFlushTheGuard) {
    Signer s("k");
    ReplayGuard guard;  // default capacity 65536
    const Frames valid = simple(s, "precious");
    ASSERT_TRUE(check(valid, s, &guard).ok);

    std::mt19937_64 rng(42);
    Frames junk = simple(s, "junk");
    int rejected = 0;
    for (int i = 0; i < 70000; ++i) {
        char sig[65];
        std::snprintf(sig, sizeof sig, "%016llx%016llx%016llx%016llx",
                      static_cast<unsigned long long>(rng()),
                      static_cast<unsigned long long>(rng()),
                      static_cast<unsigned long long>(rng()), static_cast<unsigned long long>(i));
        junk[2] = sig;
        if (check(junk, s, &guard).error == "bad signature") ++rejected;
    }
    EXPECT_EQ(rejected, 70000);
    EXPECT_EQ(guard.size(), 1u);
    EXPECT_EQ(check(valid, s, &guard).error, "replayed message");
    EXPECT_EQ(dec(valid, s, &guard).error, "replayed message");
}

TEST(CheckWire, GuardForgetsOnlyPastCapacity) {
    Signer s("k");
    ReplayGuard guard(4);
    std::vector<Frames> msgs;
    for (int i = 0; i < 5; ++i) {
        msgs.push_back(simple(s, std::to_string(i) + "-msg"));
        ASSERT_TRUE(check(msgs.back(), s, &guard).ok);
    }
    EXPECT_EQ(guard.size(), 4u);
    // The oldest was evicted, so its replay passes (the window is bounded)...
    EXPECT_TRUE(check(msgs[0], s, &guard).ok);
    // ...and pushes out m1, the next oldest; m2..m4 and m0 stay remembered.
    EXPECT_EQ(guard.size(), 4u);
    for (int i : {0, 2, 3, 4}) EXPECT_EQ(check(msgs[i], s, &guard).error, "replayed message") << i;
    EXPECT_TRUE(check(msgs[1], s, &guard).ok);
}

TEST(CheckWire, SigningDisabledAcceptsUnsignedAndNeverRemembers) {
    Signer s("");
    ReplayGuard guard;
    const Frames f = simple(s, "m");
    ASSERT_EQ(f[2], "");
    EXPECT_TRUE(check(f, s, &guard).ok);
    EXPECT_TRUE(check(f, s, &guard).ok);
    EXPECT_EQ(guard.size(), 0u);
    Frames signed_by_someone = f;
    signed_by_someone[2] = Signer("k").sign(f[3], f[4], f[5], f[6]);
    EXPECT_EQ(check(signed_by_someone, s).error, "bad signature");
}

// ---------------------------------------------------------------------------
// parse_json_frame and decode

std::string nested(std::size_t depth, char open = '[', char close = ']') {
    return std::string(depth, open) + std::string(depth, close);
}

TEST(ParseJsonFrame, AcceptsObjectsAndScalars) {
    const auto j = parse_json_frame("{\"a\":[1,2,{\"b\":null}],\"c\":\"\\u00e9\"}", 64);
    ASSERT_TRUE(j);
    EXPECT_EQ((*j)["a"][2]["b"], nullptr);
    EXPECT_EQ((*j)["c"], "\xc3\xa9");
    EXPECT_EQ(parse_json_frame("3", 64), json(3));
}

TEST(ParseJsonFrame, DepthLimitIsExact) {
    EXPECT_TRUE(parse_json_frame(nested(64), 64));
    EXPECT_FALSE(parse_json_frame(nested(65), 64));
    EXPECT_TRUE(parse_json_frame("{\"a\":{\"b\":{}}}", 3));
    EXPECT_FALSE(parse_json_frame("{\"a\":{\"b\":{}}}", 2));
    EXPECT_FALSE(parse_json_frame("{}", 0));
    EXPECT_TRUE(parse_json_frame("1", 0));
}

TEST(ParseJsonFrame, HugeDepthIsRejectedWithoutRecursion) {
    EXPECT_FALSE(parse_json_frame(nested(100000), 64));
    EXPECT_FALSE(parse_json_frame(std::string(1000000, '['), 64));
    std::string objects;
    for (int i = 0; i < 100000; ++i) objects += "{\"a\":";
    objects += "1" + std::string(100000, '}');
    EXPECT_FALSE(parse_json_frame(objects, 64));
}

TEST(ParseJsonFrame, BracketsInsideStringsDoNotCount) {
    const std::string s =
        "{\"a\":\"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"}";
    const auto j = parse_json_frame(s, 1);
    ASSERT_TRUE(j);
    EXPECT_EQ((*j)["a"].get<std::string>().size(), 2001u);
    // An escaped backslash ends before the quote, so the string closes there.
    EXPECT_TRUE(parse_json_frame("{\"a\":\"\\\\\",\"b\":[[1]]}", 3));
    EXPECT_FALSE(parse_json_frame("{\"a\":\"\\\\\",\"b\":[[1]]}", 2));
}

TEST(ParseJsonFrame, RejectsInvalidUtf8) {
    EXPECT_FALSE(parse_json_frame("{\"a\":\"\xff\"}", 64));
    EXPECT_FALSE(parse_json_frame("{\"a\":\"\xc3\"}", 64));          // truncated sequence
    EXPECT_FALSE(parse_json_frame("{\"a\":\"\xc0\xaf\"}", 64));      // overlong '/'
    EXPECT_FALSE(parse_json_frame("{\"a\":\"\xed\xa0\x80\"}", 64));  // encoded surrogate
    EXPECT_FALSE(parse_json_frame("{\"\xfe\":1}", 64));
    EXPECT_TRUE(parse_json_frame("{\"a\":\"\xf0\x9f\x98\x80\"}", 64));
}

TEST(ParseJsonFrame, RejectsLoneSurrogateEscape) {
    EXPECT_FALSE(parse_json_frame("{\"a\":\"\\ud800\"}", 64));
    EXPECT_TRUE(parse_json_frame("{\"a\":\"\\ud83d\\ude00\"}", 64));
}

TEST(ParseJsonFrame, RejectsNanInfinityAndOverflow) {
    EXPECT_FALSE(parse_json_frame("{\"a\":NaN}", 64));
    EXPECT_FALSE(parse_json_frame("{\"a\":Infinity}", 64));
    EXPECT_FALSE(parse_json_frame("{\"a\":-Infinity}", 64));
    EXPECT_FALSE(parse_json_frame("{\"a\":1e400}", 64));
    EXPECT_TRUE(parse_json_frame("{\"a\":1e300}", 64));
}

TEST(ParseJsonFrame, RejectsNonJson) {
    for (const char* text : {"", " ", "hello", "{", "{}}", "{} x", "{'a':1}", "{\"a\":1,}", "[1,]",
                             "{\"a\" 1}", "// c\n{}", "\"unterminated"}) {
        EXPECT_FALSE(parse_json_frame(text, 64)) << text;
    }
    // nlohmann's lexer stops at NUL; Python's json does not, so a NUL must
    // not let trailing bytes through.
    EXPECT_FALSE(parse_json_frame("{}\0"s, 64));
    EXPECT_FALSE(parse_json_frame("{\"a\":1}\0{\"a\":2}"s, 64));
    EXPECT_FALSE(parse_json_frame("{\"a\":\"x\0\"}"s, 64));
}

TEST(ParseJsonFrame, RandomBytesNeverThrow) {
    std::mt19937 rng(7);
    const std::string alphabet = "{}[]\",:\\0123456789eE+-.truefalsnul \xff\xc3\xa9";
    for (int i = 0; i < 3000; ++i) {
        std::string s(rng() % 64, ' ');
        for (char& c : s) c = alphabet[rng() % alphabet.size()];
        EXPECT_NO_THROW((void)parse_json_frame(s, 8)) << s;
    }
}

TEST(Decode, DeepContentIsRejectedNotCrashed) {
    Signer s("k");
    const Frames f = simple(s, "m", "{\"a\":" + nested(100000) + "}");
    const WireDecode d = dec(f, s);
    EXPECT_FALSE(d.message);
    EXPECT_EQ(d.error, "content is not valid JSON");
}

TEST(Decode, NamesTheBadFrame) {
    Signer s("k");
    struct Case {
        std::string header, parent, metadata, content, error;
    };
    const std::vector<Case> cases = {
        {"{\"msg_id\":\"m\",\"msg_type\":\"t\",\"x\":NaN}", "{}", "{}", "{}",
         "header is not valid JSON"},
        {header_text("m"), "{\"a\":\"\xff\"}", "{}", "{}", "parent_header is not valid JSON"},
        {header_text("m"), "{}", "not json", "{}", "metadata is not valid JSON"},
        {header_text("m"), "{}", "{}", "{\"x\":NaN}", "content is not valid JSON"},
        {"null", "{}", "{}", "{}", "header is not a JSON object"},
        {header_text("m"), "[]", "{}", "{}", "parent_header is not a JSON object"},
        {header_text("m"), "{}", "\"s\"", "{}", "metadata is not a JSON object"},
        {header_text("m"), "{}", "{}", "[1]", "content is not a JSON object"},
        {"{\"msg_type\":\"t\"}", "{}", "{}", "{}", "header has no string msg_id"},
        {"{\"msg_id\":7,\"msg_type\":\"t\"}", "{}", "{}", "{}", "header has no string msg_id"},
        {"{\"msg_id\":\"m\"}", "{}", "{}", "{}", "header has no string msg_type"},
        {"{\"msg_id\":\"m\",\"msg_type\":null}", "{}", "{}", "{}", "header has no string msg_type"},
    };
    for (const Case& c : cases) {
        ReplayGuard guard;
        const WireDecode d =
            dec(signed_frames(s, {}, c.header, c.parent, c.metadata, c.content), s, &guard);
        EXPECT_FALSE(d.message) << c.error;
        EXPECT_EQ(d.error, c.error);
        EXPECT_EQ(guard.size(), 0u) << "a rejected message was remembered: " << c.error;
    }
}

TEST(Decode, NulByteInAFrameIsRejected) {
    Signer s("k");
    const Frames f = simple(s, "m", "{\"code\":\"a\"}\0{\"code\":\"b\"}"s);
    EXPECT_EQ(dec(f, s).error, "content is not valid JSON");
}

TEST(Decode, DepthLimitFollowsLimits) {
    Signer s("k");
    const Frames f = simple(s, "m", "{\"a\":" + nested(9) + "}");  // depth 10
    WireLimits limits;
    limits.max_json_depth = 10;
    EXPECT_TRUE(dec(f, s, nullptr, limits).message);
    limits.max_json_depth = 9;
    EXPECT_EQ(dec(f, s, nullptr, limits).error, "content is not valid JSON");
}

TEST(Decode, PassesCheckWireErrorsThrough) {
    Signer s("k");
    Frames f = simple(s, "m");
    f[3] += " ";
    EXPECT_EQ(dec(f, s).error, "bad signature");
    EXPECT_EQ(dec(Frames{"a", "b"}, s).error, "missing delimiter");
}

TEST(Decode, RemembersOnlyAcceptedMessages) {
    Signer s("k");
    ReplayGuard guard;
    const Frames f = simple(s, "m", "{\"x\":1}");
    const WireDecode first = dec(f, s, &guard);
    ASSERT_TRUE(first.message) << first.error;
    EXPECT_EQ(guard.size(), 1u);
    EXPECT_EQ(dec(f, s, &guard).error, "replayed message");
    EXPECT_EQ(check(f, s, &guard).error, "replayed message");
}

// ---------------------------------------------------------------------------
// encode, headers, replies

WireMessage sample_message() {
    WireMessage m;
    m.identities = {"\x00\x01route"s, "second"};
    m.header = make_header("execute_request", "session-1");
    m.parent_header = {{"msg_id", "parent-1"}, {"msg_type", "x"}};
    m.metadata = {{"deletedCells", json::array()}};
    m.content = {{"code", "print('h\xc3\xa9llo')\n"}, {"silent", false}, {"n", 1.5}};
    m.buffers = {"\x00\xff<IDS|MSG>"s, ""};
    return m;
}

TEST(Encode, LayoutAndCompactDump) {
    Signer s("k");
    const WireMessage m = sample_message();
    const Frames f = encode(m, s);
    ASSERT_EQ(f.size(), 2u + 6u + 2u);
    EXPECT_EQ(f[0], m.identities[0]);
    EXPECT_EQ(f[1], m.identities[1]);
    EXPECT_EQ(f[2], kDelimiter);
    EXPECT_EQ(f[4], m.header.dump());
    EXPECT_EQ(f[5], m.parent_header.dump());
    EXPECT_EQ(f[6], m.metadata.dump());
    EXPECT_EQ(f[7], m.content.dump());
    EXPECT_EQ(f[7], "{\"code\":\"print('h\xc3\xa9llo')\\n\",\"n\":1.5,\"silent\":false}");
    EXPECT_EQ(f[3], s.sign(f[4], f[5], f[6], f[7]));
    EXPECT_EQ(f[3].size(), 64u);
    EXPECT_EQ(f[8], m.buffers[0]);
    EXPECT_EQ(f[9], m.buffers[1]);
}

TEST(Encode, RoundTripsThroughDecode) {
    Signer s("k");
    const WireMessage m = sample_message();
    ReplayGuard guard;
    const WireDecode d = dec(encode(m, s), s, &guard);
    ASSERT_TRUE(d.message) << d.error;
    EXPECT_EQ(d.message->identities, m.identities);
    EXPECT_EQ(d.message->header, m.header);
    EXPECT_EQ(d.message->parent_header, m.parent_header);
    EXPECT_EQ(d.message->metadata, m.metadata);
    EXPECT_EQ(d.message->content, m.content);
    EXPECT_EQ(d.message->buffers, m.buffers);
    EXPECT_EQ(guard.size(), 1u);
}

TEST(Encode, UnsignedWhenKeyIsEmpty) {
    Signer s("");
    const Frames f = encode(sample_message(), s);
    EXPECT_EQ(f[3], "");
    EXPECT_TRUE(check(f, s).ok);
    EXPECT_EQ(check(f, Signer("k")).error, "bad signature");
}

TEST(Encode, InvalidUtf8IsReplacedNotThrown) {
    Signer s("k");
    WireMessage m;
    m.header = make_header("stream", "s");
    m.content = {{"text", std::string("bad \xff byte")}};
    Frames f;
    ASSERT_NO_THROW(f = encode(m, s));
    EXPECT_EQ(f[5], "{\"text\":\"bad \xef\xbf\xbd byte\"}");
    const WireDecode d = dec(f, s);
    ASSERT_TRUE(d.message) << d.error;
    EXPECT_EQ(d.message->content["text"], "bad \xef\xbf\xbd byte");
}

TEST(MakeHeader, HasTheSpecFields) {
    const json h = make_header("kernel_info_request", "sess-42");
    ASSERT_TRUE(h.is_object());
    EXPECT_EQ(h.size(), 6u);
    EXPECT_EQ(h.at("msg_type"), "kernel_info_request");
    EXPECT_EQ(h.at("session"), "sess-42");
    EXPECT_EQ(h.at("username"), "cellblock");
    EXPECT_EQ(h.at("version"), "5.3");
    EXPECT_EQ(make_header("x", "s", "alice").at("username"), "alice");
    EXPECT_NE(make_header("x", "s").at("msg_id"), make_header("x", "s").at("msg_id"));
}

TEST(MakeHeader, MsgIdIsUuid4AndDateIsNowUtcWithMicroseconds) {
    const json h = make_header("x", "s");
    const std::regex uuid4("^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$");
    EXPECT_TRUE(std::regex_match(h.at("msg_id").get<std::string>(), uuid4)) << h.at("msg_id");
    const std::string date = h.at("date").get<std::string>();
    const std::regex iso(R"(^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.\d{6}Z$)");
    std::smatch m;
    ASSERT_TRUE(std::regex_match(date, m, iso)) << date;
    std::tm tm{};
    tm.tm_year = std::stoi(m[1]) - 1900;
    tm.tm_mon = std::stoi(m[2]) - 1;
    tm.tm_mday = std::stoi(m[3]);
    tm.tm_hour = std::stoi(m[4]);
    tm.tm_min = std::stoi(m[5]);
    tm.tm_sec = std::stoi(m[6]);
    const std::time_t parsed = timegm(&tm);
    EXPECT_LE(std::abs(static_cast<long>(parsed - std::time(nullptr))), 5L) << date;
}

TEST(MakeUuid, CanonicalAndUnique) {
    const std::regex uuid4("^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$");
    std::set<std::string> ids;
    for (int i = 0; i < 1000; ++i) {
        const std::string id = make_uuid();
        ASSERT_TRUE(std::regex_match(id, uuid4)) << id;
        ids.insert(id);
    }
    EXPECT_EQ(ids.size(), 1000u);
}

TEST(MakeReply, LinksToItsParent) {
    WireMessage parent = sample_message();
    parent.header["msg_id"] = "parent-id";
    const WireMessage r = make_reply(parent, "execute_reply", {{"status", "ok"}}, "server-session");
    EXPECT_EQ(r.identities, parent.identities);
    EXPECT_EQ(r.parent_header, parent.header);
    EXPECT_EQ(r.parent_msg_id(), "parent-id");
    EXPECT_EQ(r.msg_type(), "execute_reply");
    EXPECT_EQ(r.header.at("session"), "server-session");
    EXPECT_EQ(r.header.at("version"), "5.3");
    EXPECT_NE(r.msg_id(), "parent-id");
    EXPECT_EQ(r.content, json({{"status", "ok"}}));
    EXPECT_EQ(r.metadata, json::object());
    EXPECT_TRUE(r.buffers.empty());
}

TEST(WireMessage, AccessorsToleratesMissingOrMistypedFields) {
    WireMessage m;
    EXPECT_EQ(m.msg_type(), "");
    EXPECT_EQ(m.msg_id(), "");
    EXPECT_EQ(m.parent_msg_id(), "");
    m.header = {{"msg_id", 5}, {"msg_type", "t"}};
    m.parent_header = json::array();
    EXPECT_EQ(m.msg_id(), "");
    EXPECT_EQ(m.msg_type(), "t");
    EXPECT_EQ(m.parent_msg_id(), "");
}

TEST(Iso8601Now, Format) {
    const std::regex iso(R"(^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$)");
    for (int i = 0; i < 100; ++i) {
        const std::string now = iso8601_now();
        ASSERT_TRUE(std::regex_match(now, iso)) << now;
    }
}

}  // namespace
}  // namespace cellblock
