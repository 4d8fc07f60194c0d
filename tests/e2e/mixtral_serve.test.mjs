// `moelora serve --model <tiny Mixtral>` end to end with the official `openai` npm client (CPU).
//
// The fixture tests/fixtures/mixtral/model-bf16 holds config.json, generation_config.json and
// model.safetensors only: no tokenizer.json and no tokenizer_config.json (so no chat template).
//  1. Served as it is, it takes token-id prompts (completions, streamed and not, with an adapter
//     of the fixture), and refuses text prompts and chat with the documented 400s.
//  2. With a Mixtral-layout SentencePiece tokenizer of its 256 ids and Mixtral-Instruct's chat
//     template beside the same weights (lib/tiny_mixtral.mjs), chat and completions work through
//     the client, and the prompt the server renders is checked token for token against the
//     Mixtral-Instruct format written out by hand, through /tokenize.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import path from 'node:path';
import OpenAI from 'openai';

import { assertNoLeaks, post, startServer } from './lib/harness.mjs';
import { makeTinyMixtralDir, mixtralFixture, VOCAB_SIZE } from './lib/tiny_mixtral.mjs';

const ADAPTER = `attn-r8=${path.join(mixtralFixture, 'adapters', 'attn-r8')}`;

function makeClient(server) {
  return new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60000 });
}

async function stopServer(server) {
  if (!server) return;
  const code = await server.stop();
  assert.equal(code, 0, `server exit code\n${server.logs()}`);
}

// A completion stream's text, token ids, finish reasons and usage.
async function readStream(stream) {
  const out = { text: '', tokenIds: [], finish: [], usage: null, ids: new Set() };
  for await (const chunk of stream) {
    out.ids.add(chunk.id);
    if (chunk.usage) out.usage = chunk.usage;
    for (const c of chunk.choices) {
      out.text += c.text ?? c.delta?.content ?? '';
      if (c.token_ids) out.tokenIds.push(...c.token_ids);
      if (c.finish_reason) out.finish.push(c.finish_reason);
    }
  }
  assert.equal(out.ids.size, 1);
  return out;
}

// Token counts (cached_tokens is left out: it depends on what the prefix cache holds by then).
const counts = (u) => ({ prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens, total_tokens: u.total_tokens });

async function rejects400(promise, message, param) {
  await assert.rejects(promise, (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.status, 400);
    assert.equal(e.error?.message ?? e.message, message);
    if (param !== undefined) assert.equal(e.param, param);
    return true;
  });
}

describe('the Mixtral fixture as it is: token ids only', () => {
  let server;
  let client;
  const MODEL = 'model-bf16';  // the folder's name
  before(async () => {
    server = await startServer(['--model', path.join(mixtralFixture, 'model-bf16'), '--lora', ADAPTER]);
    client = makeClient(server);
  });
  after(() => stopServer(server));

  const prompt = [1, 40, 41, 42, 43, 44];
  const args = { prompt, max_tokens: 10, temperature: 0, ignore_eos: true, return_token_ids: true };

  test('lists the model and its adapter', async () => {
    const ids = (await client.models.list()).data.map((m) => m.id).sort();
    assert.deepEqual(ids, ['attn-r8', MODEL]);
  });

  test('token-id completions, streamed and not; the adapter changes the output', async () => {
    const r = await client.completions.create({ model: MODEL, ...args });
    assert.equal(r.object, 'text_completion');
    const c = r.choices[0];
    assert.equal(c.text, '', 'no tokenizer: no text');
    assert.equal(c.token_ids.length, 10);
    for (const id of c.token_ids) assert.ok(Number.isInteger(id) && id >= 0 && id < VOCAB_SIZE, String(id));
    assert.equal(c.finish_reason, 'length');
    assert.deepEqual(counts(r.usage), { prompt_tokens: prompt.length, completion_tokens: 10, total_tokens: prompt.length + 10 });

    const s = await readStream(await client.completions.create({ model: MODEL, ...args, stream: true, stream_options: { include_usage: true } }));
    assert.deepEqual(s.tokenIds, c.token_ids);
    assert.deepEqual(s.finish, ['length']);
    assert.equal(s.text, '');
    assert.deepEqual(counts(s.usage), counts(r.usage));

    const lora = await client.completions.create({ model: 'attn-r8', ...args });
    assert.equal(lora.choices[0].token_ids.length, 10);
    assert.notDeepEqual(lora.choices[0].token_ids, c.token_ids);
  });

  test('text prompts and chat are refused with what is missing', async () => {
    await rejects400(client.completions.create({ model: MODEL, prompt: 'Hello', max_tokens: 2 }),
      'this model has no tokenizer.json: send the prompt as token ids');
    await rejects400(client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 }),
      'chat completions need the model\'s tokenizer.json, which this model lacks');
    await assertNoLeaks(server.url);
  });
});

describe('the Mixtral fixture with a Mixtral tokenizer and the Mixtral-Instruct template', () => {
  let server;
  let client;
  let folder;
  const MODEL = 'tiny-mixtral';
  before(async () => {
    folder = makeTinyMixtralDir();
    server = await startServer(['--model', folder.dir, '--served-model-name', MODEL, '--lora', ADAPTER]);
    client = makeClient(server);
  });
  after(async () => {
    await stopServer(server);
    folder?.remove();
  });

  async function tokenize(body) {
    const res = await post(server.url, '/tokenize', { model: MODEL, ...body });
    assert.equal(res.status, 200, res.text);
    return res.json;
  }

  const ids = (text) => tokenize({ prompt: text, add_special_tokens: false });

  test('the chat template renders the Mixtral-Instruct prompt, token for token', async () => {
    const one = [{ role: 'user', content: 'Hello there, how are you?' }];
    const rendered = await tokenize({ messages: one });
    const expected = await ids('<s>[INST] Hello there, how are you? [/INST]');
    assert.deepEqual(rendered.tokens, expected.tokens);
    assert.equal(rendered.tokens[0], 1, '<s> first');
    assert.notEqual(rendered.tokens[1], 1, 'one <s>, not two');
    // Decoded as transformers decodes Mixtral's legacy layout (a space after <s>).
    const text = await post(server.url, '/detokenize', { model: MODEL, tokens: rendered.tokens });
    assert.equal(text.json.prompt, '<s> [INST] Hello there, how are you? [/INST]');

    const turns = [{ role: 'user', content: 'What is the capital of France?' }, { role: 'assistant', content: 'Paris.' },
      { role: 'user', content: 'Thanks!' }];
    const multi = await tokenize({ messages: turns });
    const expectedMulti = await ids('<s>[INST] What is the capital of France? [/INST]Paris.</s>[INST] Thanks! [/INST]');
    assert.deepEqual(multi.tokens, expectedMulti.tokens);
    assert.equal(multi.tokens.filter((t) => t === 2).length, 1, 'the assistant turn ends with </s>');
  });

  test('chat completions, streamed and not: usage counts the rendered template', async () => {
    const messages = [{ role: 'user', content: 'Tell me a story.' }];
    const args = { model: MODEL, messages, max_tokens: 12, temperature: 0 };
    const r = await client.chat.completions.create(args);
    assert.equal(r.object, 'chat.completion');
    assert.equal(r.model, MODEL);
    const c = r.choices[0];
    assert.equal(c.message.role, 'assistant');
    assert.equal(typeof c.message.content, 'string');
    // </s> (id 2) ends generation: "stop" before 12 tokens, else "length".
    assert.ok(['stop', 'length'].includes(c.finish_reason), c.finish_reason);
    if (c.finish_reason === 'length') assert.equal(r.usage.completion_tokens, 12);
    else assert.ok(r.usage.completion_tokens < 12);
    const rendered = await tokenize({ messages });
    assert.equal(rendered.count, (await ids('<s>[INST] Tell me a story. [/INST]')).count);
    assert.equal(r.usage.prompt_tokens, rendered.count);
    assert.equal(r.usage.total_tokens, rendered.count + r.usage.completion_tokens);

    const s = await readStream(await client.chat.completions.create({ ...args, stream: true, stream_options: { include_usage: true } }));
    assert.equal(s.text, c.message.content);
    assert.deepEqual(s.finish, [c.finish_reason]);
    assert.deepEqual(counts(s.usage), counts(r.usage));

    // ignore_eos: exactly max_tokens, the same greedy start.
    const long = await client.chat.completions.create({ ...args, ignore_eos: true, return_token_ids: true });
    assert.equal(long.choices[0].finish_reason, 'length');
    assert.equal(long.usage.completion_tokens, 12);
    assert.equal(long.choices[0].token_ids.length, 12);
  });

  test('the template\'s own refusals reach the client as 400s', async () => {
    await assert.rejects(client.chat.completions.create({ model: MODEL, max_tokens: 2,
      messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Hi' }] }), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name}: ${e.message}`);
      assert.equal(e.error.message, 'chat template line 1: Conversation roles must alternate user/assistant/user/assistant/...');
      assert.equal(e.param, 'messages');
      return true;
    });
    await assert.rejects(client.chat.completions.create({ model: MODEL, max_tokens: 2,
      messages: [{ role: 'user', content: 'Hi' }, { role: 'tool', content: 'x', tool_call_id: 'a' }] }), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name}: ${e.message}`);
      assert.equal(e.error.message, 'chat template line 1: Only user and assistant roles are supported!');
      assert.equal(e.param, 'messages');
      return true;
    });
  });

  test('text completions, streamed and not, with echo and an adapter', async () => {
    const prompt = 'Once upon a time there were eight experts';
    const args = { model: MODEL, prompt, max_tokens: 10, temperature: 0, ignore_eos: true, return_token_ids: true };
    const r = await client.completions.create(args);
    const c = r.choices[0];
    assert.equal(c.finish_reason, 'length');
    assert.equal(c.token_ids.length, 10);
    const tok = await tokenize({ prompt });
    assert.equal(tok.tokens[0], 1, 'completions add <s>');
    assert.deepEqual(c.prompt_token_ids, tok.tokens);
    assert.deepEqual(counts(r.usage), { prompt_tokens: tok.count, completion_tokens: 10, total_tokens: tok.count + 10 });

    const s = await readStream(await client.completions.create({ ...args, stream: true, stream_options: { include_usage: true } }));
    assert.equal(s.text, c.text);
    assert.deepEqual(s.tokenIds, c.token_ids);
    assert.deepEqual(counts(s.usage), counts(r.usage));

    const echo = await client.completions.create({ ...args, echo: true });
    assert.equal(echo.choices[0].text, prompt + c.text);

    const lora = await client.completions.create({ ...args, model: 'attn-r8' });
    assert.notDeepEqual(lora.choices[0].token_ids, c.token_ids);
    const loraChat = await client.chat.completions.create({ model: 'attn-r8', messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4, temperature: 0 });
    assert.equal(loraChat.model, 'attn-r8');
    assert.equal(loraChat.usage.prompt_tokens, (await tokenize({ messages: [{ role: 'user', content: 'Hi' }] })).count);
    await assertNoLeaks(server.url);
  });
});
