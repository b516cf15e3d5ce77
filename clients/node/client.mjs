// A client of the engine core wire protocol (docs/protocol.md): one DEALER socket, frames
// [type byte, msgpack payload], array-like messages in field order.
import { encode, decode } from "@msgpack/msgpack";
import { Dealer } from "zeromq";

export const PROTOCOL_VERSION = 1;
export const RequestType = { HELLO: 0, ADD: 1, ABORT: 2, UTILITY: 3 };
export const OutputType = { READY: 0, OUTPUTS: 1, UTILITY: 2, ERROR: 3, DEAD: 4 };
export const FINISH_REASONS = ["stop", "length", "abort"];

/** Connects to an engine core, completes the handshake, sends requests, reads messages. */
export class EngineCoreClient {
  constructor(address, { receiveTimeoutMs = 120000 } = {}) {
    this.socket = new Dealer({ linger: 0, receiveTimeout: receiveTimeoutMs });
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
    const [type, payload] = await this.socket.receive();
    return { type: type[0], msg: decode(payload) };
  }

  /** Yields {requestId, newTokenIds, finishReason} for requestId until it finishes. */
  async *stream(requestId) {
    for (;;) {
      const { type, msg } = await this.receive();
      if (type === OutputType.ERROR && msg[0] === requestId) throw new Error(`refused: ${msg[1]}`);
      if (type === OutputType.DEAD) throw new Error(`engine core died: ${msg[0]}`);
      if (type !== OutputType.OUTPUTS) continue;
      for (const out of msg[0] ?? []) {
        if (out[0] !== requestId) continue;
        const reason = out[4] ?? null;
        yield { requestId, newTokenIds: out[1], finishReason: reason === null ? null : FINISH_REASONS[reason] };
        if (reason !== null) return;
      }
    }
  }

  close() {
    this.socket.close();
  }
}
