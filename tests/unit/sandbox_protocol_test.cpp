// The words across the sandbox's edge (include/cellblock/sandbox_protocol.hpp):
// the Python side (kernel-shim/cellblock_protocol.py) says the same, no side
// spells a word itself, and every status line the shim can write is parsed.
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cellblock/runc_sandbox.hpp"
#include "cellblock/sandbox_protocol.hpp"

namespace cellblock {
namespace {

namespace protocol = sandbox_protocol;
using nlohmann::json;

const std::string kSource = CELLBLOCK_SOURCE_DIR;

// Every upper-case name of cellblock_protocol.py with its value, as the
// interpreter that runs the zygote would see them.
json python_side() {
    const std::string command =
        "cd " + kSource +
        "/kernel-shim && " CELLBLOCK_PYTHON
        " -B -c 'import json, cellblock_protocol as p; "
        "print(json.dumps({k: v for k, v in vars(p).items() if k.isupper()}))'";
    FILE* pipe = ::popen(command.c_str(), "r");
    if (!pipe) return nullptr;
    std::string out;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
    if (::pclose(pipe) != 0) return nullptr;
    return json::parse(out, nullptr, false);
}

json cpp_side() {
    json all = json::object();
    for (const auto& w : protocol::kSharedWords) all[std::string(w.python_name)] = w.word;
    for (const auto& n : protocol::kSharedNumbers) all[std::string(n.python_name)] = n.number;
    json fds = json::array();
    for (const auto& name : protocol::kForkFdNames) fds.push_back(name);
    all["FORK_FDS"] = fds;
    return all;
}

TEST(SandboxProtocol, ThePythonSideSaysWhatTheHeaderSays) {
    const json python = python_side();
    ASSERT_TRUE(python.is_object()) << "could not import kernel-shim/cellblock_protocol.py";
    const json cpp = cpp_side();
    for (const auto& [name, value] : cpp.items()) {
        ASSERT_TRUE(python.contains(name)) << name << " is missing from cellblock_protocol.py";
        EXPECT_EQ(python[name], value) << name << " differs: the header says " << value.dump()
                                       << ", cellblock_protocol.py says " << python[name].dump();
    }
    for (const auto& [name, value] : python.items()) {
        EXPECT_TRUE(cpp.contains(name))
            << name << " is in cellblock_protocol.py but not in sandbox_protocol.hpp";
    }
}

std::string read(const std::string& relative) {
    std::ifstream in(kSource + "/" + relative);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

// A word quoted where the protocol is spoken would drift from the header:
// each side names it instead (the header's constant, the Python module's name).
TEST(SandboxProtocol, NoSideSpellsAWordItself) {
    const auto quoted = [](std::string_view word) { return "\"" + std::string(word) + "\""; };
    const auto prefix = [](std::string_view word) { return "\"" + std::string(word) + " "; };
    const std::vector<std::string> spelled = {prefix(protocol::kSeccompRequest) + "\"",
                                              quoted(protocol::kReportUserns),
                                              quoted(protocol::kAnswerMapped),
                                              prefix(protocol::kReportInit),
                                              quoted(protocol::kAnswerCgrouped),
                                              quoted(protocol::kReportReady),
                                              quoted(protocol::kShimAdoptOption),
                                              quoted(protocol::kInterruptLine),
                                              prefix(protocol::kKernelExit),
                                              quoted(protocol::kExitTerminated),
                                              "\"" + std::string(protocol::kExitStatus),
                                              "\"" + std::string(protocol::kExitSignal),
                                              quoted(protocol::kLifelineEnv),
                                              prefix(protocol::kAdoptKeyLine),
                                              prefix(protocol::kAdoptLine),
                                              quoted(protocol::kAdoptedLine),
                                              quoted(protocol::kMemoryLimitReached),
                                              "\"" + std::string(protocol::kShimLogPrefix)};
    const std::vector<std::string> files = {"kernel-shim/shim.cpp",
                                            "kernel-shim/egress_forwarder.cpp",
                                            "kernel-shim/cellblock_zygote.py",
                                            "kernel-shim/cellblock_containment.py",
                                            "sessions/sandbox.cpp",
                                            "sessions/lifeline.cpp",
                                            "sessions/sandbox_adopt.cpp",
                                            "sessions/zygote.cpp"};
    for (const auto& file : files) {
        const std::string text = read(file);
        ASSERT_FALSE(text.empty()) << file;
        for (const auto& literal : spelled) {
            EXPECT_EQ(text.find(literal), std::string::npos)
                << file << " spells " << literal << " itself (sandbox_protocol.hpp names it)";
        }
    }
}

TEST(SandboxProtocol, EveryKernelExitLineTheShimWritesIsParsed) {
    using How = protocol::KernelExit::How;
    for (const protocol::KernelExit exit :
         {protocol::KernelExit{How::exited, 0}, protocol::KernelExit{How::exited, 1},
          protocol::KernelExit{How::signaled, 9}, protocol::KernelExit{How::terminated, 0}}) {
        const std::string line = protocol::kernel_exit_line(exit);
        EXPECT_EQ(protocol::parse_kernel_exit(line + "\n"), exit) << line;
    }
    EXPECT_EQ(protocol::kernel_exit_line({How::unknown, 0}), "");
}

TEST(SandboxProtocol, TheLastKernelExitLineCountsAndJunkIsUnknown) {
    using How = protocol::KernelExit::How;
    EXPECT_EQ(protocol::parse_kernel_exit("kernel-exit status=3\nkernel-exit signal=15\n"),
              (protocol::KernelExit{How::signaled, 15}));
    EXPECT_EQ(protocol::parse_kernel_exit("kernel-exit terminated"),
              (protocol::KernelExit{How::terminated, 0}));
    for (const char* junk :
         {"", "\n", "kernel-exit", "kernel-exit status=", "kernel-exit status=x",
          "kernel-exit signal=9 and more", "kernel-exit bye", "not-kernel-exit status=1"}) {
        EXPECT_EQ(protocol::parse_kernel_exit(junk).how, How::unknown) << junk;
    }
}

TEST(SandboxProtocol, EachKernelExitHasItsOwnWords) {
    EXPECT_EQ(describe_kernel_exit("kernel-exit status=1\n"), "the kernel exited with status 1");
    EXPECT_EQ(describe_kernel_exit("kernel-exit signal=9\n"), "the kernel was killed by signal 9");
    EXPECT_EQ(describe_kernel_exit("kernel-exit terminated\n"),
              "the sandbox's init was told to stop, and the kernel had not ended 2 s after "
              "its SIGTERM");
    EXPECT_EQ(describe_kernel_exit(""), "the sandbox ended");
}

TEST(SandboxProtocol, AnAdoptKeyLineGivesItsKeyAndNothingElseDoes) {
    const std::string key = "0123456789abcdef0123456789abcdef";
    ASSERT_EQ(key.size(), protocol::kAdoptKeyHexDigits);
    const std::string head = std::string(protocol::kAdoptKeyLine) + " ";
    EXPECT_EQ(protocol::adopt_key_of(head + key), key);
    // The line fits what the shim keeps of a line.
    EXPECT_LE((head + key).size(), protocol::kMaxLifelineLine);
    for (const std::string& junk :
         {head + key.substr(1), head + key + "0", head + "0123456789ABCDEF0123456789abcdef",
          std::string(protocol::kAdoptKeyLine) + key, std::string(protocol::kAdoptLine) + " " + key,
          head + key.substr(0, 31) + "g", std::string(protocol::kInterruptLine), head}) {
        EXPECT_FALSE(protocol::adopt_key_of(junk)) << junk;
    }
    EXPECT_TRUE(protocol::well_formed_adopt_key(key));
    EXPECT_FALSE(protocol::well_formed_adopt_key(""));
}

TEST(SandboxProtocol, AFrontIsAttachedOnlyByAnEstablishedConnectionToAKernelPort) {
    // /proc/net/tcp as a task shows it: 5555 is 15B3, 5559 15B7, 5560 15B8.
    const std::string header =
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n";
    const auto row = [](const std::string& local, const std::string& remote,
                        const std::string& state) {
        return "   0: " + local + " " + remote + " " + state +
               " 00000000:00000000 00:00000000 00000000  1000        0 12345 1 0000000000000000 "
               "100 0 0 10 0\n";
    };
    const std::string listening =
        row("00000000:15B3", "00000000:0000", "0A") + row("00000000:15B7", "00000000:0000", "0A");
    EXPECT_FALSE(protocol::front_attached(""));
    EXPECT_FALSE(protocol::front_attached(header));
    EXPECT_FALSE(protocol::front_attached(header + listening));
    // The front's connection to control (5558), and to hb (5559).
    EXPECT_TRUE(
        protocol::front_attached(header + listening + row("0200000A:15B6", "0100000A:D2F0", "01")));
    EXPECT_TRUE(protocol::front_attached(header + row("0200000A:15B7", "0100000A:D2F0", "01")));
    // Closing (06 TIME_WAIT, 08 CLOSE_WAIT), another port, or the kernel's
    // own connection out to a port 5555 elsewhere: no front.
    EXPECT_FALSE(protocol::front_attached(header + row("0200000A:15B3", "0100000A:D2F0", "08") +
                                          row("0200000A:15B4", "0100000A:D2F1", "06")));
    EXPECT_FALSE(protocol::front_attached(header + row("0200000A:15B8", "0100000A:D2F0", "01")));
    EXPECT_FALSE(protocol::front_attached(header + row("0200000A:D2F0", "0100000A:15B3", "01")));
    // tcp6's longer addresses; the header is never read as a row.
    EXPECT_TRUE(
        protocol::front_attached(header + row("00000000000000000000000000000000:15B5",
                                              "0000000000000000FFFF00000100000A:C350", "01")));
    EXPECT_FALSE(protocol::front_attached("   0: 0200000A:15B3 0100000A:D2F0 01\n"));
    // Lines cut short or not hex: skipped, never a match.
    EXPECT_FALSE(protocol::front_attached(header + "   0: 0200000A:15B3\n   1: x:zz y 01\n"));
}

}  // namespace
}  // namespace cellblock
