// The subcommands that talk to a running server over its manager socket:
// `cellblock new | ls | info | close | put | get | history | server-info`.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace cellblock {

// "KEY=VALUE" limit options (`--limit`) as a limits object: numbers stay
// numbers. Shared by `new`, `kernel` and `kernelspec install`.
nlohmann::json parse_limits(const std::vector<std::string>& items);

class ClientCommands {
  public:
    // Adds the subcommands to `app`.
    explicit ClientCommands(CLI::App& app);
    bool parsed() const;
    // Runs the parsed subcommand against the server; returns the exit code.
    // Throws what the server or the transfer refused.
    int run();

  private:
    std::filesystem::path state_dir_;
    std::string image_, metadata_text_, output_file_, session_id_, local_, remote_;
    std::vector<std::string> limit_items_;
    bool all_ = false, as_json_ = false, stream_only_ = false, local_only_ = false;
    CLI::App* new_cmd_ = nullptr;
    CLI::App* ls_cmd_ = nullptr;
    CLI::App* info_cmd_ = nullptr;
    CLI::App* close_cmd_ = nullptr;
    CLI::App* hibernate_cmd_ = nullptr;
    CLI::App* resume_cmd_ = nullptr;
    CLI::App* put_cmd_ = nullptr;
    CLI::App* get_cmd_ = nullptr;
    CLI::App* history_cmd_ = nullptr;
    CLI::App* server_info_cmd_ = nullptr;
};

}  // namespace cellblock
