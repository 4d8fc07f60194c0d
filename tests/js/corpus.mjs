// A deterministic corpus of byte strings for the tokenizer oracle test: curated cases
// (multilingual text, emoji sequences, code, whitespace runs, numbers, contractions, special-token
// text) plus seeded random strings drawn from Unicode pools, invalid UTF-8 and lone surrogates.
//
// Every character drawn at random was assigned by Unicode 14.0, the version of PCRE2 10.42 (our
// regex engine) and Oniguruma 6.9.8 (Hugging Face tokenizers'); Node's newer Unicode would
// classify characters assigned later differently, which is a version skew, not a tokenizer bug.

// mulberry32: a small seeded PRNG, so the corpus is the same on every run.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const range = (first, last) => ({ first, last });

// Code point pools: [weight, ranges]. All assigned in Unicode <= 14 (or unassigned in every
// version: noncharacters, U+0378), see the header.
export const POOLS = {
  ascii_letters: [range(0x41, 0x5a), range(0x61, 0x7a)],
  ascii_digits: [range(0x30, 0x39)],
  ascii_punct: [range(0x21, 0x2f), range(0x3a, 0x40), range(0x5b, 0x60), range(0x7b, 0x7e)],
  ascii_space: [range(0x20, 0x20), range(0x09, 0x0a), range(0x0d, 0x0d)],
  controls: [range(0x00, 0x08), range(0x0b, 0x0c), range(0x0e, 0x1f), range(0x7f, 0x9f)],
  latin: [range(0xa0, 0x24f)],
  combining: [range(0x300, 0x36f)],
  greek_cyrillic: [range(0x391, 0x3a1), range(0x3a3, 0x3c9), range(0x400, 0x4ff)],
  hebrew_arabic: [range(0x5b0, 0x5bc), range(0x5d0, 0x5ea), range(0x621, 0x652), range(0x660, 0x669)],
  indic_thai: [range(0x905, 0x939), range(0x93e, 0x94d), range(0x966, 0x96f), range(0xe01, 0xe3a), range(0xe40, 0xe4e)],
  hangul: [range(0xac00, 0xd7a3), range(0x1100, 0x1112), range(0x1161, 0x1175), range(0x11a8, 0x11c2)],
  kana: [range(0x3041, 0x3096), range(0x30a1, 0x30fa), range(0x30fc, 0x30fc), range(0xff66, 0xff9d)],
  cjk: [range(0x4e00, 0x9fff), range(0x3400, 0x4dbf), range(0x20000, 0x2a6df), range(0x3000, 0x303f), range(0xff01, 0xff5e)],
  symbols: [range(0x2190, 0x21ff), range(0x2200, 0x22ff), range(0x2600, 0x26ff), range(0x2700, 0x27bf), range(0x20a0, 0x20bf),
            range(0x2070, 0x209c), range(0x2160, 0x2188), range(0x2460, 0x24ff), range(0x2010, 0x2027)],
  emoji: [range(0x1f300, 0x1f5ff), range(0x1f600, 0x1f64f), range(0x1f680, 0x1f6d7), range(0x1f910, 0x1f9ff),
          range(0x1f1e6, 0x1f1ff), range(0x1f3fb, 0x1f3ff), range(0xfe0e, 0xfe0f), range(0x200d, 0x200d), range(0x20e3, 0x20e3)],
  unicode_space: [range(0x85, 0x85), range(0xa0, 0xa0), range(0x1680, 0x1680), range(0x180e, 0x180e), range(0x2000, 0x200d),
                  range(0x2028, 0x202f), range(0x205f, 0x2060), range(0x3000, 0x3000), range(0xfeff, 0xfeff)],
  odd: [range(0xe000, 0xe0ff), range(0xfdd0, 0xfdef), range(0x378, 0x379), range(0xfffc, 0xfffd), range(0xe0020, 0xe007f)],
};

const POOL_WEIGHTS = {
  ascii_letters: 30, ascii_digits: 6, ascii_punct: 8, ascii_space: 10, controls: 1, latin: 4, combining: 3,
  greek_cyrillic: 4, hebrew_arabic: 3, indic_thai: 3, hangul: 3, kana: 3, cjk: 6, symbols: 3, emoji: 5,
  unicode_space: 3, odd: 1,
};

const CURATED = [
  // English, contractions, casing
  "Hello, world!", "Hello world", " Hello", "  Hello", "hello   world", "HELLO WORLD", "I'm here", "you're", "he's",
  "we've", "they'll", "I'd", "don't", "can't", "IT'S", "We'RE", "THEY'LL", "o'clock", "rock'n'roll", "'s", "''", "'",
  "it’s curly", "the 'quoted' word", "'ſ long s", "'S 'T 'RE 'VE 'M 'LL 'D", "The quick brown fox jumps over the lazy dog.",
  "Mr. O'Neil's dog's bone", "a'b'c'd", "x's'", "'''",
  // Numbers
  "1234567890", "3.14159", "1,000,000", "-42", "1e-10", "0x1F", "123456789012345678901234567890", "१२३४५", "٣٤٥٦",
  "１２３４", "²³¹", "½ ¾", "Ⅻ Ⅳ", "①②③", "v1.2.3-rc4", "2024-12-31T23:59:59Z", "$19.99", "€5", "100%", "#1", "a1b2c3",
  "0.000001", "12 345 678", "1\u00a0000",
  // Multilingual
  "你好，世界！", "我爱自然语言处理。", "日本語のテキストです。カタカナとひらがな。", "ｶﾀｶﾅ ﾊﾝｶｸ", "한국어 텍스트입니다.",
  "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới",
  "Xin cha\u0300o thê\u0301 giơ\u0301i", "e\u0301 e\u0300 e\u0302 a\u030a o\u0308", "\u1100\u1161\u11a8 \u1112\u1161\u11ab",
  "A\u0323\u0302 q\u0307\u0323", "\u0041\u030a\u0301", "Ω Å K ﬁ ǅ", "ǅungla", "İstanbul ıi", "straße STRASSE",
  "中文English混合text", "日本語とEnglishの混在", "龥龦鿿一", "\u9fa5\u9fa6\u9fff\u4e00\u3040\u309f\u30a0\u30ff",
  "Ελληνικά και русский", "ქართული ენა", "አማርኛ", "தமிழ் மொழி", "ꯃꯩꯇꯩ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙", "𠀀𠀁𪚥",
  // Emoji and sequences
  "😀😃😄", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏽‍💻", "🧑‍🤝‍🧑", "❤️‍🔥", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "1️⃣ #️⃣ *️⃣", "🇯🇵🇺🇸🇫🇷", "☺︎ ☺️",
  "Hello 👋 world 🌍!", "emoji:😀,text", "🤖🤖🤖🤖🤖", "👨🏻‍⚕️👩🏿‍🚀",
  // Whitespace runs
  " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n ", "\t\t  \n", "a  b", "a   b", "a\tb", "a\nb",
  "a \n b", "a\r\nb", "  leading", "trailing  ", "   both   ", "\n\n\nnewlines\n\n\n", "x\u00a0y", "x\u3000y",
  "x\u2003\u2003y", "x\u2028y", "x\u2029y", "x\u0085y", "x\ufeffy", "\ufeffBOM first", "x\u180ey", "x\u200by",
  "x \u00a0 y", "  \u3000  ", "\u00a0\u00a0", "a\u00a0\u00a0b", "end\u2028", "\v\f", "x\u000by\u000cz",
  "word    \n    word", "  \t\n\r  ", " !", "  !", "\n!", "a\n\n\n\nb",
  // Code
  "def foo(bar):\n    return bar * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
  "const x = () => { return `template ${y}`; };", "fn main() { println!(\"Hello, {}!\", name); }",
  "{\"key\": \"value\", \"n\": [1, 2, 3], \"nested\": {\"a\": null}}", "<div class=\"x\">Hi &amp; bye</div>",
  "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';", "ls -la | grep \"\\.cpp$\" && echo done",
  "| a | b |\n|---|---|\n| 1 | 2 |", "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$", "--- a/file\n+++ b/file\n@@ -1,3 +1,3 @@",
  "x+=1;y-=2;z*=3", "if(a&&b||!c){}", "arr[i][j]", "std::vector<std::string> v;", "#include <iostream>",
  "    indented code", "\t\ttabbed", "// comment\n/* block */", "a->b.c::d", "@decorator\nclass A:", "__init__",
  "https://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Users\\name\\file.txt", "~/.bashrc",
  "...", "!!!???", "—–-", "«quoted»", "„German“", "¿Qué?", "¡Hola!", "(parens) [brackets] {braces}",
  // Special-token text (both tokenizers)
  "<|im_start|>user\nHello<|im_end|>\n", "<|im_start|><|im_start|>", "<|im_start", "|im_end|>", "<|im_end|>x<|endoftext|>",
  "<think>\nreasoning\n</think>\n\nanswer", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<|endoftext|><|endoftext|>",
  " <|im_end|> ", "text<|vision_start|><|image_pad|><|vision_end|>", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
  "<｜begin▁of▁sentence｜>Hello", "<｜User｜>hi<｜Assistant｜>hello<｜end▁of▁sentence｜>", "<｜tool▁sep｜>",
  "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>",
  "<｜place▁holder▁no▁7｜><｜place▁holder▁no▁799｜>", "<｜fim▁hole｜>", "<|EOT|>", "<｜User", "｜>", "▁▁▁",
  "<<|im_start|>>", "<|im_start|>|>", "<think><think></think>",
  // Empty-ish and edge
  "", "a", "?", ".", "\u0000", "\u0000a\u0000", "\u007f", "\ufffd", "\ufffd\ufffd", "\uffff", "\ufdd0", "\u0378",
];

// Byte strings that are not valid UTF-8.
const INVALID_BYTES = [
  [0x80], [0xbf], [0xc0, 0xaf], [0xc1, 0xbf], [0xe0, 0x80, 0xaf], [0xed, 0xa0, 0x80], [0xed, 0xbf, 0xbf],
  [0xf0, 0x8f, 0xbf, 0xbf], [0xf4, 0x90, 0x80, 0x80], [0xf5, 0x80], [0xff], [0xfe, 0xff], [0xe4, 0xbd], [0xe4],
  [0xf0, 0x9f, 0x98], [0xf0, 0x9f], [0xc3], [0x41, 0xe4, 0xbd, 0x42], [0xe4, 0xbd, 0xe4, 0xbd, 0xa0],
  [0xed, 0xa0, 0xbd, 0xed, 0xb8, 0x80], // CESU-8 surrogate pair of U+1F600
  [0x68, 0x69, 0x80, 0x80, 0x80, 0x21], [0xc2, 0x41], [0xe1, 0x80, 0x41], [0xf1, 0x80, 0x80, 0x41],
];

const LONE_SURROGATE_STRINGS = [
  "\ud800", "\udfff", "a\ud83dz", "\ude00 after", "pair \ud83d\ude00 then lone \ud83d", "\udc00\ud800",
];

// UTF-8 the way a careless encoder writes a JS string: lone surrogates as 3-byte sequences (WTF-8).
export function wtf8(str) {
  const out = [];
  for (let i = 0; i < str.length; ++i) {
    let cp = str.charCodeAt(i);
    if (cp >= 0xd800 && cp <= 0xdbff && i + 1 < str.length) {
      const lo = str.charCodeAt(i + 1);
      if (lo >= 0xdc00 && lo <= 0xdfff) {
        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        ++i;
      }
    }
    if (cp < 0x80) out.push(cp);
    else if (cp < 0x800) out.push(0xc0 | (cp >> 6), 0x80 | (cp & 63));
    else if (cp < 0x10000) out.push(0xe0 | (cp >> 12), 0x80 | ((cp >> 6) & 63), 0x80 | (cp & 63));
    else out.push(0xf0 | (cp >> 18), 0x80 | ((cp >> 12) & 63), 0x80 | ((cp >> 6) & 63), 0x80 | (cp & 63));
  }
  return Uint8Array.from(out);
}

const utf8 = (s) => new TextEncoder().encode(s);

function pick(r, items) {
  return items[Math.floor(r() * items.length)];
}

function randomCodePoint(r, poolName) {
  const ranges = POOLS[poolName];
  let total = 0;
  for (const x of ranges) total += x.last - x.first + 1;
  let k = Math.floor(r() * total);
  for (const x of ranges) {
    const n = x.last - x.first + 1;
    if (k < n) return x.first + k;
    k -= n;
  }
  return ranges[0].first;
}

function weightedPool(r, weights) {
  const names = Object.keys(weights);
  let total = 0;
  for (const n of names) total += weights[n];
  let k = r() * total;
  for (const n of names) {
    if (k < weights[n]) return n;
    k -= weights[n];
  }
  return names[0];
}

// A random string: runs of characters from one pool at a time, so words and whitespace runs form.
function randomText(r, maxLength, weights = POOL_WEIGHTS) {
  const length = 1 + Math.floor(r() * maxLength);
  let s = "";
  let count = 0;
  while (count < length) {
    const pool = weightedPool(r, weights);
    const run = 1 + Math.floor(r() * 6);
    for (let i = 0; i < run && count < length; ++i, ++count) s += String.fromCodePoint(randomCodePoint(r, pool));
  }
  return s;
}

// Returns [{name, bytes: Uint8Array}] with `randomCount` random entries after the curated ones.
export function buildCorpus({ randomCount = 4000, addedTokens = [], seed = 20241202 } = {}) {
  const r = rng(seed);
  const corpus = [];
  const add = (name, bytes) => corpus.push({ name, bytes });
  CURATED.forEach((s, i) => add(`curated/${i}`, utf8(s)));
  INVALID_BYTES.forEach((b, i) => add(`invalid/${i}`, Uint8Array.from(b)));
  LONE_SURROGATE_STRINGS.forEach((s, i) => add(`lone_surrogate/${i}`, wtf8(s)));
  addedTokens.forEach((t, i) => add(`added_token/${i}`, utf8(t)));

  // Curated strings glued together with whitespace and added tokens.
  for (let i = 0; i < 300; ++i) {
    const parts = [];
    const n = 2 + Math.floor(r() * 4);
    for (let k = 0; k < n; ++k) {
      const roll = r();
      if (roll < 0.5) parts.push(pick(r, CURATED));
      else if (roll < 0.7 && addedTokens.length) parts.push(pick(r, addedTokens));
      else parts.push(pick(r, [" ", "  ", "\n", "\n\n", "\t", " \n", "", "\r\n", "\u3000"]));
    }
    add(`combined/${i}`, utf8(parts.join("")));
  }
  // Random text, some with invalid bytes or added tokens spliced in.
  for (let i = 0; i < randomCount; ++i) {
    const roll = r();
    let bytes;
    if (roll < 0.08) {
      const a = utf8(randomText(r, 20));
      const bad = Uint8Array.from(pick(r, INVALID_BYTES));
      const b = utf8(randomText(r, 20));
      bytes = new Uint8Array([...a, ...bad, ...b]);
    } else if (roll < 0.11) {
      bytes = Uint8Array.from({ length: 1 + Math.floor(r() * 24) }, () => Math.floor(r() * 256));
    } else if (roll < 0.2 && addedTokens.length) {
      bytes = utf8(randomText(r, 15) + pick(r, addedTokens) + randomText(r, 15));
    } else if (roll < 0.23) {
      bytes = wtf8(randomText(r, 10) + String.fromCharCode(0xd800 + Math.floor(r() * 0x800)) + randomText(r, 10));
    } else {
      bytes = utf8(randomText(r, roll < 0.9 ? 40 : 160));
    }
    add(`random/${i}`, bytes);
  }
  // A few long texts (pre-tokenizer regexes on long inputs, BPE on long words).
  for (let i = 0; i < 6; ++i) add(`long/${i}`, utf8(randomText(r, 6000)));
  add("long/spaces", utf8(" ".repeat(5000) + "x" + "\n".repeat(3000)));
  add("long/word", utf8("a".repeat(3000) + "ab".repeat(1500)));
  add("long/digits", utf8("7".repeat(2000)));
  add("long/cjk", utf8("中".repeat(2000)));
  add("long/emoji", utf8("😀".repeat(1000)));
  return corpus;
}
