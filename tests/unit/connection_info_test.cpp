#include "cellblock/connection_info.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "error_of.hpp"

namespace cellblock {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

class TempDir {
  public:
    TempDir() {
        std::string pattern = (fs::temp_directory_path() / "cb-conn-XXXXXX").string();
        if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
        path_ = pattern;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path_, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const fs::path& path() const { return path_; }

  private:
    fs::path path_;
};

void write_text(const fs::path& p, const std::string& text) {
    std::ofstream(p, std::ios::binary) << text;
}

unsigned mode_of(const fs::path& p) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return 0;
    return st.st_mode & 07777;
}

using cellblock::testing::error_of;

json valid_json() {
    return json{
        {"shell_port", 50001},     {"iopub_port", 50002}, {"stdin_port", 50003},
        {"control_port", 50004},   {"hb_port", 50005},    {"ip", "127.0.0.1"},
        {"key", "secret"},         {"transport", "tcp"},  {"signature_scheme", "hmac-sha256"},
        {"kernel_name", "python3"}};
}

ConnectionInfo sample() {
    ConnectionInfo c;
    c.transport = "ipc";
    c.ip = "/run/cellblock/s1/kernel";
    c.shell_port = 1;
    c.iopub_port = 2;
    c.stdin_port = 3;
    c.control_port = 4;
    c.hb_port = 5;
    c.key = "k\xc3\xa9y-\"quoted\"";
    c.kernel_name = "python3";
    return c;
}

void expect_same(const ConnectionInfo& a, const ConnectionInfo& b) {
    EXPECT_EQ(a.transport, b.transport);
    EXPECT_EQ(a.ip, b.ip);
    EXPECT_EQ(a.shell_port, b.shell_port);
    EXPECT_EQ(a.iopub_port, b.iopub_port);
    EXPECT_EQ(a.stdin_port, b.stdin_port);
    EXPECT_EQ(a.control_port, b.control_port);
    EXPECT_EQ(a.hb_port, b.hb_port);
    EXPECT_EQ(a.key, b.key);
    EXPECT_EQ(a.signature_scheme, b.signature_scheme);
    EXPECT_EQ(a.kernel_name, b.kernel_name);
    EXPECT_EQ(a.curve_server_key, b.curve_server_key);
    EXPECT_EQ(a.curve_secret_key, b.curve_secret_key);
    EXPECT_EQ(a.egress_port, b.egress_port);
}

const json& reference_connections() {
    static const json doc = [] {
        std::ifstream in(std::string(CELLBLOCK_FIXTURES_DIR) + "/jupyter_client_vectors.json");
        if (!in) throw std::runtime_error("cannot open jupyter_client_vectors.json");
        return json::parse(in).at("connection");
    }();
    return doc;
}

TEST(ConnectionInfo, ReadsFilesWrittenByJupyterClientAndMatchesItsUrls) {
    ASSERT_EQ(reference_connections().size(), 2u);
    for (const json& ref : reference_connections()) {
        SCOPED_TRACE(ref.at("transport").get<std::string>());
        TempDir dir;
        const fs::path file = dir.path() / "kernel.json";
        write_text(file, ref.at("file_text").get<std::string>());
        const ConnectionInfo c = ConnectionInfo::read(file);
        EXPECT_EQ(c.transport, ref.at("transport"));
        EXPECT_EQ(c.key, "a0b1c2d3-e4f5-vector-connection-key");
        EXPECT_EQ(c.kernel_name, "python3");
        EXPECT_EQ(c.signature_scheme, "hmac-sha256");
        for (Channel ch :
             {Channel::shell, Channel::iopub, Channel::stdin_, Channel::control, Channel::hb}) {
            EXPECT_EQ(c.endpoint(ch), ref.at("urls").at(channel_name(ch))) << channel_name(ch);
        }
    }
}

TEST(ConnectionInfo, Endpoints) {
    ConnectionInfo c = sample();
    EXPECT_EQ(c.endpoint(Channel::shell), "ipc:///run/cellblock/s1/kernel-1");
    EXPECT_EQ(c.endpoint(Channel::hb), "ipc:///run/cellblock/s1/kernel-5");
    c.transport = "tcp";
    c.ip = "10.0.0.7";
    c.stdin_port = 45678;
    EXPECT_EQ(c.endpoint(Channel::stdin_), "tcp://10.0.0.7:45678");
    EXPECT_EQ(c.endpoint(Channel::control), "tcp://10.0.0.7:4");
}

TEST(ConnectionInfo, PortAndChannelNames) {
    const ConnectionInfo c = sample();
    EXPECT_EQ(c.port(Channel::shell), 1);
    EXPECT_EQ(c.port(Channel::iopub), 2);
    EXPECT_EQ(c.port(Channel::stdin_), 3);
    EXPECT_EQ(c.port(Channel::control), 4);
    EXPECT_EQ(c.port(Channel::hb), 5);
    EXPECT_STREQ(channel_name(Channel::shell), "shell");
    EXPECT_STREQ(channel_name(Channel::iopub), "iopub");
    EXPECT_STREQ(channel_name(Channel::stdin_), "stdin");
    EXPECT_STREQ(channel_name(Channel::control), "control");
    EXPECT_STREQ(channel_name(Channel::hb), "hb");
}

TEST(ConnectionInfo, JsonRoundTrip) {
    const ConnectionInfo c = sample();
    const json j = c.to_json();
    EXPECT_EQ(j.at("shell_port"), 1);
    EXPECT_EQ(j.at("transport"), "ipc");
    EXPECT_EQ(j.at("signature_scheme"), "hmac-sha256");
    EXPECT_EQ(j.size(), 10u);
    expect_same(ConnectionInfo::from_json(j), c);
}

TEST(ConnectionInfo, CurveKeysAreWrittenOnlyWhenSetAndMustBeZ85) {
    ConnectionInfo c = sample();
    EXPECT_FALSE(c.to_json().contains("curve_server_key"));
    EXPECT_FALSE(c.to_json().contains("curve_secret_key"));
    char public_key[41], secret_key[41];
    ASSERT_EQ(zmq_curve_keypair(public_key, secret_key), 0) << "libzmq without CURVE";
    c.curve_server_key = public_key;
    c.curve_secret_key = secret_key;
    const json j = c.to_json();
    EXPECT_EQ(j.at("curve_server_key"), public_key);
    EXPECT_EQ(j.at("curve_secret_key"), secret_key);
    expect_same(ConnectionInfo::from_json(j), c);

    for (const char* field : {"curve_server_key", "curve_secret_key"}) {
        const std::string refused =
            std::string("field ") + field + " must be a CurveZMQ key: 40 characters of Z85";
        json bad = j;
        bad[field] = std::string(public_key).substr(0, 39);
        EXPECT_EQ(error_of([&] { ConnectionInfo::from_json(bad); }), refused);
        bad[field] = std::string(39, 'a') + "\"";  // '"' is not in Z85's alphabet
        EXPECT_EQ(error_of([&] { ConnectionInfo::from_json(bad); }), refused);
        bad[field] = 7;
        EXPECT_EQ(error_of([&] { ConnectionInfo::from_json(bad); }),
                  std::string("field ") + field + " must be a string");
    }
}

TEST(ConnectionInfo, TheEgressTunnelsPortIsWrittenOnlyWhenSetAndMustBeAPort) {
    ConnectionInfo c = sample();
    EXPECT_FALSE(c.to_json().contains("cellblock_egress_port"));
    c.egress_port = 5560;
    const json j = c.to_json();
    EXPECT_EQ(j.at("cellblock_egress_port"), 5560);
    expect_same(ConnectionInfo::from_json(j), c);
    json bad = j;
    bad["cellblock_egress_port"] = 70000;
    EXPECT_EQ(error_of([&] { ConnectionInfo::from_json(bad); }),
              "field cellblock_egress_port must be in 0..65535, got 70000");
    bad["cellblock_egress_port"] = "5560";
    EXPECT_EQ(error_of([&] { ConnectionInfo::from_json(bad); }),
              "field cellblock_egress_port must be an integer");
}

TEST(ConnectionInfo, WriteReadRoundTripWithMode0600) {
    TempDir dir;
    const fs::path file = dir.path() / "kernel-1.json";
    // Even with a permissive umask the file must come out private.
    const mode_t old = ::umask(0);
    sample().write(file);
    ::umask(old);
    EXPECT_EQ(mode_of(file), 0600u);
    expect_same(ConnectionInfo::read(file), sample());
    // Nothing but the file is left in the directory.
    int entries = 0;
    for (const auto& e : fs::directory_iterator(dir.path())) {
        ++entries;
        EXPECT_EQ(e.path().filename(), "kernel-1.json");
    }
    EXPECT_EQ(entries, 1);
}

TEST(ConnectionInfo, OverwriteReplacesAPermissiveFile) {
    TempDir dir;
    const fs::path file = dir.path() / "kernel.json";
    write_text(file, "old contents");
    ASSERT_EQ(::chmod(file.c_str(), 0644), 0);
    ConnectionInfo c = sample();
    c.key = "new-key";
    c.write(file);
    EXPECT_EQ(mode_of(file), 0600u);
    EXPECT_EQ(ConnectionInfo::read(file).key, "new-key");
}

TEST(ConnectionInfo, WriteIntoMissingDirectoryNamesThePath) {
    TempDir dir;
    const fs::path file = dir.path() / "no-such-dir" / "kernel.json";
    const std::string err = error_of([&] { sample().write(file); });
    EXPECT_EQ(err.rfind("connection file " + file.string() + ": ", 0), 0u) << err;
    EXPECT_FALSE(fs::exists(file));
}

TEST(ConnectionInfo, MissingFieldIsNamed) {
    for (const char* field :
         {"shell_port", "iopub_port", "stdin_port", "control_port", "hb_port", "ip", "key"}) {
        TempDir dir;
        const fs::path file = dir.path() / "x.json";
        json j = valid_json();
        j.erase(field);
        write_text(file, j.dump());
        EXPECT_EQ(error_of([&] { ConnectionInfo::read(file); }),
                  "connection file " + file.string() + ": missing field " + field);
        EXPECT_EQ(error_of([&] { ConnectionInfo::from_json(j); }),
                  std::string("missing field ") + field);
    }
}

TEST(ConnectionInfo, OptionalFieldsDefault) {
    json j = valid_json();
    j.erase("kernel_name");
    j.erase("transport");
    j.erase("signature_scheme");
    const ConnectionInfo c = ConnectionInfo::from_json(j);
    EXPECT_EQ(c.kernel_name, "");
    EXPECT_EQ(c.transport, "tcp");
    EXPECT_EQ(c.signature_scheme, "hmac-sha256");
    EXPECT_EQ(c.shell_port, 50001);
    j["kernel_name"] = nullptr;
    EXPECT_EQ(ConnectionInfo::from_json(j).kernel_name, "");
}

TEST(ConnectionInfo, MistypedFieldsAreNamed) {
    auto err = [](const char* field, json value) {
        json j = valid_json();
        j[field] = std::move(value);
        return error_of([&] { ConnectionInfo::from_json(j); });
    };
    EXPECT_EQ(err("shell_port", "50001"), "field shell_port must be an integer");
    EXPECT_EQ(err("hb_port", 5.5), "field hb_port must be an integer");
    EXPECT_EQ(err("iopub_port", true), "field iopub_port must be an integer");
    EXPECT_EQ(err("stdin_port", -1), "field stdin_port must be in 0..65535, got -1");
    EXPECT_EQ(err("control_port", 65536), "field control_port must be in 0..65535, got 65536");
    EXPECT_EQ(err("control_port", 18446744073709551615ull),
              "field control_port must be in 0..65535, got 18446744073709551615");
    EXPECT_EQ(err("key", 1234), "field key must be a string");
    EXPECT_EQ(err("ip", nullptr), "field ip must be a string");
    EXPECT_EQ(err("kernel_name", 3), "field kernel_name must be a string");
    EXPECT_EQ(err("transport", "udp"), "field transport must be \"tcp\" or \"ipc\", got \"udp\"");
    EXPECT_EQ(err("signature_scheme", "hmac-md5"),
              "field signature_scheme must be \"hmac-sha256\", got \"hmac-md5\"");
    EXPECT_EQ(err("shell_port", 65535), "");
    EXPECT_EQ(error_of([] { ConnectionInfo::from_json(json::array()); }), "not a JSON object");
}

TEST(ConnectionInfo, UnreadableOrInvalidFile) {
    TempDir dir;
    const fs::path missing = dir.path() / "absent.json";
    EXPECT_EQ(error_of([&] { ConnectionInfo::read(missing); }),
              "connection file " + missing.string() + ": cannot open: No such file or directory");
    const fs::path bad = dir.path() / "bad.json";
    write_text(bad, "{\"shell_port\": 1,");
    EXPECT_EQ(error_of([&] { ConnectionInfo::read(bad); }),
              "connection file " + bad.string() + ": not valid JSON");
}

}  // namespace
}  // namespace cellblock
