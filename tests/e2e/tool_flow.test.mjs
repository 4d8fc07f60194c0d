// Tool calling end to end with the official `openai` npm client against the real server on the
// bundled tiny model (CPU): tools and tool_choice ("auto", "none"; "required" and named functions
// are refused with the documented 400), the conversation continued with the assistant's
// tool_calls and a `tool` message, streamed and not, usage counts against /tokenize, the rendered
// prompt, malformed tools, and the client's own tool loop (runTools).
//
// The model's weights are random, so its own text never holds a tool call. To see a real parsed
// call end to end, the generation is steered with sampling controls the API offers (vLLM's
// allowed_token_ids, logit_bias and bad_words), never with a test hook: see `steering()` below.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';

import { assertNoLeaks, post, startServer } from './lib/harness.mjs';

const BASE = 'tiny-qwen3moe';
let server;
let client;

before(async () => {
  // The bundled template's tools block alone is ~200 byte-level tokens: the tool conversations
  // need more context than the harness's default 256.
  server = await startServer(['--max-model-len', '1024']);
  client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60000 });
});

after(async () => {
  if (server) {
    const code = await server.stop();
    assert.equal(code, 0, `server exit code\n${server.logs()}`);
  }
});

const TOOLS = [{
  type: 'function',
  function: { name: 'get_time', description: 'The current time', parameters: { type: 'object', properties: {} } },
}];
const MESSAGES = [{ role: 'user', content: 'What time is it?' }];
// What the bundled template writes for TOOLS (tojson of each tool, in the client's key order).
const RENDERED_TOOLS = '<tools>\n{"type": "function", "function": {"name": "get_time", "description": "The current time", '
  + '"parameters": {"type": "object", "properties": {}}}}\n</tools>';
// finish_reason values the chat completion object allows (OpenAI's spec).
const SPEC_FINISH = ['stop', 'length', 'tool_calls', 'content_filter', 'function_call'];

async function tokenize(body) {
  const res = await post(server.url, '/tokenize', body);
  assert.equal(res.status, 200, res.text);
  return res.json;
}

// The prompt the server renders for a chat request, as text.
async function renderedPrompt(body) {
  const tok = await tokenize(body);
  const res = await post(server.url, '/detokenize', { tokens: tok.tokens });
  assert.equal(res.status, 200, res.text);
  return res.json.prompt;
}

// Reads a chat stream: content, tool-call deltas, finish reasons, usage, and checks every chunk's
// shape on the way.
async function readChatStream(stream) {
  const out = { content: '', toolDeltas: [], finish: [], usage: null, chunks: 0, ids: new Set(), role: null };
  for await (const chunk of stream) {
    out.chunks++;
    assert.equal(chunk.object, 'chat.completion.chunk');
    assert.match(chunk.id, /^chatcmpl-/);
    out.ids.add(chunk.id);
    assert.equal(typeof chunk.created, 'number');
    if (chunk.usage) out.usage = chunk.usage;
    for (const c of chunk.choices) {
      assert.equal(c.index, 0);
      if (out.chunks === 1) out.role = c.delta.role;
      if (typeof c.delta.content === 'string') out.content += c.delta.content;
      for (const d of c.delta.tool_calls ?? []) out.toolDeltas.push(d);
      if (c.finish_reason) out.finish.push(c.finish_reason);
    }
  }
  assert.equal(out.ids.size, 1, 'one id for the whole stream');
  return out;
}

// Token counts (cached_tokens is left out: it depends on what the prefix cache holds by then).
const counts = (u) => ({ prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens, total_tokens: u.total_tokens });

function assertUsage(usage, promptTokens) {
  assert.equal(usage.prompt_tokens, promptTokens);
  assert.ok(usage.completion_tokens >= 1, JSON.stringify(usage));
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
}

// A non-streamed chat completion's single choice, checked against the spec's shapes.
function checkChoice(r) {
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.choices.length, 1);
  const c = r.choices[0];
  assert.equal(c.index, 0);
  assert.equal(c.message.role, 'assistant');
  assert.ok(SPEC_FINISH.includes(c.finish_reason), c.finish_reason);
  if (c.finish_reason === 'tool_calls') {
    assert.ok(Array.isArray(c.message.tool_calls) && c.message.tool_calls.length > 0);
  } else {
    assert.equal(typeof c.message.content, 'string');
    assert.equal(c.message.tool_calls, undefined);
  }
  return c;
}

describe('tools on the model\'s own (random) text', () => {
  const args = { model: BASE, messages: MESSAGES, tools: TOOLS, max_tokens: 16, temperature: 0 };

  test('tool_choice auto, non-streamed: a valid choice, and the tools are part of the prompt', async () => {
    const r = await client.chat.completions.create({ ...args, tool_choice: 'auto' });
    const c = checkChoice(r);
    assert.ok(['stop', 'length', 'tool_calls'].includes(c.finish_reason), c.finish_reason);
    const withTools = await tokenize({ model: BASE, messages: MESSAGES, tools: TOOLS });
    const without = await tokenize({ model: BASE, messages: MESSAGES });
    assertUsage(r.usage, withTools.count);
    assert.ok(withTools.count > without.count + 50, `${withTools.count} vs ${without.count}`);
    if (c.finish_reason === 'length') assert.equal(r.usage.completion_tokens, 16);
    const prompt = await renderedPrompt({ model: BASE, messages: MESSAGES, tools: TOOLS });
    assert.ok(prompt.includes(RENDERED_TOOLS), prompt);
    assert.ok(prompt.endsWith('<|im_start|>user\nWhat time is it?<|im_end|>\n<|im_start|>assistant\n'), prompt);
  });

  test('tool_choice auto, streamed: the same text as the whole response, usage last', async () => {
    const whole = await client.chat.completions.create({ ...args, tool_choice: 'auto' });
    const s = await readChatStream(await client.chat.completions.create({
      ...args, tool_choice: 'auto', stream: true, stream_options: { include_usage: true },
    }));
    assert.equal(s.role, 'assistant');
    assert.deepEqual(s.finish, [whole.choices[0].finish_reason]);
    assert.equal(s.content, whole.choices[0].message.content ?? '');
    assert.deepEqual(counts(s.usage), counts(whole.usage));
  });

  test('tool_choice none: plain content, the tools still in the prompt', async () => {
    const r = await client.chat.completions.create({ ...args, tool_choice: 'none' });
    const c = checkChoice(r);
    assert.ok(['stop', 'length'].includes(c.finish_reason), c.finish_reason);
    assertUsage(r.usage, (await tokenize({ model: BASE, messages: MESSAGES, tools: TOOLS })).count);
    const s = await readChatStream(await client.chat.completions.create({
      ...args, tool_choice: 'none', stream: true, stream_options: { include_usage: true },
    }));
    assert.equal(s.content, c.message.content);
    assert.deepEqual(s.toolDeltas, []);
    // tool_choice "none" needs no tools.
    const plain = await client.chat.completions.create({ model: BASE, messages: MESSAGES, max_tokens: 4, tool_choice: 'none' });
    checkChoice(plain);
  });
});

// Steering the random model into writing exactly TARGET, with vLLM's sampling controls:
//  - allowed_token_ids: only TARGET's characters (the bundled tokenizer has one token per byte);
//  - logit_bias: a strict priority among them, 100 for ORDER[0] down to -100 for the last, in
//    steps of ~12, far larger than the model's own logit spread over these 18 tokens (measured
//    under 2), so greedy decoding picks the highest-priority token that is not banned, whatever
//    the prompt;
//  - bad_words: a word "<context><x>" bans x right after the generated text ends with <context>.
//    At each position of TARGET, every character of higher priority than the wanted one is
//    banned after the shortest context at which x never follows in TARGET (so no ban ever
//    blocks TARGET itself). ORDER was chosen to need few bans (vLLM-style servers take at most
//    128 bad_words);
//  - stop "</tool_call>" with include_stop_str_in_output ends the generation on the closing tag.
// The first character of TARGET needs no context, so ORDER starts with it.
const TARGET = '<tool_call>{"name":"get_time"}</tool_call>';
const ORDER = '<"aetcml/o{i_>ng}:';

function steeringBans(target, order) {
  const rank = new Map([...order].map((c, i) => [c, i]));
  const bans = new Set();
  for (let i = 0; i < target.length; i++) {
    for (const x of order.slice(0, rank.get(target[i]))) {
      let ban = null;
      for (let len = 1; len <= i && !ban; len++) {
        const ctx = target.slice(i - len, i);
        let clash = false;
        for (let j = 0; j < target.length && !clash; j++) clash = target[j] === x && target.slice(0, j).endsWith(ctx);
        if (!clash) ban = ctx + x;
      }
      assert.ok(ban, `no context bans ${x} at ${i}`);
      bans.add(ban);
    }
  }
  return [...bans];
}

let steeringParams;
async function steering() {
  if (steeringParams) return steeringParams;
  assert.deepEqual([...new Set(TARGET)].sort(), [...ORDER].sort(), 'ORDER ranks exactly the characters of TARGET');
  assert.equal(ORDER[0], TARGET[0]);
  const ids = {};
  for (const ch of ORDER) {
    const t = await tokenize({ model: BASE, prompt: ch, add_special_tokens: false });
    assert.equal(t.count, 1, `one token for ${ch}`);
    ids[ch] = t.tokens[0];
  }
  const step = 200 / (ORDER.length - 1);
  const logitBias = Object.fromEntries([...ORDER].map((ch, k) => [String(ids[ch]), Math.round((100 - k * step) * 1000) / 1000]));
  const badWords = steeringBans(TARGET, ORDER);
  assert.ok(badWords.length <= 128, `${badWords.length} bad words`);
  steeringParams = {
    temperature: 0,
    max_tokens: 64,
    allowed_token_ids: Object.values(ids),
    logit_bias: logitBias,
    bad_words: badWords,
    stop: ['</tool_call>'],
    include_stop_str_in_output: true,
  };
  return steeringParams;
}

describe('a tool call the model is steered to write', () => {
  test('without tools the steered text is exactly the call (the steering itself works)', async () => {
    const r = await client.chat.completions.create({ model: BASE, messages: MESSAGES, ...(await steering()) });
    assert.equal(r.choices[0].message.content, TARGET);
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.equal(r.usage.completion_tokens, TARGET.length);
  });

  test('tool_choice auto, non-streamed: an OpenAI tool call, finish_reason tool_calls', async () => {
    const r = await client.chat.completions.create({ model: BASE, messages: MESSAGES, tools: TOOLS, tool_choice: 'auto', ...(await steering()) });
    const c = checkChoice(r);
    assert.equal(c.finish_reason, 'tool_calls');
    assert.equal(c.message.content, null, 'a pure tool call has null content');
    assert.equal(c.message.tool_calls.length, 1);
    const call = c.message.tool_calls[0];
    assert.match(call.id, /^call_[0-9a-f]{24}$/);
    assert.equal(call.type, 'function');
    assert.equal(call.function.name, 'get_time');
    assert.equal(call.function.arguments, '{}');
    assert.deepEqual(JSON.parse(call.function.arguments), {});
    assertUsage(r.usage, (await tokenize({ model: BASE, messages: MESSAGES, tools: TOOLS })).count);
    assert.equal(r.usage.completion_tokens, TARGET.length);
  });

  test('tool_choice none: the same text stays content', async () => {
    const r = await client.chat.completions.create({ model: BASE, messages: MESSAGES, tools: TOOLS, tool_choice: 'none', ...(await steering()) });
    const c = checkChoice(r);
    assert.equal(c.finish_reason, 'stop');
    assert.equal(c.message.content, TARGET);
  });

  test('streamed: the call arrives as OpenAI streams it (id and name, then the arguments)', async () => {
    const s = await readChatStream(await client.chat.completions.create({
      model: BASE, messages: MESSAGES, tools: TOOLS, ...(await steering()), stream: true, stream_options: { include_usage: true },
    }));
    assert.equal(s.role, 'assistant');
    assert.equal(s.content, '', 'no content around the call');
    assert.deepEqual(s.finish, ['tool_calls']);
    assert.equal(s.toolDeltas.length, 2, JSON.stringify(s.toolDeltas));
    const [head, tail] = s.toolDeltas;
    assert.equal(head.index, 0);
    assert.match(head.id, /^call_[0-9a-f]{24}$/);
    assert.equal(head.type, 'function');
    assert.deepEqual(head.function, { name: 'get_time', arguments: '' });
    assert.deepEqual(tail, { index: 0, function: { arguments: '{}' } });
    assert.equal(s.usage.completion_tokens, TARGET.length);
    assertUsage(s.usage, (await tokenize({ model: BASE, messages: MESSAGES, tools: TOOLS })).count);
  });

  test('the conversation continues with the assistant\'s tool_calls and a tool message, streamed and not', async () => {
    const first = await client.chat.completions.create({ model: BASE, messages: MESSAGES, tools: TOOLS, ...(await steering()) });
    const assistant = first.choices[0].message;
    assert.equal(first.choices[0].finish_reason, 'tool_calls');
    const callId = assistant.tool_calls[0].id;
    const messages = [...MESSAGES, assistant, { role: 'tool', tool_call_id: callId, content: '{"time": "12:00"}' }];
    const expectedCount = (await tokenize({ model: BASE, messages, tools: TOOLS })).count;

    const r = await client.chat.completions.create({ model: BASE, messages, tools: TOOLS, max_tokens: 8, temperature: 0 });
    const c = checkChoice(r);
    assert.ok(['stop', 'length', 'tool_calls'].includes(c.finish_reason), c.finish_reason);
    assertUsage(r.usage, expectedCount);
    const s = await readChatStream(await client.chat.completions.create({
      model: BASE, messages, tools: TOOLS, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true },
    }));
    assert.deepEqual(s.finish, [c.finish_reason]);
    assert.deepEqual(counts(s.usage), counts(r.usage));

    // The template got the call (in the client's key order, as transformers renders it) and the
    // tool's answer.
    const prompt = await renderedPrompt({ model: BASE, messages, tools: TOOLS });
    assert.ok(prompt.includes(RENDERED_TOOLS), prompt);
    assert.ok(prompt.endsWith('<|im_start|>user\nWhat time is it?<|im_end|>\n'
      + '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call><|im_end|>\n'
      + '<|im_start|>tool\n{"time": "12:00"}<|im_end|>\n<|im_start|>assistant\n'), prompt);
  });

  for (const stream of [false, true]) {
    test(`the client's own tool loop (runTools, ${stream ? 'streamed' : 'not streamed'}) calls the function and sends its result back`, async () => {
      const seen = [];
      const runner = client.beta.chat.completions.runTools({
        model: BASE,
        messages: MESSAGES,
        tools: [{ type: 'function', function: { name: 'get_time', description: 'The current time', parameters: { type: 'object', properties: {} }, parse: JSON.parse, function: (a) => { seen.push(a); return { time: '12:00' }; } } }],
        ...(await steering()),
        ...(stream ? { stream: true } : {}),
      }, { maxChatCompletions: 2 });
      await runner.done();
      // Every answer is steered into a call, so the loop ends at maxChatCompletions: two calls,
      // two results, the second request carrying the first exchange.
      assert.deepEqual(seen, [{}, {}]);
      const completions = runner.allChatCompletions();
      assert.equal(completions.length, 2);
      for (const cc of completions) {
        assert.equal(cc.choices[0].finish_reason, 'tool_calls');
        assert.equal(cc.choices[0].message.tool_calls[0].function.name, 'get_time');
      }
      const roles = runner.messages.map((m) => m.role);
      assert.deepEqual(roles, ['user', 'assistant', 'tool', 'assistant', 'tool']);
      assert.equal(runner.messages[2].tool_call_id, runner.messages[1].tool_calls[0].id);
      assert.equal(runner.messages[2].content, '{"time":"12:00"}');
      assert.notEqual(runner.messages[1].tool_calls[0].id, runner.messages[3].tool_calls[0].id);
      if (!stream) {
        // The second prompt is the first plus the call and its result (counted like /tokenize).
        const expected = await tokenize({ model: BASE, messages: runner.messages.slice(0, 3), tools: [TOOLS[0]] });
        assert.equal(completions[1].usage.prompt_tokens, expected.count);
      }
    });
  }
});

describe('refused tool requests are 400s with clear messages', () => {
  const base = { model: BASE, messages: MESSAGES, max_tokens: 4 };
  async function rejects(body, message, param, create = (b) => client.chat.completions.create(b)) {
    await assert.rejects(create(body), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name}: ${e.message}`);
      assert.equal(e.status, 400);
      assert.equal(e.error?.message ?? e.message, message);
      assert.equal(e.param, param);
      assert.equal(e.code, 400);
      return true;
    });
  }

  test('tool_choice "required" and a named function need guided decoding (documented)', async () => {
    const msg = '\'tool_choice\' "required" or a named function needs guided decoding, which moelora does not implement; use "auto"';
    await rejects({ ...base, tools: TOOLS, tool_choice: 'required' }, msg, 'tool_choice');
    await rejects({ ...base, tools: TOOLS, tool_choice: { type: 'function', function: { name: 'get_time' } } }, msg, 'tool_choice');
    await rejects({ ...base, tools: TOOLS, tool_choice: 'sometimes' },
      '\'tool_choice\' must be "auto", "none", "required" or a named function, got "sometimes"', 'tool_choice');
    await rejects({ ...base, tool_choice: 'auto' }, '\'tool_choice\' needs \'tools\'', 'tool_choice');
  });

  test('a malformed tools array', async () => {
    const shape = 'every tool must be {"type": "function", "function": {"name": ...}}';
    await rejects({ ...base, tools: { type: 'function', function: { name: 'f' } } },
      '\'tools\' must be an array of tools, got {"function":{"name":"f"},"type":"function"}', 'tools');
    await rejects({ ...base, tools: [{ type: 'function' }] }, shape, 'tools');
    await rejects({ ...base, tools: [{ type: 'function', function: { name: '' } }] }, shape, 'tools');
    await rejects({ ...base, tools: [{ type: 'function', function: { description: 'no name' } }] }, shape, 'tools');
    await rejects({ ...base, tools: [{ type: 'retrieval', function: { name: 'f' } }] }, shape, 'tools');
    // A non-string type was a 500 ("internal error: [json.exception.type_error.302] ...").
    await rejects({ ...base, tools: [{ type: 5, function: { name: 'f' } }] }, shape, 'tools');
    await rejects({ ...base, tools: ['get_time'] }, shape, 'tools');
    // /tokenize reads tools the same way.
    const tok = await post(server.url, '/tokenize', { model: BASE, messages: MESSAGES, tools: [{ type: 5, function: { name: 'f' } }] });
    assert.equal(tok.status, 400, tok.text);
    assert.equal(tok.json.error.message, shape);
  });

  test('a malformed assistant tool call, and tools on /v1/completions', async () => {
    await rejects({ ...base, messages: [...MESSAGES, { role: 'assistant', content: null, tool_calls: [{ id: 'x', type: 'function', function: {} }] }] },
      'every tool call needs a \'function\' with a string \'name\'', 'messages');
    await rejects({ model: BASE, prompt: 'x', max_tokens: 2, tools: TOOLS }, '\'tools\' is only supported by chat completions', 'tools',
      (b) => client.completions.create(b));
  });

  test('nothing is held afterwards', async () => {
    await assertNoLeaks(server.url);
  });
});
