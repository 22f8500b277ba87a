// cellblock: the command line.
#include <unistd.h>

#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "kernel_mode.hpp"

namespace {

void setup_logging(const std::string& level) {
    auto logger = spdlog::stderr_color_st("cellblock");
    logger->set_pattern("[cellblock %Y-%m-%d %H:%M:%S.%e %l] %v");
    spdlog::set_default_logger(logger);
    spdlog::set_level(spdlog::level::from_str(level));
}

void add_limit_options(CLI::App* app, nlohmann::json& overrides, int& memory_mb, int& pids,
                       int& disk_mb, double& cpus) {
    app->add_option("--memory-mb", memory_mb, "memory limit of the sandbox");
    app->add_option("--pids", pids, "process limit of the sandbox");
    app->add_option("--disk-mb", disk_mb, "size of each writable tmpfs (/tmp, home)");
    app->add_option("--cpus", cpus, "CPU quota in cores");
    (void)overrides;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"cellblock: sandboxed Jupyter sessions for untrusted code"};
    app.require_subcommand(1);
    std::string log_level = "info";
    app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
        ->capture_default_str();

    cellblock::KernelModeOptions kernel;
    kernel.paths = cellblock::ServerPaths::defaults();
    int memory_mb = 0, pids = 0, disk_mb = 0;
    double cpus = 0;
    auto* kernel_cmd = app.add_subcommand("kernel", "run one sandboxed kernel on a connection file");
    kernel_cmd->add_option("-f,--connection-file", kernel.connection_file, "Jupyter connection file")
        ->required();
    kernel_cmd->add_option("--image", kernel.image, "image name")->capture_default_str();
    kernel_cmd->add_option("--runtime", kernel.runtime, "OCI runtime: runc, crun or runsc");
    kernel_cmd->add_option("--state-dir", kernel.paths.state_dir, "where sandboxes live")
        ->capture_default_str();
    kernel_cmd->add_option("--libexec-dir", kernel.paths.libexec_dir, "directory of cellblock-shim and the kernel launcher");
    add_limit_options(kernel_cmd, kernel.limit_overrides, memory_mb, pids, disk_mb, cpus);

    cellblock::KernelspecOptions spec;
    auto* spec_cmd = app.add_subcommand("kernelspec", "manage the Jupyter kernelspec");
    spec_cmd->require_subcommand(1);
    auto* install_cmd = spec_cmd->add_subcommand("install", "write the cellblock-python kernelspec");
    install_cmd->add_flag("--user", spec.user, "install for the current user");
    std::string prefix;
    install_cmd->add_option("--prefix", prefix, "install under PREFIX/share/jupyter/kernels");
    install_cmd->add_option("--name", spec.name, "kernelspec name")->capture_default_str();
    install_cmd->add_option("--kernel-arg", spec.extra_args,
                            "extra argument for `cellblock kernel` (repeatable)");

    CLI11_PARSE(app, argc, argv);
    setup_logging(log_level);

    try {
        if (kernel_cmd->parsed()) {
            if (memory_mb > 0) kernel.limit_overrides["memory_mb"] = memory_mb;
            if (pids > 0) kernel.limit_overrides["pids"] = pids;
            if (disk_mb > 0) kernel.limit_overrides["disk_mb"] = disk_mb;
            if (cpus > 0) kernel.limit_overrides["cpus"] = cpus;
            if (::geteuid() != 0) {
                spdlog::error("cellblock kernel needs root to create runc sandboxes");
                return 1;
            }
            return cellblock::run_kernel_mode(kernel);
        }
        if (install_cmd->parsed()) {
            if (!prefix.empty()) spec.prefix = prefix;
            const auto file = cellblock::install_kernelspec(spec);
            std::cout << "installed kernelspec " << spec.name << " in " << file.parent_path().string()
                      << "\n";
            return 0;
        }
    } catch (const std::exception& e) {
        spdlog::error("{}", e.what());
        return 1;
    }
    return 0;
}
