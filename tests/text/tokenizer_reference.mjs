// Reference ids from Hugging Face's tokenizers (the npm binding of the Rust library).
// usage: node tokenizer_reference.mjs INPUT.jsonl OUTPUT.jsonl TOKENIZER.json...
// INPUT lines: {"text": "..."} (encode with special tokens, then decode that) or {"ids": [...]}
// (decode only). OUTPUT: one line per tokenizer and input line, in order:
// {"ids": [...], "decoded": "..."} ({"decoded": "..."} for id inputs).
import { createRequire } from 'module';
import fs from 'fs';
import path from 'path';

const require = createRequire(path.resolve(process.argv[1], '..', '..', '..') + '/');
const { Tokenizer } = require('tokenizers');

const [input, output, ...files] = process.argv.slice(2);
const lines = fs.readFileSync(input, 'utf8').split('\n').filter((l) => l.length > 0).map((l) => JSON.parse(l));
const out = [];
for (const file of files) {
  const tok = Tokenizer.fromFile(file);
  for (const item of lines) {
    if (item.ids !== undefined) {
      out.push(JSON.stringify({ decoded: await tok.decode(item.ids, item.skip_special === true) }));
      continue;
    }
    const ids = (await tok.encode(item.text, null, { addSpecialTokens: true })).getIds();
    out.push(JSON.stringify({ ids, decoded: await tok.decode(ids, false) }));
  }
}
fs.writeFileSync(output, out.join('\n') + '\n');
