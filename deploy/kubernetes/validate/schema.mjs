// Each object against the Kubernetes API schema of its kind, offline, with
// kubernetes-models' generated validators (the OpenAPI schemas of the
// Kubernetes release that package was built from), and a check the schemas
// do not make: a field the schema does not know (a typo such as
// readOnlyRootFilesytem) is an error, as `kubectl apply --validate=strict`
// would make it.

const KUSTOMIZATION = "kustomize.config.k8s.io/v1beta1|Kustomization";

// apiVersion "v1" -> "kubernetes-models/v1"; "apps/v1" -> "kubernetes-models/apps/v1".
async function modelClass(apiVersion, kind) {
  let module;
  try {
    module = await import(`kubernetes-models/${apiVersion}`);
  } catch {
    return null;
  }
  const model = module[kind];
  // The modules also export the nested types (PodSpec, ...): only a
  // top-level kind carries its apiVersion and kind.
  if (typeof model !== "function" || model.kind !== kind || model.apiVersion !== apiVersion) return null;
  return model;
}

// Runs `validateFn` on a copy of `data` whose every object records which of
// its keys the validator read. The generated validators read each property
// their schema names (and enumerate the keys of maps such as labels), so an
// own key never read is one the schema does not have.
function unknownFields(validateFn, data) {
  const read = new Set();
  const enumerated = new Set();
  const reached = new Map();
  const watch = (value, path) => {
    if (value === null || typeof value !== "object") return value;
    reached.set(path, value);
    return new Proxy(value, {
      get(target, key, receiver) {
        const v = Reflect.get(target, key, receiver);
        if (typeof key !== "string" || !Object.hasOwn(target, key)) return v;
        read.add(`${path}/${key}`);
        return watch(v, `${path}/${key}`);
      },
      has(target, key) {
        if (typeof key === "string") read.add(`${path}/${key}`);
        return Reflect.has(target, key);
      },
      ownKeys(target) {
        enumerated.add(path);
        return Reflect.ownKeys(target);
      },
    });
  };
  validateFn(watch(data, ""));
  const unknown = [];
  for (const [path, value] of reached) {
    if (Array.isArray(value) || enumerated.has(path)) continue;
    for (const key of Object.keys(value)) {
      if (!read.has(`${path}/${key}`)) unknown.push(`${path}/${key}`);
    }
  }
  return unknown.sort();
}

// Problems of one object (strings); [] when it is valid.
export async function checkSchema(object) {
  const { apiVersion, kind } = object;
  if (typeof apiVersion !== "string" || typeof kind !== "string") {
    return ["no apiVersion or kind"];
  }
  if (`${apiVersion}|${kind}` === KUSTOMIZATION) return [];  // kustomize's, checked in policy.mjs
  const Model = await modelClass(apiVersion, kind);
  if (!Model) return [`unknown apiVersion/kind ${apiVersion} ${kind} (not a built-in Kubernetes kind)`];
  const model = new Model(object);
  try {
    model.validate();
  } catch (e) {
    const details = (e.errors ?? []).map((err) => `${err.instancePath || "/"} ${err.message}`);
    return details.length ? details.map((d) => `schema: ${d}`) : [`schema: ${e.message}`];
  }
  const validateFn = (data) => Model.prototype.validate.call(data);
  return unknownFields(validateFn, model.toJSON()).map(
    (path) => `schema: ${path}: field not in the ${kind} schema`);
}
