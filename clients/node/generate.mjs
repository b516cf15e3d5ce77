#!/usr/bin/env node
// Send one tokenized request to a headless engine core and print each generated token id on
// its own line as it arrives (with --logprobs K, followed by its logprob and the number of
// candidates; -1 asks for the whole vocabulary); the finish reason goes to stderr.
// Usage: node generate.mjs --address tcp://127.0.0.1:5555 [--max-tokens 16] [--temperature 0]
//                          [--ignore-eos] [--logprobs=K] TOKEN_ID...
import { parseArgs } from "node:util";
import { EngineCoreClient } from "./client.mjs";

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    address: { type: "string" },
    "max-tokens": { type: "string", default: "16" },
    temperature: { type: "string", default: "0" },
    "ignore-eos": { type: "boolean", default: false },
    logprobs: { type: "string" },
    "request-id": { type: "string", default: `node-${process.pid}` },
  },
});
if (!values.address || positionals.length === 0) {
  console.error("usage: node generate.mjs --address ADDR [--max-tokens N] [--temperature T] [--ignore-eos] [--logprobs K] TOKEN_ID...");
  process.exit(2);
}

const client = new EngineCoreClient(values.address);
try {
  const ready = await client.hello();
  console.error(`connected to ${ready.modelName} (max_model_len ${ready.maxModelLen})`);
  const params = {
    temperature: Number(values.temperature),
    max_tokens: Number(values["max-tokens"]),
    ignore_eos: values["ignore-eos"],
  };
  if (values.logprobs !== undefined) params.logprobs = Number(values.logprobs);
  await client.addRequest(values["request-id"], positionals.map(Number), params);
  for await (const out of client.stream(values["request-id"])) {
    out.newTokenIds.forEach((id, i) => {
      if (out.logprobs === null) return console.log(id);
      const [ids, logprobs] = out.logprobs;
      console.log(`${id} ${logprobs[i][0]} ${ids[i].length}`);
    });
    if (out.finishReason) console.error(`finish_reason: ${out.finishReason}`);
  }
} catch (err) {
  console.error(`error: ${err.message}`);
  process.exitCode = 1;
} finally {
  client.close();
}
