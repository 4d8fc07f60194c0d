// Adapter lifecycle over HTTP, with --lora-root a temporary folder: files confined at load and
// at every re-read (symlinked files, a folder swapped for a symlink after eviction), errors that
// never quote file contents, reads that cannot block (a FIFO) or stall (a pathological regex),
// in-place reloads that are atomic and keep the old version when they fail, re-read adapters
// checked against their identity, alpha validated after scaling, and cache_salt.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/server/raw_http.h"
#include "tests/testutil/test_files.h"

namespace moelora::server::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using moelora::testutil::TempDir;

std::string bundled(const std::string& name) { return tiny_model_dir() + "/adapters/" + name; }

class AdapterLifecycle : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(tmp_.str()) / "root";
    outside_ = fs::path(tmp_.str()) / "outside";
    fs::create_directories(root_);
    fs::create_directories(outside_);
  }
  std::unique_ptr<TinyServer> start(int max_loaded = 32) {
    ServerOptions o;
    o.allow_runtime_lora = true;
    o.lora_root = root_.string();
    EngineOptions e;
    e.max_loaded_loras = max_loaded;
    e.max_loras_per_batch = 2;
    return std::make_unique<TinyServer>(o, e);
  }
  static RawConn::Response load(TinyServer& s, const std::string& name, const fs::path& path, bool inplace = false) {
    return s.call(post_json("/v1/load_lora_adapter",
                            fmt::format(R"({{"lora_name": "{}", "lora_path": "{}", "load_inplace": {}}})", name,
                                        path.string(), inplace ? "true" : "false")));
  }
  static nlohmann::json complete(TinyServer& s, const std::string& model, const std::string& extra = "",
                                 int* status = nullptr) {
    const auto r = s.call(post_json(
        "/v1/completions",
        fmt::format(R"({{"model": "{}", "prompt": "{}", "max_tokens": 4, "temperature": 0, "return_token_ids": true{}}})",
                    model, std::string(48, 'p'), extra)));
    if (status) *status = r.status;
    auto j = nlohmann::json::parse(r.body, nullptr, false);
    return j;
  }
  static std::vector<int> tokens(const nlohmann::json& j) {
    return j.contains("choices") ? j["choices"][0]["token_ids"].get<std::vector<int>>() : std::vector<int>{};
  }
  static int cached(const nlohmann::json& j) { return j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(); }
  void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& fn) {
    auto j = nlohmann::json::parse(testutil::read_file((dir / "adapter_config.json").string()));
    fn(j);
    testutil::write_file((dir / "adapter_config.json").string(), j.dump());
  }

  TempDir tmp_;
  fs::path root_, outside_;
};

TEST_F(AdapterLifecycle, SymlinkedFilesMayNotLeaveTheRootAndErrorsQuoteNoContents) {
  auto s = start();
  const fs::path dir = root_ / "leak";
  testutil::copy_dir(bundled("attn-r8"), dir.string());
  // The weights file points at a file outside the root whose first 8 bytes would read as a
  // "header length" (how /etc/passwd leaked before).
  testutil::write_file((outside_ / "secret").string(), "SECRETSECRET-contents");
  fs::remove(dir / "adapter_model.safetensors");
  fs::create_symlink(outside_ / "secret", dir / "adapter_model.safetensors");
  const auto r = load(*s, "leak", dir);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("outside --lora-root"), std::string::npos) << r.body;
  EXPECT_EQ(r.body.find("SECRET"), std::string::npos);
  // A symlink that stays inside the root (a Hugging Face cache's blobs) is fine.
  fs::remove(dir / "adapter_model.safetensors");
  fs::copy_file(fs::path(bundled("attn-r8")) / "adapter_model.safetensors", root_ / "blob");
  fs::create_symlink(root_ / "blob", dir / "adapter_model.safetensors");
  EXPECT_EQ(load(*s, "leak", dir).status, 200);
  // Garbage inside the root: the verdict, not the bytes.
  const fs::path junk = root_ / "junk";
  testutil::copy_dir(bundled("attn-r8"), junk.string());
  testutil::write_file((junk / "adapter_model.safetensors").string(), "ABCDEFGHIJKLMNOPQRSTUVWXYZ");
  const auto j = load(*s, "junk", junk);
  EXPECT_EQ(j.status, 400);
  EXPECT_NE(j.body.find("not a valid safetensors file"), std::string::npos) << j.body;
  EXPECT_EQ(j.body.find("length"), std::string::npos) << j.body;
}

TEST_F(AdapterLifecycle, AFolderSwappedForASymlinkAfterEvictionIsNotServed) {
  auto s = start(/*max_loaded=*/2);
  testutil::copy_dir(bundled("attn-r8"), (root_ / "victim").string());
  for (const char* n : {"o1", "o2"}) testutil::copy_dir(bundled("full-r16"), (root_ / n).string());
  ASSERT_EQ(load(*s, "victim", root_ / "victim").status, 200);
  ASSERT_EQ(load(*s, "o1", root_ / "o1").status, 200);
  ASSERT_EQ(load(*s, "o2", root_ / "o2").status, 200);  // the host cap drops "victim"
  testutil::copy_dir(bundled("full-r16"), (outside_ / "evil").string());
  fs::rename(root_ / "victim", root_ / "victim.old");
  fs::create_symlink(outside_ / "evil", root_ / "victim");
  int status = 0;
  const auto j = complete(*s, "victim", "", &status);
  EXPECT_EQ(status, 400) << j.dump();
  EXPECT_NE(j.dump().find("outside --lora-root"), std::string::npos) << j.dump();
}

TEST_F(AdapterLifecycle, ChangedFilesAfterEvictionGetANewIdentity) {
  auto s = start(/*max_loaded=*/2);
  testutil::copy_dir(bundled("attn-r8"), (root_ / "chg").string());
  for (const char* n : {"o1", "o2"}) testutil::copy_dir(bundled("attn-r8"), (root_ / n).string());
  ASSERT_EQ(load(*s, "chg", root_ / "chg").status, 200);
  const auto first = complete(*s, "chg");
  const auto second = complete(*s, "chg");
  EXPECT_GT(cached(second), 0) << "the prefix cache should serve the repeated prompt";
  ASSERT_EQ(load(*s, "o1", root_ / "o1").status, 200);
  ASSERT_EQ(load(*s, "o2", root_ / "o2").status, 200);  // evicts "chg"
  // New contents behind the same path: a different adapter's weights.
  fs::remove_all(root_ / "chg");
  testutil::copy_dir(bundled("full-r16"), (root_ / "chg").string());
  const auto after = complete(*s, "chg");
  EXPECT_EQ(cached(after), 0) << "KV computed with the old weights was reused";
  EXPECT_EQ(tokens(after), tokens(complete(*s, "full-r16")));
}

TEST_F(AdapterLifecycle, AFifoAsWeightsFailsAtOnce) {
  auto s = start();
  const fs::path dir = root_ / "fifo";
  fs::create_directories(dir);
  fs::copy_file(fs::path(bundled("attn-r8")) / "adapter_config.json", dir / "adapter_config.json");
  ASSERT_EQ(::mkfifo((dir / "adapter_model.safetensors").c_str(), 0600), 0);
  std::atomic<bool> done{false};
  std::thread traffic([&] {
    while (!done.load()) {
      int st = 0;
      complete(*s, "attn-r8", "", &st);
      EXPECT_EQ(st, 200);
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = load(*s, "fifo", dir);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("not a regular file"), std::string::npos) << r.body;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  done.store(true);
  traffic.join();
}

TEST_F(AdapterLifecycle, APathologicalRankPatternFailsFast) {
  auto s = start();
  const fs::path dir = root_ / "regex";
  testutil::copy_dir(bundled("attn-r8"), dir.string());
  edit_config(dir, [](nlohmann::json& j) { j["rank_pattern"] = {{"(.*.*.*.*.*.*.*.*)*x_proj", 8}}; });
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = load(*s, "regex", dir);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("too costly"), std::string::npos) << r.body;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
}

TEST_F(AdapterLifecycle, AlphaIsValidatedAfterScaling) {
  auto s = start();
  const fs::path dir = root_ / "alpha";
  testutil::copy_dir(bundled("attn-r8"), dir.string());
  edit_config(dir, [](nlohmann::json& j) { j["lora_alpha"] = 1e39; });
  const auto r = load(*s, "alpha", dir);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("the LoRA scale"), std::string::npos) << r.body;
}

TEST_F(AdapterLifecycle, AFailedInPlaceReloadKeepsTheOldVersionServing) {
  auto s = start();
  testutil::copy_dir(bundled("attn-r8"), (root_ / "v1").string());
  testutil::copy_dir(bundled("attn-r8"), (root_ / "broken").string());
  edit_config(root_ / "broken", [](nlohmann::json& j) { j["use_dora"] = true; });
  ASSERT_EQ(load(*s, "ip", root_ / "v1").status, 200);
  const auto before = tokens(complete(*s, "ip"));
  EXPECT_EQ(load(*s, "ip", root_ / "broken", /*inplace=*/true).status, 400);
  int status = 0;
  const auto after = complete(*s, "ip", "", &status);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(tokens(after), before);
}

TEST_F(AdapterLifecycle, InPlaceReloadsUnderTrafficNeverAnswer404) {
  auto s = start();
  testutil::copy_dir(bundled("attn-r8"), (root_ / "a").string());
  testutil::copy_dir(bundled("full-r16"), (root_ / "b").string());
  ASSERT_EQ(load(*s, "live", root_ / "a").status, 200);
  const auto ref_a = tokens(complete(*s, "attn-r8"));
  const auto ref_b = tokens(complete(*s, "full-r16"));
  std::atomic<bool> done{false};
  std::atomic<int> requests{0}, not_found{0}, wrong{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 3; ++t)
    clients.emplace_back([&] {
      while (!done.load()) {
        int st = 0;
        const auto j = complete(*s, "live", "", &st);
        ++requests;
        if (st == 404) ++not_found;
        else if (st != 200 || (tokens(j) != ref_a && tokens(j) != ref_b)) ++wrong;
      }
    });
  for (int i = 0; i < 12; ++i) EXPECT_EQ(load(*s, "live", root_ / (i % 2 ? "a" : "b"), true).status, 200);
  done.store(true);
  for (auto& c : clients) c.join();
  EXPECT_GT(requests.load(), 0);
  EXPECT_EQ(not_found.load(), 0);
  EXPECT_EQ(wrong.load(), 0);

}

TEST_F(AdapterLifecycle, CacheSaltSeparatesPrefixCacheEntries) {
  auto s = start();
  const std::string base = "tiny-qwen3moe";
  complete(*s, base, R"(, "cache_salt": "tenant-1")");
  EXPECT_GT(cached(complete(*s, base, R"(, "cache_salt": "tenant-1")")), 0);
  EXPECT_EQ(cached(complete(*s, base, R"(, "cache_salt": "tenant-2")")), 0) << "tenant-2 saw tenant-1's prefix";
  EXPECT_EQ(cached(complete(*s, base)), 0) << "an unsalted request saw a salted prefix";

  // Adapter requests too: the salt is part of the key next to the adapter's version.
  fs::copy(bundled("attn-r8"), root_ / "a8", fs::copy_options::recursive);
  ASSERT_EQ(load(*s, "a8", root_ / "a8").status, 200);
  complete(*s, "a8", R"(, "cache_salt": "tenant-1")");
  EXPECT_GT(cached(complete(*s, "a8", R"(, "cache_salt": "tenant-1")")), 0);
  EXPECT_EQ(cached(complete(*s, "a8", R"(, "cache_salt": "tenant-2")")), 0) << "tenant-2 saw tenant-1's adapter prefix";
  EXPECT_EQ(cached(complete(*s, "a8")), 0) << "an unsalted adapter request saw a salted prefix";
}

}  // namespace
}  // namespace moelora::server::testing
