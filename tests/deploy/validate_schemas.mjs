// Validates rendered Kubernetes objects against the Kubernetes and KEDA JSON schemas of the npm
// packages kubernetes-models@4 and @kubernetes-models/keda@0.4 (node_modules at the repo root).
//
//   node tests/deploy/validate_schemas.mjs OBJECTS.json      (a JSON array of objects)
//
// Each object is built as the model class of its apiVersion/kind and validate()d; an apiVersion
// with no model is an error, so a new CRD needs its schema here before it can be deployed.
import { readFileSync } from "node:fs";

const groups = {
  "keda.sh": "@kubernetes-models/keda/keda.sh",
};

function modulePath(apiVersion, kind) {
  const slash = apiVersion.indexOf("/");
  if (slash < 0) return `kubernetes-models/${apiVersion}/${kind}`; // core group: "v1"
  const group = apiVersion.slice(0, slash);
  const version = apiVersion.slice(slash + 1);
  if (groups[group]) return `${groups[group]}/${version}/${kind}`;
  return `kubernetes-models/${group}/${version}/${kind}`;
}

const file = process.argv[2];
if (!file) {
  console.error("usage: validate_schemas.mjs OBJECTS.json");
  process.exit(2);
}
const objects = JSON.parse(readFileSync(file, "utf8"));
let failures = 0;
for (const obj of objects) {
  const name = `${obj.kind}/${obj.metadata?.name ?? "?"}`;
  let Model;
  try {
    const mod = await import(modulePath(obj.apiVersion, obj.kind));
    Model = mod[obj.kind];
  } catch (e) {
    console.error(`${name}: no schema for apiVersion ${obj.apiVersion} kind ${obj.kind} (${e.code ?? e.message})`);
    failures++;
    continue;
  }
  try {
    new Model(obj).validate();
  } catch (e) {
    console.error(`${name}: ${e.message}`);
    failures++;
  }
}
if (failures) {
  console.error(`validate_schemas: ${failures} of ${objects.length} objects invalid`);
  process.exit(1);
}
console.log(`validate_schemas: ${objects.length} objects valid`);
