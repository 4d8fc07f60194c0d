// A bounded soak on loopback: a seeded, sampled request gives the same tokens alone and while
// other adapters' traffic (streamed, non-streamed, clients that drop out) keeps the server busy,
// with more adapters than slots (--max-loras-per-batch 2) and than host memory holds
// (--max-loaded-loras 3), so slots and host copies churn all along, and a KV cache small enough
// (--kv-cache-pages 40) that requests get preempted and recomputed, while adapters are reloaded
// in place (one with the same files, whose probes must not change; one alternating between two
// adapters). Bounded: a fixed number of probes, a deadline, and the traffic stops with them;
// afterwards nothing is held, no request failed, no 404 or 5xx was answered.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';

import { assertNoLeaks, metrics, post, repoRoot, startServer, streamCompletion } from './lib/harness.mjs';

const BASE = 'tiny-qwen3moe';
const FIXTURES = `${repoRoot}/tests/fixtures/qwen3moe/adapters`;
const PROBES = 24;
const DEADLINE_MS = 90000;
let server;
let url;

before(async () => {
  server = await startServer(['--max-loras-per-batch', '2', '--max-loaded-loras', '3', '--max-num-seqs', '24', '--kv-cache-pages', '40']);
  url = server.url;
  for (const [name, dir] of [['noise-rslora', 'mlp-rslora-r4'], ['noise-pattern', 'pattern'], ['noise-attn', 'attn-r8']]) {
    const r = await post(url, '/v1/load_lora_adapter', { lora_name: name, lora_path: `${FIXTURES}/${dir}` });
    assert.equal(r.status, 200, r.text);
  }
});

after(async () => {
  if (server) assert.equal(await server.stop(), 0, server.logs());
});

// Deterministic pseudo-random numbers (the soak must be reproducible too).
function rng(seed) {
  let x = seed >>> 0;
  return () => {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    return x / 2 ** 32;
  };
}

function dropAfterFirstEvent(body) {
  return new Promise((resolve) => {
    const payload = JSON.stringify({ ...body, stream: true });
    const req = http.request(new URL('/v1/completions', url), {
      method: 'POST', agent: false, headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload) },
    }, (res) => {
      res.once('data', () => { req.destroy(); resolve(res.statusCode); });
      res.on('end', () => resolve(res.statusCode));
      res.on('error', () => resolve(res.statusCode));
    });
    req.on('error', () => resolve(0));
    req.end(payload);
  });
}

test('seeded output is identical with and without concurrent traffic from other adapters', async () => {
  const probe = { model: 'attn-r8', prompt: 'The soak probe says:', max_tokens: 48, temperature: 0.8, top_p: 0.9, seed: 1234, ignore_eos: true, return_token_ids: true };
  const alone = await post(url, '/v1/completions', probe);
  assert.equal(alone.status, 200, alone.text);
  const reference = alone.json.choices[0].token_ids;
  assert.equal(reference.length, 48);
  assert.deepEqual((await post(url, '/v1/completions', probe)).json.choices[0].token_ids, reference, 'not reproducible even alone');
  // The same request through 'noise-attn' (the same files as attn-r8), reloaded in place below.
  const reloadedProbe = { ...probe, model: 'noise-attn' };
  assert.deepEqual((await post(url, '/v1/completions', reloadedProbe)).json.choices[0].token_ids, reference);
  const errorsBefore = await metrics(url);  // /health answered 503 while the model loaded

  const started = Date.now();
  let stop = false;
  const failures = [];
  let trafficRequests = 0;
  const models = [BASE, 'full-r16', 'noise-rslora', 'noise-pattern', 'noise-attn'];
  const worker = async (id) => {
    const rand = rng(1000 + id);
    while (!stop && Date.now() - started < DEADLINE_MS) {
      const model = models[Math.floor(rand() * models.length)];
      const body = {
        model,
        prompt: `traffic ${id} ${Math.floor(rand() * 1e6)} `.repeat(1 + Math.floor(rand() * 6)),
        max_tokens: 1 + Math.floor(rand() * 64),
        temperature: rand() < 0.5 ? 0 : 1,
        seed: Math.floor(rand() * 1e9),
      };
      const kind = rand();
      trafficRequests++;
      if (kind < 0.1) {
        const status = await dropAfterFirstEvent(body);
        if (status !== 200 && status !== 0) failures.push(`drop: HTTP ${status}`);
      } else if (kind < 0.55) {
        const r = await streamCompletion(url, body);
        if (r.status !== 200 || r.error || r.finish !== 'length') failures.push(`stream ${model}: ${r.status} ${JSON.stringify(r.error ?? r.json)}`);
      } else {
        const r = await post(url, '/v1/completions', body);
        if (r.status !== 200) failures.push(`${model}: ${r.status} ${r.text.slice(0, 200)}`);
      }
    }
  };
  // In-place reloads: noise-attn with its own files (outputs must not change), noise-pattern
  // alternating between two different adapters (its requests must never see a 404).
  let reloads = 0;
  const reloader = async () => {
    for (let i = 0; !stop && Date.now() - started < DEADLINE_MS; i++) {
      const [name, dir] = i % 2 === 0 ? ['noise-attn', 'attn-r8'] : ['noise-pattern', i % 4 === 1 ? 'mlp-rslora-r4' : 'pattern'];
      const r = await post(url, '/v1/load_lora_adapter', { lora_name: name, lora_path: `${FIXTURES}/${dir}`, load_inplace: true });
      if (r.status !== 200) failures.push(`reload ${name}: ${r.status} ${r.text.slice(0, 200)}`);
      reloads++;
      await new Promise((res) => setTimeout(res, 50));
    }
  };
  const workers = [...Array.from({ length: 8 }, (_, i) => worker(i)), reloader()];
  try {
    for (let i = 0; i < PROBES; i++) {
      assert.ok(Date.now() - started < DEADLINE_MS, `the soak ran past ${DEADLINE_MS} ms`);
      if (i % 3 === 2) {
        const r = await post(url, '/v1/completions', reloadedProbe);
        assert.equal(r.status, 200, r.text);
        assert.deepEqual(r.json.choices[0].token_ids, reference, `probe ${i} (reloaded in place) differs`);
      } else if (i % 2 === 0) {
        const r = await post(url, '/v1/completions', probe);
        assert.equal(r.status, 200, r.text);
        assert.deepEqual(r.json.choices[0].token_ids, reference, `probe ${i} (non-streamed) differs under traffic`);
      } else {
        const r = await streamCompletion(url, probe);
        assert.equal(r.status, 200);
        assert.deepEqual(r.tokenIds, reference, `probe ${i} (streamed) differs under traffic`);
      }
    }
  } finally {
    stop = true;
    await Promise.all(workers);
  }
  assert.deepEqual(failures, []);
  assert.ok(trafficRequests > PROBES, `too little traffic: ${trafficRequests} requests`);
  assert.ok(reloads > 4, `too few in-place reloads: ${reloads}`);
  const m = await assertNoLeaks(url);
  assert.equal(m.get('vllm:request_success_total', { finished_reason: 'error' }), 0);
  for (const code of ['404', '500', '502', '503', '504']) {
    const during = (m.get('moelora_http_errors_total', { code }) ?? 0) - (errorsBefore.get('moelora_http_errors_total', { code }) ?? 0);
    assert.equal(during, 0, `HTTP ${code} answered ${during} time(s) during the soak`);
  }
  assert.ok(m.get('moelora_lora_slots_total') === 2);
  // After the traffic, alone again: still the same.
  assert.deepEqual((await post(url, '/v1/completions', probe)).json.choices[0].token_ids, reference);
  console.log(`# soak: ${trafficRequests} traffic requests, ${PROBES} probes, ${Date.now() - started} ms, ` +
    `${m.get('vllm:num_preemptions_total')} preemptions, ${reloads} in-place reloads`);
});
