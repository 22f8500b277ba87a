// Image definitions with a build section, and the content id.
#include "cellblock/image_builder.hpp"

#include <gtest/gtest.h>

#include <fstream>

#include "cellblock/image.hpp"
#include "cellblock/oci_bundle.hpp"

namespace cellblock {
namespace {

using nlohmann::json;

json minimal_definition() {
    return json::parse(R"({
        "name": "python-minimal",
        "build": {"suite": "bookworm", "packages": ["python3", "python3-ipykernel"]},
        "kernel_argv": ["/usr/bin/python3", "/opt/cellblock/cellblock_ipykernel.py", "-f",
                        "{connection_file}"],
        "preload": ["json"],
        "limits": {"memory_mb": 512}
    })");
}

std::string error_of(const json& j) {
    try {
        Image::from_json(j);
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

std::string build_error(const json& build) {
    json j = minimal_definition();
    j["build"] = build;
    return error_of(j);
}

TEST(ImageDefinition, ABuildSectionMakesAStoreImage) {
    const Image image = Image::from_json(minimal_definition());
    EXPECT_EQ(image.rootfs, "store");
    EXPECT_EQ(image.build["packages"], (json{"python3", "python3-ipykernel"}));
    EXPECT_EQ(image.definition, minimal_definition());
    EXPECT_EQ(image.limits.memory_mb, 512);
    EXPECT_TRUE(image.content_id.empty());
    const BuildSpec spec = BuildSpec::from_json(image.build);
    EXPECT_EQ(spec.suite, "bookworm");
    EXPECT_EQ(spec.mirror, "http://deb.debian.org/debian");
    EXPECT_EQ(spec.variant, "essential");
    EXPECT_TRUE(spec.strip_docs);
    EXPECT_EQ(spec.packages, (std::vector<std::string>{"python3", "python3-ipykernel"}));
}

TEST(ImageDefinition, TheShippedDefinitionsLoad) {
    for (const char* name : {"host", "host-gvisor", "python-minimal", "python-datasci"}) {
        const Image image = Image::load(std::string(CELLBLOCK_FIXTURES_DIR) + "/../../images/" +
                                        name + "/image.json");
        EXPECT_EQ(image.name, name);
        if (std::string(name).rfind("host", 0) == 0) {
            EXPECT_EQ(image.rootfs, "host");
            EXPECT_TRUE(image.build.is_null());
        } else {
            EXPECT_EQ(image.rootfs, "store");
            const auto packages = BuildSpec::from_json(image.build).packages;
            EXPECT_NE(std::find(packages.begin(), packages.end(), "python3-ipykernel"),
                      packages.end())
                << name;
        }
    }
    const Image datasci = Image::load(std::string(CELLBLOCK_FIXTURES_DIR) +
                                      "/../../images/python-datasci/image.json");
    EXPECT_EQ(datasci.preload, (std::vector<std::string>{
                                   "numpy", "pandas", "matplotlib", "matplotlib.pyplot",
                                   "matplotlib.backends.backend_agg", "scipy.stats", "seaborn"}));
}

TEST(ImageDefinition, BadBuildSectionsNameTheField) {
    EXPECT_EQ(build_error("bookworm"), "image python-minimal: build: expected an object");
    EXPECT_EQ(build_error({{"packges", json::array()}}),
              "image python-minimal: build: unknown field 'packges'");
    EXPECT_EQ(build_error({{"suite", "book worm"}}),
              "image python-minimal: build: suite 'book worm' is not a suite name");
    EXPECT_EQ(build_error({{"mirror", "ftp://x"}}),
              "image python-minimal: build: mirror 'ftp://x' is not an http(s) URL");
    EXPECT_EQ(build_error({{"packages", {"python3", "rm -rf"}}}),
              "image python-minimal: build: package \"rm -rf\" is not a Debian package name");
    EXPECT_EQ(build_error({{"packages", {"Python3"}}}),
              "image python-minimal: build: package \"Python3\" is not a Debian package name");
    EXPECT_EQ(build_error({{"packages", {"--allow-unauthenticated"}}}),
              "image python-minimal: build: package \"--allow-unauthenticated\" is not a Debian "
              "package name");
    EXPECT_EQ(error_of(json::parse(R"({"name": "x", "kernel_argv": ["k"],
                                       "build": {"packages": ["python3=3.11.2-1+b1"]}})")),
              "");
    EXPECT_NE(build_error({{"files", {{{"path", "/etc/../x"}, {"content", ""}}}}}).find("absolute"),
              std::string::npos);
    EXPECT_NE(build_error({{"files", {{{"path", "/tmp/x"}, {"content", ""}}}}}).find("mounts"),
              std::string::npos);
    EXPECT_NE(build_error({{"files", {{{"path", "/etc/x"}}}}}).find("exactly one"),
              std::string::npos);
    EXPECT_NE(
        build_error({{"files", {{{"path", "/etc/x"}, {"source", "../secret"}}}}}).find("relative"),
        std::string::npos);
    EXPECT_NE(build_error({{"files", {{{"path", "/etc/x"}, {"content", ""}, {"mode", "4755"}}}}})
                  .find("mode"),
              std::string::npos);
    EXPECT_NE(build_error({{"files", {{{"path", "/etc/x"}, {"content", ""}, {"mode", "0666"}}}}})
                  .find("writable"),
              std::string::npos);
    EXPECT_EQ(build_error({{"files", {{{"path", "/etc/x"}, {"content", "y"}, {"mode", "0755"}}}}}),
              "");
}

TEST(ImageDefinition, StoreImagesCarryNoHostBinds) {
    json j = minimal_definition();
    j["host_binds"] = {"/etc/alternatives"};
    EXPECT_NE(error_of(j).find("host_binds are for the host image only"), std::string::npos);
    j = minimal_definition();
    j["rootfs"] = "host";
    EXPECT_NE(error_of(j).find("a build section needs rootfs 'store'"), std::string::npos);
    j = minimal_definition();
    j["rootfs"] = "relative/path";
    EXPECT_NE(error_of(j).find("is not host, store or an absolute path"), std::string::npos);
}

TEST(ContentId, SameInputsSameId) {
    const json def = minimal_definition();
    const std::vector<std::string> pkgs{"python3:amd64=3.11.2-1+b1", "libc6:amd64=2.36-9"};
    const std::string id = image_content_id(def, {}, pkgs);
    EXPECT_EQ(id.size(), 64u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos);
    EXPECT_EQ(image_content_id(def, {}, pkgs), id);
    // The package order (dpkg's, a file's) does not matter; the key order of the definition
    // neither.
    EXPECT_EQ(image_content_id(def, {}, {pkgs[1], pkgs[0]}), id);
    EXPECT_EQ(image_content_id(json::parse(def.dump()), {}, pkgs), id);
}

TEST(ContentId, AnyChangeAnotherId) {
    const json def = minimal_definition();
    const std::vector<std::string> pkgs{"python3:amd64=3.11.2-1+b1"};
    const std::string id = image_content_id(def, {}, pkgs);
    EXPECT_NE(image_content_id(def, {}, {"python3:amd64=3.11.2-1+b2"}), id);
    EXPECT_NE(image_content_id(def, {}, {"python3:amd64=3.11.2-1+b1", "less:amd64=590-2"}), id);
    json more = def;
    more["build"]["packages"].push_back("less");
    EXPECT_NE(image_content_id(more, {}, pkgs), id);
    json env = def;
    env["env"] = {{"A", "1"}};
    EXPECT_NE(image_content_id(env, {}, pkgs), id);
    EXPECT_NE(image_content_id(def, {{"/etc/x", sha256_hex("a")}}, pkgs), id);
    EXPECT_NE(image_content_id(def, {{"/etc/x", sha256_hex("b")}}, pkgs),
              image_content_id(def, {{"/etc/x", sha256_hex("a")}}, pkgs));
}

TEST(ContentId, Sha256IsSha256) {
    EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(sha256_hex("abc"),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ImageStore, AnEmptyStoreResolvesNothing) {
    const ImageStore store("/nonexistent/cellblock-images");
    EXPECT_FALSE(store.current("python-minimal").has_value());
    EXPECT_TRUE(store.names().empty());
    const Image image = Image::from_json(minimal_definition());
    try {
        resolve_image(image, store);
        FAIL() << "resolved an image that was never built";
    } catch (const ImageNotBuilt& e) {
        EXPECT_NE(std::string(e.what()).find("cellblock image build python-minimal"),
                  std::string::npos);
    }
    // Host images are what they are.
    json host = minimal_definition();
    host.erase("build");
    EXPECT_EQ(resolve_image(Image::from_json(host), store).rootfs, "host");
}

TEST(ImageStore, MountPointsOfAStoreImage) {
    const auto points = image_mount_points(Image::from_json(minimal_definition()));
    for (const char* p : {"/proc", "/dev", "/tmp", "/home/sandbox", "/run/cellblock", "/data/input",
                          "/data/output", "/opt/cellblock"}) {
        EXPECT_NE(std::find(points.begin(), points.end(), p), points.end()) << p;
    }
    // No bind of the host's /usr into a built image.
    EXPECT_EQ(std::find(points.begin(), points.end(), "/usr"), points.end());
}

TEST(ImageStore, ABuiltRootGetsItsOwnUsrAgainNosuid) {
    SandboxSpec spec;
    spec.image = Image::from_json(minimal_definition());
    spec.image.rootfs = "/var/lib/cellblock/images/store/abc/rootfs";
    spec.rootfs = spec.image.rootfs;
    const json config = make_oci_config(spec);
    EXPECT_EQ(config["root"]["path"], spec.image.rootfs);
    EXPECT_EQ(config["root"]["readonly"], true);
    bool found = false;
    for (const auto& m : config["mounts"]) {
        if (m["destination"] != "/usr") continue;
        found = true;
        EXPECT_EQ(m["source"], "/var/lib/cellblock/images/store/abc/rootfs/usr");
        const auto opts = m["options"].get<std::vector<std::string>>();
        for (const char* o : {"ro", "nosuid", "nodev"}) {
            EXPECT_NE(std::find(opts.begin(), opts.end(), o), opts.end()) << o;
        }
        EXPECT_EQ(std::find(opts.begin(), opts.end(), "noexec"), opts.end());
    }
    EXPECT_TRUE(found);
}

}  // namespace
}  // namespace cellblock
