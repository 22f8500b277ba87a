// Reading deploy/kubernetes: every YAML document of every manifest, the
// session templates filled in as the backend would fill them, and the
// kustomization's list. No cluster, no network: files only.
import { readdirSync, readFileSync } from "node:fs";
import { join, relative } from "node:path";
import { isDeepStrictEqual } from "node:util";
import YAML from "yaml";

// Folders under the root that hold no manifest to apply or to check.
const SKIPPED_DIRS = new Set(["validate", "node_modules"]);
export const TEMPLATE_DIR = "session-template";

// Sample values for the capitals of session-template/: what the backend
// writes for one session, so that the filled object is what gets checked.
export const TEMPLATE_SAMPLE = {
  SESSION_ID: "0123456789abcdef",
  SERVER_ID: "5e4d3c2b1a09",
  IMAGE_NAME: "python-minimal",
  IMAGE_REF: "registry.example.org/cellblock/python-minimal:0123456789ab",
  POD_UID: "6f1b8f7e-3c2a-4d5e-9f80-1a2b3c4d5e6f",
  INNER_KEY: "a".repeat(64),
};

export function fillTemplate(text) {
  return text.replace(/\b(SESSION_ID|SERVER_ID|IMAGE_NAME|IMAGE_REF|POD_UID|INNER_KEY)\b/g,
    (word) => TEMPLATE_SAMPLE[word]);
}

// Every *.yaml / *.yml under root, but validate/ (the checker and its broken
// fixtures), as paths relative to root, sorted.
export function manifestFiles(root, dir = root) {
  const found = [];
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    if (entry.isDirectory()) {
      if (!SKIPPED_DIRS.has(entry.name)) found.push(...manifestFiles(root, join(dir, entry.name)));
    } else if (/\.ya?ml$/.test(entry.name)) {
      found.push(relative(root, join(dir, entry.name)));
    }
  }
  return found.sort();
}

// The documents of one file: [{file, index, object}] and [{file, message}].
// A document whose scalars YAML 1.1 (what the API server's parser follows)
// and YAML 1.2 read differently (0440, on, yes, ...) is refused: the checks
// here would judge another value than the cluster would receive.
export function parseFile(file, text) {
  const objects = [];
  const problems = [];
  const docs12 = YAML.parseAllDocuments(text, { prettyErrors: true });
  const docs11 = YAML.parseAllDocuments(text, { version: "1.1" });
  if (!Array.isArray(docs12)) {
    return { objects, problems: [{ file, message: "not a YAML stream" }] };
  }
  docs12.forEach((doc, index) => {
    const where = docs12.length > 1 ? `${file} (document ${index + 1})` : file;
    if (doc.errors.length) {
      for (const e of doc.errors) problems.push({ file: where, message: `YAML: ${e.message}` });
      return;
    }
    const object = doc.toJS();
    if (object === null || object === undefined) return;  // an empty document
    if (!isDeepStrictEqual(object, docs11[index]?.toJS())) {
      problems.push({
        file: where,
        message: "YAML 1.1 and 1.2 read a scalar of this document differently " +
          "(an octal like 0440, or on/off/yes/no): quote it or write it in decimal",
      });
      return;
    }
    if (typeof object !== "object" || Array.isArray(object)) {
      problems.push({ file: where, message: "a document must be one object" });
      return;
    }
    objects.push({ file: where, object });
  });
  return { objects, problems };
}

// A file under root; a template (or `fill`: a broken fixture copied from
// one) has its capitals filled in first.
export function readManifest(root, file, { fill = file.startsWith(TEMPLATE_DIR + "/") } = {}) {
  const text = readFileSync(join(root, file), "utf8");
  return parseFile(file, fill ? fillTemplate(text) : text);
}

// "Kind namespace/name" for messages.
export function describe(object) {
  const meta = object?.metadata ?? {};
  const name = meta.namespace ? `${meta.namespace}/${meta.name}` : `${meta.name}`;
  return `${object?.kind ?? "(no kind)"} ${name}`;
}

export function identity(object) {
  const meta = object?.metadata ?? {};
  return `${object?.apiVersion}|${object?.kind}|${meta.namespace ?? ""}|${meta.name}`;
}
