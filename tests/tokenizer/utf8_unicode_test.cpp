// UTF-8 repair (maximal subparts), normalization forms and Python case mappings.
#include <gtest/gtest.h>

#include "tokenizer/python_str.h"
#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"

namespace moelora {
namespace {

TEST(Utf8, ValidTextIsUnchanged) {
  const std::string text = "a é 中 😀 \x7f";
  EXPECT_TRUE(utf8::is_valid(text));
  EXPECT_EQ(utf8::sanitize(text), text);
}

// The example of Unicode §3.9 (Table 3-8): each maximal subpart becomes one U+FFFD.
TEST(Utf8, IllFormedSequencesBecomeOneReplacementPerMaximalSubpart) {
  const std::string bytes = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  EXPECT_FALSE(utf8::is_valid(bytes));
  EXPECT_EQ(utf8::sanitize(bytes), "a\uFFFD\uFFFD\uFFFDb\uFFFDc\uFFFD\uFFFDd");
}

TEST(Utf8, SurrogatesOverlongsAndOutOfRangeAreRejected) {
  EXPECT_EQ(utf8::sanitize("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");  // a lone surrogate as WTF-8
  EXPECT_EQ(utf8::sanitize("\xC0\xAF"), "\uFFFD\uFFFD");            // overlong '/'
  EXPECT_EQ(utf8::sanitize("\xE0\x80\xAF"), "\uFFFD\uFFFD\uFFFD");  // overlong, 3 bytes
  EXPECT_EQ(utf8::sanitize("\xF4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD\uFFFD");  // past U+10FFFF
  EXPECT_EQ(utf8::sanitize("\xFF\xFE"), "\uFFFD\uFFFD");
  EXPECT_EQ(utf8::sanitize("x\xE4\xBD"), "x\uFFFD");  // truncated at the end: one replacement
  EXPECT_EQ(utf8::sanitize("\xE4\xBD\xE4\xBD\xA0"), "\uFFFD你");
}

TEST(Utf8, IncompleteTailIsOnlyAValidPrefix) {
  EXPECT_EQ(utf8::incomplete_tail_length(""), 0u);
  EXPECT_EQ(utf8::incomplete_tail_length("abc"), 0u);
  EXPECT_EQ(utf8::incomplete_tail_length("a\xE4"), 1u);
  EXPECT_EQ(utf8::incomplete_tail_length("a\xE4\xBD"), 2u);
  EXPECT_EQ(utf8::incomplete_tail_length("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(utf8::incomplete_tail_length("\xF0\x9F\x98\x80"), 0u);  // complete
  EXPECT_EQ(utf8::incomplete_tail_length("\xED\xA0"), 0u);          // can never complete
  EXPECT_EQ(utf8::incomplete_tail_length("\x80\x80"), 0u);
}

TEST(Utf8, CodePointRoundTrip) {
  const std::string text = "aé中😀";
  EXPECT_EQ(utf8::to_code_points(text), U"aé中😀");
  EXPECT_EQ(utf8::from_code_points(U"aé中😀"), text);
  std::string out;
  utf8::append(out, 0xD800);  // not a scalar value
  EXPECT_EQ(out, "\uFFFD");
}

TEST(Unicode, NfcComposesAndReorders) {
  EXPECT_EQ(unicode::nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(unicode::nfc("\u1100\u1161\u11a8"), "\uac01");                 // Hangul L V T
  EXPECT_EQ(unicode::nfc("\uac00\u11a8"), "\uac01");                       // LV + T
  EXPECT_EQ(unicode::nfc("q\u0307\u0323"), "q\u0323\u0307");               // canonical order
  EXPECT_EQ(unicode::nfc("a\u0323\u0302"), "\u1ead");                      // ậ
  EXPECT_EQ(unicode::nfc("\u212b"), "\u00c5");                             // Å (Angstrom sign)
  EXPECT_EQ(unicode::nfc("\u2126"), "\u03a9");                             // Ω (singleton)
  EXPECT_EQ(unicode::nfc("\u0958"), "\u0915\u093c");                       // composition exclusion
  EXPECT_EQ(unicode::nfc("Xin cha\u0300o"), "Xin ch\u00e0o");
  EXPECT_EQ(unicode::nfc("\u0301e"), "\u0301e");                           // a leading mark stays
  const std::string plain = "plain ASCII and 中文 and 😀";
  EXPECT_EQ(unicode::nfc(plain), plain);
}

TEST(Unicode, NfdDecomposes) {
  EXPECT_EQ(unicode::nfd("\u00e9"), "e\u0301");
  EXPECT_EQ(unicode::nfd("\uac01"), "\u1100\u1161\u11a8");
  EXPECT_EQ(unicode::nfd("\u1ead"), "a\u0323\u0302");
}

TEST(Unicode, WhiteSpaceSetsOfEachLibrary) {
  EXPECT_TRUE(unicode::is_white_space(0x85));
  EXPECT_FALSE(unicode::is_white_space(0xFEFF));
  EXPECT_FALSE(unicode::is_white_space(0x180E));
  EXPECT_FALSE(unicode::is_ecmascript_space(0x85));
  EXPECT_TRUE(unicode::is_ecmascript_space(0xFEFF));
  EXPECT_TRUE(unicode::is_python_space(0x1C));
  EXPECT_TRUE(unicode::is_python_space(0x3000));
}

TEST(PythonStr, CaseMappingsAreFull) {
  EXPECT_EQ(pystr::upper("straße"), "STRASSE");
  EXPECT_EQ(pystr::lower("İ"), "i\u0307");
  EXPECT_EQ(pystr::lower("ΣΑΣ"), "σας");  // final sigma
  EXPECT_EQ(pystr::title("hello wORLD ǆ"), "Hello World ǅ");
  EXPECT_EQ(pystr::capitalize("hELLO"), "Hello");
}

TEST(PythonStr, SplitAndStripFollowPython) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pystr::split("  a  b ", std::nullopt, -1), (V{"a", "b"}));
  EXPECT_EQ(pystr::split("a,b,,c", std::string(","), -1), (V{"a", "b", "", "c"}));
  EXPECT_EQ(pystr::split("a b c", std::string(" "), 1), (V{"a", "b c"}));
  EXPECT_EQ(pystr::split("  a b c  ", std::nullopt, 1), (V{"a", "b c"}));
  EXPECT_EQ(pystr::rsplit("a b c", std::string(" "), 1), (V{"a b", "c"}));
  EXPECT_EQ(pystr::rsplit("  a b c  ", std::nullopt, 1), (V{"a b", "c"}));
  EXPECT_EQ(pystr::splitlines("a\nb\r\nc\rd\u2028e", false), (V{"a", "b", "c", "d", "e"}));
  EXPECT_EQ(pystr::strip("\u3000 x \n", std::nullopt, pystr::StripSide::kBoth), "x");
  EXPECT_EQ(pystr::strip("\n\nx\n", std::string("\n"), pystr::StripSide::kLeft), "x\n");
  EXPECT_EQ(pystr::replace("aaa", "a", "b", 2), "bba");
  EXPECT_EQ(pystr::replace("ab", "", "-", -1), "-a-b-");
  EXPECT_EQ(pystr::find("héllo", "l"), 2);
  EXPECT_EQ(pystr::length("héllo😀"), 6u);
}

}  // namespace
}  // namespace moelora
