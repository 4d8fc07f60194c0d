// The typed JSON field readers every config parser goes through.
#include <gtest/gtest.h>

#include "io/json_util.h"

namespace moelora {
namespace {

Result<std::optional<int64_t>> int_of(const std::string& value) {
  static Json j;
  j = Json::parse("{\"n\": " + value + "}");
  return json_opt_int(j, "n", "test.json");
}

TEST(JsonOptInt, IntegersAndIntegralFloats) {
  EXPECT_EQ(int_of("7").value(), std::optional<int64_t>(7));
  EXPECT_EQ(int_of("-3").value(), std::optional<int64_t>(-3));
  EXPECT_EQ(int_of("128.0").value(), std::optional<int64_t>(128));
  EXPECT_EQ(int_of("null").value(), std::optional<int64_t>());
}

// Found by fuzz_json_configs (UBSan): a float far outside int64 was cast before being compared.
TEST(JsonOptInt, FloatsOutsideInt64AreErrorsNotCasts) {
  for (const char* v : {"2.11111e+46", "-1e300", "9223372036854775808.0", "1.5", "\"12\""}) {
    auto r = int_of(v);
    ASSERT_FALSE(r.ok()) << v;
    EXPECT_NE(r.status().message().find("field \"n\" must be an integer"), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(int_of("-9223372036854775808.0").value(), std::optional<int64_t>(INT64_MIN));
}

}  // namespace
}  // namespace moelora
