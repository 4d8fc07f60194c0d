// A servable tiny Mixtral folder. The fixture tests/fixtures/mixtral/model-bf16 has the weights
// and config (vocab_size 256) but no tokenizer.json and no tokenizer_config.json, so served as it
// is it takes token-id prompts only and no chat. This builds, in a temporary folder, the fixture's
// files plus a Mixtral-style tokenizer that fits its 256 ids:
//  - tokenizer.json in the layout of Mixtral-8x7B's own (the "legacy" SentencePiece layout the
//    tokenizer tests use: Prepend + Replace normalizer, no pre-tokenizer, BPE with <unk>, the
//    <s> TemplateProcessing post-processor, Replace/ByteFallback/Fuse/Strip decoder), with
//    Mixtral's ids for <unk> <s> </s> (0 1 2, the config's bos/eos ids), then '▁', the printable
//    ASCII characters and merges learned from a fixed text until there are 256 tokens;
//  - tokenizer_config.json: Mixtral-Instruct's (bos <s>, eos </s>, add_bos_token) with its chat
//    template, tests/tokenizer/data/mixtral_instruct.jinja.
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { repoRoot } from './harness.mjs';

export const mixtralFixture = path.join(repoRoot, 'tests', 'fixtures', 'mixtral');
export const VOCAB_SIZE = 256;

const SPACE = '\u2581';

// Text the merges are learned from: plain English and the template's own markers.
const CORPUS = [
  '[INST] What is the capital of France? [/INST] The capital of France is Paris.',
  '[INST] Tell me a story about a mixture of experts. [/INST] Once upon a time there were eight',
  'experts and a router that sent every token to the two that knew it best. They worked in the',
  'same model and shared their attention, but each one learned something of its own. The router',
  'learned which of them to ask, and the answers became better with every step of the training.',
  'Hello there, how are you doing today? I am doing well, thank you for asking. This is a test of',
  'the tokenizer and the chat template, written in the same layout as the real one. [INST] Thanks!',
  '[/INST] You are welcome. Let me know if there is anything else I can help you with in the end.',
].join(' ');

function learnMerges(symbols, budget) {
  const vocab = new Set(symbols);
  const words = new Map();  // word (symbols joined by \0) -> count
  for (const w of CORPUS.split(' ')) {
    const key = [SPACE, ...w].filter((c) => vocab.has(c)).join('\0');
    words.set(key, (words.get(key) ?? 0) + 1);
  }
  let split = [...words].map(([k, n]) => ({ syms: k.split('\0'), n }));
  const merges = [];
  while (merges.length < budget) {
    const counts = new Map();
    for (const { syms, n } of split) {
      for (let i = 0; i + 1 < syms.length; i++) {
        if (vocab.has(syms[i] + syms[i + 1])) continue;
        const key = `${syms[i]} ${syms[i + 1]}`;
        counts.set(key, (counts.get(key) ?? 0) + n);
      }
    }
    if (counts.size === 0) break;
    // The most frequent pair; ties broken by the pair's text, so the result never varies.
    const [best] = [...counts].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))[0];
    const [a, b] = best.split(' ');
    merges.push(best);
    vocab.add(a + b);
    split = split.map(({ syms, n }) => {
      const out = [];
      for (let i = 0; i < syms.length; i++) {
        if (i + 1 < syms.length && syms[i] === a && syms[i + 1] === b) { out.push(a + b); i++; } else out.push(syms[i]);
      }
      return { syms: out, n };
    });
  }
  return merges;
}

export function tinyMixtralTokenizer() {
  const base = [SPACE];
  for (let c = 0x21; c <= 0x7e; c++) base.push(String.fromCharCode(c));
  const merges = learnMerges(base, VOCAB_SIZE - 3 - base.length);
  const vocab = { '<unk>': 0, '<s>': 1, '</s>': 2 };
  for (const piece of base) vocab[piece] = Object.keys(vocab).length;
  for (const m of merges) vocab[m.replace(' ', '')] = Object.keys(vocab).length;
  if (Object.keys(vocab).length !== VOCAB_SIZE) throw new Error(`tiny Mixtral tokenizer has ${Object.keys(vocab).length} tokens`);
  const special = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
  return {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [special(0, '<unk>'), special(1, '<s>'), special(2, '</s>')],
    normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: SPACE }, { type: 'Replace', pattern: { String: ' ' }, content: SPACE }] },
    pre_tokenizer: null,
    post_processor: {
      type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
        { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } },
    },
    decoder: {
      type: 'Sequence',
      decoders: [{ type: 'Replace', pattern: { String: SPACE }, content: ' ' }, { type: 'ByteFallback' }, { type: 'Fuse' },
        { type: 'Strip', content: ' ', start: 1, stop: 0 }],
    },
    model: {
      type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: true, byte_fallback: false, vocab, merges,
    },
  };
}

export const mixtralChatTemplate = () => readFileSync(path.join(repoRoot, 'tests', 'tokenizer', 'data', 'mixtral_instruct.jinja'), 'utf8');

// A temporary model folder: the fixture's checkpoint (`variant`: model-bf16 or model-fp8) plus
// the tokenizer above. Returns { dir, tokenizer, remove() }.
export function makeTinyMixtralDir(variant = 'model-bf16') {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'moelora-tiny-mixtral-'));
  for (const f of ['config.json', 'generation_config.json', 'model.safetensors'])
    copyFileSync(path.join(mixtralFixture, variant, f), path.join(dir, f));
  const tokenizer = tinyMixtralTokenizer();
  writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(tokenizer, null, 1));
  writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify({
    add_bos_token: true,
    add_eos_token: false,
    bos_token: '<s>',
    eos_token: '</s>',
    unk_token: '<unk>',
    pad_token: null,
    clean_up_tokenization_spaces: false,
    legacy: true,
    model_max_length: 1e30,
    spaces_between_special_tokens: false,
    tokenizer_class: 'LlamaTokenizer',
    chat_template: mixtralChatTemplate(),
  }, null, 2));
  return { dir, tokenizer, remove: () => rmSync(dir, { recursive: true, force: true }) };
}
