// Greedy continuations by llama.cpp (node-llama-cpp's prebuilt CPU build) of token-id prompts.
// stdin: {"module": ".../node-llama-cpp/dist/index.js", "model": "FILE.gguf", "prompts": [[ids]], "tokens": N,
//         "context": N, "threads": N, "options": {createContext options}}; stdout: {"tokens": [[ids]], "prefill_s": [..], "decode_s": [..]}
import {readFileSync} from "node:fs";
import {pathToFileURL} from "node:url";

const job = JSON.parse(readFileSync(0, "utf8"));
const {getLlama} = await import(pathToFileURL(job.module).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: job.model, gpuLayers: 0});
const out = {tokens: [], prefill_s: [], decode_s: []};
for (const prompt of job.prompts) {
    // a fresh context a prompt: nothing is reused between prompts
    const context = await model.createContext({contextSize: job.context, threads: job.threads, batchSize: 512,
                                               ...(job.options ?? {})});
    const sequence = context.getSequence();
    const got = [];
    const start = performance.now();
    let first = 0;
    for await (const token of sequence.evaluate(prompt, {temperature: 0})) {
        if (got.length === 0) first = performance.now();
        got.push(token);
        if (got.length >= job.tokens) break;
    }
    const end = performance.now();
    out.tokens.push(got);
    out.prefill_s.push((first - start) / 1000);
    out.decode_s.push((end - first) / 1000);
    await context.dispose();
}
await model.dispose();
await llama.dispose();
process.stdout.write(JSON.stringify(out) + "\n");
