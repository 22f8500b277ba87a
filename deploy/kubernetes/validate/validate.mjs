#!/usr/bin/env node
// Offline validation of deploy/kubernetes (no API server is involved):
//   node validate.mjs                 every manifest and template under ..
//   node validate.mjs --with FILE     the same, with FILE's objects replacing
//                                     those of the same kind, namespace and
//                                     name (and any others added): how run.sh
//                                     shows that a broken manifest is refused
// Exit 0: valid. Exit 1: refused, one line per problem naming file and
// object. Exit 2: the validator could not run.
import { dirname, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { TEMPLATE_DIR, describe, identity, manifestFiles, readManifest } from "./manifests.mjs";
import { checkKustomization, checkObject, checkSet } from "./policy.mjs";
import { checkSchema } from "./schema.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, "..");

function usage(message) {
  console.error(`validate.mjs: ${message}\nusage: node validate.mjs [--with FILE]`);
  process.exit(2);
}

const args = process.argv.slice(2);
let overlay = null;
if (args.length === 2 && args[0] === "--with") overlay = resolve(args[1]);
else if (args.length) usage(`unexpected arguments: ${args.join(" ")}`);

async function validate() {
  const problems = [];
  const files = manifestFiles(root);
  let entries = [];
  for (const file of files) {
    const read = readManifest(root, file);
    problems.push(...read.problems);
    entries.push(...read.objects);
  }

  // The base set must not name one object twice (the second would win on apply).
  const seen = new Map();
  for (const e of entries) {
    const id = identity(e.object);
    if (seen.has(id)) problems.push({ file: e.file, object: describe(e.object), message: `also defined in ${seen.get(id)}` });
    else seen.set(id, e.file);
  }

  if (overlay) {
    const read = readManifest(root, relative(root, overlay), { fill: true });
    problems.push(...read.problems);
    const replaced = new Set(read.objects.map((e) => identity(e.object)));
    entries = [...entries.filter((e) => !replaced.has(identity(e.object))), ...read.objects];
  }
  problems.push(...checkKustomization(entries, files, TEMPLATE_DIR));

  // The schema first; cellblock's rules judge only what the schema accepts.
  const valid = [];
  for (const entry of entries) {
    const object = describe(entry.object);
    const schemaProblems = await checkSchema(entry.object);
    for (const message of schemaProblems) problems.push({ file: entry.file, object, message });
    if (schemaProblems.length) continue;
    valid.push(entry);
    for (const p of checkObject(entry)) problems.push({ file: entry.file, object, ...p });
  }
  problems.push(...checkSet(valid, entries));
  return { problems, files, entries };
}

let result;
try {
  result = await validate();
} catch (e) {
  console.error(`validate.mjs: the validator failed (not a verdict on the manifests): ${e.stack ?? e}`);
  process.exit(2);
}
const { problems, files, entries } = result;
const label = overlay ? `${files.length} files with ${relative(process.cwd(), overlay)}` : `${files.length} files`;
if (problems.length) {
  for (const p of problems) console.log(`${p.file}: ${p.object ? p.object + ": " : ""}${p.message}`);
  console.log(`refused: ${problems.length} problem(s) in ${entries.length} objects of ${label}`);
  process.exit(1);
}
console.log(`valid: ${entries.length} objects of ${label} (Kubernetes schemas, unknown fields, cellblock hardening)`);
