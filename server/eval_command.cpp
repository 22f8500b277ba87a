#include "eval_command.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#ifndef CELLBLOCK_SOURCE_DIR
#define CELLBLOCK_SOURCE_DIR ""
#endif

namespace cellblock {
namespace {
namespace fs = std::filesystem;

bool has_package(const fs::path& dir) {
    std::error_code ec;
    return fs::is_regular_file(dir / "cellblock" / "eval.py", ec);
}

// The client package: $CELLBLOCK_PYTHON_CLIENT, then beside an installed
// binary (PREFIX/share/cellblock/python), then a build tree inside a clone
// (BUILD/bin/cellblock -> clients/python), then the source dir compiled in.
fs::path find_client_dir(const fs::path& exe) {
    std::vector<fs::path> candidates;
    if (const char* env = std::getenv("CELLBLOCK_PYTHON_CLIENT")) candidates.emplace_back(env);
    const fs::path bin_dir = exe.parent_path();
    candidates.push_back(bin_dir.parent_path() / "share" / "cellblock" / "python");
    fs::path dir = bin_dir;
    for (int up = 0; up < 3 && dir.has_relative_path(); ++up, dir = dir.parent_path()) {
        candidates.push_back(dir / "clients" / "python");
    }
    if (std::strlen(CELLBLOCK_SOURCE_DIR) > 0) {
        candidates.push_back(fs::path(CELLBLOCK_SOURCE_DIR) / "clients" / "python");
    }
    for (const auto& dir : candidates) {
        if (has_package(dir)) return dir;
    }
    return {};
}

}  // namespace

int exec_eval(int argc, char** argv) {
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    const fs::path client = find_client_dir(exe);
    if (client.empty()) {
        std::cerr << "cellblock eval: cannot find the Python client (clients/python); set "
                     "CELLBLOCK_PYTHON_CLIENT to its directory\n";
        return 2;
    }
    std::string pythonpath = client.string();
    if (const char* old = std::getenv("PYTHONPATH"); old && *old)
        pythonpath += ":" + std::string(old);
    ::setenv("PYTHONPATH", pythonpath.c_str(), 1);
    if (!ec) ::setenv("CELLBLOCK_BIN", exe.c_str(), 0);
    const char* env_python = std::getenv("CELLBLOCK_PYTHON");
    const std::string python = env_python && *env_python ? env_python : "/usr/bin/python3";
    std::vector<char*> args{const_cast<char*>(python.c_str()), const_cast<char*>("-m"),
                            const_cast<char*>("cellblock.eval")};
    for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    ::execv(python.c_str(), args.data());
    std::cerr << "cellblock eval: cannot run " << python << ": " << std::strerror(errno) << "\n";
    return 2;
}

}  // namespace cellblock
