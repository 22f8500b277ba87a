#include "image_cli.hpp"

#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <iostream>
#include <map>

#include <spdlog/spdlog.h>

#include "cellblock/image_builder.hpp"
#include "cellblock/swarm_backend.hpp"
#include "kernel_mode.hpp"
#include "manager_paths.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The definitions under the image directories, by name (first found wins).
std::map<std::string, Image> defined_images() {
    std::map<std::string, Image> found;
    for (const auto& dir : ServerPaths::defaults().image_dirs) {
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(dir, ec)) {
            const fs::path file = entry.path() / "image.json";
            const std::string name = entry.path().filename().string();
            if (found.count(name) || !fs::exists(file)) continue;
            try {
                found.emplace(name, Image::load(file));
            } catch (const std::exception& e) {
                spdlog::warn("{}", e.what());
            }
        }
    }
    return found;
}

std::string when(double unix_seconds) {
    if (unix_seconds <= 0) return "-";
    const std::time_t t = static_cast<std::time_t>(unix_seconds);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", std::localtime(&t));
    return buf;
}

std::string megabytes(std::uint64_t bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.0f MB", static_cast<double>(bytes) / (1 << 20));
    return buf;
}

}  // namespace

ImageCommands::ImageCommands(CLI::App& app) {
    state_dir_ = default_serve_state_dir();
    image_ = app.add_subcommand("image", "build, list, remove and import sandbox images");
    image_->require_subcommand(1);
    image_->add_option("--state-dir", state_dir_, "images live in STATE_DIR/images")
        ->capture_default_str();
    auto add = [&](const char* name, const char* help) {
        auto* cmd = image_->add_subcommand(name, help);
        cmd->add_option("--state-dir", state_dir_, "images live in STATE_DIR/images")
            ->capture_default_str();
        return cmd;
    };
    build_ = add("build", "build an image from images/NAME/image.json with mmdebstrap");
    build_->add_option("name", name_, "image name")->required();
    ls_ = add("ls", "list the defined and stored images");
    ls_->add_flag("--json", as_json_, "print JSON");
    rm_ = add("rm", "remove an image's name and its versions no sandbox uses");
    rm_->add_option("name", name_, "image name")->required();
    import_ = add("import", "store a root filesystem tarball as image NAME");
    import_->add_option("name", name_, "image name")->required();
    import_->add_option("rootfs", tarball_, "root filesystem tarball (tar, tar.gz, ...)")
        ->required()
        ->check(CLI::ExistingFile);
    export_ = add("export",
                  "write image NAME as a tarball for `docker import` (the Swarm backend's "
                  "images; docs/scale-out.md)");
    export_->add_option("name", name_, "image name")->required();
    export_->add_option("-o,--output", output_, "the tarball (default cellblock-NAME.tar)");
    libexec_dir_ = ServerPaths::defaults().libexec_dir;
    export_->add_option("--libexec-dir", libexec_dir_, "directory of cellblock-shim")
        ->capture_default_str();
}

bool ImageCommands::parsed() const { return image_->parsed(); }

int ImageCommands::run() {
    const ImageStore store(state_dir_ / "images");
    const bool mutating = build_->parsed() || rm_->parsed() || import_->parsed();
    if (mutating && ::geteuid() != 0) {
        spdlog::error("cellblock image {} needs root (mmdebstrap --mode=root, a root-owned store)",
                      build_->parsed() ? "build"
                      : rm_->parsed()  ? "rm"
                                       : "import");
        return 1;
    }
    try {
        if (build_->parsed()) {
            const auto defined = defined_images();
            auto it = defined.find(name_);
            if (it == defined.end()) {
                std::string known;
                for (const auto& [name, image] : defined) {
                    if (!image.build.is_null()) known += (known.empty() ? "" : ", ") + name;
                }
                throw std::runtime_error("no image definition '" + name_ +
                                         "' (images with a build section: " + known + ")");
            }
            build_image(it->second, store, std::cout);
            return 0;
        }
        if (import_->parsed()) {
            const auto defined = defined_images();
            auto it = defined.find(name_);
            const Image definition =
                it != defined.end() ? it->second : default_import_definition(name_);
            import_image(definition, tarball_, store, std::cout);
            return 0;
        }
        if (export_->parsed()) {
            const auto defined = defined_images();
            auto it = defined.find(name_);
            if (it == defined.end())
                throw std::runtime_error("no image definition '" + name_ + "'");
            const Image image = resolve_image(it->second, store);
            const fs::path out =
                output_.empty() ? fs::path("cellblock-" + name_ + ".tar") : output_;
            const std::string tag = export_engine_image(image, libexec_dir_, out);
            std::cout << "image " << name_ << " written to " << out.string() << "\n"
                      << "load it on every node (or push it to your registry) as " << tag
                      << ":\n  docker import " << out.string() << " " << tag << "\n";
            return 0;
        }
        if (rm_->parsed()) {
            const auto kept = remove_image(name_, store);
            std::cout << "image " << name_ << " removed from " << store.root().string() << "\n";
            for (const auto& v : kept) {
                std::cout << "  version " << v.content_id.substr(0, 12)
                          << " kept: " << processes_using(v).size()
                          << " process(es) run on it; a later `cellblock image rm " << name_
                          << "` removes it once they end\n";
            }
            return 0;
        }
        if (ls_->parsed()) {
            const auto defined = defined_images();
            std::map<std::string, json> rows;
            for (const auto& [name, image] : defined) {
                rows[name] = {{"name", name},
                              {"rootfs", image.rootfs},
                              {"runtime", image.runtime},
                              {"defined", true}};
            }
            for (const auto& name : store.names()) {
                json& row = rows[name];
                row["name"] = name;
                row["defined"] = defined.count(name) > 0;
                row["rootfs"] = "store";
            }
            json out = json::array();
            for (auto& [name, row] : rows) {
                if (row["rootfs"] == "store") {
                    if (const auto cur = store.current(name)) {
                        row["content_id"] = cur->content_id;
                        row["size_bytes"] = cur->size_bytes();
                        row["source"] = cur->manifest.value("source", "");
                        row["built_at"] = cur->manifest.value("built_at", 0.0);
                        row["package_count"] = cur->manifest.value("package_count", 0);
                        row["rootfs_path"] = cur->rootfs().string();
                    }
                    json versions = json::array();
                    for (const auto& v : store.versions(name)) {
                        versions.push_back({{"content_id", v.content_id},
                                            {"size_bytes", v.size_bytes()},
                                            {"processes", processes_using(v).size()}});
                    }
                    row["versions"] = versions;
                }
                out.push_back(row);
            }
            if (as_json_) {
                std::cout << out.dump(2) << "\n";
                return 0;
            }
            std::printf("%-18s %-14s %8s %-7s %-16s %s\n", "IMAGE", "CONTENT ID", "SIZE", "SOURCE",
                        "BUILT", "VERSIONS");
            for (const auto& row : out) {
                const std::string name = row["name"];
                if (row["rootfs"] != "store") {
                    std::printf("%-18s %-14s %8s %-7s %-16s %s\n", name.c_str(), "-", "-",
                                row["rootfs"].get<std::string>().c_str(), "-", "-");
                    continue;
                }
                if (!row.contains("content_id")) {
                    std::printf("%-18s %-14s %8s %-7s %-16s %zu\n", name.c_str(), "(not built)",
                                "-", "-", "-", row["versions"].size());
                    continue;
                }
                std::printf("%-18s %-14s %8s %-7s %-16s %zu\n", name.c_str(),
                            row["content_id"].get<std::string>().substr(0, 12).c_str(),
                            megabytes(row["size_bytes"].get<std::uint64_t>()).c_str(),
                            row["source"].get<std::string>().c_str(),
                            when(row["built_at"].get<double>()).c_str(), row["versions"].size());
            }
            return 0;
        }
    } catch (const std::exception& e) {
        spdlog::error("{}", e.what());
        return 1;
    }
    return 0;
}

}  // namespace cellblock
