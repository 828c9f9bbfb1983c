// The checkpoint header reader: each defect it fixed, as a file that was
// accepted, hung or took quadratic time before.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <zlib.h>

#include "devbridge/checkpoint_file.hpp"

namespace devbridge::checkpoint {
namespace {

// A file: the 8-byte little-endian length, the header, then `data` bytes.
std::string file_of(const std::string& header, std::size_t data) {
  std::string out(8, '\0');
  std::uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + header + std::string(data, '\0');
}

const std::string kOne = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";

std::string refusal(const std::string& header, std::size_t data = 4) {
  try {
    parse_checkpoint(file_of(header, data), "'f'");
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "(accepted)";
}

#define EXPECT_REFUSED(header, words) EXPECT_NE(refusal(header).find(words), std::string::npos) << refusal(header)

// The writer (Python's checkpoint) names dtypes through this table too: every
// dtype has a name, and it reads back as the same dtype.
TEST(CheckpointHeader, EveryDTypeHasASafetensorsNameThatReadsBack) {
  for (const auto& info : all_dtypes()) {
    const auto name = safetensors_name(info.dtype);
    ASSERT_FALSE(name.empty()) << info.name;
    DType back{};
    ASSERT_TRUE(from_safetensors_name(name, back)) << name;
    EXPECT_EQ(back, info.dtype) << name;
  }
}

TEST(CheckpointHeader, AQuotedNameStaysValidUtf8WhateverItsBytes) {
  // UTF-8 names as they are; a byte of no sequence, and controls, escaped.
  EXPECT_EQ(checkpoint::quoted("b\xc3\xa9ta"), "'b\xc3\xa9ta'");
  EXPECT_EQ(checkpoint::quoted("x\xff\xfey"), "'x\\xff\\xfey'");
  EXPECT_EQ(checkpoint::quoted("\xc3"), "'\\xc3'");  // a sequence cut short
  EXPECT_EQ(checkpoint::quoted(std::string("a\0b", 3)), "'a\\x00b'");
  EXPECT_TRUE(valid_utf8(checkpoint::quoted("\xed\xa0\x80\xf8\x88\x80\x80\x80")));
}

TEST(CheckpointHeader, AGoodHeaderParses) {
  const Header h = parse_checkpoint(file_of(R"({"__metadata__":{"k":"v"},"b":{"dtype":"U8","shape":[2],)"
                                            R"("data_offsets":[4,6]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                            6),
                                    "'f'");
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "a");  // file order
  EXPECT_EQ(h.tensors[1].dtype, DType::UInt8);
  EXPECT_EQ(h.data_bytes(), 6u);
  ASSERT_NE(h.find_metadata("k"), nullptr);
  EXPECT_EQ(*h.find_metadata("k"), "v");
  EXPECT_FALSE(h.devbridge);
}

// A devbridge checkpoint of a later format_version is refused, naming it:
// read as version 1 it could be misread. Without the key it is version 1.
TEST(CheckpointHeader, AFormatVersionThisReaderDoesNotKnowIsRefused) {
  const std::string meta = R"({"__metadata__":{"format":"devbridge-checkpoint",)";
  const std::string checksum = R"("checksum":"crc32:00000000"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_REFUSED(meta + R"("format_version":"2",)" + checksum, "format_version '2', which this devbridge does not read");
  EXPECT_EQ(refusal(meta + R"("format_version":"1",)" + checksum), "(accepted)");
  EXPECT_EQ(refusal(meta + checksum), "(accepted)");
  // Not devbridge's: the key is its writer's own.
  EXPECT_EQ(refusal(R"({"__metadata__":{"format_version":"9"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})"),
            "(accepted)");
}

// An empty tensor or a dtype devbridge lacks (safetensors' F8_E8M0) is kept,
// marked with why restore cannot take it, so the file's other tensors stay
// restorable and inspectable; it had refused the whole file.
TEST(CheckpointHeader, AnEmptyTensorOrAnUnknownDTypeIsKeptMarkedNotRefused) {
  const Header h = parse_checkpoint(
      file_of(R"({"e":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},)"
              R"("s":{"dtype":"F8_E8M0","shape":[8],"data_offsets":[0,8]},)"
              R"("w":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
              12),
      "'f'");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "e");
  EXPECT_NE(h.tensors[0].unrestorable.find("'f': tensor 'e': shape (0, 4) is empty"), std::string::npos)
      << h.tensors[0].unrestorable;
  EXPECT_EQ(h.tensors[1].safetensors_dtype, "F8_E8M0");
  EXPECT_NE(h.tensors[1].unrestorable.find("'f': tensor 's': dtype 'F8_E8M0' is not one devbridge holds"),
            std::string::npos)
      << h.tensors[1].unrestorable;
  EXPECT_TRUE(h.tensors[2].unrestorable.empty());
  // The dtype is empty exactly when devbridge lacks the file's: an empty tensor keeps its own.
  EXPECT_EQ(h.tensors[0].dtype, std::optional(DType::Float32));
  EXPECT_EQ(h.tensors[1].dtype, std::nullopt);
  EXPECT_EQ(h.tensors[2].dtype, std::optional(DType::Float32));
  // Its data_offsets still tile the data section.
  EXPECT_REFUSED(R"({"s":{"dtype":"F8_E8M0","shape":[8],"data_offsets":[0,8]}})", "8 bytes of data, the file holds 4");
}

// The names of what `selection` chooses of `h`, or the refusal's words.
std::string chosen_of(const Header& h, const TensorSelection& selection) {
  try {
    std::string names;
    for (const TensorEntry* entry : select_tensors(h.tensors, selection, "'f'")) names += entry->name + " ";
    return names;
  } catch (const CheckpointError& e) {
    return e.what();
  }
}

// The one selection of every front end (Python's restore, the C ABI's
// devbridge_restore_selected): names, prefix and a predicate all apply, in
// file order; a name the file lacks is refused, and an unrestorable tensor
// only when it is chosen.
TEST(CheckpointSelection, NamesPrefixAndPredicateChooseInFileOrderAndRefuseOnlyWhatIsChosen) {
  const Header h = parse_checkpoint(
      file_of(R"({"e":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},)"
              R"("w.b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
              R"("w.a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
              8),
      "'f'");
  using Names = std::vector<std::string>;
  EXPECT_EQ(chosen_of(h, {Names{"w.b", "w.a"}}), "w.a w.b ");  // the file's order, not the caller's
  EXPECT_EQ(chosen_of(h, {std::nullopt, "w."}), "w.a w.b ");
  EXPECT_EQ(chosen_of(h, {Names{"w.b", "w.a"}, "w.b"}), "w.b ");
  EXPECT_EQ(chosen_of(h, {Names{}}), "");  // an empty list chooses none
  EXPECT_EQ(chosen_of(h, {Names{"w.a"}, "x"}), "");
  std::vector<std::string> asked;
  const auto odd = [&](const std::string& name) {
    asked.push_back(name);
    return name == "w.b";
  };
  EXPECT_EQ(chosen_of(h, {std::nullopt, "w.", odd}), "w.b ");
  EXPECT_EQ(asked, (Names{"w.a", "w.b"}));  // asked only of what the others pass
  // Missing names: by name, each once, the first five.
  EXPECT_EQ(chosen_of(h, {Names{"z", "w.a", "y", "y"}}), "'f' holds no tensor named 'y', 'z'; nothing was restored");
  EXPECT_EQ(chosen_of(h, {Names{"1", "2", "3", "4", "5", "6"}}),
            "'f' holds no tensor named '1', '2', '3', '4', '5' and more; nothing was restored");
  // Required names (Python's rows=) are refused when missing, as names are, but choose nothing themselves.
  EXPECT_EQ(chosen_of(h, {std::nullopt, "w.b", {}, Names{"w.a"}}), "w.b ");
  EXPECT_EQ(chosen_of(h, {Names{"w.a", "q"}, "", {}, Names{"p", "w.a"}}),
            "'f' holds no tensor named 'p', 'q'; nothing was restored");
  // The empty tensor: refused when chosen (every tensor, by name, by prefix), not otherwise.
  for (const TensorSelection& selection : {TensorSelection{}, TensorSelection{Names{"e", "w.a"}},
                                           TensorSelection{std::nullopt, "e"}}) {
    EXPECT_EQ(chosen_of(h, selection),
              "'f': tensor 'e': shape (0, 4) is empty, and a device allocation cannot be (devbridge cannot restore "
              "it); select the others by name or prefix; nothing was restored");
  }
}

// Hex digits in either case are the same checksum, recorded lowercase (as
// every devbridge digest is) so that comparisons need no case folding.
TEST(CheckpointHeader, AChecksumInUppercaseHexIsAcceptedAndLowercased) {
  const Header h = parse_checkpoint(
      file_of(R"({"__metadata__":{"format":"devbridge-checkpoint","checksum":"crc32:25601B8B"},)"
              R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
              4),
      "'f'");
  EXPECT_EQ(h.checksum, "crc32:25601b8b");
  EXPECT_REFUSED(R"({"__metadata__":{"format":"devbridge-checkpoint","checksum":"crc32:25601G8B"},)"
                 R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                 "without a valid checksum");
}

TEST(CheckpointHeader, WhitespacePaddingIsAcceptedAsTheSafetensorsPackageDoes) {
  EXPECT_EQ(refusal(" \n" + kOne + "   \t\r\n"), "(accepted)");
}

TEST(CheckpointHeader, ADTypeThatIsAListOrObjectIsRefused) {
  EXPECT_REFUSED(R"({"a":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}})", "tensor 'a': dtype [\"F32\"] is not one");
  EXPECT_REFUSED(R"({"a":{"dtype":{"x":1},"shape":[1],"data_offsets":[0,4]}})", "tensor 'a': dtype {\"x\":1} is not one");
}

TEST(CheckpointHeader, MetadataThatIsNoObjectIsRefused) {
  for (const char* value : {"[]", "false", "\"\"", "0", "{\"k\":1}"}) {
    EXPECT_REFUSED(std::string(R"({"__metadata__":)") + value + R"(,"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                   "__metadata__ is not a map of strings to strings");
  }
  EXPECT_EQ(refusal(R"({"__metadata__":null,"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})"), "(accepted)");
}

TEST(CheckpointHeader, RankPastTheMaximumIsRefused) {
  EXPECT_REFUSED(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}})", "9 dimensions, more than");
  EXPECT_EQ(refusal(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1],"data_offsets":[0,4]}})"), "(accepted)");
}

TEST(CheckpointHeader, TrailingGarbageAndAByteOrderMarkAreRefused) {
  EXPECT_REFUSED(kOne + std::string("\0garbage", 8), "trailing characters");
  EXPECT_REFUSED(kOne + std::string("\0", 1), "trailing characters");
  EXPECT_REFUSED(kOne + "{}", "trailing characters");
  EXPECT_REFUSED("\xEF\xBB\xBF" + kOne, "byte order mark");
}

TEST(CheckpointHeader, InvalidUtf8IsRefused) {
  EXPECT_REFUSED(R"({"a\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "surrogate");
  EXPECT_REFUSED(R"({"a\udc00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "surrogate");
  EXPECT_REFUSED("{\"a\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "invalid UTF-8");
  EXPECT_REFUSED("{\"a\xed\xa0\x80\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "invalid UTF-8");  // CESU
  EXPECT_REFUSED("{\"a\xc0\xaf\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "invalid UTF-8");  // overlong
  EXPECT_REFUSED(R"({"__metadata__":{"k":"\udfff"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "surrogate");
  // A surrogate pair is one valid code point.
  const Header h = parse_checkpoint(file_of(R"({"\ud83d\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4), "f");
  EXPECT_EQ(h.tensors[0].name, "\xF0\x9F\x98\x80");
}

TEST(CheckpointHeader, DuplicateNamesAreRefused) {
  EXPECT_REFUSED(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                 "tensor 'a' appears twice");
  EXPECT_REFUSED(R"({"__metadata__":{"k":"1","k":"2"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                 "__metadata__ is not a map");
  EXPECT_REFUSED(R"({"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "twice");
}

TEST(CheckpointHeader, DeepNestingIsRefusedWithoutExhaustingTheStack) {
  const std::string deep = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":)" + std::string(100000, '[') +
                           std::string(100000, ']') + "}}";
  EXPECT_REFUSED(deep, "nested deeper than 64");
}

TEST(CheckpointHeader, OffsetsThatWrapOverlapOrExceedAreRefused) {
  EXPECT_REFUSED(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,0]}})", "are not [begin, end]");
  EXPECT_REFUSED(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616]}})", "are not [begin, end]");
  EXPECT_REFUSED(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                 "overlap");
  EXPECT_REFUSED(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "truncated: its tensors need 8");
  EXPECT_REFUSED(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", "more than 2^64");
}

TEST(CheckpointHeader, FiftyThousandTensorsParseInLinearTime) {
  // The CLI's old reader took 24-160 s here; a linear one takes well under a second.
  constexpr int kTensors = 50000;
  std::string header = "{";
  for (int i = 0; i < kTensors; ++i) {
    if (i > 0) header += ',';
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[" + std::to_string(i) +
              "," + std::to_string(i + 1) + "]}";
  }
  header += '}';
  const Header h = parse_checkpoint(file_of(header, kTensors), "'f'");
  ASSERT_EQ(h.tensors.size(), static_cast<std::size_t>(kTensors));
  EXPECT_EQ(h.tensors.back().name, "t49999");
}

class CheckpointFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("devbridge-ckpt-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(CheckpointFileTest, AFifoIsRefusedWithoutBlocking) {
  const std::string fifo = (dir_ / "p").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    CheckpointFile::open(fifo);  // a plain open() would wait for a writer forever
    FAIL() << "a FIFO was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a regular file"), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointFileTest, ADirectoryAndACharacterDeviceAreRefused) {
  for (const std::string& path : {dir_.string(), std::string("/dev/zero")}) {
    try {
      CheckpointFile::open(path);
      FAIL() << path << " was accepted";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("is not a regular file"), std::string::npos) << e.what();
    }
  }
}

TEST_F(CheckpointFileTest, ARegularFileOpensAndItsDataReadsThroughTheSameDescriptor) {
  const std::string path = (dir_ / "x.safetensors").string();
  std::string bytes = file_of(kOne, 0) + std::string("\x01\x02\x03\x04", 4);
  std::ofstream(path, std::ios::binary) << bytes;
  CheckpointFile file = CheckpointFile::open(path);
  ASSERT_EQ(file.header().tensors.size(), 1u);
  EXPECT_EQ(::fcntl(file.fd(), F_GETFL) & O_NONBLOCK, 0);  // reads block again once it is known regular
  unsigned char data[4];
  std::filesystem::remove(path);  // the descriptor still reads the file that was checked
  file.read_at(file.header().data_start(), data, 4);
  EXPECT_EQ(data[3], 4);
  EXPECT_THROW(file.read_at(file.header().data_start() + 2, data, 4), CheckpointError);
}

// The one CRC-32 (ISA-L's where it loads, zlib's otherwise) is zlib's, in
// one call, in pieces, and with parts hashed apart and joined.
TEST(Crc32, IsZlibsInPiecesAndJoined) {
  std::string data(3 << 20, '\0');
  std::uint32_t state = 12345;
  for (auto& c : data) c = static_cast<char>((state = state * 1103515245u + 12345u) >> 24);
  const auto* bytes = reinterpret_cast<const unsigned char*>(data.data());
  const auto expected = static_cast<std::uint32_t>(::crc32(0, bytes, static_cast<uInt>(data.size())));
  Crc32 whole;
  whole.update(data.data(), data.size());
  EXPECT_EQ(whole.value(), expected);
  Crc32 pieces;
  for (std::size_t at = 0; at < data.size(); at += 4099)
    pieces.update(data.data() + at, std::min<std::size_t>(4099, data.size() - at));
  EXPECT_EQ(pieces.value(), expected);
  const std::size_t half = 1234567;
  Crc32 first, second;
  first.update(data.data(), half);
  second.update(data.data() + half, data.size() - half);
  EXPECT_EQ(Crc32::combine(first.value(), second.value(), data.size() - half), expected);
  EXPECT_EQ(Crc32::text_of(expected), whole.text());
}

}  // namespace
}  // namespace devbridge::checkpoint
