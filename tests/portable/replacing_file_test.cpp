// ReplacingFile (include/devbridge/replacing_file.hpp): whole or not at all,
// links written through, FIFOs and devices never replaced, permissions kept.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "devbridge/error.hpp"
#include "devbridge/replacing_file.hpp"

namespace {

namespace fs = std::filesystem;
using devbridge::Error;
using devbridge::ErrorKind;
using devbridge::ReplacingFile;

class ReplacingFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("devbridge-replacing-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string read(const fs::path& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  static void put(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }
  // Every name in the directory: no temporary left behind.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& entry : fs::directory_iterator(dir_)) out.push_back(entry.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  fs::path dir_;
};

TEST_F(ReplacingFileTest, ReplacesWholeOnCommitAndLeavesTheOldFileWhenDroppedUncommitted) {
  const auto path = dir_ / "a.json";
  put(path, "old");
  {
    ReplacingFile file(path.string());
    file.write("new, not committed");
    EXPECT_EQ(read(path), "old");
  }
  EXPECT_EQ(read(path), "old");
  EXPECT_EQ(names(), std::vector<std::string>{"a.json"});
  ReplacingFile file(path.string());
  file.write("new");
  file.commit(ReplacingFile::Durability::Synced);
  EXPECT_EQ(read(path), "new");
  EXPECT_EQ(names(), std::vector<std::string>{"a.json"});
}

TEST_F(ReplacingFileTest, WritesAtOffsetsAndKeepsTheReplacedFilesPermissions) {
  const auto path = dir_ / "m.safetensors";
  put(path, "old");
  ::chmod(path.c_str(), 0640);
  ReplacingFile file(path.string(), ReplacingFile::NotRegular::Refuse);
  const std::string tail = "world", head = "hello ";
  file.write_at(head.size(), std::as_bytes(std::span(tail)));
  file.write_at(0, std::as_bytes(std::span(head)));
  file.commit(ReplacingFile::Durability::Synced);
  EXPECT_EQ(read(path), "hello world");
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
}

TEST_F(ReplacingFileTest, ALinkIsWrittenThroughAndStaysALink) {
  fs::create_directories(dir_ / "real");
  put(dir_ / "real" / "model", "old");
  fs::create_symlink("real/model", dir_ / "link");
  fs::create_symlink("real/new", dir_ / "dangling");
  for (const char* name : {"link", "dangling"}) {
    ReplacingFile file((dir_ / name).string(), ReplacingFile::NotRegular::Refuse);
    file.write(std::string("via ") + name);
    file.commit(ReplacingFile::Durability::Synced);
    EXPECT_TRUE(fs::is_symlink(dir_ / name)) << name;
  }
  EXPECT_EQ(read(dir_ / "real" / "model"), "via link");
  EXPECT_EQ(read(dir_ / "real" / "new"), "via dangling");
  EXPECT_EQ(names(), (std::vector<std::string>{"dangling", "link", "real"}));
}

TEST_F(ReplacingFileTest, AFifoIsWrittenInPlaceOrRefusedNeverReplaced) {
  const auto fifo = dir_ / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    ReplacingFile refused(fifo.string(), ReplacingFile::NotRegular::Refuse);
    FAIL() << "a FIFO was taken for a file replaced at offsets";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unavailable);
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  std::string got;
  std::thread reader([&] { got = read(fifo); });
  {
    ReplacingFile file(fifo.string(), ReplacingFile::NotRegular::WriteInPlace);
    EXPECT_TRUE(file.temporary().empty());
    file.write("through the pipe");
    file.commit(ReplacingFile::Durability::Renamed);
  }
  reader.join();
  EXPECT_EQ(got, "through the pipe");
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

TEST_F(ReplacingFileTest, ANameNearTheFileSystemsLimitStillGetsATemporary) {
  const auto path = dir_ / std::string(250, 'n');
  ReplacingFile file(path.string());
  EXPECT_LE(fs::path(file.temporary()).filename().string().size(), 255u);
  file.write("long");
  file.commit(ReplacingFile::Durability::Renamed);
  EXPECT_EQ(read(path), "long");
}

TEST_F(ReplacingFileTest, FailuresNameThePathAndTheReason) {
  const auto expect_refused = [](const std::string& path, const std::string& reason) {
    try {
      ReplacingFile file(path);
      FAIL() << path << " was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Unavailable);
      const std::string what = e.what();
      EXPECT_NE(what.find("cannot write '" + path + "'"), std::string::npos) << what;
      EXPECT_NE(what.find(reason), std::string::npos) << what;
    }
  };
  expect_refused(dir_.string(), "Is a directory");
  expect_refused((dir_ / "missing" / "x").string(), "No such file or directory");
}

}  // namespace
