// k6 load test: virtual users streaming chat completions from kubesgl's OpenAI API.
//
//   BASE_URL=http://127.0.0.1:8000 .venv/bin/k6 run --no-usage-report loadtest/k6/chat_stream.js   (or: make loadtest-k6)
//
// Knobs (environment): BASE_URL, API_KEY, MODEL (default: the first of /v1/models), PROMPT_MIX
// ("WORDS:WEIGHT,...", e.g. "16:6,128:3,512:1": prompt lengths in words and their weights), MAX_TOKENS (32),
// VUS (4, at most 1000), DURATION (20s, at most 24h). Thresholds: MAX_ERROR_RATE (0), TTFT_P95_MS (5000),
// ITL_P95_MS (1000), E2E_P95_MS (30000); k6 exits non-zero when one is crossed.
//
// k6 reads a response only once it is complete, so it cannot timestamp each streamed token. It times the
// first byte and the whole body: `ttft` is the time to the first byte of the stream (the gateway sends it
// once the request is admitted, so it excludes prefill) and `itl` is the rest of the stream divided by the
// gaps between its content chunks (so it includes prefill). For per-token distributions use locust or
// loadtest/replay.py, which read the stream as it arrives.

import http from 'k6/http';
import { check } from 'k6';
import { Counter, Rate, Trend } from 'k6/metrics';

const BASE_URL = (__ENV.BASE_URL || 'http://127.0.0.1:8000').replace(/\/+$/, '');
const API_KEY = __ENV.API_KEY || '';
const MAX_TOKENS = intEnv('MAX_TOKENS', 32, 1, 1 << 20);
const VUS = intEnv('VUS', 4, 1, 1000);
const DURATION = durationEnv('DURATION', '20s');
const MAX_ERROR_RATE = Number(__ENV.MAX_ERROR_RATE || '0');
const PROMPT_MIX = parseMix(__ENV.PROMPT_MIX || '16:6,128:3,512:1');

const WORDS = ('time year people way day man thing woman life child world school state family student group ' +
  'country problem hand part place case week company system program question work government number night ' +
  'point home water room mother area money story fact month lot right study book eye job word business issue ' +
  'side kind head house service friend father power hour game line end member law').split(' ');

const ttft = new Trend('ttft', true);
const itl = new Trend('itl', true);
const completionTokens = new Counter('completion_tokens');
const streamErrors = new Rate('stream_errors');

export const options = {
  scenarios: {
    chat_stream: { executor: 'constant-vus', vus: VUS, duration: DURATION, gracefulStop: '60s' },
  },
  thresholds: {
    http_req_failed: [`rate<=${MAX_ERROR_RATE}`],
    stream_errors: [`rate<=${MAX_ERROR_RATE}`],
    ttft: [`p(95)<${intEnv('TTFT_P95_MS', 5000, 1, 3600000)}`],
    itl: [`p(95)<${intEnv('ITL_P95_MS', 1000, 1, 3600000)}`],
    'http_req_duration{name:chat_stream}': [`p(95)<${intEnv('E2E_P95_MS', 30000, 1, 3600000)}`],
  },
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'],
};

function intEnv(name, fallback, min, max) {
  const raw = __ENV[name];
  const value = raw === undefined || raw === '' ? fallback : Number(raw);
  if (!Number.isInteger(value) || value < min || value > max) {
    throw new Error(`${name}=${raw}: expected an integer in [${min}, ${max}]`);
  }
  return value;
}

function durationEnv(name, fallback) {
  const raw = __ENV[name] || fallback;
  const m = /^(\d+)(s|m|h)$/.exec(raw);
  const seconds = m ? Number(m[1]) * { s: 1, m: 60, h: 3600 }[m[2]] : NaN;
  if (!(seconds >= 1 && seconds <= 86400)) {
    throw new Error(`${name}=${raw}: expected a duration like 20s, 5m or 1h, at most 24h`);
  }
  return raw;
}

function parseMix(spec) {
  const mix = [];
  for (const part of spec.split(',').map((p) => p.trim()).filter((p) => p)) {
    const [words, weight] = part.split(':');
    const n = Number(words);
    const w = weight === undefined ? 1 : Number(weight);
    if (!Number.isInteger(n) || n < 1 || !(w > 0)) {
      throw new Error(`PROMPT_MIX part "${part}" is not WORDS:WEIGHT`);
    }
    mix.push({ words: n, weight: w });
  }
  if (mix.length === 0) throw new Error(`PROMPT_MIX "${spec}" names no prompt length`);
  return mix;
}

function pickLength() {
  const total = PROMPT_MIX.reduce((s, m) => s + m.weight, 0);
  let r = Math.random() * total;
  for (const m of PROMPT_MIX) {
    r -= m.weight;
    if (r < 0) return m.words;
  }
  return PROMPT_MIX[PROMPT_MIX.length - 1].words;
}

function prompt(words) {
  const out = [];
  for (let i = 0; i < words; i++) out.push(WORDS[Math.floor(Math.random() * WORDS.length)]);
  return 'Summarize: ' + out.join(' ');
}

function headers() {
  const h = { 'Content-Type': 'application/json' };
  if (API_KEY) h.Authorization = `Bearer ${API_KEY}`;
  return h;
}

export function setup() {
  if (__ENV.MODEL) return { model: __ENV.MODEL };
  const res = http.get(`${BASE_URL}/v1/models`, { headers: headers(), tags: { name: 'models' } });
  const models = res.status === 200 ? res.json('data') : [];
  if (!models || models.length === 0) {
    throw new Error(`set MODEL: GET /v1/models answered ${res.status} ${String(res.body).slice(0, 200)}`);
  }
  return { model: models[0].id };
}

// Reads the SSE body: content chunks, the finish reason, usage, an error event, the [DONE] marker.
function readStream(body) {
  const s = { chunks: 0, done: false, finish: null, tokens: null, error: null };
  for (const line of String(body || '').split('\n')) {
    if (!line.startsWith('data:')) continue;
    const data = line.slice(5).trim();
    if (data === '[DONE]') {
      s.done = true;
      continue;
    }
    let event;
    try {
      event = JSON.parse(data);
    } catch (e) {
      s.error = `malformed event: ${data.slice(0, 200)}`;
      continue;
    }
    if (event.error) s.error = event.error.message || JSON.stringify(event.error);
    if (event.usage) s.tokens = event.usage.completion_tokens;
    for (const choice of event.choices || []) {
      if (choice.delta && choice.delta.content) s.chunks += 1;
      if (choice.finish_reason) s.finish = choice.finish_reason;
    }
  }
  return s;
}

export default function (data) {
  const body = JSON.stringify({
    model: data.model,
    messages: [{ role: 'user', content: prompt(pickLength()) }],
    max_tokens: MAX_TOKENS,
    stream: true,
    stream_options: { include_usage: true },
  });
  const res = http.post(`${BASE_URL}/v1/chat/completions`, body, {
    headers: headers(),
    timeout: '300s',
    tags: { name: 'chat_stream' },
  });
  const s = res.status === 200 ? readStream(res.body) : null;
  const ok = check(res, {
    'status is 200': (r) => r.status === 200,
    'stream finished with [DONE]': () => s !== null && s.done && s.finish !== null,
    'no error event': () => s !== null && s.error === null,
  });
  streamErrors.add(!ok);
  if (!ok) {
    const why = s === null ? `HTTP ${res.status} ${res.error || ''}` : s.error || 'stream cut before [DONE]';
    console.warn(`request failed: ${why}: ${String(res.body || '').slice(0, 300)}`);
    return;
  }
  ttft.add(res.timings.waiting);
  if (s.chunks > 1) itl.add(res.timings.receiving / (s.chunks - 1));
  if (s.tokens !== null) completionTokens.add(s.tokens);
}
