// Fault injection over raw HTTP: malformed requests, oversized bodies, unknown adapters, prompts
// longer than the context, hundreds of concurrent streams, clients that disconnect (streamed and
// not), adapters loaded and unloaded while requests use them, bad loads under traffic, and a
// graceful shutdown mid-stream. After each: the server still answers, no KV page or adapter slot
// is held (via /metrics), and a canary request's output is unchanged.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';

import {
  assertHealthy, assertNoLeaks, get, metrics, post, repoRoot, request, sleep, startServer, streamCompletion,
} from './lib/harness.mjs';

const BASE = 'tiny-qwen3moe';
const FIXTURE_ADAPTERS = `${repoRoot}/tests/fixtures/qwen3moe/adapters`;
let server;
let url;
let canary;

const canaryRequest = { model: 'attn-r8', prompt: 'canary: the output of this never changes', max_tokens: 16, temperature: 0, return_token_ids: true };

async function checkCanary() {
  const r = await post(url, '/v1/completions', canaryRequest);
  assert.equal(r.status, 200, r.text);
  assert.deepEqual(r.json.choices[0].token_ids, canary, 'the canary output changed');
}

// Every fault test ends here: still serving, nothing leaked, other outputs unchanged.
async function afterFault() {
  await assertHealthy(url);
  await assertNoLeaks(url);
  await checkCanary();
}

before(async () => {
  server = await startServer(['--heartbeat-ms', '100']);
  url = server.url;
  const r = await post(url, '/v1/completions', canaryRequest);
  assert.equal(r.status, 200, r.text);
  canary = r.json.choices[0].token_ids;
  assert.equal(canary.length, 16);
});

after(async () => {
  if (server) assert.equal(await server.stop(), 0, server.logs());
});

function assertEnvelope(res, status, param) {
  assert.equal(res.status, status, res.text);
  assert.ok(res.json && res.json.error, `not an error envelope: ${res.text}`);
  const e = res.json.error;
  assert.equal(typeof e.message, 'string');
  assert.ok(e.message.length > 0);
  assert.equal(typeof e.type, 'string');
  assert.equal(e.code, status);
  assert.ok('param' in e);
  if (param !== undefined) assert.equal(e.param, param, e.message);
}

describe('malformed input', () => {
  const cases = [
    ['invalid JSON', '/v1/completions', '{"model": "tiny-qwen3moe", "prompt": ', 400],
    ['a JSON array', '/v1/completions', '[1, 2, 3]', 400],
    ['an empty body', '/v1/completions', '', 400],
    ['invalid UTF-8', '/v1/completions', Buffer.from([0x7b, 0x22, 0x70, 0x22, 0x3a, 0x22, 0xff, 0xfe, 0x22, 0x7d]), 400],
    ['duplicate keys', '/v1/completions', '{"prompt": "a", "prompt": "b"}', 400],
    ['nesting 10000 deep', '/v1/completions', '{"prompt": ' + '['.repeat(10000) + ']'.repeat(10000) + '}', 400],
    ['prompt of the wrong type', '/v1/completions', { model: BASE, prompt: 5 }, 400, 'prompt'],
    ['max_tokens as a string', '/v1/completions', { model: BASE, prompt: 'x', max_tokens: '10' }, 400, 'max_tokens'],
    ['max_tokens = 0', '/v1/completions', { model: BASE, prompt: 'x', max_tokens: 0 }, 400, 'max_tokens'],
    ['max_tokens < 0', '/v1/completions', { model: BASE, prompt: 'x', max_tokens: -1 }, 400, 'max_tokens'],
    ['chat max_tokens = 0', '/v1/chat/completions', { model: BASE, messages: [{ role: 'user', content: 'x' }], max_tokens: 0 }, 400, 'max_tokens'],
    ['stream as a string', '/v1/completions', { model: BASE, prompt: 'x', stream: 'yes' }, 400, 'stream'],
    ['messages as a string', '/v1/chat/completions', { model: BASE, messages: 'hi' }, 400, 'messages'],
    ['temperature < 0', '/v1/completions', { model: BASE, prompt: 'x', temperature: -0.5 }, 400, 'temperature'],
    ['n = 0', '/v1/completions', { model: BASE, prompt: 'x', n: 0 }, 400, 'n'],
    ['a token id outside the vocabulary', '/v1/completions', { model: BASE, prompt: [1, 2, 100000] }, 400],
    ['unknown adapter', '/v1/completions', { model: 'no-such-adapter', prompt: 'x' }, 404, 'model'],
    ['unknown base:adapter', '/v1/chat/completions', { model: `${BASE}:nope`, messages: [{ role: 'user', content: 'x' }] }, 404, 'model'],
    ['unknown lora_path', '/v1/completions', { model: BASE, lora_path: 'nope', prompt: 'x' }, 404, 'lora_path'],
    ['prompt longer than the context', '/v1/completions', { model: BASE, prompt: 'y'.repeat(400), max_tokens: 1 }, 400],
    ['prompt + max_tokens past the context', '/v1/completions', { model: BASE, prompt: 'y'.repeat(200), max_tokens: 100 }, 400, 'max_tokens'],
    ['unknown route', '/v1/nothing-here', { x: 1 }, 404],
  ];
  for (const [name, route, body, status, param] of cases) {
    test(name, async () => {
      assertEnvelope(await post(url, route, body), status, param);
    });
  }

  test("the context-length error uses vLLM's wording", async () => {
    const res = await post(url, '/v1/completions', { model: BASE, prompt: 'y'.repeat(200), max_tokens: 100 });
    assert.match(res.json.error.message,
      /^This model's maximum context length is 256 tokens\. However, you requested 300 tokens \(200 in the messages, 100 in the completion\)\./);
  });

  test('an oversized body is refused with 413', async () => {
    const big = JSON.stringify({ model: BASE, prompt: 'z'.repeat(2 * 1024 * 1024) });
    assertEnvelope(await post(url, '/v1/completions', big), 413);
  });

  test('a wrong method on a known route', async () => {
    const res = await request(url, 'GET', '/v1/completions');
    assert.ok(res.status === 404 || res.status === 405, `status ${res.status}`);
    assert.ok(res.json?.error, res.text);
  });

  test('the server is unharmed', afterFault);
});

// Sends a streamed completion and drops the connection after `events` SSE events.
function streamAndDisconnect(body, events) {
  return new Promise((resolve, reject) => {
    const payload = JSON.stringify({ ...body, stream: true });
    const req = http.request(new URL('/v1/completions', url), {
      method: 'POST', agent: false, headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload) },
    }, (res) => {
      let seen = 0;
      res.on('data', (d) => {
        seen += (d.toString().match(/^data: /gm) || []).length;
        if (seen >= events) { req.destroy(); resolve(seen); }
      });
      res.on('end', () => resolve(seen));
      res.on('error', () => resolve(seen));
    });
    req.on('error', (e) => (e.code === 'ECONNRESET' ? resolve(-1) : reject(e)));
    req.end(payload);
  });
}

describe('clients that go away', () => {
  test('disconnects mid-stream cancel their requests and free everything', async () => {
    const before = await metrics(url);
    const abortsBefore = before.get('vllm:request_success_total', { finished_reason: 'abort' });
    const genBefore = before.get('vllm:generation_tokens_total');
    const n = 24;
    const models = [BASE, 'attn-r8', 'full-r16'];
    await Promise.all(Array.from({ length: n }, (_, i) =>
      streamAndDisconnect({ model: models[i % 3], prompt: `disconnect ${i}`, max_tokens: 230, temperature: 0.7 }, 3)));
    const m = await assertNoLeaks(url);
    assert.equal(m.get('vllm:request_success_total', { finished_reason: 'abort' }) - abortsBefore, n);
    const generated = m.get('vllm:generation_tokens_total') - genBefore;
    assert.ok(generated < (n * 230) / 2, `cancelled requests kept generating: ${generated} tokens`);
    await afterFault();
  });

  test('a client that leaves a long non-streamed request cancels it too', async () => {
    const before = await metrics(url);
    const abortsBefore = before.get('vllm:request_success_total', { finished_reason: 'abort' });
    const genBefore = before.get('vllm:generation_tokens_total');
    const n = 32;
    const payload = JSON.stringify({ model: 'full-r16', prompt: 'long and unwanted', n, max_tokens: 230, ignore_eos: true });
    await new Promise((resolve) => {
      const req = http.request(new URL('/v1/completions', url), {
        method: 'POST', agent: false, headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload) },
      });
      req.on('error', () => resolve());
      req.end(payload);
      setTimeout(() => { req.destroy(); resolve(); }, 100);
    });
    const m = await assertNoLeaks(url);
    assert.equal(m.get('vllm:request_success_total', { finished_reason: 'abort' }) - abortsBefore, n);
    assert.ok(m.get('vllm:generation_tokens_total') - genBefore < n * 230, 'the request ran to the end');
    await afterFault();
  });
});

describe('load', () => {
  test('hundreds of concurrent streams all complete with their own output', async () => {
    const models = [BASE, 'attn-r8', 'full-r16'];
    const prompts = ['alpha', 'beta', 'gamma', 'delta'];
    const reference = new Map();
    for (const model of models) {
      for (const prompt of prompts) {
        const r = await post(url, '/v1/completions', { model, prompt, max_tokens: 8, temperature: 0, return_token_ids: true });
        reference.set(`${model}/${prompt}`, r.json.choices[0].token_ids);
      }
    }
    const n = 300;
    const results = await Promise.all(Array.from({ length: n }, (_, i) => {
      const model = models[i % 3];
      const prompt = prompts[Math.floor(i / 3) % 4];
      return streamCompletion(url, { model, prompt, max_tokens: 8, temperature: 0, return_token_ids: true, stream_options: { include_usage: true } })
        .then((r) => ({ ...r, key: `${model}/${prompt}` }));
    }));
    for (const r of results) {
      assert.equal(r.status, 200, JSON.stringify(r.json));
      assert.equal(r.error, null);
      assert.equal(r.finish, 'length');
      assert.equal(r.usage.completion_tokens, 8);
      assert.deepEqual(r.tokenIds, reference.get(r.key), r.key);
    }
    await afterFault();
  });
});

describe('overload', () => {
  test('past --max-open-requests, generation gets 503 while /health and /metrics still answer', async () => {
    // 4 generation responses at most, on 2 I/O threads; one running sequence at a time keeps
    // those 4 open long enough to look.
    const small = await startServer(['--max-open-requests', '4', '--http-threads', '2', '--max-num-seqs', '1']);
    try {
      const body = { model: BASE, prompt: 'hold the line', max_tokens: 200, ignore_eos: true };
      const open = Array.from({ length: 4 }, () => streamCompletion(small.url, body));
      const deadline = Date.now() + 10000;
      while ((await metrics(small.url)).get('moelora_http_requests_active') < 4) {
        assert.ok(Date.now() < deadline, 'the four streams never became active');
        await sleep(5);
      }
      const refused = await post(small.url, '/v1/completions', body);
      assertEnvelope(refused, 503);
      assert.equal(refused.headers['retry-after'], '1');
      await assertHealthy(small.url);
      for (const r of await Promise.all(open)) assert.equal(r.finish, 'length');
      await assertNoLeaks(small.url);
      assert.equal((await post(small.url, '/v1/completions', { ...body, max_tokens: 2 })).status, 200);
    } finally {
      await small.stop();
    }
  });

  test('a full queue answers 429', async () => {
    const small = await startServer(['--max-num-seqs', '1', '--max-queued-requests', '2']);
    try {
      const body = { model: BASE, prompt: 'queue', max_tokens: 200, ignore_eos: true };
      const results = await Promise.all(Array.from({ length: 8 }, () => post(small.url, '/v1/completions', body)));
      const codes = results.map((r) => r.status);
      assert.ok(codes.includes(200), codes.join(','));
      assert.ok(codes.includes(429), codes.join(','));
      for (const r of results) if (r.status === 429) assertEnvelope(r, 429);
      await assertNoLeaks(small.url);
    } finally {
      await small.stop();
    }
  });
});

describe('adapters under traffic', () => {
  test('unloading an adapter in use lets its requests finish, then it is gone', async () => {
    const load = await post(url, '/v1/load_lora_adapter', { lora_name: 'busy', lora_path: `${FIXTURE_ADAPTERS}/pattern` });
    assert.equal(load.status, 200, load.text);
    const body = { model: 'busy', prompt: 'in flight', max_tokens: 64, temperature: 0, return_token_ids: true };
    const ref = (await post(url, '/v1/completions', body)).json.choices[0].token_ids;
    const running = Array.from({ length: 12 }, () => streamCompletion(url, body));
    await sleep(30);
    const unload = await post(url, '/v1/unload_lora_adapter', { lora_name: 'busy' });
    assert.equal(unload.status, 200, unload.text);
    for (const r of await Promise.all(running)) {
      if (r.status === 404) continue;  // arrived after the unload started: refused, never half-served
      assert.equal(r.status, 200);
      assert.equal(r.finish, 'length');
      assert.deepEqual(r.tokenIds, ref);
    }
    assertEnvelope(await post(url, '/v1/completions', body), 404, 'model');
    // Reloading the name with other weights never serves the old ones (prefix cache included).
    const reload = await post(url, '/v1/load_lora_adapter', { lora_name: 'busy', lora_path: `${FIXTURE_ADAPTERS}/mlp-rslora-r4` });
    assert.equal(reload.status, 200, reload.text);
    await post(url, '/v1/load_lora_adapter', { lora_name: 'rslora-ref', lora_path: `${FIXTURE_ADAPTERS}/mlp-rslora-r4` });
    const after = (await post(url, '/v1/completions', body)).json.choices[0].token_ids;
    const expected = (await post(url, '/v1/completions', { ...body, model: 'rslora-ref' })).json.choices[0].token_ids;
    assert.deepEqual(after, expected);
    assert.notDeepEqual(after, ref);
    for (const name of ['busy', 'rslora-ref']) assert.equal((await post(url, '/v1/unload_lora_adapter', { lora_name: name })).status, 200);
    await afterFault();
  });

  test('bad loads are refused while good traffic goes on untouched', async () => {
    const badDir = path.join(repoRoot, 'tests', 'e2e', '.tmp-bad-adapter');
    fs.rmSync(badDir, { recursive: true, force: true });
    fs.mkdirSync(badDir, { recursive: true });
    fs.writeFileSync(path.join(badDir, 'adapter_config.json'), '{"r": 8, "lora_alpha": ');
    fs.writeFileSync(path.join(badDir, 'adapter_model.safetensors'), 'not a safetensors file');
    let stop = false;
    const good = (async () => {
      let n = 0;
      while (!stop) {
        await checkCanary();
        n++;
      }
      return n;
    })();
    try {
      const attempts = [
        [{ lora_name: 'ghost', lora_path: `${FIXTURE_ADAPTERS}/does-not-exist` }, 404],
        [{ lora_name: 'escape', lora_path: '/etc' }, 400],
        [{ lora_name: 'escape2', lora_path: `${repoRoot}/../../..` }, 400],
        [{ lora_name: 'broken', lora_path: badDir }, 400],
        [{ lora_name: 'bad name!', lora_path: `${FIXTURE_ADAPTERS}/pattern` }, 400],
        [{ lora_name: 'attn-r8', lora_path: `${FIXTURE_ADAPTERS}/pattern` }, 400],
        [{ lora_name: BASE, lora_path: `${FIXTURE_ADAPTERS}/pattern` }, 400],
        [{ lora_name: 'half' }, 400],
        [{ lora_path: `${FIXTURE_ADAPTERS}/pattern` }, 400],
      ];
      for (let round = 0; round < 3; round++) {
        for (const [body, status] of attempts) assertEnvelope(await post(url, '/v1/load_lora_adapter', body), status);
      }
      assertEnvelope(await post(url, '/v1/unload_lora_adapter', { lora_name: 'never-loaded' }), 404);
      assertEnvelope(await post(url, '/v1/unload_lora_adapter', {}), 400);
    } finally {
      stop = true;
      fs.rmSync(badDir, { recursive: true, force: true });
    }
    assert.ok(await good > 0);
    const models = (await get(url, '/v1/models')).json.data.map((m) => m.id).sort();
    assert.deepEqual(models, ['attn-r8', 'full-r16', BASE].sort());
    // A valid adapter still loads and serves afterwards.
    assert.equal((await post(url, '/v1/load_lora_adapter', { lora_name: 'late', lora_path: `${FIXTURE_ADAPTERS}/pattern` })).status, 200);
    assert.equal((await post(url, '/v1/completions', { model: 'late', prompt: 'x', max_tokens: 2 })).status, 200);
    assert.equal((await post(url, '/v1/unload_lora_adapter', { lora_name: 'late' })).status, 200);
    await afterFault();
  });
});

describe('shutdown', () => {
  test('SIGTERM mid-stream ends the stream cleanly and the process exits 0', async () => {
    const other = await startServer(['--shutdown-grace', '0.2']);
    try {
      // 16 choices of 200 tokens: more than the grace period allows.
      const payload = JSON.stringify({ model: BASE, prompt: 'never finishes in time', n: 16, max_tokens: 200, ignore_eos: true, stream: true });
      let body = '';
      let firstData;
      const gotData = new Promise((resolve) => { firstData = resolve; });
      const ended = new Promise((resolve) => {
        const req = http.request(new URL('/v1/completions', other.url), {
          method: 'POST', agent: false, headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload) },
        }, (res) => {
          res.on('data', (d) => { body += d; firstData(); });
          res.on('end', () => resolve('end'));
          res.on('error', (e) => resolve(`response error ${e.code}`));
        });
        req.on('error', (e) => resolve(`request error ${e.code}`));
        req.end(payload);
      });
      await gotData;
      assert.equal(await other.stop(), 0, other.logs());
      assert.equal(await ended, 'end', 'the stream must end, not be reset');
      const events = body.split('\n\n').filter((e) => e.startsWith('data: '));
      assert.equal(events.at(-1), 'data: [DONE]');
      const last = JSON.parse(events.at(-2).slice(6));
      assert.equal(last.error?.code, 503, events.at(-2));
    } finally {
      await other.stop();
    }
  });
});
