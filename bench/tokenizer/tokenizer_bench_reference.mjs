// Times Hugging Face's tokenizers (npm binding of the Rust library) on the benchmark's texts.
// usage: RAYON_NUM_THREADS=1 node tokenizer_bench_reference.mjs TOKENIZER.json TEXTS.json MIN_SECONDS
// TEXTS.json: {"name": [chunk, ...], ...}. Prints {"name": {"seconds": s, "bytes": b, "tokens": t}}
// per text: one encodeBatch over all chunks (the Rust loop, no per-call overhead), best of repeats,
// in wall-clock and in process CPU seconds.
import { createRequire } from 'module';
import fs from 'fs';
import path from 'path';

const require = createRequire(path.resolve(process.argv[1], '..', '..', '..') + '/');
const { Tokenizer } = require('tokenizers');
const [file, textsFile, minSeconds] = process.argv.slice(2);
const tok = Tokenizer.fromFile(file);
const texts = JSON.parse(fs.readFileSync(textsFile, 'utf8'));
const out = {};
for (const [name, chunks] of Object.entries(texts)) {
  const bytes = chunks.reduce((n, c) => n + Buffer.byteLength(c, 'utf8'), 0);
  let tokens = 0;
  for (const e of await tok.encodeBatch(chunks, { addSpecialTokens: false })) tokens += e.getIds().length;  // warm-up
  let best = Infinity, bestCpu = Infinity, spent = 0;
  while (spent < Number(minSeconds) || best === Infinity) {
    const t0 = process.hrtime.bigint();
    const c0 = process.cpuUsage();
    await tok.encodeBatch(chunks, { addSpecialTokens: false });
    const c = process.cpuUsage(c0);
    const s = Number(process.hrtime.bigint() - t0) / 1e9;
    best = Math.min(best, s);
    bestCpu = Math.min(bestCpu, (c.user + c.system) / 1e6);
    spent += s;
  }
  out[name] = { seconds: best, cpu_seconds: bestCpu, bytes, tokens };
}
console.log(JSON.stringify(out));
