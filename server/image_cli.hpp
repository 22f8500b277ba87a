// `cellblock image build | ls | rm | import | export`: the image store from the command line.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

namespace cellblock {

class ImageCommands {
  public:
    // Adds `image` and its subcommands to `app`.
    explicit ImageCommands(CLI::App& app);
    bool parsed() const;
    // Runs the parsed subcommand; returns the process exit code.
    int run();

  private:
    CLI::App* image_ = nullptr;
    CLI::App* build_ = nullptr;
    CLI::App* ls_ = nullptr;
    CLI::App* rm_ = nullptr;
    CLI::App* import_ = nullptr;
    CLI::App* export_ = nullptr;
    std::filesystem::path output_;
    std::filesystem::path libexec_dir_;
    std::filesystem::path state_dir_;
    std::string name_;
    std::filesystem::path tarball_;
    bool as_json_ = false;
};

}  // namespace cellblock
