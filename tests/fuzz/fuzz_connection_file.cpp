// Fuzzes connection files: ConnectionInfo::from_json on the input parsed as
// JSON, and ConnectionInfo::read on the input written to a temporary file.
// Both must agree, throw only std::runtime_error, and whatever they accept
// must be a usable connection (ports in range, a known transport and scheme,
// a key a Signer takes) that survives write() and read() unchanged.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <typeinfo>

#include "cellblock/connection_info.hpp"
#include "cellblock/signer.hpp"
#include "fuzz_support.hpp"

namespace cellblock::fuzz {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr Channel kChannels[] = {Channel::shell, Channel::iopub, Channel::stdin_, Channel::control,
                                 Channel::hb};

// One private directory per process, on tmpfs when there is one, named by
// pid: libFuzzer ends without running atexit handlers, so each start removes
// the directories of processes that are gone.
const fs::path& scratch_dir() {
    static const fs::path dir = [] {
        const fs::path base =
            fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
        const std::string prefix = "cellblock-fuzz-conn-";
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(base, ec)) {
            const std::string name = entry.path().filename().string();
            if (name.rfind(prefix, 0) != 0) continue;
            const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
            if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
                fs::remove_all(entry.path(), ec);
            }
        }
        const fs::path made = base / (prefix + std::to_string(::getpid()));
        fs::create_directories(made);
        fs::permissions(made, fs::perms::owner_all);
        return made;
    }();
    return dir;
}

void write_file(const fs::path& path, const std::uint8_t* data, std::size_t size) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FUZZ_CHECK(fd >= 0, "cannot create %s", path.c_str());
    std::size_t done = 0;
    while (done < size) {
        const ssize_t n = ::write(fd, data + done, size - done);
        FUZZ_CHECK(n > 0, "cannot write %s", path.c_str());
        done += static_cast<std::size_t>(n);
    }
    ::close(fd);
}

json fields(const ConnectionInfo& c) { return c.to_json(); }

void check_usable(const ConnectionInfo& c) {
    for (const Channel ch : kChannels) {
        FUZZ_CHECK(c.port(ch) >= 0 && c.port(ch) <= 65535, "%s port %d out of range",
                   channel_name(ch), c.port(ch));
        const std::string endpoint = c.endpoint(ch);
        FUZZ_CHECK(endpoint.rfind(c.transport + "://", 0) == 0, "endpoint %s", endpoint.c_str());
    }
    FUZZ_CHECK(c.transport == "tcp" || c.transport == "ipc", "transport %s", c.transport.c_str());
    FUZZ_CHECK(c.signature_scheme == "hmac-sha256", "scheme %s", c.signature_scheme.c_str());
    // The server builds a Signer from every connection it accepts.
    try {
        const Signer signer(c.key, c.signature_scheme);
        const std::string sig = signer.sign("{}", "{}", "{}", "{}");
        FUZZ_CHECK(signer.verify(sig, "{}", "{}", "{}", "{}"), "the key cannot sign");
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "a Signer refused an accepted connection: %s", e.what());
    }
    const ConnectionInfo again = ConnectionInfo::from_json(c.to_json());
    FUZZ_CHECK(fields(again) == fields(c), "to_json/from_json round trip changed the connection");
}

void fuzz(const std::uint8_t* data, std::size_t size) {
    const std::string text(reinterpret_cast<const char*>(data), size);

    std::optional<ConnectionInfo> from_json;
    const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded()) {
        try {
            from_json = ConnectionInfo::from_json(parsed);
        } catch (const std::runtime_error& e) {
            FUZZ_CHECK(e.what()[0] != '\0', "from_json threw an empty message");
        } catch (const std::exception& e) {
            FUZZ_CHECK(false, "from_json threw %s (not std::runtime_error): %s", typeid(e).name(),
                       e.what());
        } catch (...) {
            FUZZ_CHECK(false, "from_json threw something that is not a std::exception");
        }
    }

    const fs::path file = scratch_dir() / "kernel.json";
    write_file(file, data, size);
    std::optional<ConnectionInfo> read;
    try {
        read = ConnectionInfo::read(file);
    } catch (const std::runtime_error& e) {
        const std::string prefix = "connection file " + file.string() + ": ";
        FUZZ_CHECK(std::string(e.what()).rfind(prefix, 0) == 0,
                   "read() error '%s' does not name "
                   "the file",
                   e.what());
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "read threw %s (not std::runtime_error): %s", typeid(e).name(), e.what());
    } catch (...) {
        FUZZ_CHECK(false, "read threw something that is not a std::exception");
    }

    FUZZ_CHECK(read.has_value() == from_json.has_value(), "read() %s what from_json %s",
               read ? "accepted" : "refused", from_json ? "accepts" : "refuses");
    if (!read) return;
    FUZZ_CHECK(fields(*read) == fields(*from_json), "read() and from_json disagree");
    check_usable(*read);

    // What cellblock writes (mode 0600, atomically) it reads back unchanged.
    const fs::path written = scratch_dir() / "written.json";
    read->write(written);
    FUZZ_CHECK((fs::status(written).permissions() & fs::perms::all) ==
                   (fs::perms::owner_read | fs::perms::owner_write),
               "written connection file is not 0600");
    const ConnectionInfo back = ConnectionInfo::read(written);
    FUZZ_CHECK(fields(back) == fields(*read), "write/read round trip changed the connection");
}

}  // namespace
}  // namespace cellblock::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    cellblock::fuzz::fuzz(data, size);
    return 0;
}
