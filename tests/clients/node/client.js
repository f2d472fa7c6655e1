#!/usr/bin/env node
// A small Node.js client of the rollfleet frontend socket, written from PROTOCOL.md.
//
// Library:  const { Client } = require("./client");
//           const c = new Client("tcp://127.0.0.1:5555"); c.connect();
//           const r = await c.generate("r1", [1, 2, 3], { max_tokens: 8 }, { stream: true, onChunk });
// CLI:      node client.js run ADDRESS < script     (one JSON line printed per script line)
//           node client.js golden DIR               (checks every golden vector in DIR)
//
// Script lines (the same for the C client; the conformance test writes them):
//   generate ID PROMPT [max_tokens=N temperature=X top_p=X top_k=N seed=N stream=1]
//   abort_after ID N PROMPT [options]     stream ID and abort it once N chunks arrived
//   abort ID | stats | control OP
//   raw ANSWER_ID HEX                     send HEX as a header frame; print the answer with
//                                         id ANSWER_ID ("-" for the empty id)
//   hello                                 say hello with batch: true (PROTOCOL.md 4.1); answers
//                                         may then come several to a frame
//   batch PREFIX N PROMPT [options]       N generates PREFIX0..PREFIX{N-1} (prompt PROMPT,i) in
//                                         one batch frame; prints their results in order and
//                                         how many frames brought the answers
// PROMPT is comma-separated token ids ("-" for none); sampling is greedy unless told.
"use strict";

const fs = require("fs");
const path = require("path");
const zmq = require("zeromq");
const { encode, decode } = require("@msgpack/msgpack");

const PROTOCOL_VERSION = 1;

class ProtocolError extends Error {
  // An error reply: `code` is the wire error code (PROTOCOL.md, "Error codes").
  constructor(code, message, requestId = null) {
    super(`${code}: ${message}`);
    this.code = code;
    this.detail = message;
    this.requestId = requestId;
  }
}

// Decode one header frame and check what every message must have: a map with v, type, id.
function decodeHeader(frame) {
  return checkHeader(decode(frame));
}

function checkHeader(msg) {
  if (msg === null || typeof msg !== "object" || Array.isArray(msg) || msg instanceof Uint8Array) {
    throw new Error("header is not a map");
  }
  if (msg.v !== PROTOCOL_VERSION) throw new Error(`protocol version ${msg.v} != ${PROTOCOL_VERSION}`);
  if (typeof msg.type !== "string") throw new Error("field 'type' is not a string");
  if (typeof msg.id !== "string") throw new Error("field 'id' is not a string");
  return msg;
}

function encodeMessage(type, id, fields) {
  // v, type and id first, then the fields; undefined fields are left out (defaults apply).
  return encode({ v: PROTOCOL_VERSION, type, id, ...fields }, { ignoreUndefined: true });
}

class Client {
  constructor(address, { routingId } = {}) {
    this.address = address;
    this.sock = new zmq.Dealer(routingId ? { routingId } : {});
    this.requests = new Map(); // request id -> {onChunk, resolve, reject}
    this.calls = new Map(); // call id -> {resolve, reject, raw}
    this.nextCall = 1;
    this.framesReceived = 0;
    this.batches = false; // the fleet said it sends this client batches (hello)
    this.sending = Promise.resolve(); // zeromq allows one send at a time: sends are chained
    this.closed = false;
  }

  connect() {
    this.sock.connect(this.address);
    this.reader = this._readLoop();
    return this;
  }

  async _readLoop() {
    try {
      for await (const frames of this.sock) {
        this._onFrames(frames);
      }
    } catch (err) {
      if (!this.closed) this._failAll(err);
    }
  }

  _onFrames(frames) {
    // (header, *buffers): the frontend sends no buffers, extra frames are ignored.
    this.framesReceived += 1;
    let msg;
    try {
      msg = decodeHeader(frames[0]);
    } catch (err) {
      process.stderr.write(`rollfleet client: dropped a bad message: ${err.message}\n`);
      return;
    }
    if (msg.type !== "batch") {
      this._onMessage(msg);
      return;
    }
    // A batch (only after hello with batch: true): its messages, in order, each checked alone.
    for (const item of Array.isArray(msg.messages) ? msg.messages : []) {
      let inner;
      try {
        inner = checkHeader(item);
      } catch (err) {
        process.stderr.write(`rollfleet client: dropped a bad message in a batch: ${err.message}\n`);
        continue;
      }
      this._onMessage(inner);
    }
  }

  _onMessage(msg) {
    const call = this.calls.get(msg.id);
    if (call && (call.raw || msg.type === "reply" || msg.type === "error")) {
      this.calls.delete(msg.id);
      if (call.raw) call.resolve(msg);
      else if (msg.type === "reply") call.resolve(msg.data || {});
      else call.reject(new ProtocolError(msg.code, msg.message || "", msg.request_id ?? null));
      return;
    }
    const req = this.requests.get(msg.id);
    if (!req) return; // a late answer to something this client no longer waits for
    if (msg.type === "chunk") {
      if (req.onChunk) req.onChunk(msg);
    } else if (msg.type === "result") {
      this.requests.delete(msg.id);
      req.resolve(msg);
    } else if (msg.type === "error") {
      this.requests.delete(msg.id);
      req.reject(new ProtocolError(msg.code, msg.message || "", msg.request_id ?? null));
    }
  }

  _failAll(err) {
    for (const r of this.requests.values()) r.reject(err);
    for (const c of this.calls.values()) c.reject(err);
    this.requests.clear();
    this.calls.clear();
  }

  _send(frame) {
    const next = this.sending.then(() => this.sock.send(frame));
    this.sending = next.catch(() => {});
    return next;
  }

  _call(type, fields) {
    const id = `call-${this.nextCall++}`;
    return new Promise((resolve, reject) => {
      this.calls.set(id, { resolve, reject, raw: false });
      this._send(encodeMessage(type, id, fields)).catch(reject);
    });
  }

  // Generate; resolves with the result message (all tokens), rejects with ProtocolError.
  // With stream, onChunk receives each chunk message (only the tokens new since the last one).
  generate(requestId, promptIds, sampling = {}, { stream = false, onChunk, sessionId, resume } = {}) {
    if (this.requests.has(requestId)) {
      return Promise.reject(new Error(`request ${requestId} is already in flight`));
    }
    return new Promise((resolve, reject) => {
      this.requests.set(requestId, { onChunk, resolve, reject });
      const fields = { prompt_ids: promptIds, sampling, stream, session_id: sessionId, resume };
      this._send(encodeMessage("generate", requestId, fields)).catch(reject);
    });
  }

  // Resolves true once the fleet accepted the abort, false if no such request is in flight.
  // The request itself still ends with its result (finish_reason "abort", tokens so far).
  async abort(requestId) {
    try {
      await this._call("abort", { request_id: requestId });
      return true;
    } catch (err) {
      if (err instanceof ProtocolError && err.code === "unknown_request") return false;
      throw err;
    }
  }

  stats() {
    return this._call("stats", {});
  }

  // Ask the fleet to send this client's answers in batches; resolves with the reply's data
  // ({batch: true} from a fleet that will).
  async hello() {
    const data = await this._call("hello", { batch: true });
    this.batches = data.batch === true;
    return data;
  }

  // Several generates in one batch frame (any client may send one; answers come in batches
  // only after hello). Resolves with their results in the order given; rejects with the first
  // error.
  generateMany(requests) {
    const promises = requests.map(({ id }) => new Promise((resolve, reject) => {
      this.requests.set(id, { onChunk: null, resolve, reject });
    }));
    const messages = requests.map(({ id, promptIds, sampling }) => (
      { v: PROTOCOL_VERSION, type: "generate", id, prompt_ids: promptIds, sampling }));
    this._send(encodeMessage("batch", "", { messages })).catch((err) => {
      for (const { id } of requests) {
        const req = this.requests.get(id);
        this.requests.delete(id);
        if (req) req.reject(err);
      }
    });
    return Promise.all(promises);
  }

  control(op, args = {}) {
    return this._call("control", { op, args });
  }

  // Send a header frame as is and resolve with the next message carrying `expectId`
  // (for bad input, whose error reply has the id "" when the id could not be read).
  raw(frame, expectId) {
    return new Promise((resolve, reject) => {
      this.calls.set(expectId, { resolve, reject, raw: true });
      this._send(frame).catch(reject);
    });
  }

  close() {
    this.closed = true;
    this.sock.close();
  }
}

// ---------------------------------------------------------------------------- CLI: run

function parseScriptLine(line) {
  const words = line.trim().split(/\s+/);
  const cmd = words.shift();
  const options = {};
  const positional = [];
  for (const w of words) {
    const eq = w.indexOf("=");
    if (eq > 0) options[w.slice(0, eq)] = Number(w.slice(eq + 1));
    else positional.push(w);
  }
  return { cmd, positional, options };
}

function tokens(text) {
  return text === "-" ? [] : text.split(",").map(Number);
}

function samplingOf(options) {
  const sampling = { temperature: 0 };
  for (const key of ["max_tokens", "temperature", "top_p", "top_k", "seed"]) {
    if (key in options) sampling[key] = options[key];
  }
  return sampling;
}

function resultView(msg) {
  return {
    token_ids: msg.token_ids,
    finish_reason: msg.finish_reason,
    logprobs: msg.logprobs ?? null,
    weight_versions: msg.weight_versions ?? [],
    num_preemptions: msg.num_preemptions ?? 0,
    worker: msg.worker ?? "",
    timings: Object.keys(msg.timings ?? {}).sort(),
  };
}

function errorView(err) {
  if (!(err instanceof ProtocolError)) throw err;
  return { code: err.code, message: err.detail, request_id: err.requestId };
}

async function runLine(client, line) {
  const { cmd, positional, options } = parseScriptLine(line);
  if (cmd === "generate" || cmd === "abort_after") {
    const id = positional[0];
    const abortAfter = cmd === "abort_after" ? Number(positional[1]) : null;
    const prompt = tokens(positional[cmd === "abort_after" ? 2 : 1]);
    const stream = cmd === "abort_after" || options.stream === 1;
    const out = { cmd, id, chunks: [] };
    let aborting = null;
    const onChunk = (chunk) => {
      out.chunks.push(chunk.token_ids);
      if (abortAfter !== null && out.chunks.length === abortAfter) {
        aborting = client._call("abort", { request_id: id }).then(
          (data) => ({ reply: data }),
          (err) => ({ error: errorView(err) }),
        );
      }
    };
    try {
      out.result = resultView(await client.generate(id, prompt, samplingOf(options), { stream, onChunk }));
    } catch (err) {
      out.error = errorView(err);
    }
    if (abortAfter !== null) out.abort = aborting ? await aborting : null;
    return out;
  }
  if (cmd === "abort") {
    try {
      return { cmd, request_id: positional[0], reply: await client._call("abort", { request_id: positional[0] }) };
    } catch (err) {
      return { cmd, request_id: positional[0], error: errorView(err) };
    }
  }
  if (cmd === "stats") return { cmd, reply: await client.stats() };
  if (cmd === "control") {
    try {
      return { cmd, op: positional[0], reply: await client.control(positional[0]) };
    } catch (err) {
      return { cmd, op: positional[0], error: errorView(err) };
    }
  }
  if (cmd === "hello") return { cmd, reply: await client.hello() };
  if (cmd === "batch") {
    const [prefix, count, prompt] = [positional[0], Number(positional[1]), tokens(positional[2])];
    const requests = Array.from({ length: count }, (_, i) => (
      { id: `${prefix}${i}`, promptIds: [...prompt, i], sampling: samplingOf(options) }));
    const framesBefore = client.framesReceived;
    try {
      const results = (await client.generateMany(requests)).map(resultView);
      return { cmd, results, frames: client.framesReceived - framesBefore };
    } catch (err) {
      return { cmd, error: errorView(err) };
    }
  }
  if (cmd === "raw") {
    const answer = await client.raw(Buffer.from(positional[1], "hex"), positional[0] === "-" ? "" : positional[0]);
    return { cmd, answer };
  }
  throw new Error(`unknown script command ${cmd}`);
}

async function run(address, scriptText) {
  const client = new Client(address).connect();
  try {
    for (const line of scriptText.split("\n")) {
      if (!line.trim() || line.trim().startsWith("#")) continue;
      process.stdout.write(JSON.stringify(await runLine(client, line)) + "\n");
    }
  } finally {
    client.close();
  }
}

// ---------------------------------------------------------------------------- CLI: golden

// The JSON convention of the golden vectors: {"$bin": hex} is a msgpack bin value.
function fromJson(value) {
  if (Array.isArray(value)) return value.map(fromJson);
  if (value !== null && typeof value === "object") {
    const keys = Object.keys(value);
    if (keys.length === 1 && keys[0] === "$bin") return Uint8Array.from(Buffer.from(value.$bin, "hex"));
    return Object.fromEntries(keys.map((k) => [k, fromJson(value[k])]));
  }
  return value;
}

function difference(got, want, where) {
  if (want instanceof Uint8Array) {
    if (!(got instanceof Uint8Array) || Buffer.compare(Buffer.from(got), Buffer.from(want)) !== 0) {
      return `${where}: bin differs`;
    }
    return null;
  }
  if (Array.isArray(want)) {
    if (!Array.isArray(got) || got.length !== want.length) return `${where}: array differs`;
    for (let i = 0; i < want.length; i++) {
      const d = difference(got[i], want[i], `${where}[${i}]`);
      if (d) return d;
    }
    return null;
  }
  if (want !== null && typeof want === "object") {
    if (got === null || typeof got !== "object" || Array.isArray(got)) return `${where}: not a map`;
    const gk = Object.keys(got);
    const wk = Object.keys(want);
    if (gk.join(",") !== wk.join(",")) return `${where}: keys ${gk} != ${wk}`;
    for (const k of wk) {
      const d = difference(got[k], want[k], `${where}.${k}`);
      if (d) return d;
    }
    return null;
  }
  return got === want ? null : `${where}: ${JSON.stringify(got)} != ${JSON.stringify(want)}`;
}

// Types this client encodes itself; their bytes must equal the vectors exactly.
const ENCODED_TYPES = ["generate", "abort", "stats", "control"];

function golden(dir) {
  const names = fs.readdirSync(dir).filter((f) => f.endsWith(".msgpack")).map((f) => f.slice(0, -8)).sort();
  const failures = [];
  for (const name of names) {
    const raw = fs.readFileSync(path.join(dir, `${name}.msgpack`));
    const want = fromJson(JSON.parse(fs.readFileSync(path.join(dir, `${name}.json`), "utf8")));
    let got;
    try {
      got = decodeHeader(raw);
    } catch (err) {
      failures.push(`${name}: ${err.message}`);
      continue;
    }
    const d = difference(got, want, name);
    if (d) failures.push(d);
    if (got.type !== name) failures.push(`${name}: type ${got.type}`);
    if (ENCODED_TYPES.includes(name)) {
      const { v, type, id, ...fields } = want;
      const mine = Buffer.from(encodeMessage(type, id, fields));
      if (Buffer.compare(mine, raw) !== 0) failures.push(`${name}: encoding differs: ${mine.toString("hex")}`);
    }
  }
  return { checked: names, failures };
}

async function main(argv) {
  const [command, arg] = argv;
  if (command === "run" && arg) {
    await run(arg, fs.readFileSync(0, "utf8"));
    return 0;
  }
  if (command === "golden" && arg) {
    const report = golden(arg);
    process.stdout.write(JSON.stringify(report) + "\n");
    return report.failures.length ? 1 : 0;
  }
  process.stderr.write("usage: client.js run ADDRESS < script | client.js golden DIR\n");
  return 2;
}

module.exports = { Client, ProtocolError, decodeHeader, encodeMessage, PROTOCOL_VERSION };

if (require.main === module) {
  main(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (err) => {
      process.stderr.write(`${err.stack || err}\n`);
      process.exit(1);
    },
  );
}
