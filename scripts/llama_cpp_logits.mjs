// llama.cpp's raw next-token logits (node-llama-cpp's prebuilt CPU build) along token-id sequences.
// stdin: {"module": ".../node-llama-cpp/dist/index.js", "model": "FILE.gguf", "sequences": [[ids]], "starts": [N],
//         "top": K, "context": N, "threads": N, "options": {createContext options}}
// stdout: one row a position from starts[i] on: {"top": [[id, logit]] (the K largest), "total": sum(exp(logit - max)),
//         "following": the logit of the token that follows in the sequence (absent at its last position)}
import {readFileSync} from "node:fs";
import {pathToFileURL} from "node:url";

const job = JSON.parse(readFileSync(0, "utf8"));
const {getLlama} = await import(pathToFileURL(job.module).href);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: job.model, gpuLayers: 0});
const out = [];
for (const [i, ids] of job.sequences.entries()) {
    // a fresh context a sequence, evaluated as one prompt (batches of 512), logits kept from starts[i] on
    const context = await model.createContext({contextSize: job.context, threads: job.threads, batchSize: 512,
                                               ...(job.options ?? {})});
    const want = (at) => ({generateNext: {logits: {filter: {includeTop: job.top, tokens: ids.slice(at + 1, at + 2)}},
                                          totalLogitWeight: true}});
    const input = ids.map((id, at) => at >= job.starts[i] ? [id, want(at)] : id);
    const result = await context.getSequence().controlledEvaluate(input);
    out.push(result.slice(job.starts[i]).map((r, k) => {
        const logits = r.next.logits;
        const following = ids[job.starts[i] + k + 1];
        const top = [...logits.entries()].sort((a, b) => b[1] - a[1]).slice(0, job.top);
        return {top, total: r.next.totalLogitWeight, following: logits.get(following)};
    }));
    await context.dispose();
}
await model.dispose();
await llama.dispose();
process.stdout.write(JSON.stringify(out) + "\n");
