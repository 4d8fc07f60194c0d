// safetensors validation: every malformed file gets its own clear error, never a crash.
#include <gtest/gtest.h>

#include "io/checkpoint.h"
#include "io/json_util.h"
#include "io/safetensors.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

using testutil::make_raw_safetensors;

Result<std::shared_ptr<SafetensorsFile>> parse(const std::string& bytes) {
  return SafetensorsFile::parse(std::make_shared<const std::string>(bytes), "test.safetensors");
}

std::string error_of(const std::string& bytes) {
  auto r = parse(bytes);
  EXPECT_FALSE(r.ok()) << "accepted a malformed file";
  return r.ok() ? "" : r.status().message();
}

const std::string kGood = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}})";

TEST(Safetensors, ReadsAValidFile) {
  std::string data(12, '\0');
  const float v[2] = {1.5f, -2.0f};
  std::memcpy(data.data(), v, 8);
  auto f = parse(make_raw_safetensors(kGood, data));
  ASSERT_TRUE(f.ok()) << f.status().message();
  auto a = (*f)->tensor("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dtype(), DType::kF32);
  EXPECT_EQ(a->ptr<float>()[1], -2.0f);
  EXPECT_EQ((*f)->tensor("b")->shape(), (std::vector<int64_t>{1, 2}));
  EXPECT_FALSE((*f)->tensor("c").ok());
}

TEST(Safetensors, AcceptsSpacePaddedHeaderAndMetadata) {
  std::string h = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})";
  h += "       ";
  auto f = parse(make_raw_safetensors(h, std::string(4, '\0')));
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
}

TEST(Safetensors, TooShortForTheLengthPrefix) {
  EXPECT_NE(error_of("abc").find("no header length"), std::string::npos);
}

TEST(Safetensors, HeaderLengthPastTheFile) {
  std::string bytes = make_raw_safetensors(kGood, std::string(12, '\0'));
  bytes.resize(40);  // truncated inside the header
  EXPECT_NE(error_of(bytes).find("runs past the end"), std::string::npos);
}

TEST(Safetensors, HugeHeaderLengthIsRefusedWithoutAllocating) {
  std::string bytes(8, '\0');
  const uint64_t n = 1ull << 40;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  bytes += "{}";
  EXPECT_NE(error_of(bytes).find("over the 100000000 byte limit"), std::string::npos);
}

TEST(Safetensors, HeaderNotAnObject) {
  EXPECT_NE(error_of(make_raw_safetensors("[1,2]", "")).find("does not begin with '{'"), std::string::npos);
}

TEST(Safetensors, InvalidJson) {
  EXPECT_NE(error_of(make_raw_safetensors("{\"a\": {", "")).find("not valid JSON"), std::string::npos);
}

TEST(Safetensors, GarbledHeaderBytes) {
  std::string h = kGood;
  h[10] = '\xff';
  h[11] = '\xfe';
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(12, '\0'))).find("JSON"), std::string::npos);
}

TEST(Safetensors, UnknownDtype) {
  const std::string h = R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(8, '\0'))).find("dtype C64 which moelora does not read"),
            std::string::npos);
}

TEST(Safetensors, ByteSizeDisagreesWithShapeAndDtype) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(8, '\0'))).find("is 8 bytes in the file but F32 x [3] needs 12"),
            std::string::npos);
}

TEST(Safetensors, OffsetsOutsideTheDataArea) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(4, '\0'))).find("truncated file or trailing bytes"),
            std::string::npos);
}

TEST(Safetensors, TrailingBytes) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(9, '\0'))).find("data area holds 9"), std::string::npos);
}

TEST(Safetensors, OverlappingTensors) {
  const std::string h =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(12, '\0'))).find("overlap or leave a gap"), std::string::npos);
}

TEST(Safetensors, GapBetweenTensors) {
  const std::string h =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(12, '\0'))).find("starts at byte 8"), std::string::npos);
}

TEST(Safetensors, EndBeforeBegin) {
  const std::string h = R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(4, '\0'))).find("end before they begin"), std::string::npos);
}

TEST(Safetensors, DuplicateNames) {
  const std::string h =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(8, '\0'))).find("duplicate key \"a\""), std::string::npos);
}

TEST(Safetensors, NegativeOrNonIntegerShape) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(4, '\0'))).find("not a non-negative integer"),
            std::string::npos);
  const std::string h2 = R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h2, std::string(4, '\0'))).find("not a non-negative integer"),
            std::string::npos);
}

TEST(Safetensors, ShapeProductOverflow) {
  const std::string h =
      R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(4, '\0'))).find("overflows"), std::string::npos);
}

TEST(Safetensors, EntryMissingFields) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1]}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, std::string(4, '\0'))).find("two data_offsets"), std::string::npos);
}

TEST(Safetensors, MetadataValuesMustBeStrings) {
  const std::string h = R"({"__metadata__":{"n":1}})";
  EXPECT_NE(error_of(make_raw_safetensors(h, "")).find("__metadata__ value of 'n' is not a string"), std::string::npos);
}

TEST(Safetensors, DeepNestingIsRefused) {
  std::string h = "{\"a\":";
  for (int i = 0; i < 200; ++i) h += "[";
  for (int i = 0; i < 200; ++i) h += "]";
  h += "}";
  EXPECT_NE(error_of(make_raw_safetensors(h, "")).find("nesting deeper"), std::string::npos);
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto r = SafetensorsFile::open("/nonexistent/model.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kNotFound);
}

TEST(Checkpoint, ShardedIndexResolvesEveryTensor) {
  testutil::TempDir dir;
  testutil::write_file(dir.sub("a.safetensors"),
                       testutil::make_safetensors({{"x", testutil::f32_tensor({2}, {1, 2})}}));
  testutil::write_file(dir.sub("b.safetensors"),
                       testutil::make_safetensors({{"y", testutil::f32_tensor({1}, {3})}}));
  testutil::write_file(dir.sub("model.safetensors.index.json"),
                       R"({"metadata":{},"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  auto ck = Checkpoint::open(dir.str());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->tensor("y")->ptr<float>()[0], 3.0f);
  EXPECT_EQ(ck->names().size(), 2u);
}

TEST(Checkpoint, IndexNamingAMissingTensorOrUnsafeShard) {
  testutil::TempDir dir;
  testutil::write_file(dir.sub("a.safetensors"), testutil::make_safetensors({{"x", testutil::f32_tensor({1}, {1})}}));
  testutil::write_file(dir.sub("model.safetensors.index.json"), R"({"weight_map":{"z":"a.safetensors"}})");
  auto ck = Checkpoint::open(dir.str());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("has no such tensor"), std::string::npos);
  testutil::write_file(dir.sub("model.safetensors.index.json"), R"({"weight_map":{"x":"../a.safetensors"}})");
  ck = Checkpoint::open(dir.str());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("plain file name"), std::string::npos);
}

TEST(Checkpoint, PickleOnlyIsRefused) {
  testutil::TempDir dir;
  testutil::write_file(dir.sub("pytorch_model.bin"), "not really a pickle");
  auto ck = Checkpoint::open(dir.str());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("pickle checkpoints are code"), std::string::npos);
}

TEST(Json, StrictParserRejectsDuplicatesAtAnyDepth) {
  auto r = parse_json_strict(R"({"a":{"b":1,"b":2}})", "x.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("duplicate key \"b\""), std::string::npos);
  EXPECT_TRUE(parse_json_strict(R"({"a":{"b":1},"c":{"b":2}})", "x.json").ok());
}

}  // namespace
}  // namespace moelora
