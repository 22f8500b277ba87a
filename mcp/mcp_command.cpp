#include "mcp_command.hpp"

#include <sys/stat.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "manager_paths.hpp"

namespace cellblock::mcp {
namespace fs = std::filesystem;

std::atomic<bool>& stop_requested() {
    static std::atomic<bool> stop{false};
    return stop;
}

namespace {

// The token, trimmed; the file must not be readable by others.
std::string read_token(const fs::path& file) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0)
        throw std::runtime_error("--token-file " + file.string() + ": cannot read it");
    if (st.st_mode & 0077)
        throw std::runtime_error("--token-file " + file.string() +
                                 ": readable by others (chmod 600 it)");
    std::ifstream in(file);
    std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back())))
        token.pop_back();
    while (!token.empty() && std::isspace(static_cast<unsigned char>(token.front())))
        token.erase(token.begin());
    if (token.size() < 16)
        throw std::runtime_error("--token-file " + file.string() +
                                 ": the token must be at least 16 characters");
    for (const char c : token) {
        if (c < 0x21 || c > 0x7e)
            throw std::runtime_error("--token-file " + file.string() +
                                     ": the token must be one word of visible ASCII");
    }
    return token;
}

// A private directory the transfers pass through, removed at exit.
class ScratchDir {
  public:
    ScratchDir() {
        const char* tmp = std::getenv("TMPDIR");
        std::string name = std::string(tmp && *tmp ? tmp : "/tmp") + "/cellblock-mcp-XXXXXX";
        if (!::mkdtemp(name.data()))
            throw std::runtime_error("cannot create a scratch directory in " + name);
        path_ = name;
    }
    ~ScratchDir() {
        std::error_code ignored;
        fs::remove_all(path_, ignored);
    }
    ScratchDir(const ScratchDir&) = delete;
    ScratchDir& operator=(const ScratchDir&) = delete;
    const fs::path& path() const { return path_; }

  private:
    fs::path path_;
};

}  // namespace

McpCommand::McpCommand(CLI::App& app) {
    command_ = app.add_subcommand(
        "mcp",
        "serve the Model Context Protocol (stdio, or Streamable HTTP with --http) for a "
        "running `cellblock serve` (docs/mcp.md)");
    state_dir_ = default_serve_state_dir().string();
    command_->add_option("--state-dir", state_dir_, "the server's state dir (its server.json)")
        ->capture_default_str();
    command_->add_option("--server-file", server_file_,
                         "the server's server.json (its directory is the state dir)");
    command_->add_option("--http", http_.listen,
                         "serve Streamable HTTP on ADDR:PORT (POST /mcp) instead of stdio; "
                         "port 0 picks one");
    command_->add_option("--token-file", token_file_,
                         "file holding the bearer token HTTP clients must send (mode 600); "
                         "required off loopback");
    command_->add_option("--allow-origin", http_.allowed_origins,
                         "an Origin header allowed besides localhost's (repeatable)");
    command_->add_option("--image", options_.image, "create_session's default image");
    command_->add_option("--limit", limit_items_,
                         "KEY=VALUE (repeatable): a limit of every session it creates, "
                         "e.g. max_executions=200");
    command_->add_flag("--keep-sessions", keep_sessions_,
                       "leave a conversation's sessions open when it ends (default: close them)");
    command_
        ->add_option("--max-file-mb", max_file_mb_,
                     "largest file upload_file or download_file moves (it travels inside "
                     "one JSON-RPC message)")
        ->capture_default_str()
        ->check(CLI::Range(1, 1024));
    command_
        ->add_option("--http-idle-timeout", http_.idle_timeout_s,
                     "seconds an unused HTTP MCP session lives")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
}

int McpCommand::run(const nlohmann::json& limits) {
    const bool use_http = command_->count("--http") > 0;
    if (!server_file_.empty()) {
        const fs::path file(server_file_);
        if (file.filename() != "server.json")
            throw std::runtime_error("--server-file " + server_file_ +
                                     ": expected a server's server.json in its state dir");
        options_.state_dir = fs::absolute(file).parent_path();
    } else {
        options_.state_dir = state_dir_;
    }
    options_.limits = limits;
    options_.close_sessions = !keep_sessions_;
    options_.max_file_bytes = static_cast<std::uint64_t>(max_file_mb_) << 20;
    http_.max_body_bytes = options_.max_file_bytes * 4 / 3 + (1u << 20);  // base64 and the rest
    if (!token_file_.empty()) http_.token = read_token(token_file_);
    if (!use_http && !token_file_.empty())
        throw std::runtime_error("--token-file is for --http (stdio is the client's own pipe)");

    // SIGINT and SIGTERM are taken by one thread (sigwait): no other thread's
    // poll or recv is ever interrupted by them. Blocked before any thread starts.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    ::pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
    std::thread signals([&] {
        int signal = 0;
        ::sigwait(&stop_signals, &signal);
        stop_requested() = true;
    });
    struct WakeSignals {
        std::thread& thread;
        ~WakeSignals() {
            ::pthread_kill(thread.native_handle(), SIGTERM);
            thread.join();
        }
    } wake{signals};

    ScratchDir scratch;
    options_.scratch_dir = scratch.path();
    zmq::context_t context(1);
    if (use_http) return serve_http(options_, http_, context);
    return serve_stdio(options_, context);
}

}  // namespace cellblock::mcp
