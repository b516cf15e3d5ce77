// A client of the engine core wire protocol (docs/protocol.md): one DEALER socket, frames
// [type byte, msgpack payload, buffer frames...], array-like messages in field order.
import { createHash, createPrivateKey, createPublicKey } from "node:crypto";
import { decode, encode, ExtensionCodec } from "@msgpack/msgpack";
import { Dealer } from "zeromq";

export const PROTOCOL_VERSION = 6;

// ENGINE_CORE_KEY (docs/protocol.md): CurveZMQ key pairs derived from one shared secret.
const Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
function z85(bytes) {
  let out = "";
  for (let i = 0; i < bytes.length; i += 4) {
    let value = ((bytes[i] << 24) >>> 0) + (bytes[i + 1] << 16) + (bytes[i + 2] << 8) + bytes[i + 3];
    let chunk = "";
    for (let j = 0; j < 5; j++, value = Math.floor(value / 85)) chunk = Z85[value % 85] + chunk;
    out += chunk;
  }
  return out;
}
const X25519_PKCS8_PREFIX = Buffer.from("302e020100300506032b656e04220420", "hex");
function keyPair(label, secret) {
  const secretKey = createHash("sha256").update(Buffer.from(label, "latin1")).update(secret, "utf8").digest();
  const privateKey = createPrivateKey({ key: Buffer.concat([X25519_PKCS8_PREFIX, secretKey]), format: "der", type: "pkcs8" });
  const spki = createPublicKey(privateKey).export({ format: "der", type: "spki" });
  return { publicKey: z85(spki.subarray(spki.length - 32)), secretKey: z85(secretKey) };
}
/** The Dealer options of a client holding the engine core's secret. */
export function curveOptions(secret) {
  const server = keyPair("engine-core/server\0", secret);
  const client = keyPair("engine-core/client\0", secret);
  return { curveServerKey: server.publicKey, curvePublicKey: client.publicKey, curveSecretKey: client.secretKey };
}
// A large array travels as msgpack Ext 1, [dtype, shape, buffer index], its bytes in a frame.
export const ARRAY_EXT_CODE = 1;
const TYPED_ARRAYS = { int32: Int32Array, int64: BigInt64Array, float32: Float32Array };

const arrayCodec = new ExtensionCodec();
arrayCodec.register({
  type: ARRAY_EXT_CODE,
  encode: () => null, // this client sends plain arrays, which the engine core accepts too
  decode: (data, _type, buffers) => toArray(decode(data), buffers),
});

/** The array an Ext names as plain nested JS arrays (numbers; int64 too, exact below 2**53). */
function toArray([dtype, shape, index], buffers) {
  const Typed = TYPED_ARRAYS[dtype];
  const frame = buffers[index];
  if (Typed === undefined || frame === undefined) throw new Error(`bad array extension ${dtype} ${index}`);
  // Copied into aligned memory: typed arrays need it and the frame's offset may be odd.
  const bytes = new Uint8Array(frame);
  const flat = Array.from(new Typed(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength)), Number);
  if (shape.length === 1) return flat;
  const width = shape[1];
  return Array.from({ length: shape[0] }, (_, i) => flat.slice(i * width, (i + 1) * width));
}
export const RequestType = { HELLO: 0, ADD: 1, ABORT: 2, UTILITY: 3 };
export const OutputType = { READY: 0, OUTPUTS: 1, UTILITY: 2, ERROR: 3, DEAD: 4 };
export const FINISH_REASONS = ["stop", "length", "abort"];

/** Connects to an engine core, completes the handshake, sends requests, reads messages. */
export class EngineCoreClient {
  /** key: the engine core's shared secret (default: $ENGINE_CORE_KEY), when it has one. */
  constructor(address, { receiveTimeoutMs = 120000, key = process.env.ENGINE_CORE_KEY } = {}) {
    const curve = key ? curveOptions(key) : {};
    this.socket = new Dealer({ linger: 0, receiveTimeout: receiveTimeoutMs, ...curve });
    this.socket.connect(address);
    this.address = address;
  }

  /** Sends HELLO and resolves with the engine core's READY as an object. */
  async hello(clientName = "node") {
    await this.send(RequestType.HELLO, [PROTOCOL_VERSION, clientName]);
    const { type, msg } = await this.receive();
    if (type === OutputType.ERROR) throw new Error(`engine core refused us: ${msg[1]}`);
    if (type !== OutputType.READY) throw new Error(`expected READY, got message type ${type}`);
    const [protocolVersion, modelName, maxModelLen, numBlocks, blockSize, vocabSize, eos = []] = msg;
    if (protocolVersion !== PROTOCOL_VERSION) {
      throw new Error(`engine core speaks protocol ${protocolVersion}, this client ${PROTOCOL_VERSION}`);
    }
    return { protocolVersion, modelName, maxModelLen, numBlocks, blockSize, vocabSize, eosTokenIds: eos };
  }

  /** Sends ADD: samplingParams is a map with vLLM's names, e.g. {temperature: 0, max_tokens: 16}. */
  async addRequest(requestId, promptTokenIds, samplingParams = {}) {
    await this.send(RequestType.ADD, [requestId, promptTokenIds, samplingParams]);
  }

  async abortRequests(requestIds) {
    await this.send(RequestType.ABORT, requestIds);
  }

  async send(type, payload) {
    await this.socket.send([Buffer.from([type]), encode(payload)]);
  }

  /** The next message as {type, msg}; msg is the decoded payload (an array for structs). */
  async receive() {
    const [type, payload, ...buffers] = await this.socket.receive();
    return { type: type[0], msg: decode(payload, { extensionCodec: arrayCodec, context: buffers }) };
  }

  /** Yields {requestId, newTokenIds, logprobs, finishReason} for requestId until it finishes;
   * logprobs is [tokenIds, logprobs, ranks] per position (the sampled token first) or null. */
  async *stream(requestId) {
    for (;;) {
      const { type, msg } = await this.receive();
      if (type === OutputType.ERROR && msg[0] === requestId) throw new Error(`refused: ${msg[1]}`);
      if (type === OutputType.DEAD) throw new Error(`engine core died: ${msg[0]}`);
      if (type !== OutputType.OUTPUTS) continue;
      for (const out of msg[0] ?? []) {
        if (out[0] !== requestId) continue;
        const reason = out[4] ?? null;
        yield {
          requestId,
          newTokenIds: out[1],
          logprobs: out[2] ?? null,
          finishReason: reason === null ? null : FINISH_REASONS[reason],
        };
        if (reason !== null) return;
      }
    }
  }

  close() {
    this.socket.close();
  }
}
