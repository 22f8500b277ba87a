#include "cellblock/cpu_demand.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <random>
#include <stdexcept>

#include "cellblock/errno_text.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

// Fixed width, so that a rewrite never changes the length: a reader sees
// the old figures or the new ones.
constexpr std::size_t kDigits = 10;
constexpr std::size_t kRecord = 2 * kDigits + 2;

std::string record(std::size_t interactive, std::size_t hogging) {
    auto field = [](std::size_t n) {
        std::string digits = std::to_string(n);
        if (digits.size() > kDigits) digits = std::string(kDigits, '9');
        return std::string(kDigits - digits.size(), '0') + digits;
    };
    return field(interactive) + " " + field(hogging) + "\n";
}

bool parse(const char* text, std::size_t length, CpuDemand& out) {
    if (length != kRecord || text[kDigits] != ' ' || text[kRecord - 1] != '\n') return false;
    auto number = [&](const char* from, std::size_t& value) {
        const auto r = std::from_chars(from, from + kDigits, value);
        return r.ec == std::errc() && r.ptr == from + kDigits;
    };
    return number(text, out.interactive) && number(text + kDigits + 1, out.hogging);
}

}  // namespace

HostCpuDemand::HostCpuDemand(fs::path dir) : dir_(std::move(dir)) {
    if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST)
        throw std::runtime_error("mkdir " + dir_.string() + ": " + errno_text());
    std::random_device random;
    const std::string name =
        std::to_string(::getpid()) + "-" + std::to_string(random()) + std::to_string(random());
    // Locked before it has its visible name: a reader removes only unlocked files.
    for (int attempt = 0; attempt < 5 && !fd_; ++attempt) {
        const fs::path temporary = dir_ / (".new-" + name);
        UniqueFd fd(::open(temporary.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
        if (!fd) throw std::runtime_error("create " + temporary.string() + ": " + errno_text());
        const std::string zeros = record(0, 0);
        if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0 ||
            ::pwrite(fd.get(), zeros.data(), zeros.size(), 0) !=
                static_cast<ssize_t>(zeros.size())) {
            ::unlink(temporary.c_str());
            throw std::runtime_error("write " + temporary.string() + ": " + errno_text());
        }
        file_ = dir_ / name;
        // A reader may have taken the temporary file for a crashed server's
        // in the instant before the lock: then it is gone, and we try again.
        if (::rename(temporary.c_str(), file_.c_str()) == 0) fd_ = std::move(fd);
    }
    if (!fd_) throw std::runtime_error("publish in " + dir_.string() + ": " + errno_text());
}

HostCpuDemand::~HostCpuDemand() {
    if (fd_) ::unlink(file_.c_str());  // then the lock goes with the descriptor
}

void HostCpuDemand::publish(std::size_t interactive, std::size_t hogging) {
    if (interactive == own_.interactive && hogging == own_.hogging) return;
    const std::string text = record(interactive, hogging);
    if (::pwrite(fd_.get(), text.data(), text.size(), 0) == static_cast<ssize_t>(text.size())) {
        own_.interactive = interactive;
        own_.hogging = hogging;
    }
}

CpuDemand HostCpuDemand::totals() {
    CpuDemand sum = own_;
    sum.servers = 1;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
        const fs::path path = entry.path();
        if (path == file_) continue;
        const std::string name = path.filename().string();
        UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
        if (!fd) continue;  // removed meanwhile
        struct stat st {};
        if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (::flock(fd.get(), LOCK_SH | LOCK_NB) == 0) {
            // Nobody holds it: a server that died, or one that died making its
            // file (a temporary name). Either is gone for good.
            ::unlink(path.c_str());
            continue;
        }
        if (name.rfind(".new-", 0) == 0) continue;  // being made: not published yet
        char text[kRecord + 1];
        const ssize_t n = ::pread(fd.get(), text, sizeof text, 0);
        CpuDemand theirs;
        if (n > 0 && parse(text, static_cast<std::size_t>(n), theirs)) {
            sum.interactive += theirs.interactive;
            sum.hogging += theirs.hogging;
            ++sum.servers;
        }
    }
    return sum;
}

}  // namespace cellblock
