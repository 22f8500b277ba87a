// The ZMTP 3.0 codec (include/cellblock/zmtp.hpp): first against bytes
// written by hand from RFC 23, then against real libzmq sockets (ROUTER, PUB,
// XPUB) over an ipc:// path that a plain AF_UNIX socket connects to.
#include "cellblock/zmtp.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

namespace cellblock {
namespace {

using namespace std::string_literals;
using Frames = std::vector<std::string>;

// ---------------------------------------------------------------------------
// The peer's side, written by hand from RFC 23 (not with the codec's encoder).

std::string peer_greeting(unsigned char major = 3, unsigned char minor = 0,
                          std::string_view mechanism = "NULL", unsigned char as_server = 0) {
    std::string g(64, '\0');
    g[0] = '\xff';
    g[9] = '\x7f';
    g[10] = static_cast<char>(major);
    g[11] = static_cast<char>(minor);
    std::copy(mechanism.begin(), mechanism.end(), g.begin() + 12);
    g[32] = static_cast<char>(as_server);
    return g;
}

std::string size_field(std::size_t size, bool long_form) {
    std::string out;
    if (long_form) {
        for (int shift = 56; shift >= 0; shift -= 8)
            out += static_cast<char>((size >> shift) & 0xff);
    } else {
        out += static_cast<char>(size);
    }
    return out;
}

// One frame: flags as given plus LONG when the body needs it (or when forced).
std::string raw_frame(unsigned char flags, std::string_view body, bool force_long = false) {
    const bool long_form = force_long || body.size() > 255;
    if (long_form) flags |= 0x02;
    return static_cast<char>(flags) + size_field(body.size(), long_form) + std::string(body);
}

std::string command(std::string_view name, std::string_view data, bool force_long = false) {
    std::string body = static_cast<char>(name.size()) + std::string(name) + std::string(data);
    return raw_frame(0x04, body, force_long);
}

std::string property(std::string_view name, std::string_view value) {
    std::string out = static_cast<char>(name.size()) + std::string(name);
    for (int shift = 24; shift >= 0; shift -= 8) {
        out += static_cast<char>((value.size() >> shift) & 0xff);
    }
    return out + std::string(value);
}

std::string ready_command(std::string_view socket_type) {
    return command("READY", property("Socket-Type", socket_type));
}

std::string message(const Frames& frames, bool force_long = false) {
    std::string out;
    for (std::size_t i = 0; i < frames.size(); ++i) {
        out += raw_frame(i + 1 < frames.size() ? 0x01 : 0x00, frames[i], force_long);
    }
    return out;
}

std::string handshake(std::string_view peer_type = "ROUTER") {
    return peer_greeting() + ready_command(peer_type);
}

// A frame as the codec wrote it.
struct OutFrame {
    unsigned char flags;
    bool long_size;
    std::string body;
};

// Splits what the codec wrote after its greeting into frames.
std::vector<OutFrame> frames_written(std::string_view bytes) {
    std::vector<OutFrame> out;
    while (!bytes.empty()) {
        const auto flags = static_cast<unsigned char>(bytes[0]);
        const std::size_t header = (flags & 0x02) ? 9 : 2;
        if (bytes.size() < header) {
            ADD_FAILURE() << "the codec wrote a truncated frame header";
            return out;
        }
        std::uint64_t size = 0;
        for (std::size_t i = 1; i < header; ++i) {
            size = (size << 8) | static_cast<unsigned char>(bytes[i]);
        }
        if (bytes.size() - header < size) {
            ADD_FAILURE() << "the codec wrote a truncated frame body";
            return out;
        }
        out.push_back({flags, (flags & 0x02) != 0, std::string(bytes.substr(header, size))});
        bytes.remove_prefix(header + size);
    }
    return out;
}

// A READY command's properties; fails the test if the body is not READY.
std::map<std::string, std::string> ready_properties(std::string_view body) {
    std::map<std::string, std::string> props;
    if (body.substr(0, 6) != "\x05READY") {
        ADD_FAILURE() << "not a READY command";
        return props;
    }
    body.remove_prefix(6);
    while (!body.empty()) {
        const std::size_t name_len = static_cast<unsigned char>(body[0]);
        if (body.size() < 1 + name_len + 4) {
            ADD_FAILURE() << "truncated READY property";
            return props;
        }
        std::string name(body.substr(1, name_len));
        std::size_t value_len = 0;
        for (std::size_t i = 0; i < 4; ++i) {
            value_len = (value_len << 8) | static_cast<unsigned char>(body[1 + name_len + i]);
        }
        if (body.size() - 1 - name_len - 4 < value_len) {
            ADD_FAILURE() << "truncated READY property value";
            return props;
        }
        EXPECT_EQ(props.count(name), 0u) << "property " << name << " twice";
        props[name] = std::string(body.substr(1 + name_len + 4, value_len));
        body.remove_prefix(1 + name_len + 4 + value_len);
    }
    return props;
}

// The messages waiting, oldest first; their counts of frames dropped past
// max_frames go to `dropped` if given, else there must be none.
std::vector<Frames> drain(zmtp::Connection& c, std::vector<std::size_t>* dropped = nullptr) {
    std::vector<Frames> out;
    const std::size_t queued_bytes = c.queued_bytes();
    std::size_t popped_bytes = 0;
    while (c.has_message()) {
        zmtp::Message m = c.pop();
        std::size_t sum = 0;
        for (const auto& f : m.frames) sum += f.size();
        EXPECT_EQ(m.total_bytes, sum);
        popped_bytes += sum;
        if (dropped) {
            dropped->push_back(m.dropped_frames);
        } else {
            EXPECT_EQ(m.dropped_frames, 0u);
        }
        out.push_back(std::move(m.frames));
    }
    EXPECT_EQ(queued_bytes, popped_bytes) << "queued_bytes() before popping";
    EXPECT_EQ(c.queued_bytes(), 0u);
    return out;
}

// Feeds through read_buffer()/commit() in pieces of at most `piece` bytes
// (and never more than the codec offers), as a transport reads.
bool commit_in_pieces(zmtp::Connection& c, std::string_view bytes, std::size_t piece) {
    while (!bytes.empty()) {
        const zmtp::Connection::Span span = c.read_buffer();
        if (span.size == 0) return false;
        const std::size_t n = std::min({span.size, piece, bytes.size()});
        std::memcpy(span.data, bytes.data(), n);
        bytes.remove_prefix(n);
        if (!c.commit(n)) return false;
    }
    return !c.failed();
}

std::string pattern(std::size_t size, unsigned seed) {
    std::string s(size, '\0');
    for (std::size_t i = 0; i < size; ++i)
        s[i] = static_cast<char>((i * 131 + seed * 7 + i / 251) & 0xff);
    return s;
}

// ---------------------------------------------------------------------------
// Pure codec.

TEST(ZmtpCodec, GreetingIsExactlyRfc23s) {
    zmtp::Connection c("DEALER", "me");
    const std::string_view g = c.output();
    ASSERT_EQ(g.size(), 64u) << "only the greeting goes out before the peer's greeting";
    EXPECT_EQ(static_cast<unsigned char>(g[0]), 0xffu);
    for (int i = 1; i <= 8; ++i) EXPECT_EQ(g[i], '\0') << "padding byte " << i;
    EXPECT_EQ(static_cast<unsigned char>(g[9]), 0x7fu);
    EXPECT_EQ(g[10], 3) << "version major";
    EXPECT_EQ(g[11], 0) << "version minor";
    EXPECT_EQ(g.substr(12, 20), std::string_view("NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 20));
    EXPECT_EQ(g[32], 0) << "as-server";
    EXPECT_EQ(g.substr(33), std::string(31, '\0')) << "filler";
    EXPECT_FALSE(c.ready());
    EXPECT_FALSE(c.failed());
    EXPECT_TRUE(c.error().empty());

    // SUB's greeting is the same bytes.
    zmtp::Connection sub("SUB", "");
    EXPECT_EQ(sub.output(), g);

    const std::string greeting(g);
    c.consumed(10);
    EXPECT_EQ(c.output(), greeting.substr(10));
    c.consumed(54);
    EXPECT_TRUE(c.output().empty());
}

TEST(ZmtpCodec, HandshakeWithAScriptedRouter) {
    zmtp::Connection c("DEALER", "dealer-7");
    ASSERT_TRUE(c.feed(peer_greeting()));
    EXPECT_FALSE(c.ready()) << "ready only after the peer's READY";
    // Our READY goes out once the peer's greeting is in.
    const std::string out(c.output());
    ASSERT_GT(out.size(), 64u);
    const auto frames = frames_written(std::string_view(out).substr(64));
    ASSERT_EQ(frames.size(), 1u);
    EXPECT_EQ(frames[0].flags, 0x04) << "a short command frame";
    const auto props = ready_properties(frames[0].body);
    EXPECT_EQ(props.size(), 2u);
    EXPECT_EQ(props.at("Socket-Type"), "DEALER");
    EXPECT_EQ(props.at("Identity"), "dealer-7");

    ASSERT_TRUE(c.feed(ready_command("ROUTER")));
    EXPECT_TRUE(c.ready());
    EXPECT_FALSE(c.failed());
    EXPECT_EQ(c.peer_socket_type(), "ROUTER");
    EXPECT_TRUE(c.error().empty());
    EXPECT_EQ(c.output(), out) << "nothing more to say after the handshake";
    EXPECT_FALSE(c.has_message());
}

TEST(ZmtpCodec, NoIdentityPropertyWithoutAnIdentityAndSubSaysSub) {
    zmtp::Connection c("SUB", "");
    ASSERT_TRUE(c.feed(peer_greeting(3, 1)));  // libzmq 4.x greets as 3.1
    const auto frames = frames_written(c.output().substr(64));
    ASSERT_EQ(frames.size(), 1u);
    const auto props = ready_properties(frames[0].body);
    EXPECT_EQ(props.size(), 1u);
    EXPECT_EQ(props.at("Socket-Type"), "SUB");
    ASSERT_TRUE(c.feed(ready_command("PUB")));
    EXPECT_TRUE(c.ready());
    EXPECT_EQ(c.peer_socket_type(), "PUB");
}

TEST(ZmtpCodec, CompatibleSocketTypesAndExtraReadyProperties) {
    for (const auto& [ours, peer] :
         std::vector<std::pair<std::string, std::string>>{{"DEALER", "ROUTER"},
                                                          {"DEALER", "DEALER"},
                                                          {"DEALER", "REP"},
                                                          {"SUB", "PUB"},
                                                          {"SUB", "XPUB"}}) {
        SCOPED_TRACE(ours + " to " + peer);
        zmtp::Connection c(ours, "");
        // A READY as libzmq writes it for a ROUTER: an (empty) Identity too,
        // and a property we do not know.
        const std::string ready =
            command("READY", property("Socket-Type", peer) + property("Identity", "") +
                                 property("X-Extra", "whatever"));
        EXPECT_TRUE(c.feed(peer_greeting() + ready)) << c.error();
        EXPECT_TRUE(c.ready());
        EXPECT_EQ(c.peer_socket_type(), peer);
    }
}

TEST(ZmtpCodec, MessagesShortLongMultiFrameAndEmpty) {
    zmtp::Connection c("DEALER", "");
    ASSERT_TRUE(c.feed(handshake()));
    const std::string long_body = pattern(300, 1);
    const std::string b256 = pattern(256, 2);
    const std::string b255 = pattern(255, 3);
    std::string in;
    in += message({"hello"});
    in += message({long_body});
    // 300 bytes with an 8-byte size field: 0x02, then 00 00 00 00 00 00 01 2c.
    EXPECT_EQ(message({long_body}).substr(0, 9), "\x02\0\0\0\0\0\0\x01\x2c"s);
    in += message({"a", "", "ccc", long_body});
    in += message({""});
    in += message({"", "", ""});
    in += message({b255, b256});
    in += message({"short in long form"}, /*force_long=*/true);  // legal, if wasteful
    ASSERT_TRUE(c.feed(in)) << c.error();
    EXPECT_EQ(c.queued_messages(), 7u);
    const std::vector<Frames> want = {{"hello"},    {long_body},  {"a", "", "ccc", long_body}, {""},
                                      {"", "", ""}, {b255, b256}, {"short in long form"}};
    EXPECT_EQ(drain(c), want);
    EXPECT_EQ(c.skipped_messages(), 0u);
    EXPECT_FALSE(c.failed());
}

// A closed session keeps its connection objects for its SessionClosed window:
// released, they hold no buffer (16 KiB of staging each before: ~116 kB per
// closed session with a client connected).
TEST(ZmtpCodec, AReleasedConnectionHoldsNoBufferAndReadsNothing) {
    zmtp::Connection c("DEALER", "");
    ASSERT_TRUE(c.feed(handshake()));
    ASSERT_TRUE(c.feed(message({"waiting"})));
    c.send({pattern(70000, 5)});
    EXPECT_GE(c.held_bytes(), std::size_t{16} << 10);
    c.release();
    EXPECT_LT(c.held_bytes(), 64u);  // the strings' inline capacity only
    EXPECT_TRUE(c.failed());
    EXPECT_FALSE(c.has_message());
    EXPECT_TRUE(c.output().empty());
    EXPECT_EQ(c.read_buffer().size, 0u);
    c.send({"after"});
    EXPECT_TRUE(c.output().empty());
    EXPECT_FALSE(c.feed(message({"after"})));
}

TEST(ZmtpCodec, PartialMessageIsNotDeliveredUntilItsLastFrame) {
    zmtp::Connection c("DEALER", "");
    ASSERT_TRUE(c.feed(handshake()));
    const std::string m = message({"one", "two", "three"});
    ASSERT_TRUE(c.feed(m.substr(0, m.size() - 1)));
    EXPECT_FALSE(c.has_message());
    ASSERT_TRUE(c.feed(m.substr(m.size() - 1)));
    EXPECT_EQ(drain(c), (std::vector<Frames>{{"one", "two", "three"}}));
}

TEST(ZmtpCodec, WhatWeSendIsEncodedShortLongAndWithMore) {
    zmtp::Connection c("DEALER", "");
    ASSERT_TRUE(c.feed(handshake()));
    c.consumed(c.output().size());
    const std::string long_body = pattern(70000, 4);
    c.send({"a", "", long_body, std::string(255, 'x')});
    c.send({std::string_view("\x01topic", 6)});
    const auto frames = frames_written(c.output());
    ASSERT_EQ(frames.size(), 5u);
    EXPECT_EQ(frames[0].flags, 0x01);
    EXPECT_EQ(frames[0].body, "a");
    EXPECT_EQ(frames[1].flags, 0x01);
    EXPECT_EQ(frames[1].body, "");
    EXPECT_EQ(frames[2].flags, 0x03) << "MORE and LONG";
    EXPECT_EQ(frames[2].body, long_body);
    EXPECT_EQ(frames[3].flags, 0x00) << "255 bytes still fit a short size";
    EXPECT_EQ(frames[3].body, std::string(255, 'x'));
    EXPECT_EQ(frames[4].flags, 0x00);
    EXPECT_EQ(frames[4].body, "\x01topic");
    // Written in two goes, the rest is what was left.
    const std::string all(c.output());
    c.consumed(1000);
    EXPECT_EQ(c.output(), std::string_view(all).substr(1000));
    c.consumed(c.output().size());
    EXPECT_TRUE(c.output().empty());
}

struct Outcome {
    std::vector<Frames> messages;
    std::vector<std::size_t> dropped;
    bool failed = false;
    std::string error;
    std::uint64_t skipped = 0;
    std::string output;
};

Outcome run_script(const std::string& script, zmtp::Limits limits,
                   const std::function<void(zmtp::Connection&, std::string_view)>& feeder) {
    zmtp::Connection c("DEALER", "id", limits);
    c.send({"queued", "early"});
    feeder(c, script);
    Outcome r;
    r.messages = drain(c, &r.dropped);
    r.failed = c.failed();
    r.error = c.error();
    r.skipped = c.skipped_messages();
    r.output = std::string(c.output());
    return r;
}

TEST(ZmtpCodec, ByteAtATimeGivesWhatAllAtOnceGives) {
    const std::string big = pattern(70 * 1024, 5);      // read into its own storage
    const std::string bigger = pattern(300 * 1024, 6);  // larger than the staging buffer
    std::string script = handshake();
    script += message({"a", "bb"});
    script += message({pattern(300, 7)});
    script += message({"head", big, "tail"});
    script += message({std::string(2000, 'o')});
    script += message({"x", pattern(500 * 1024, 9)});  // a frame over the cap: skipped
    script += message({bigger});
    script += message({""});
    script += message({"1", "2", "3", "4", "5"});  // too many frames: the fifth is dropped
    script += message({"after"});
    const zmtp::Limits limits{400 * 1024, 4};
    for (const bool with_tail_error : {false, true}) {
        SCOPED_TRACE(with_tail_error ? "ending in a protocol error" : "clean");
        std::string s = script;
        if (with_tail_error) s += "\x40\x01x" + message({"never"});
        const Outcome whole =
            run_script(s, limits, [](zmtp::Connection& c, std::string_view b) { c.feed(b); });
        const Outcome bytewise = run_script(s, limits, [](zmtp::Connection& c, std::string_view b) {
            for (char ch : b) c.feed(std::string_view(&ch, 1));
        });
        const Outcome pieces = run_script(s, limits, [](zmtp::Connection& c, std::string_view b) {
            const std::size_t sizes[] = {1, 7, 300, 65539, 3, 100000};
            std::size_t i = 0;
            while (!b.empty()) {
                const auto span = c.read_buffer();
                if (span.size == 0) return;
                const std::size_t n = std::min({span.size, sizes[i++ % 6], b.size()});
                std::memcpy(span.data, b.data(), n);
                b.remove_prefix(n);
                if (!c.commit(n)) return;
            }
        });
        EXPECT_EQ(whole.failed, with_tail_error) << whole.error;
        EXPECT_EQ(whole.skipped, 1u);
        const std::vector<Frames> want = {{"a", "bb"},
                                          {pattern(300, 7)},
                                          {"head", big, "tail"},
                                          {std::string(2000, 'o')},
                                          {bigger},
                                          {""},
                                          {"1", "2", "3", "4"},
                                          {"after"}};
        EXPECT_EQ(whole.messages, want);
        EXPECT_EQ(whole.dropped, (std::vector<std::size_t>{0, 0, 0, 0, 0, 0, 1, 0}));
        for (const Outcome* r : {&bytewise, &pieces}) {
            EXPECT_EQ(r->messages, whole.messages);
            EXPECT_EQ(r->dropped, whole.dropped);
            EXPECT_EQ(r->failed, whole.failed);
            EXPECT_EQ(r->error, whole.error);
            EXPECT_EQ(r->skipped, whole.skipped);
            EXPECT_EQ(r->output, whole.output);
        }
    }
}

TEST(ZmtpCodec, AFrameOver64KiBArrivingInPieces) {
    zmtp::Connection c("DEALER", "");
    ASSERT_TRUE(c.feed(handshake()));
    const std::string big = pattern(200 * 1024 + 17, 8);
    std::string bytes = raw_frame(0x01, "head") + raw_frame(0x01, big) + raw_frame(0x00, "tail");
    bytes += message({"next"});
    const std::size_t body_start = raw_frame(0x01, "head").size() + 9;
    const std::size_t body_end = body_start + big.size();
    std::size_t at = 0, spans_inside_body = 0;
    while (at < bytes.size()) {
        const auto span = c.read_buffer();
        ASSERT_GT(span.size, 0u);
        if (at >= body_start && at < body_end) {
            ++spans_inside_body;
            ASSERT_LE(span.size, body_end - at) << "room offered past the frame's end at " << at;
        }
        const std::size_t n = std::min<std::size_t>({span.size, 4093, bytes.size() - at});
        std::memcpy(span.data, bytes.data() + at, n);
        at += n;
        ASSERT_TRUE(c.commit(n)) << c.error();
        if (at <= body_end) {
            EXPECT_FALSE(c.has_message()) << "delivered early at " << at;
        }
    }
    EXPECT_GT(spans_inside_body, 40u);
    EXPECT_EQ(drain(c), (std::vector<Frames>{{"head", big, "tail"}, {"next"}}));

    // The same frame with the caller reading as much as it is offered.
    zmtp::Connection d("DEALER", "");
    ASSERT_TRUE(d.feed(handshake()));
    ASSERT_TRUE(commit_in_pieces(d, bytes, SIZE_MAX)) << d.error();
    EXPECT_EQ(drain(d), (std::vector<Frames>{{"head", big, "tail"}, {"next"}}));
}

TEST(ZmtpCodec, AnOversizeFrameIsSkippedAndTheNextMessageIsIntact) {
    for (const std::size_t limit : {std::size_t{100}, std::size_t{100000}}) {
        SCOPED_TRACE("max_frame_bytes " + std::to_string(limit));
        zmtp::Connection c("DEALER", "", zmtp::Limits{limit, 8});
        ASSERT_TRUE(c.feed(handshake()));
        std::string in;
        in += message({std::string(limit, 'x')});                // exactly the cap: kept
        in += message({std::string(limit + 1, 'y')});            // one over: skipped
        in += message({"a", std::string(limit * 3, 'z'), "b"});  // over in the middle
        in += message({"after"});
        ASSERT_TRUE(commit_in_pieces(c, in, 4096)) << c.error();
        EXPECT_EQ(c.skipped_messages(), 2u);
        EXPECT_STREQ(c.last_skip_reason(), "frame too large");
        EXPECT_EQ(drain(c), (std::vector<Frames>{{std::string(limit, 'x')}, {"after"}}));
        EXPECT_FALSE(c.failed());
        // And fed whole.
        zmtp::Connection d("DEALER", "", zmtp::Limits{limit, 8});
        ASSERT_TRUE(d.feed(handshake() + in)) << d.error();
        EXPECT_EQ(d.skipped_messages(), 2u);
        EXPECT_EQ(drain(d), (std::vector<Frames>{{std::string(limit, 'x')}, {"after"}}));
    }
}

// Frames past max_frames are read past and counted, and the message is
// delivered with the ones kept, so the relay can refuse it with a reason
// ("too many frames") instead of losing it without a word.
TEST(ZmtpCodec, FramesPastTheCountCapAreDroppedAndCounted) {
    zmtp::Connection c("DEALER", "", zmtp::Limits{1024, 3});
    ASSERT_TRUE(c.feed(handshake()));
    std::string in;
    in += message({"1", "2", "3"});
    in += message({"1", "2", "3", "4"});
    in += message({"", "", "", "", "", "", "", "", "", pattern(5000, 3)});
    in += message({"x", "y"});
    ASSERT_TRUE(c.feed(in)) << c.error();
    EXPECT_EQ(c.skipped_messages(), 0u);
    const std::vector<std::pair<Frames, std::size_t>> want = {
        {{"1", "2", "3"}, 0}, {{"1", "2", "3"}, 1}, {{"", "", ""}, 7}, {{"x", "y"}, 0}};
    for (const auto& [frames, dropped] : want) {
        ASSERT_TRUE(c.has_message());
        const zmtp::Message m = c.pop();
        EXPECT_EQ(m.frames, frames);
        EXPECT_EQ(m.dropped_frames, dropped);
    }
    EXPECT_FALSE(c.has_message());
}

TEST(ZmtpCodec, AMessageOverTheByteCapIsSkipped) {
    zmtp::Connection c("DEALER", "", zmtp::Limits{1024, 8, 2048});
    ASSERT_TRUE(c.feed(handshake()));
    ASSERT_TRUE(c.feed(message({std::string(1000, 'a'), std::string(1000, 'b'), "c"}) +
                       message({std::string(1024, 'd'), std::string(1024, 'e'), "f"}) +
                       message({"after"})))
        << c.error();
    EXPECT_EQ(c.skipped_messages(), 1u);
    EXPECT_EQ(drain(c), (std::vector<Frames>{{std::string(1000, 'a'), std::string(1000, 'b'), "c"},
                                             {"after"}}));
}

TEST(ZmtpCodec, TheByteCapCountsExactly) {
    zmtp::Connection c("DEALER", "", zmtp::Limits{1000, 8, 2500});
    ASSERT_TRUE(c.feed(handshake()));
    std::string in;
    in += message({std::string(1000, 'a'), std::string(1000, 'b'), std::string(500, 'c')});
    in += message({std::string(1000, 'a'), std::string(1000, 'b'), std::string(501, 'c'), "d"});
    in += message({"after"});
    ASSERT_TRUE(commit_in_pieces(c, in, 300)) << c.error();
    EXPECT_EQ(c.skipped_messages(), 1u);
    EXPECT_STREQ(c.last_skip_reason(), "message too large");
    EXPECT_EQ(drain(c), (std::vector<Frames>{
                            {std::string(1000, 'a'), std::string(1000, 'b'), std::string(500, 'c')},
                            {"after"}}));
}

// The reason is that of the message counted, not of one still being
// skipped: after one read that ends a message skipped for its frame and
// starts one skipped for its bytes, the frame is what is reported (a client's
// frame over the cap cuts it off; it must not pass as "message too large"
// because a message over the byte cap follows at once). Found by this test
// while it was disabled; fixed with skipped_for_frame_size().
TEST(ZmtpCodec, TheSkipReasonIsThatOfTheMessageCounted) {
    zmtp::Connection c("DEALER", "", zmtp::Limits{100, 8, 150});
    ASSERT_TRUE(c.feed(handshake()));
    const std::string a = message({std::string(200, 'a')});  // a frame over 100
    const std::string b = raw_frame(0x01, std::string(100, 'b')) +
                          raw_frame(0x01, std::string(100, 'b'));  // 200 bytes, not ended
    ASSERT_TRUE(c.feed(a + b));
    EXPECT_EQ(c.skipped_messages(), 1u);
    EXPECT_EQ(c.skipped_for_frame_size(), 1u);
    EXPECT_STREQ(c.last_skip_reason(), "frame too large");
    ASSERT_TRUE(c.feed(raw_frame(0x00, "end") + message({"after"})));
    EXPECT_EQ(c.skipped_messages(), 2u);
    EXPECT_EQ(c.skipped_for_frame_size(), 1u);
    EXPECT_STREQ(c.last_skip_reason(), "message too large");
}

TEST(ZmtpCodec, ALargeFramesStorageGrowsWithWhatArrives) {
    // A peer that announces 60 MiB and sends little makes us hold little:
    // the room offered is at most 1 MiB, or twice what has arrived.
    zmtp::Connection c("DEALER", "");
    ASSERT_TRUE(c.feed(handshake()));
    const std::size_t size = 60u << 20;
    ASSERT_TRUE(c.feed("\x02" + size_field(size, true) + "some"));
    std::size_t have = 4;
    const std::string chunk(256 << 10, 'z');
    while (have < (5u << 20)) {  // far enough to see it double
        const auto span = c.read_buffer();
        ASSERT_GT(span.size, 0u);
        ASSERT_LE(span.size + have, std::max<std::size_t>(1u << 20, 2 * have)) << "at " << have;
        const std::size_t n = std::min(span.size, chunk.size());
        std::memcpy(span.data, chunk.data(), n);
        have += n;
        ASSERT_TRUE(c.commit(n)) << c.error();
    }
    EXPECT_FALSE(c.has_message());
    EXPECT_FALSE(c.failed());
}

TEST(ZmtpCodec, CommandsAfterTheHandshakeAreIgnoredButErrorFails) {
    zmtp::Connection c("DEALER", "");
    ASSERT_TRUE(c.feed(handshake()));
    // A PING from a ZMTP 3.1 peer (ttl 0, no context) between messages.
    ASSERT_TRUE(c.feed(message({"a"}) + command("PING", "\0\0"s) + message({"b"}))) << c.error();
    EXPECT_EQ(drain(c), (std::vector<Frames>{{"a"}, {"b"}}));
    EXPECT_FALSE(c.feed(command("ERROR", "\x0bgoing away!")));
    EXPECT_TRUE(c.failed());
    EXPECT_NE(c.error().find("going away!"), std::string::npos) << c.error();
}

struct BadPeer {
    const char* what;
    std::string ours;
    std::string bytes;
    bool after_ready = false;  // the handshake completes before the error
};

TEST(ZmtpCodec, ProtocolErrorsFailWithAReason) {
    std::string bad_sig = peer_greeting();
    bad_sig[0] = '\xfe';
    std::string bad_sig9 = peer_greeting();
    bad_sig9[9] = '\x7e';
    const std::vector<BadPeer> cases = {
        {"bad signature byte 0", "DEALER", bad_sig + ready_command("ROUTER")},
        {"bad signature byte 9", "DEALER", bad_sig9 + ready_command("ROUTER")},
        {"ZMTP 2.0 (revision 1)", "DEALER", peer_greeting(1, 0)},
        {"ZMTP 2 version", "DEALER", peer_greeting(2, 0)},
        {"mechanism PLAIN", "DEALER", peer_greeting(3, 0, "PLAIN")},
        {"mechanism CURVE", "SUB", peer_greeting(3, 0, "CURVE")},
        {"mechanism NULL with trailing junk", "DEALER", peer_greeting(3, 0, "NULLX")},
        {"READY without Socket-Type", "DEALER",
         peer_greeting() + command("READY", property("Identity", "x"))},
        {"READY with no properties", "DEALER", peer_greeting() + command("READY", "")},
        {"READY with a truncated property", "DEALER",
         peer_greeting() + command("READY", property("Socket-Type", "ROUTER").substr(0, 14))},
        {"SUB to a ROUTER", "SUB", handshake("ROUTER")},
        {"DEALER to a PUB", "DEALER", handshake("PUB")},
        {"DEALER to a SUB", "DEALER", handshake("SUB")},
        {"ERROR instead of READY", "DEALER",
         peer_greeting() + command("ERROR", "\x0dinvalid thing")},
        {"ERROR after READY", "DEALER", handshake() + command("ERROR", "\x03"s + "bye"), true},
        {"a command other than READY first", "DEALER", peer_greeting() + command("PING", "\0\0"s)},
        {"reserved flag bit 3", "DEALER", handshake() + "\x08\x01x"s, true},
        {"reserved flag bit 7", "DEALER", handshake() + "\x80\x01x"s, true},
        {"reserved bit on a command", "DEALER",
         peer_greeting() + "\x44"s + ready_command("ROUTER").substr(1)},
        {"message before the handshake", "DEALER", peer_greeting() + message({"hi"})},
        {"message before READY, SUB", "SUB",
         peer_greeting() + message({"hi"}) + ready_command("PUB")},
        {"command with MORE", "DEALER",
         peer_greeting() + "\x05"s + ready_command("ROUTER").substr(1)},
        {"command with MORE after READY", "DEALER", handshake() + "\x05\x05\x04PING"s, true},
        {"empty command", "DEALER", peer_greeting() + "\x04\x00"s},
        {"command name longer than the frame", "DEALER", peer_greeting() + "\x04\x02\x09R"s},
    };
    for (const auto& bad : cases) {
        SCOPED_TRACE(bad.what);
        zmtp::Connection c(bad.ours, "me");
        c.send({"held"});
        EXPECT_FALSE(c.feed(bad.bytes));
        EXPECT_TRUE(c.failed());
        EXPECT_FALSE(c.ready());
        EXPECT_FALSE(c.error().empty());
        EXPECT_FALSE(c.has_message());
        // A held message goes out only if the handshake completed first.
        EXPECT_EQ(c.output().find("held") != std::string_view::npos, bad.after_ready);
        // Nothing more is parsed, the reason stays, and nothing more goes out.
        const std::string error = c.error();
        const std::string output(c.output());
        EXPECT_FALSE(c.feed(handshake() + message({"later"})));
        EXPECT_TRUE(c.failed());
        EXPECT_EQ(c.error(), error);
        EXPECT_FALSE(c.has_message());
        c.send({"after failing"});
        EXPECT_EQ(c.output(), output);
    }
}

TEST(ZmtpCodec, SendBeforeTheHandshakeIsHeldUntilReadyAndFollowsOurReady) {
    zmtp::Connection c("DEALER", "held-id");
    c.send({"first", "message"});
    EXPECT_EQ(c.output().size(), 64u) << "only the greeting before the peer's greeting";
    ASSERT_TRUE(c.feed(peer_greeting()));
    c.send({"second"});
    {
        const auto frames = frames_written(c.output().substr(64));
        ASSERT_EQ(frames.size(), 1u) << "only our READY before the peer's READY";
        EXPECT_EQ(frames[0].flags, 0x04);
    }
    ASSERT_TRUE(c.feed(ready_command("ROUTER")));
    ASSERT_TRUE(c.ready());
    c.send({"third"});
    const auto frames = frames_written(c.output().substr(64));
    ASSERT_EQ(frames.size(), 5u);
    EXPECT_EQ(frames[0].flags, 0x04);
    EXPECT_EQ(ready_properties(frames[0].body).at("Identity"), "held-id");
    EXPECT_EQ(frames[1].flags, 0x01);
    EXPECT_EQ(frames[1].body, "first");
    EXPECT_EQ(frames[2].flags, 0x00);
    EXPECT_EQ(frames[2].body, "message");
    EXPECT_EQ(frames[3].body, "second");
    EXPECT_EQ(frames[4].body, "third");
}

TEST(ZmtpCodec, HeldMessagesSurviveTheGreetingBeingWrittenFirst) {
    // The transport writes the greeting before the peer has answered.
    zmtp::Connection c("DEALER", "");
    c.consumed(30);
    c.send({"x"});
    c.consumed(34);
    EXPECT_TRUE(c.output().empty());
    ASSERT_TRUE(c.feed(handshake()));
    const auto frames = frames_written(c.output());
    ASSERT_EQ(frames.size(), 2u);
    EXPECT_EQ(frames[0].flags, 0x04);
    EXPECT_EQ(frames[1].body, "x");
}

// ---------------------------------------------------------------------------
// Against libzmq: our codec on a plain AF_UNIX socket, the peer a real
// libzmq socket bound to the same ipc:// path.

using Clock = std::chrono::steady_clock;
constexpr auto kDeadline = std::chrono::seconds(5);

struct TempDir {
    std::string path;
    TempDir() {
        char tmpl[] = "/tmp/zmtp_test.XXXXXX";
        if (::mkdtemp(tmpl) != nullptr) path = tmpl;
    }
    ~TempDir() {
        std::error_code ec;
        if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
};

// Our end: the codec on a connected AF_UNIX stream socket, driven with poll.
class Link {
  public:
    Link(const std::string& path, std::string type, std::string identity, zmtp::Limits limits = {})
        : conn(std::move(type), std::move(identity), limits) {
        fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
        if (fd_ < 0 || ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
            io_error = "connect " + path + ": " + std::strerror(errno);
            return;
        }
        // Non-blocking, so a write never waits on a peer that waits on us;
        // poll does the waiting, with a timeout.
        ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) | O_NONBLOCK);
    }
    ~Link() {
        if (fd_ >= 0) ::close(fd_);
    }
    Link(const Link&) = delete;
    Link& operator=(const Link&) = delete;

    // Waits up to `ms` for the socket, then writes and reads what it can.
    void turn(int ms) {
        if (!io_error.empty() || eof) return;
        pollfd p{fd_, POLLIN, 0};
        if (!conn.output().empty()) p.events |= POLLOUT;
        const int n = ::poll(&p, 1, ms);
        if (n < 0 && errno != EINTR) io_error = std::string("poll: ") + std::strerror(errno);
        if (n <= 0) return;
        if (p.revents & POLLOUT) {
            const auto out = conn.output();
            const ssize_t w = ::send(fd_, out.data(), out.size(), MSG_NOSIGNAL);
            if (w > 0) {
                conn.consumed(static_cast<std::size_t>(w));
            } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
                io_error = std::string("send: ") + std::strerror(errno);
            }
        }
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            for (int reads = 0; reads < 64; ++reads) {
                const auto span = conn.read_buffer();
                if (span.size == 0) return;  // failed
                const ssize_t r = ::recv(fd_, span.data, span.size, 0);
                if (r == 0) {
                    eof = true;
                    return;
                }
                if (r < 0) {
                    if (errno != EAGAIN && errno != EINTR) {
                        io_error = std::string("recv: ") + std::strerror(errno);
                    }
                    return;
                }
                if (!conn.commit(static_cast<std::size_t>(r))) return;
            }
        }
    }

    // Turns until `done()` (checked between turns; it may drive the libzmq
    // side without blocking), the codec fails, the socket breaks, or the
    // deadline passes.
    bool drive(const std::function<bool()>& done, Clock::duration deadline = kDeadline) {
        const auto until = Clock::now() + deadline;
        while (!done()) {
            if (conn.failed() || eof || !io_error.empty() || Clock::now() > until) return false;
            turn(5);
        }
        return true;
    }

    std::string why() const {
        return "failed=" + std::to_string(conn.failed()) + " error='" + conn.error() +
               "' eof=" + std::to_string(eof) + " io='" + io_error + "'";
    }

    zmtp::Connection conn;
    bool eof = false;
    std::string io_error;

  private:
    int fd_ = -1;
};

class ZmtpLibzmq : public ::testing::Test {
  protected:
    void SetUp() override { ASSERT_FALSE(dir.path.empty()) << "mkdtemp failed"; }

    // Binds a libzmq socket of `type` at a fresh path; returns the path.
    std::string bind(zmq::socket_t& s) {
        const std::string path = dir.path + "/peer" + std::to_string(next_++) + ".sock";
        s.set(zmq::sockopt::linger, 0);
        s.bind("ipc://" + path);
        return path;
    }

    TempDir dir;  // destroyed last: after the sockets and the context
    zmq::context_t ctx;

  private:
    int next_ = 0;
};

std::vector<zmq::message_t> recv_all(zmq::socket_t& s) {
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(s, std::back_inserter(parts), zmq::recv_flags::dontwait)) return {};
    return parts;
}

Frames strings(const std::vector<zmq::message_t>& parts) {
    Frames out;
    for (const auto& p : parts) out.push_back(p.to_string());
    return out;
}

// Sends without waiting; false when the pipe is full (ROUTER_MANDATORY/HWM).
bool try_send(zmq::socket_t& s, const Frames& frames) {
    std::vector<zmq::const_buffer> parts;
    for (const auto& f : frames) parts.push_back(zmq::buffer(f));
    return zmq::send_multipart(s, parts, zmq::send_flags::dontwait).has_value();
}

TEST_F(ZmtpLibzmq, DealerTalksToARouter) {
    zmq::socket_t router(ctx, zmq::socket_type::router);
    router.set(zmq::sockopt::router_mandatory, 1);  // a reply to an unknown id fails, not drops
    const std::string path = bind(router);
    Link link(path, "DEALER", "cellblock-dealer");
    ASSERT_TRUE(link.io_error.empty()) << link.io_error;
    ASSERT_TRUE(link.drive([&] { return link.conn.ready(); })) << link.why();
    EXPECT_EQ(link.conn.peer_socket_type(), "ROUTER");

    // A multipart message reaches the ROUTER under our Identity.
    link.conn.send({"hello", "", std::string(300, 'L')});
    std::vector<zmq::message_t> got;
    ASSERT_TRUE(link.drive([&] {
        got = recv_all(router);
        return !got.empty();
    })) << link.why();
    EXPECT_EQ(strings(got), (Frames{"cellblock-dealer", "hello", "", std::string(300, 'L')}));

    // The ROUTER replies to that identity; we get exactly the frames.
    ASSERT_TRUE(try_send(router, {"cellblock-dealer", "reply", "", "three"}));
    ASSERT_TRUE(link.drive([&] { return link.conn.has_message(); })) << link.why();
    EXPECT_EQ(drain(link.conn), (std::vector<Frames>{{"reply", "", "three"}}));

    // A 5 MiB frame each way.
    const std::string big_out = pattern(5 << 20, 10), big_in = pattern(5 << 20, 11);
    link.conn.send({"big", big_out});
    ASSERT_TRUE(link.drive([&] {
        got = recv_all(router);
        return !got.empty();
    })) << link.why();
    ASSERT_EQ(got.size(), 3u);
    EXPECT_EQ(got[0].to_string(), "cellblock-dealer");
    EXPECT_EQ(got[1].to_string(), "big");
    EXPECT_TRUE(got[2].to_string() == big_out) << "5 MiB frame corrupted on the way to the ROUTER";
    ASSERT_TRUE(try_send(router, {"cellblock-dealer", big_in, "end"}));
    ASSERT_TRUE(link.drive([&] { return link.conn.has_message(); })) << link.why();
    {
        const auto msgs = drain(link.conn);
        ASSERT_EQ(msgs.size(), 1u);
        ASSERT_EQ(msgs[0].size(), 2u);
        EXPECT_TRUE(msgs[0][0] == big_in) << "5 MiB frame corrupted on the way to us";
        EXPECT_EQ(msgs[0][1], "end");
    }

    // 1000 messages in a row, each way, in order.
    constexpr int kCount = 1000;
    for (int i = 0; i < kCount; ++i) {
        const std::string n = std::to_string(i);
        link.conn.send({"up", n, std::string(i % 300, 'u')});
    }
    int received = 0;
    bool in_order = true;
    ASSERT_TRUE(link.drive([&] {
        for (auto parts = recv_all(router); !parts.empty(); parts = recv_all(router)) {
            const Frames f = strings(parts);
            in_order = in_order && f == Frames{"cellblock-dealer", "up", std::to_string(received),
                                               std::string(received % 300, 'u')};
            ++received;
        }
        return received == kCount;
    })) << link.why()
        << " received " << received;
    EXPECT_TRUE(in_order);

    int sent = 0;
    std::vector<Frames> down;
    ASSERT_TRUE(link.drive([&] {
        while (sent < kCount && try_send(router, {"cellblock-dealer", "down", std::to_string(sent),
                                                  std::string(sent % 500, 'd')})) {
            ++sent;
        }
        for (auto& m : drain(link.conn)) down.push_back(std::move(m));
        return down.size() == static_cast<std::size_t>(kCount);
    })) << link.why()
        << " sent " << sent << " received " << down.size();
    for (int i = 0; i < kCount; ++i) {
        ASSERT_EQ(down[i], (Frames{"down", std::to_string(i), std::string(i % 500, 'd')}))
            << "message " << i;
    }
    EXPECT_EQ(link.conn.skipped_messages(), 0u);
    EXPECT_FALSE(link.conn.failed()) << link.conn.error();
}

TEST_F(ZmtpLibzmq, WithoutAnIdentityTheRouterPicksOne) {
    zmq::socket_t router(ctx, zmq::socket_type::router);
    router.set(zmq::sockopt::router_mandatory, 1);
    Link link(bind(router), "DEALER", "");
    ASSERT_TRUE(link.drive([&] { return link.conn.ready(); })) << link.why();
    link.conn.send({"x"});
    std::vector<zmq::message_t> got;
    ASSERT_TRUE(link.drive([&] {
        got = recv_all(router);
        return !got.empty();
    })) << link.why();
    ASSERT_EQ(got.size(), 2u);
    EXPECT_GT(got[0].size(), 0u);
    EXPECT_EQ(got[1].to_string(), "x");
    ASSERT_TRUE(try_send(router, {got[0].to_string(), "back"}));
    ASSERT_TRUE(link.drive([&] { return link.conn.has_message(); })) << link.why();
    EXPECT_EQ(drain(link.conn), (std::vector<Frames>{{"back"}}));
}

TEST_F(ZmtpLibzmq, OurFrameLimitSkipsTheRoutersOversizeMessage) {
    zmq::socket_t router(ctx, zmq::socket_type::router);
    router.set(zmq::sockopt::router_mandatory, 1);
    Link link(bind(router), "DEALER", "limited", zmtp::Limits{1 << 20, 8});
    ASSERT_TRUE(link.drive([&] { return link.conn.ready(); })) << link.why();
    // The ROUTER learns our identity from the handshake, so it can send first
    // once it has seen us; a message from us makes sure it has.
    link.conn.send({"hi"});
    ASSERT_TRUE(link.drive([&] { return !recv_all(router).empty(); })) << link.why();
    ASSERT_TRUE(try_send(router, {"limited", "first", std::string((1 << 20) + 1, 'o'), "last"}));
    ASSERT_TRUE(try_send(router, {"limited", std::string(1 << 20, 'k')}));  // at the cap
    ASSERT_TRUE(try_send(router, {"limited", "small"}));
    std::vector<Frames> got;
    ASSERT_TRUE(link.drive([&] {
        for (auto& m : drain(link.conn)) got.push_back(std::move(m));
        return got.size() >= 2;
    })) << link.why();
    EXPECT_EQ(link.conn.skipped_messages(), 1u);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(got[0] == Frames{std::string(1 << 20, 'k')});
    EXPECT_EQ(got[1], Frames{"small"});
    EXPECT_FALSE(link.conn.failed());

    // Ten frames to our cap of eight: the first eight arrive, two dropped.
    ASSERT_TRUE(try_send(router, {"limited", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"}));
    ASSERT_TRUE(try_send(router, {"limited", "then"}));
    got.clear();
    std::vector<std::size_t> dropped;
    ASSERT_TRUE(link.drive([&] {
        for (auto& m : drain(link.conn, &dropped)) got.push_back(std::move(m));
        return got.size() >= 2;
    })) << link.why();
    EXPECT_EQ(got, (std::vector<Frames>{{"0", "1", "2", "3", "4", "5", "6", "7"}, {"then"}}));
    EXPECT_EQ(dropped, (std::vector<std::size_t>{2, 0}));
}

TEST_F(ZmtpLibzmq, SubReceivesWhatAPubPublishesUnderItsSubscription) {
    zmq::socket_t pub(ctx, zmq::socket_type::pub);
    Link link(bind(pub), "SUB", "");
    ASSERT_TRUE(link.drive([&] { return link.conn.ready(); })) << link.why();
    EXPECT_EQ(link.conn.peer_socket_type(), "PUB");
    link.conn.send({std::string_view("\x01topic", 6)});
    // The subscription takes effect at the PUB some time later: publish until
    // the first one arrives, with a message we did not subscribe to before
    // each one.
    int published = 0;
    ASSERT_TRUE(link.drive([&] {
        try_send(pub, {"other", "not for us"});
        try_send(pub, {"topic", std::to_string(published++)});
        return link.conn.has_message();
    })) << link.why();
    // Once subscribed, every publication reaches us, in order, and nothing else.
    auto first = drain(link.conn);
    ASSERT_FALSE(first.empty());
    ASSERT_EQ(first[0].size(), 2u);
    EXPECT_EQ(first[0][0], "topic");
    int next = std::stoi(first[0][1]);
    for (std::size_t i = 1; i < first.size(); ++i) {
        EXPECT_EQ(first[i], (Frames{"topic", std::to_string(++next)}));
    }
    for (int i = 0; i < 100; ++i) {
        ASSERT_TRUE(try_send(pub, {"other", "x"}));
        ASSERT_TRUE(try_send(pub, {"topic.sub", std::to_string(i), std::string(i * 100, 'p')}));
    }
    std::vector<Frames> got;
    ASSERT_TRUE(link.drive([&] {
        for (auto& m : drain(link.conn)) got.push_back(std::move(m));
        return got.size() >= 100;
    })) << link.why()
        << " got " << got.size();
    // Whatever was still in flight from the loop above comes first.
    std::size_t skip = 0;
    while (skip < got.size() && got[skip][0] == "topic") ++skip;
    ASSERT_TRUE(link.drive([&] {
        for (auto& m : drain(link.conn)) got.push_back(std::move(m));
        return got.size() >= skip + 100;
    })) << link.why();
    ASSERT_EQ(got.size(), skip + 100);
    for (int i = 0; i < 100; ++i) {
        EXPECT_EQ(got[skip + i],
                  (Frames{"topic.sub", std::to_string(i), std::string(i * 100, 'p')}));
    }
}

TEST_F(ZmtpLibzmq, SubscriptionReachesAnXpubAndPublicationsReachUs) {
    zmq::socket_t xpub(ctx, zmq::socket_type::xpub);
    Link link(bind(xpub), "SUB", "");
    ASSERT_TRUE(link.drive([&] { return link.conn.ready(); })) << link.why();
    EXPECT_EQ(link.conn.peer_socket_type(), "XPUB");
    link.conn.send(
        {std::string_view("\x01"
                          "kernel.",
                          8)});
    std::vector<zmq::message_t> sub;
    ASSERT_TRUE(link.drive([&] {
        sub = recv_all(xpub);
        return !sub.empty();
    })) << link.why();
    EXPECT_EQ(strings(sub), Frames{"\x01kernel."});
    // Subscribed now: everything published under the prefix arrives, the rest does not.
    for (int i = 0; i < 50; ++i) {
        ASSERT_TRUE(try_send(xpub, {"other", "x"}));
        ASSERT_TRUE(try_send(xpub, {"kernel.iopub", std::to_string(i)}));
    }
    const std::string big = pattern(5 << 20, 12);
    ASSERT_TRUE(try_send(xpub, {"kernel.big", big}));
    std::vector<Frames> got;
    ASSERT_TRUE(link.drive([&] {
        for (auto& m : drain(link.conn)) got.push_back(std::move(m));
        return got.size() >= 51;
    })) << link.why();
    ASSERT_EQ(got.size(), 51u);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(got[i], (Frames{"kernel.iopub", std::to_string(i)}));
    ASSERT_EQ(got[50].size(), 2u);
    EXPECT_EQ(got[50][0], "kernel.big");
    EXPECT_TRUE(got[50][1] == big) << "5 MiB publication corrupted";

    // Unsubscribing (0x00 + prefix) reaches the XPUB too.
    link.conn.send(
        {std::string_view("\x00"
                          "kernel.",
                          8)});
    ASSERT_TRUE(link.drive([&] {
        sub = recv_all(xpub);
        return !sub.empty();
    })) << link.why();
    EXPECT_EQ(strings(sub), Frames{"\x00kernel."s});
}

TEST_F(ZmtpLibzmq, ASubDoesNotCompleteAHandshakeWithARouter) {
    // A SUB codec connecting to a ROUTER fails the handshake on its side.
    zmq::socket_t router(ctx, zmq::socket_type::router);
    Link link(bind(router), "SUB", "");
    EXPECT_FALSE(link.drive([&] { return link.conn.ready(); }));
    EXPECT_TRUE(link.conn.failed() || link.eof) << link.why();
    EXPECT_FALSE(link.conn.ready());
}

}  // namespace
}  // namespace cellblock
