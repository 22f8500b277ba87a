// cellblock's own rules for deploy/kubernetes: the hardening a schema cannot
// express, so that a regression in it fails here, offline, before any
// cluster sees it. Pure functions over parsed objects; each problem names
// the file and the object.
import { describe } from "./manifests.mjs";

export const FRONT_NS = "cellblock";
export const SESSIONS_NS = "cellblock-sessions";
const FRONT_SA = "cellblock-front";
const FRONT_DEPLOYMENT = "cellblock-front";
const FRONT_POD_LABELS = { "app.kubernetes.io/name": "cellblock", "app.kubernetes.io/component": "front" };
const KERNEL_PORTS = { first: 5555, last: 5559 };
const FRONT_VERBS = new Set(["create", "delete", "get", "list", "watch"]);
const FRONT_RESOURCES = new Set(["pods", "secrets"]);
const CLUSTER_SCOPED = new Set(["Namespace", "RuntimeClass", "ClusterRole", "ClusterRoleBinding",
  "PriorityClass", "StorageClass", "PersistentVolume", "CustomResourceDefinition", "Node",
  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]);
const KUSTOMIZATION_KEYS = new Set(["apiVersion", "kind", "resources"]);

const DNS_SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const DNS_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const LABEL_NAME = /^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$/;
const LABEL_VALUE = /^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$/;

const isKustomization = (o) => o.kind === "Kustomization" && `${o.apiVersion}`.startsWith("kustomize.config.k8s.io/");
const nsOf = (o) => o.metadata?.namespace;

// --- names and labels: what the API server refuses that the schemas allow ---

function checkName(object) {
  const name = object.metadata?.name;
  if (typeof name !== "string" || !name) return ["metadata.name is missing"];
  const label = object.kind === "Namespace" || object.kind === "Service";
  const ok = label ? DNS_LABEL.test(name) && name.length <= 63
    : DNS_SUBDOMAIN.test(name) && name.length <= 253;
  return ok ? [] : [`metadata.name "${name}" is not a valid DNS-1123 ${label ? "label" : "subdomain"}`];
}

function checkLabels(labels, where) {
  const problems = [];
  for (const [key, value] of Object.entries(labels ?? {})) {
    const slash = key.lastIndexOf("/");
    const prefix = slash >= 0 ? key.slice(0, slash) : null;
    const name = slash >= 0 ? key.slice(slash + 1) : key;
    if ((prefix !== null && !(DNS_SUBDOMAIN.test(prefix) && prefix.length <= 253)) ||
        !(LABEL_NAME.test(name) && name.length <= 63)) {
      problems.push(`${where}: label key "${key}" is not valid`);
    }
    if (typeof value !== "string" || !(LABEL_VALUE.test(value) && value.length <= 63)) {
      problems.push(`${where}: label ${key}="${value}" is not a valid label value`);
    }
  }
  return problems;
}

function checkNamespaced(object) {
  if (CLUSTER_SCOPED.has(object.kind)) {
    return nsOf(object) ? [`a ${object.kind} is cluster-scoped: metadata.namespace must not be set`] : [];
  }
  // kustomization.yaml sets no namespace: each object names its own.
  if (![FRONT_NS, SESSIONS_NS].includes(nsOf(object))) {
    return [`metadata.namespace must be ${FRONT_NS} or ${SESSIONS_NS} (is ${nsOf(object) ?? "unset"})`];
  }
  return [];
}

// --- pods and pod templates ---

// [{where, meta, spec}] for a Pod and for the pod template of a controller.
export function podSpecs(object) {
  const spec = object.spec ?? {};
  switch (object.kind) {
    case "Pod":
      return [{ where: "", meta: object.metadata ?? {}, spec }];
    case "Deployment": case "ReplicaSet": case "StatefulSet": case "DaemonSet": case "Job":
      return [{ where: "spec.template: ", meta: spec.template?.metadata ?? {}, spec: spec.template?.spec ?? {} }];
    case "CronJob": {
      const t = spec.jobTemplate?.spec?.template;
      return [{ where: "spec.jobTemplate.spec.template: ", meta: t?.metadata ?? {}, spec: t?.spec ?? {} }];
    }
    default:
      return [];
  }
}

function containersOf(spec) {
  return [
    ...(spec.initContainers ?? []).map((c) => ["init container", c]),
    ...(spec.containers ?? []).map((c) => ["container", c]),
    ...(spec.ephemeralContainers ?? []).map((c) => ["ephemeral container", c]),
  ];
}

// Every pod, in either namespace: no host namespaces, no host paths, no
// root, no capability, no privilege escalation, a read-only root, a seccomp
// profile, capped memory and capped memory-backed volumes.
function checkPodHardening(spec, where) {
  const problems = [];
  const pod = spec.securityContext ?? {};
  for (const field of ["hostNetwork", "hostPID", "hostIPC"]) {
    if (spec[field] === true) problems.push(`${where}${field} must not be true`);
  }
  for (const volume of spec.volumes ?? []) {
    if (volume.hostPath) problems.push(`${where}volume ${volume.name}: hostPath is not allowed`);
    if (volume.emptyDir && !volume.emptyDir.sizeLimit) {
      problems.push(`${where}volume ${volume.name}: an emptyDir needs a sizeLimit`);
    }
  }
  if (pod.runAsUser === 0) problems.push(`${where}securityContext.runAsUser must not be 0`);
  for (const [what, c] of containersOf(spec)) {
    const at = `${where}${what} ${c.name}: `;
    const sc = c.securityContext ?? {};
    const effective = (field) => (sc[field] !== undefined ? sc[field] : pod[field]);
    if (sc.readOnlyRootFilesystem !== true) problems.push(`${at}securityContext.readOnlyRootFilesystem must be true`);
    if (sc.allowPrivilegeEscalation !== false) problems.push(`${at}securityContext.allowPrivilegeEscalation must be false`);
    if (sc.privileged === true) problems.push(`${at}securityContext.privileged must not be true`);
    if (effective("runAsNonRoot") !== true) problems.push(`${at}runAsNonRoot must be true (pod or container securityContext)`);
    if (effective("runAsUser") === 0) problems.push(`${at}runAsUser must not be 0`);
    const drop = sc.capabilities?.drop ?? [];
    if (!drop.includes("ALL")) problems.push(`${at}securityContext.capabilities.drop must include ALL`);
    const add = sc.capabilities?.add ?? [];
    if (add.length) problems.push(`${at}securityContext.capabilities.add must be empty (has ${add.join(", ")})`);
    const seccomp = effective("seccompProfile")?.type;
    if (!["RuntimeDefault", "Localhost"].includes(seccomp)) {
      problems.push(`${at}seccompProfile.type must be RuntimeDefault or Localhost (is ${seccomp ?? "unset"})`);
    }
    for (const port of c.ports ?? []) {
      if (port.hostPort !== undefined) problems.push(`${at}port ${port.containerPort}: hostPort is not allowed`);
    }
    if (!c.resources?.limits?.memory) problems.push(`${at}resources.limits.memory must be set`);
  }
  return problems;
}

// A session pod: the rules above, and those of issue 16's design.
function checkSessionPod(object, meta, spec, where) {
  const problems = [];
  if (object.kind !== "Pod") {
    return [`${where}a ${object.kind} in ${SESSIONS_NS}: sessions are bare pods the front creates; ` +
      "a controller would start a new kernel silently"];
  }
  const labels = meta.labels ?? {};
  for (const key of ["cellblock.session", "cellblock.server"]) {
    if (!labels[key]) problems.push(`${where}label ${key} is missing`);
  }
  if (spec.runtimeClassName !== "gvisor") problems.push(`${where}runtimeClassName must be gvisor (is ${spec.runtimeClassName ?? "unset"})`);
  if (spec.automountServiceAccountToken !== false) problems.push(`${where}automountServiceAccountToken must be false`);
  if (spec.enableServiceLinks !== false) problems.push(`${where}enableServiceLinks must be false`);
  if (spec.restartPolicy !== "Never") problems.push(`${where}restartPolicy must be Never (never a silent new kernel)`);
  if (spec.shareProcessNamespace === true) problems.push(`${where}shareProcessNamespace must not be true`);
  for (const volume of spec.volumes ?? []) {
    if (!volume.emptyDir && !volume.secret) {
      problems.push(`${where}volume ${volume.name}: only emptyDir and the inner-key secret belong in a session pod`);
    }
  }
  for (const [what, c] of containersOf(spec)) {
    const at = `${where}${what} ${c.name}: `;
    if (!c.resources?.limits?.cpu) problems.push(`${at}resources.limits.cpu must be set`);
    for (const port of c.ports ?? []) {
      if (port.containerPort < KERNEL_PORTS.first || port.containerPort > KERNEL_PORTS.last) {
        problems.push(`${at}port ${port.containerPort} is not a kernel port (${KERNEL_PORTS.first}-${KERNEL_PORTS.last})`);
      }
    }
  }
  return problems;
}

// --- RBAC ---

function checkRole(object) {
  const problems = [];
  if (nsOf(object) !== SESSIONS_NS) {
    problems.push(`a Role outside ${SESSIONS_NS}: the front has rights in the sessions namespace only`);
  }
  (object.rules ?? []).forEach((rule, i) => {
    const at = `rules[${i}]: `;
    for (const field of ["apiGroups", "resources", "verbs", "resourceNames"]) {
      if ((rule[field] ?? []).some((v) => v.includes("*"))) problems.push(`${at}${field} must not contain "*"`);
    }
    for (const group of rule.apiGroups ?? []) {
      if (group !== "") problems.push(`${at}apiGroup "${group}" is not the core group`);
    }
    for (const resource of rule.resources ?? []) {
      if (!FRONT_RESOURCES.has(resource) && !resource.includes("*")) {
        problems.push(`${at}resource ${resource} is not one of ${[...FRONT_RESOURCES].join(", ")}`);
      }
    }
    for (const verb of rule.verbs ?? []) {
      if (!FRONT_VERBS.has(verb) && verb !== "*") {
        problems.push(`${at}verb ${verb} is not one of ${[...FRONT_VERBS].join(", ")}`);
      }
    }
  });
  return problems;
}

function checkRoleBinding(object) {
  const problems = [];
  if (nsOf(object) !== SESSIONS_NS) problems.push(`a RoleBinding outside ${SESSIONS_NS}`);
  if (object.roleRef?.kind !== "Role") {
    problems.push(`roleRef must be a Role of ${SESSIONS_NS} (is a ${object.roleRef?.kind}): a ClusterRole grants what its author chose`);
  }
  for (const s of object.subjects ?? []) {
    if (s.kind !== "ServiceAccount" || s.name !== FRONT_SA || s.namespace !== FRONT_NS) {
      problems.push(`subject ${s.kind} ${s.namespace ?? ""}/${s.name}: only ServiceAccount ${FRONT_NS}/${FRONT_SA} is bound`);
    }
  }
  return problems;
}

// --- network ---

const isFrontPeer = (peer) =>
  Object.keys(peer).sort().join() === "namespaceSelector,podSelector" &&
  !peer.namespaceSelector.matchExpressions?.length &&
  !peer.podSelector.matchExpressions?.length &&
  JSON.stringify(peer.namespaceSelector.matchLabels) === JSON.stringify({ "kubernetes.io/metadata.name": FRONT_NS }) &&
  Object.entries(FRONT_POD_LABELS).every(([k, v]) => peer.podSelector.matchLabels?.[k] === v);

function checkSessionNetworkPolicy(object) {
  const problems = [];
  const spec = object.spec ?? {};
  if ((spec.egress ?? []).length) {
    problems.push("an egress rule in the sessions namespace: sessions have no egress at all, not even DNS");
  }
  (spec.ingress ?? []).forEach((rule, i) => {
    const at = `ingress[${i}]: `;
    if (!(rule.from ?? []).length) problems.push(`${at}no "from": this would admit every source`);
    (rule.from ?? []).forEach((peer, j) => {
      if (!isFrontPeer(peer)) {
        problems.push(`${at}from[${j}] is a peer other than the front's pods (namespace ${FRONT_NS} and pod labels ${JSON.stringify(FRONT_POD_LABELS)}, in one peer)`);
      }
    });
    if (!(rule.ports ?? []).length) problems.push(`${at}no "ports": this would admit every port`);
    for (const port of rule.ports ?? []) {
      const first = port.port;
      const last = port.endPort ?? port.port;
      if ((port.protocol ?? "TCP") !== "TCP" || typeof first !== "number" ||
          first < KERNEL_PORTS.first || last > KERNEL_PORTS.last) {
        problems.push(`${at}port ${JSON.stringify(port)} is not within TCP ${KERNEL_PORTS.first}-${KERNEL_PORTS.last}`);
      }
    }
  });
  return problems;
}

// {} or a selector whose matchLabels and matchExpressions are empty: every pod.
const selectsEveryPod = (selector) =>
  selector !== null && typeof selector === "object" &&
  Object.values(selector).every((v) => Object.keys(v ?? {}).length === 0);

const isDefaultDenyAll = (o) =>
  o.kind === "NetworkPolicy" && nsOf(o) === SESSIONS_NS && selectsEveryPod(o.spec?.podSelector) &&
  ["Ingress", "Egress"].every((t) => (o.spec?.policyTypes ?? []).includes(t)) &&
  !(o.spec?.ingress ?? []).length && !(o.spec?.egress ?? []).length;

// --- one object ---

export function checkObject({ object }) {
  if (isKustomization(object)) return [];
  const problems = [...checkName(object), ...checkNamespaced(object),
    ...checkLabels(object.metadata?.labels, "metadata.labels")];
  const sessions = nsOf(object) === SESSIONS_NS;
  for (const { where, meta, spec } of podSpecs(object)) {
    if (where) problems.push(...checkLabels(meta.labels, `${where}metadata.labels`));
    problems.push(...checkPodHardening(spec, where));
    if (sessions) problems.push(...checkSessionPod(object, meta, spec, where));
  }
  switch (object.kind) {
    case "ClusterRole": case "ClusterRoleBinding":
      problems.push(`a ${object.kind}: the front needs no rights outside ${SESSIONS_NS}`);
      break;
    case "Role":
      problems.push(...checkRole(object));
      break;
    case "RoleBinding":
      problems.push(...checkRoleBinding(object));
      break;
    case "NetworkPolicy":
      if (sessions) problems.push(...checkSessionNetworkPolicy(object));
      break;
    case "Namespace":
      if (object.metadata?.labels?.["pod-security.kubernetes.io/enforce"] !== "restricted") {
        problems.push('label pod-security.kubernetes.io/enforce must be "restricted"');
      }
      break;
    case "Secret":
      if (sessions && !(object.metadata?.ownerReferences ?? []).some((r) => r.kind === "Pod")) {
        problems.push("a Secret in the sessions namespace must be a session's inner key, owned by its pod");
      }
      break;
    case "Deployment":
      if (object.metadata?.name === FRONT_DEPLOYMENT) {
        if (object.spec?.replicas !== 1) problems.push("the front runs exactly 1 replica (it holds client keys and relay state)");
        if (object.spec?.strategy?.type !== "Recreate") problems.push("the front's strategy must be Recreate (one front on its state at a time)");
      }
      break;
    case "HorizontalPodAutoscaler":
      if (object.spec?.scaleTargetRef?.name === FRONT_DEPLOYMENT) {
        problems.push("the front must not autoscale: it is one stateful replica");
      }
      break;
    case "RuntimeClass":
      if (object.metadata?.name === "gvisor" && object.handler !== "runsc") problems.push("RuntimeClass gvisor must have handler runsc");
      break;
    default:
      break;
  }
  return problems.map((message) => ({ message }));
}

// --- the whole set ---

// Problems that need every object: what must exist, and what must match.
// `entries`: the objects the schema accepted; `all`: every object read (a
// session pod refused by the schema is reported there, not as missing).
export function checkSet(entries, all = entries) {
  const problems = [];
  const objects = entries.map((e) => e.object);
  const need = (found, message) => { if (!found) problems.push({ file: "(all manifests)", message }); };
  // What must exist counts every object read; what must hold, only the
  // objects the schema accepted (the others are reported already).
  const present = (test) => all.some((e) => test(e.object));
  for (const ns of [FRONT_NS, SESSIONS_NS]) {
    need(present((o) => o.kind === "Namespace" && o.metadata?.name === ns), `Namespace ${ns} is missing`);
  }
  need(objects.some(isDefaultDenyAll),
    `no default-deny NetworkPolicy in ${SESSIONS_NS} (podSelector {}, policyTypes Ingress and Egress, no rules)`);
  need(present((o) => o.kind === "ResourceQuota" && nsOf(o) === SESSIONS_NS), `no ResourceQuota in ${SESSIONS_NS}`);
  need(present((o) => o.kind === "LimitRange" && nsOf(o) === SESSIONS_NS), `no LimitRange in ${SESSIONS_NS}`);
  // Its handler is checked with the object (checkObject).
  need(present((o) => o.kind === "RuntimeClass" && o.metadata?.name === "gvisor"), "no RuntimeClass gvisor");
  need(present((o) => o.kind === "Deployment" && nsOf(o) === FRONT_NS && o.metadata?.name === FRONT_DEPLOYMENT),
    `no Deployment ${FRONT_NS}/${FRONT_DEPLOYMENT}`);
  need(present((o) => o.kind === "RoleBinding" && nsOf(o) === SESSIONS_NS),
    `no RoleBinding giving the front its Role in ${SESSIONS_NS}`);
  const isSessionPod = (e) => e.object.kind === "Pod" && nsOf(e.object) === SESSIONS_NS;
  const sessionPods = entries.filter(isSessionPod);
  need(all.some(isSessionPod), `no session Pod template in ${SESSIONS_NS}: the hardening checks would check nothing`);
  // Each secret a session pod mounts is a Secret owned by that very pod.
  for (const { file, object: pod } of sessionPods) {
    for (const volume of pod.spec?.volumes ?? []) {
      if (!volume.secret) continue;
      const owned = objects.some((o) => o.kind === "Secret" && nsOf(o) === SESSIONS_NS &&
        o.metadata?.name === volume.secret.secretName &&
        (o.metadata?.ownerReferences ?? []).some((r) => r.kind === "Pod" && r.name === pod.metadata?.name));
      if (!owned) {
        problems.push({ file, object: describe(pod),
          message: `volume ${volume.name}: no Secret ${volume.secret.secretName} owned by this pod (ownerReferences)` });
      }
    }
  }
  return problems;
}

// kustomization.yaml against the files: every manifest an operator applies
// is listed, no template is, every listed file exists.
export function checkKustomization(entries, files, templateDir) {
  const problems = [];
  const found = entries.filter((e) => isKustomization(e.object));
  if (found.length !== 1) return [{ file: "kustomization.yaml", message: `expected one Kustomization, found ${found.length}` }];
  const { file, object } = found[0];
  for (const key of Object.keys(object)) {
    if (!KUSTOMIZATION_KEYS.has(key)) {
      problems.push({ file, message: `field ${key} is not used here (a namespace: would move both namespaces' objects into one)` });
    }
  }
  const listed = object.resources ?? [];
  const seen = new Set();
  for (const path of listed) {
    if (seen.has(path)) problems.push({ file, message: `${path} is listed twice` });
    seen.add(path);
    if (!files.includes(path)) problems.push({ file, message: `${path} is listed but does not exist` });
    if (path.startsWith(templateDir + "/")) problems.push({ file, message: `${path} is a template the front fills in: applying it would start a pod` });
  }
  for (const path of files) {
    if (path !== "kustomization.yaml" && !path.startsWith(templateDir + "/") && !seen.has(path)) {
      problems.push({ file, message: `${path} is not listed in resources` });
    }
  }
  return problems;
}
