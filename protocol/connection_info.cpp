#include "cellblock/connection_info.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "cellblock/errno_text.hpp"
#include "cellblock/sandbox_protocol.hpp"
#include "cellblock/unique_fd.hpp"

namespace cellblock {

namespace {

using json = nlohmann::json;

struct PortField {
    const char* name;
    int ConnectionInfo::*member;
};

constexpr PortField kPorts[] = {
    {"shell_port", &ConnectionInfo::shell_port}, {"iopub_port", &ConnectionInfo::iopub_port},
    {"stdin_port", &ConnectionInfo::stdin_port}, {"control_port", &ConnectionInfo::control_port},
    {"hb_port", &ConnectionInfo::hb_port},
};

const json& required(const json& j, const char* field) {
    const auto it = j.find(field);
    if (it == j.end()) throw std::runtime_error(std::string("missing field ") + field);
    return *it;
}

std::string string_field(const json& value, const char* field) {
    if (!value.is_string()) {
        throw std::runtime_error(std::string("field ") + field + " must be a string");
    }
    return value.get<std::string>();
}

int port_field(const json& value, const char* field) {
    if (!value.is_number_integer()) {
        throw std::runtime_error(std::string("field ") + field + " must be an integer");
    }
    // Unsigned and signed integers are distinct in nlohmann::json; compare in
    // a wide type so 2^63 and -1 are both caught.
    const bool in_range = value.is_number_unsigned() ? value.get<std::uint64_t>() <= 65535
                                                     : value.get<std::int64_t>() >= 0 &&
                                                           value.get<std::int64_t>() <= 65535;
    if (!in_range) {
        throw std::runtime_error(std::string("field ") + field + " must be in 0..65535, got " +
                                 value.dump());
    }
    return static_cast<int>(value.get<std::int64_t>());
}

// Z85 (ZeroMQ RFC 32) of a 32-byte key: 40 characters of its alphabet.
bool is_z85_key(const std::string& text) {
    static constexpr std::string_view kZ85 =
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
    return text.size() == 40 && text.find_first_not_of(kZ85) == std::string::npos;
}

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& why) {
    throw std::runtime_error("connection file " + path.string() + ": " + why);
}

}  // namespace

const char* channel_name(Channel c) {
    switch (c) {
        case Channel::shell:
            return "shell";
        case Channel::iopub:
            return "iopub";
        case Channel::stdin_:
            return "stdin";
        case Channel::control:
            return "control";
        case Channel::hb:
            return "hb";
    }
    return "unknown";
}

namespace {

// The field of a channel's port.
int ConnectionInfo::*port_member(Channel c) {
    switch (c) {
        case Channel::shell:
            return &ConnectionInfo::shell_port;
        case Channel::iopub:
            return &ConnectionInfo::iopub_port;
        case Channel::stdin_:
            return &ConnectionInfo::stdin_port;
        case Channel::control:
            return &ConnectionInfo::control_port;
        case Channel::hb:
            return &ConnectionInfo::hb_port;
    }
    return &ConnectionInfo::shell_port;
}

}  // namespace

void ConnectionInfo::set_port(Channel c, int port) { this->*port_member(c) = port; }

int ConnectionInfo::port(Channel c) const { return this->*port_member(c); }

// jupyter_client's _make_url: "tcp://ip:port", otherwise "transport://ip-port".
std::string ConnectionInfo::endpoint(Channel c) const {
    const std::string p = std::to_string(port(c));
    if (transport == "tcp") return "tcp://" + ip + ":" + p;
    return transport + "://" + ip + "-" + p;
}

ConnectionInfo ConnectionInfo::from_json(const json& j) {
    if (!j.is_object()) throw std::runtime_error("not a JSON object");
    ConnectionInfo info;
    for (const PortField& f : kPorts) info.*f.member = port_field(required(j, f.name), f.name);
    info.ip = string_field(required(j, "ip"), "ip");
    info.key = string_field(required(j, "key"), "key");
    if (const auto it = j.find("transport"); it != j.end()) {
        info.transport = string_field(*it, "transport");
    }
    if (info.transport != "tcp" && info.transport != "ipc") {
        throw std::runtime_error("field transport must be \"tcp\" or \"ipc\", got \"" +
                                 info.transport + "\"");
    }
    if (const auto it = j.find("signature_scheme"); it != j.end()) {
        info.signature_scheme = string_field(*it, "signature_scheme");
    }
    if (info.signature_scheme != "hmac-sha256") {
        throw std::runtime_error("field signature_scheme must be \"hmac-sha256\", got \"" +
                                 info.signature_scheme + "\"");
    }
    if (const auto it = j.find("kernel_name"); it != j.end() && !it->is_null()) {
        info.kernel_name = string_field(*it, "kernel_name");
    }
    for (auto [field, member] :
         {std::pair{"curve_server_key", &ConnectionInfo::curve_server_key},
          std::pair{"curve_secret_key", &ConnectionInfo::curve_secret_key}}) {
        const auto it = j.find(field);
        if (it == j.end()) continue;
        info.*member = string_field(*it, field);
        if (!is_z85_key(info.*member)) {
            throw std::runtime_error(std::string("field ") + field +
                                     " must be a CurveZMQ key: 40 characters of Z85");
        }
    }
    if (const auto it = j.find(sandbox_protocol::kEgressTunnelField); it != j.end()) {
        info.egress_port = port_field(*it, sandbox_protocol::kEgressTunnelField);
    }
    return info;
}

json ConnectionInfo::to_json() const {
    json j = json::object();
    for (const PortField& f : kPorts) j[f.name] = this->*f.member;
    j["ip"] = ip;
    j["key"] = key;
    j["transport"] = transport;
    j["signature_scheme"] = signature_scheme;
    j["kernel_name"] = kernel_name;
    if (!curve_server_key.empty()) j["curve_server_key"] = curve_server_key;
    if (!curve_secret_key.empty()) j["curve_secret_key"] = curve_secret_key;
    if (egress_port != 0) j[sandbox_protocol::kEgressTunnelField] = egress_port;
    return j;
}

ConnectionInfo ConnectionInfo::read(const std::filesystem::path& path) {
    errno = 0;
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(path, errno != 0 ? "cannot open: " + errno_text(errno) : "cannot open");
    std::ostringstream text;
    text << in.rdbuf();
    if (in.bad()) fail(path, "cannot read");
    const json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) fail(path, "not valid JSON");
    try {
        return from_json(j);
    } catch (const std::exception& e) {
        fail(path, e.what());
    }
}

void ConnectionInfo::write(const std::filesystem::path& path) const {
    const std::string text = to_json().dump(2) + "\n";

    // The key is a secret: the temporary file is made private before anything
    // is written to it, and rename() makes the new file appear whole.
    const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
    std::string hidden_name = ".";
    hidden_name += path.filename().string();
    hidden_name += ".XXXXXX";
    std::string temp = (dir / hidden_name).string();
    UniqueFd fd(::mkstemp(temp.data()));  // fills in the X's
    if (!fd) {
        fail(path, "cannot create temporary file in " + dir.string() + ": " + errno_text(errno));
    }

    auto abandon = [&](const std::string& step) {
        const int err = errno;
        fd.reset();
        ::unlink(temp.c_str());
        fail(path, step + ": " + errno_text(err));
    };
    if (::fchmod(fd.get(), 0600) != 0) abandon("fchmod 0600");
    std::size_t written = 0;
    while (written < text.size()) {
        const ssize_t n = ::write(fd.get(), text.data() + written, text.size() - written);
        if (n < 0) {
            if (errno == EINTR) continue;
            abandon("write");
        }
        written += static_cast<std::size_t>(n);
    }
    if (::fsync(fd.get()) != 0) abandon("fsync");
    if (!fd.close()) {
        const int err = errno;
        ::unlink(temp.c_str());
        fail(path, "close: " + errno_text(err));
    }
    if (::rename(temp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        ::unlink(temp.c_str());
        fail(path, "rename into place: " + errno_text(err));
    }
}

}  // namespace cellblock
