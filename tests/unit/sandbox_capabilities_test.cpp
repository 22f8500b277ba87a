// The sandbox seam: a backend that offers only the lifecycle fits without a
// default that says "unsupported", its capabilities read as absent; the runc
// backend refuses a runtime this host does not have before anything starts.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cellblock/error_names.hpp"
#include "cellblock/runc_backend.hpp"
#include "cellblock/sandbox.hpp"

namespace cellblock {
namespace {

// What a remote backend (a VM, a Kubernetes pod) must write: the lifecycle only.
class LifecycleOnly final : public Sandbox {
  public:
    LifecycleOnly() { session_id_ = "s"; }
    const std::string& runtime() const override { return name_; }
    int lifeline_fd() const override { return -1; }
    bool read_lifeline() override { return !exited_; }
    bool exited() const override { return exited_; }
    std::string exit_description() const override { return "the VM stopped"; }
    bool memory_limit_hit() const override { return false; }
    std::string log_tail() const override { return {}; }
    bool node_lost() const override { return false; }
    SandboxUsage usage() const override { return {}; }
    bool interrupt() override { return false; }
    void kill() override { exited_ = true; }
    void destroy() override { exited_ = true; }
    void apply_limits(const SandboxLimits&) override {}

  private:
    std::string name_ = "vm";
    bool exited_ = false;
};

TEST(SandboxCapabilities, ALifecycleOnlyBackendOffersNone) {
    LifecycleOnly box;
    Sandbox& seen = box;
    EXPECT_EQ(seen.files(), nullptr);
    EXPECT_EQ(seen.cpu(), nullptr);
    EXPECT_EQ(seen.host_process(), nullptr);
    seen.kill();
    EXPECT_TRUE(seen.exited());
}

TEST(SandboxCapabilities, RuncRefusesARuntimeThisHostDoesNotHave) {
    const auto state = std::filesystem::temp_directory_path() / "cellblock-caps-test";
    RuntimeSettings settings;
    settings.state_dir = state;
    RuncBackend backend(settings);
    Image image;
    image.name = "host";
    image.runtime = "/nonexistent/runsc";
    const auto refusal = backend.refuse(image);
    ASSERT_TRUE(refusal);
    EXPECT_EQ(refusal->ename, ename::UnknownRuntime);
    EXPECT_NE(refusal->message.find("'/nonexistent/runsc' is not installed"), std::string::npos)
        << refusal->message;
    image.runtime = "/bin/sh";  // an executable: the backend can run it
    EXPECT_FALSE(backend.refuse(image));
}

}  // namespace
}  // namespace cellblock
