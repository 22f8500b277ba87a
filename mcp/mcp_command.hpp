// `cellblock mcp`: its options and its run (the transport chosen, signals,
// the scratch directory). main.cpp only adds the subcommand.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "conversation.hpp"
#include "transports.hpp"

namespace cellblock::mcp {

class McpCommand {
  public:
    explicit McpCommand(CLI::App& app);
    bool parsed() const { return command_->parsed(); }
    // `limits` are the parsed --limit items (main.cpp owns the parser).
    int run(const nlohmann::json& limits);
    const std::vector<std::string>& limit_items() const { return limit_items_; }

  private:
    CLI::App* command_;
    McpOptions options_;
    HttpOptions http_;
    std::string state_dir_;
    std::string server_file_;
    std::string token_file_;
    bool keep_sessions_ = false;
    int max_file_mb_ = 64;
    std::vector<std::string> limit_items_;
};

}  // namespace cellblock::mcp
