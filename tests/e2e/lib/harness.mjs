// Starts the real `moelora serve` on a free loopback port and talks to it: raw HTTP (node:http,
// so malformed requests and mid-stream disconnects are possible), SSE parsing, /metrics parsing
// and the leak check every fault test ends with.
import { spawn } from 'node:child_process';
import http from 'node:http';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', '..');

// The moelora binary: --moelora PATH on the command line (CTest passes the built target).
export function moeloraBinary() {
  const i = process.argv.indexOf('--moelora');
  if (i < 0 || !process.argv[i + 1]) throw new Error('usage: node <test>.mjs --moelora /path/to/moelora');
  return path.resolve(process.argv[i + 1]);
}

// Flags every e2e server gets: loopback, any free port, a short context (so "too long" is
// cheap to hit), a 1 MiB body limit, runtime LoRA confined to the repository.
const DEFAULT_SERVE_FLAGS = [
  ['--host', '127.0.0.1'], ['--port', '0'], ['--max-model-len', '256'], ['--max-request-bytes', '1048576'],
  ['--allow-runtime-lora'], ['--lora-root', repoRoot], ['--log-level', 'warn'],
];

// A flag in `extraArgs` replaces its default (the server refuses a flag given twice). Global
// options (--log-level) are accepted after the subcommand too.
export async function startServer(extraArgs = [], { env = {}, waitReady = true } = {}) {
  const bin = moeloraBinary();
  const defaults = DEFAULT_SERVE_FLAGS.filter(([flag]) => !extraArgs.includes(flag)).flat();
  const args = ['serve', ...defaults, ...extraArgs];
  const proc = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } });
  let stdout = '';
  let stderr = '';
  proc.stderr.on('data', (d) => { stderr += d; });
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start in 60 s\n${stdout}\n${stderr}`)), 60000);
    proc.stdout.on('data', (d) => {
      stdout += d;
      const m = stdout.match(/listening on (http:\/\/[^\s]+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    });
    proc.on('exit', (code) => { clearTimeout(timer); reject(new Error(`server exited (${code})\n${stdout}\n${stderr}`)); });
  });
  // The port is bound before the model loads: /health answers 503 until the server is ready.
  if (waitReady) {
    const deadline = Date.now() + 60000;
    for (;;) {
      const h = await get(url, '/health').catch(() => ({ status: 0 }));
      if (h.status === 200) break;
      if (Date.now() > deadline) throw new Error(`server not ready in 60 s\n${stdout}\n${stderr}`);
      await sleep(20);
    }
  }
  const server = {
    url,
    proc,
    logs: () => stdout + stderr,
    async stop() {
      if (proc.exitCode !== null) return proc.exitCode;
      const exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve(code ?? signal)));
      proc.kill('SIGTERM');
      const killer = setTimeout(() => proc.kill('SIGKILL'), 20000);
      const code = await exited;
      clearTimeout(killer);
      return code;
    },
  };
  return server;
}

// One HTTP request with node:http. `body` is sent as given (a string or Buffer) when not an
// object; objects are JSON-encoded.
export function request(url, method, pathname, body, headers = {}) {
  return new Promise((resolve, reject) => {
    const u = new URL(pathname, url);
    const payload = body === undefined ? undefined
      : (typeof body === 'string' || Buffer.isBuffer(body)) ? body : JSON.stringify(body);
    const req = http.request(u, {
      method,
      agent: false,
      headers: { 'Content-Type': 'application/json', ...(payload !== undefined ? { 'Content-Length': Buffer.byteLength(payload) } : {}), ...headers },
    }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        let json;
        try { json = JSON.parse(text); } catch { json = undefined; }
        resolve({ status: res.statusCode, headers: res.headers, text, json });
      });
      res.on('error', reject);
    });
    req.on('error', reject);
    if (payload !== undefined) req.write(payload);
    req.end();
  });
}

export const post = (url, p, body, headers) => request(url, 'POST', p, body, headers);
export const get = (url, p, headers) => request(url, 'GET', p, undefined, headers);

// Parses an SSE body into its data payloads (JSON objects, or the string '[DONE]').
export function parseSse(text) {
  const events = [];
  for (const block of text.split('\n\n')) {
    for (const line of block.split('\n')) {
      if (!line.startsWith('data: ')) continue;
      const data = line.slice(6);
      events.push(data === '[DONE]' ? data : JSON.parse(data));
    }
  }
  return events;
}

// A streamed completion through raw HTTP: the text, token ids and finish reason of choice 0.
export async function streamCompletion(url, body, p = '/v1/completions') {
  const res = await post(url, p, { ...body, stream: true });
  if (res.status !== 200) return { status: res.status, json: res.json };
  const events = parseSse(res.text);
  let text = '';
  const tokenIds = [];
  let finish = null;
  let usage = null;
  let error = null;
  for (const e of events) {
    if (e === '[DONE]') continue;
    if (e.error) { error = e.error; continue; }
    if (e.usage) usage = e.usage;
    for (const c of e.choices ?? []) {
      text += c.text ?? c.delta?.content ?? '';
      if (c.token_ids) tokenIds.push(...c.token_ids);
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { status: 200, text, tokenIds, finish, usage, error, events };
}

// /metrics as {"name{labels}": value}, with a lookup that ignores the model_name label.
export async function metrics(url) {
  const res = await get(url, '/metrics');
  const values = new Map();
  for (const line of res.text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const sp = line.lastIndexOf(' ');
    values.set(line.slice(0, sp), Number(line.slice(sp + 1)));
  }
  return {
    text: res.text,
    values,
    // The value of a sample whose name is `name` and whose labels include `labels`.
    get(name, labels = {}) {
      for (const [k, v] of values) {
        const brace = k.indexOf('{');
        if ((brace < 0 ? k : k.slice(0, brace)) !== name) continue;
        if (Object.entries(labels).every(([lk, lv]) => k.includes(`${lk}="${lv}"`))) return v;
      }
      return undefined;
    },
  };
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Waits until the server is idle and nothing is held: no running or waiting request, no KV
// page or adapter slot referenced, no HTTP generation response open. Throws with the numbers
// when that does not happen in time.
export async function assertNoLeaks(url, timeoutMs = 15000) {
  const deadline = Date.now() + timeoutMs;
  let m;
  for (;;) {
    m = await metrics(url);
    const held = {
      running: m.get('vllm:num_requests_running'),
      waiting: m.get('vllm:num_requests_waiting'),
      kv_pages_used: m.get('moelora_kv_pages_used'),
      lora_slots_used: m.get('moelora_lora_slots_used'),
      http_requests_active: m.get('moelora_http_requests_active'),
    };
    if (Object.values(held).every((v) => v === 0)) return m;
    if (Date.now() > deadline) throw new Error(`resources still held after ${timeoutMs} ms: ${JSON.stringify(held)}`);
    await sleep(50);
  }
}

export async function assertHealthy(url) {
  const res = await get(url, '/health');
  if (res.status !== 200) throw new Error(`/health answered ${res.status}`);
}
