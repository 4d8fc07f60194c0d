// The server as the official `openai` npm client sees it: models, completions and chat
// completions (streamed and not), adapters selected by `model` (and sglang's forms), usage
// counts, stop strings, n, logprobs, errors as typed exceptions, and an adapter loaded over HTTP
// then used for a streamed chat completion.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import OpenAI from 'openai';

import { assertNoLeaks, moeloraBinary, post, repoRoot, startServer } from './lib/harness.mjs';

const BASE = 'tiny-qwen3moe';
let server;
let client;

before(async () => {
  server = await startServer();
  client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60000 });
});

after(async () => {
  if (server) {
    const code = await server.stop();
    assert.equal(code, 0, `server exit code\n${server.logs()}`);
  }
});

const greedy = { temperature: 0, max_tokens: 12 };

async function streamText(stream) {
  let text = '';
  const finish = [];
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.text ?? c.delta?.content ?? '';
      if (c.finish_reason) finish.push(c.finish_reason);
    }
  }
  return { text, finish, usage, chunks };
}

describe('models', () => {
  test('lists the base model and its adapters with lineage', async () => {
    const list = await client.models.list();
    const byId = Object.fromEntries(list.data.map((m) => [m.id, m]));
    assert.ok(byId[BASE], JSON.stringify(list.data));
    assert.equal(byId[BASE].parent, null);
    for (const name of ['attn-r8', 'full-r16']) {
      assert.equal(byId[name].parent, BASE);
      assert.match(byId[name].root, new RegExp(`adapters/${name}$`));
    }
  });
});

describe('completions', () => {
  test('non-streamed: text, finish reason and usage counts', async () => {
    const prompt = 'Hello, world';
    const r = await client.completions.create({ model: 'attn-r8', prompt, ...greedy });
    assert.equal(r.object, 'text_completion');
    assert.equal(r.model, 'attn-r8');
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(typeof r.choices[0].text, 'string');
    const tok = await post(server.url, '/tokenize', { model: 'attn-r8', prompt });
    assert.equal(r.usage.prompt_tokens, tok.json.count);
    assert.equal(r.usage.completion_tokens, 12);
    assert.equal(r.usage.total_tokens, tok.json.count + 12);
  });

  test('streamed text equals the non-streamed text, usage comes last', async () => {
    const args = { model: 'full-r16', prompt: 'Stream me', ...greedy };
    const whole = await client.completions.create(args);
    const s = await streamText(await client.completions.create({ ...args, stream: true, stream_options: { include_usage: true } }));
    assert.equal(s.text, whole.choices[0].text);
    assert.deepEqual(s.finish, ['length']);
    assert.equal(s.usage.completion_tokens, 12);
    assert.equal(s.usage.prompt_tokens, whole.usage.prompt_tokens);
    // At least one text chunk before the usage chunk; how many depends on timing, because the
    // server sends in one event the tokens that arrived while the previous write was in flight.
    assert.ok(s.chunks >= 2, `chunks: ${s.chunks}`);
  });

  test('each adapter gives its own output; sglang forms select the same adapter', async () => {
    const prompt = 'Which adapter am I?';
    const ids = {};
    for (const model of [BASE, 'attn-r8', 'full-r16']) {
      const r = await client.completions.create({ model, prompt, ...greedy, return_token_ids: true });
      ids[model] = r.choices[0].token_ids;
      assert.equal(ids[model].length, 12);
    }
    assert.notDeepEqual(ids[BASE], ids['attn-r8']);
    assert.notDeepEqual(ids['attn-r8'], ids['full-r16']);
    const colon = await client.completions.create({ model: `${BASE}:attn-r8`, prompt, ...greedy, return_token_ids: true });
    assert.deepEqual(colon.choices[0].token_ids, ids['attn-r8']);
    const loraPath = await client.completions.create({ model: BASE, lora_path: 'full-r16', prompt, ...greedy, return_token_ids: true });
    assert.deepEqual(loraPath.choices[0].token_ids, ids['full-r16']);
  });

  test('token-id prompts, batches of prompts and n choices', async () => {
    const r = await client.completions.create({ model: BASE, prompt: [[72, 105], [79, 75]], n: 2, max_tokens: 4, temperature: 0.8, seed: 5 });
    assert.equal(r.choices.length, 4);
    assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2, 3]);
    assert.equal(r.usage.prompt_tokens, 4);
    assert.equal(r.usage.completion_tokens, 16);
    const again = await client.completions.create({ model: BASE, prompt: [[72, 105], [79, 75]], n: 2, max_tokens: 4, temperature: 0.8, seed: 5 });
    assert.deepEqual(again.choices.map((c) => c.text), r.choices.map((c) => c.text), 'a seed makes sampling reproducible');
  });

  test('stop strings cut the text, streamed or not', async () => {
    const args = { model: 'attn-r8', prompt: 'abc', temperature: 0, max_tokens: 40, return_token_ids: true };
    const full = (await client.completions.create(args)).choices[0].text;
    // A stop string from the middle of the greedy output.
    const chars = [...full];
    const stop = chars.slice(10, 12).join('');
    const cut = full.slice(0, full.indexOf(stop));
    const r = await client.completions.create({ ...args, stop: [stop] });
    assert.equal(r.choices[0].text, cut);
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.equal(r.choices[0].stop_reason, stop);
    const s = await streamText(await client.completions.create({ ...args, stop: stop, stream: true }));
    assert.equal(s.text, cut);
    assert.deepEqual(s.finish, ['stop']);
    const inc = await client.completions.create({ ...args, stop: [stop], include_stop_str_in_output: true });
    assert.equal(inc.choices[0].text, cut + stop);
  });

  test('logprobs', async () => {
    const r = await client.completions.create({ model: BASE, prompt: 'log', max_tokens: 5, temperature: 0, logprobs: 3 });
    const lp = r.choices[0].logprobs;
    assert.equal(lp.tokens.length, 5);
    assert.equal(lp.token_logprobs.length, 5);
    assert.equal(lp.top_logprobs.length, 5);
    for (const v of lp.token_logprobs) assert.ok(v <= 0);
    // Greedy picks the most likely token: its logprob is the best of the alternatives.
    for (let i = 0; i < 5; i++) assert.ok(lp.token_logprobs[i] >= Math.max(...Object.values(lp.top_logprobs[i])) - 1e-6);
  });
});

describe('chat completions', () => {
  const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say something.' }];

  test('non-streamed and streamed agree', async () => {
    const r = await client.chat.completions.create({ model: 'full-r16', messages, ...greedy });
    assert.equal(r.object, 'chat.completion');
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 12);
    const tok = await post(server.url, '/tokenize', { model: 'full-r16', messages });
    assert.equal(r.usage.prompt_tokens, tok.json.count, 'chat prompt = the rendered template');
    const stream = await client.chat.completions.create({ model: 'full-r16', messages, ...greedy, stream: true, stream_options: { include_usage: true } });
    let first = true;
    let text = '';
    let usage;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        if (first) { assert.equal(c.delta.role, 'assistant'); first = false; }
        text += c.delta.content ?? '';
      }
    }
    assert.equal(text, r.choices[0].message.content);
    assert.equal(usage.completion_tokens, 12);
  });

  test('chat logprobs', async () => {
    const r = await client.chat.completions.create({ model: 'attn-r8', messages, max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 2 });
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, 4);
    for (const t of content) {
      assert.equal(t.top_logprobs.length, 2);
      assert.ok(Array.isArray(t.bytes));
    }
  });
});

describe('errors as the client sees them', () => {
  test('unknown model is a NotFoundError (404)', async () => {
    await assert.rejects(client.completions.create({ model: 'no-such-adapter', prompt: 'x', max_tokens: 2 }), (e) => {
      assert.ok(e instanceof OpenAI.NotFoundError, e.constructor.name);
      assert.equal(e.status, 404);
      assert.match(e.message, /The model `no-such-adapter` does not exist/);
      return true;
    });
    await assert.rejects(client.chat.completions.create({ model: `${BASE}:nope`, messages: [{ role: 'user', content: 'x' }] }), OpenAI.NotFoundError);
  });

  test('bad parameters are BadRequestErrors (400) naming the parameter', async () => {
    await assert.rejects(client.completions.create({ model: BASE, prompt: 'x', max_tokens: 0 }), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError);
      assert.equal(e.param, 'max_tokens');
      return true;
    });
    await assert.rejects(client.completions.create({ model: BASE, prompt: 'x', temperature: -1 }), OpenAI.BadRequestError);
    await assert.rejects(client.completions.create({ model: BASE, prompt: 'x'.repeat(300), max_tokens: 4 }), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError);
      assert.match(e.message, /maximum context length is 256 tokens/);
      return true;
    });
  });
});

describe('adapters over HTTP', () => {
  test('load a second adapter, stream a chat completion with it, unload it', async () => {
    const path = `${repoRoot}/tests/fixtures/qwen3moe/adapters/mlp-rslora-r4`;
    const loaded = await post(server.url, '/v1/load_lora_adapter', { lora_name: 'rslora', lora_path: path });
    assert.equal(loaded.status, 200, loaded.text);
    assert.match(loaded.text, /Success: LoRA adapter 'rslora' added successfully/);
    const models = await client.models.list();
    const card = models.data.find((m) => m.id === 'rslora');
    assert.equal(card.parent, BASE);
    const stream = await client.chat.completions.create({
      model: 'rslora', messages: [{ role: 'user', content: 'Hello adapter' }], max_tokens: 10, temperature: 0, stream: true,
    });
    const s = await streamText(stream);
    assert.deepEqual(s.finish, ['length']);
    const base = await client.chat.completions.create({ model: BASE, messages: [{ role: 'user', content: 'Hello adapter' }], max_tokens: 10, temperature: 0 });
    assert.notEqual(s.text, base.choices[0].message.content, 'the adapter changes the output');
    const unloaded = await post(server.url, '/v1/unload_lora_adapter', { lora_name: 'rslora' });
    assert.equal(unloaded.status, 200, unloaded.text);
    await assert.rejects(client.chat.completions.create({ model: 'rslora', messages: [{ role: 'user', content: 'x' }] }), OpenAI.NotFoundError);
    await assertNoLeaks(server.url);
  });
});

describe('tokenize', () => {
  test('/tokenize and /detokenize round-trip', async () => {
    const text = 'Grüße, 世界! 👋';
    const t = await post(server.url, '/tokenize', { model: BASE, prompt: text, return_token_strs: true });
    assert.equal(t.status, 200);
    assert.equal(t.json.count, t.json.tokens.length);
    assert.equal(t.json.max_model_len, 256);
    assert.equal(t.json.token_strs.length, t.json.count);
    const d = await post(server.url, '/detokenize', { model: BASE, tokens: t.json.tokens });
    assert.equal(d.status, 200);
    assert.equal(d.json.prompt, text);
    assert.equal((await post(server.url, '/detokenize', { tokens: [1, 99999] })).status, 400);
    assert.equal((await post(server.url, '/tokenize', { model: 'nope', prompt: 'x' })).status, 404);
  });
});

describe('bench-serving', () => {
  test('drives the server and prints its report', async () => {
    const port = new URL(server.url).port;
    const { stdout } = await promisify(execFile)(moeloraBinary(), [
      'bench-serving', '--port', port, '--num-requests', '12', '--max-concurrency', '4', '--input-len', '8',
      '--output-len', '6', '--include-base',
    ], { timeout: 120000 });
    assert.match(stdout, /Successful requests:\s+12\n/);
    assert.match(stdout, /Failed requests:\s+0\n/);
    assert.match(stdout, /Total generated tokens:\s+72\n/);
    for (const key of ['TTFT', 'TPOT', 'ITL', 'E2EL']) {
      for (const p of ['P50', 'P90', 'P99']) assert.match(stdout, new RegExp(`${p} ${key} \\(ms\\):\\s+[0-9.]+`));
    }
    await assertNoLeaks(server.url);
  });
});
