#!/usr/bin/env python3
"""Renders a kustomize overlay of deploy/ and checks it: schemas, then the project's own rules.

    check_manifests.py --overlay dev|eks|base [--cluster deploy/eks/cluster.yaml]
                       [--external-secret NAME ...] [--moerl BUILD/moerl]
    check_manifests.py --bad-fixtures          every known-bad variant must be rejected

Schemas: tests/deploy/validate_schemas.mjs (kubernetes-models, @kubernetes-models/keda).
Rules (lint()): selectors match, each PDB and ScaledObject targets a workload, extended resources
requested = limits, spot tolerations only on rollout, Redis has AOF on the PVC, every $(VAR)
resolves, probes, resources and a locked-down securityContext on every container, images pinned,
the rollout drain fits the 2-minute spot notice, the trainer gets torchrun's environment, and the
ScaledObject reads the stream and consumer group src/control/redis_queue.cpp uses.
"""
import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPOT_NOTICE_S = 120
# src/control/redis_queue.cpp: stream moerl:{RUN_ID}:tasks, consumer group "workers".
TASK_STREAM = "moerl:{%s}:tasks"
TASK_GROUP = "workers"
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
LONG_RUNNING = {"Deployment", "StatefulSet", "DaemonSet"}
BASIC_RESOURCES = {"cpu", "memory", "ephemeral-storage"}
SPOT_TAINT = "moerl.dev/spot"


def render(overlay):
    path = os.path.join(ROOT, "deploy", overlay if overlay == "base" else os.path.join("overlays", overlay))
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate_schemas(objects):
    """Errors of the npm schema validator, one string per line it printed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(objects, f)
        name = f.name
    try:
        out = subprocess.run(["node", os.path.join(ROOT, "tests", "deploy", "validate_schemas.mjs"), name],
                             capture_output=True, text=True, cwd=ROOT)
    finally:
        os.unlink(name)
    if out.returncode == 0:
        return []
    return [l for l in out.stderr.splitlines() if l and not l.startswith("validate_schemas:")] or [out.stderr]


class Lint:
    def __init__(self, objects, external_secrets=(), cluster=None):
        self.objects = objects
        self.external_secrets = set(external_secrets)
        self.cluster = cluster
        self.errors = []
        self.by_kind = {}
        for o in objects:
            self.by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o

    def error(self, obj, text):
        self.errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {text}")

    def named(self, kind, name):
        return self.by_kind.get(kind, {}).get(name)

    def workloads(self):
        for kind in WORKLOAD_KINDS:
            for o in self.by_kind.get(kind, {}).values():
                yield o

    @staticmethod
    def pod_spec(w):
        return w["spec"]["template"]["spec"]

    @staticmethod
    def containers(w):
        spec = Lint.pod_spec(w)
        return [(c, False) for c in spec.get("containers", [])] + [(c, True) for c in spec.get("initContainers", [])]

    @staticmethod
    def matches(selector, labels):
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    def workloads_selected_by(self, selector):
        return [w for w in self.workloads()
                if self.matches(selector, w["spec"]["template"].get("metadata", {}).get("labels", {}))]

    # ---- the rules -------------------------------------------------------------------------
    def run(self):
        namespaces = {o["metadata"].get("namespace") for o in self.objects
                      if o["kind"] not in ("Namespace", "StorageClass")}
        if len(namespaces) != 1 or None in namespaces:
            self.errors.append(f"objects in namespaces {sorted(map(str, namespaces))}; expected all in one")
        self.namespace = next(iter(namespaces)) if namespaces else None
        for w in self.workloads():
            self.check_workload(w)
        for s in self.by_kind.get("Service", {}).values():
            if not self.workloads_selected_by(s["spec"].get("selector", {})):
                self.error(s, f"selector {s['spec'].get('selector')} matches no workload's pod labels")
        for p in self.by_kind.get("PodDisruptionBudget", {}).values():
            if not self.workloads_selected_by(p["spec"].get("selector", {}).get("matchLabels", {})):
                self.error(p, "PodDisruptionBudget selector matches no workload")
        self.check_scaled_objects()
        self.check_trainer()
        self.check_rollout()
        self.check_redis()
        self.check_credentials()
        if self.cluster:
            self.check_node_groups()
        return self.errors

    def check_workload(self, w):
        spec = self.pod_spec(w)
        sel = w["spec"].get("selector", {}).get("matchLabels", {})
        labels = w["spec"]["template"].get("metadata", {}).get("labels", {})
        if w["kind"] != "Job" and not self.matches(sel, labels):
            self.error(w, f"selector {sel} does not match the pod labels {labels}")
        sa = spec.get("serviceAccountName")
        if sa and not self.named("ServiceAccount", sa):
            self.error(w, f"serviceAccountName {sa}: no such ServiceAccount")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claim_templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for v in volumes.values():
            if "configMap" in v and not self.named("ConfigMap", v["configMap"]["name"]):
                self.error(w, f"volume {v['name']}: no ConfigMap {v['configMap']['name']}")
            if "persistentVolumeClaim" in v and not self.named("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]):
                self.error(w, f"volume {v['name']}: no PersistentVolumeClaim {v['persistentVolumeClaim']['claimName']}")
        pod_sc = spec.get("securityContext", {})
        component = labels.get("app.kubernetes.io/component", "")
        for toleration in spec.get("tolerations", []):
            if toleration.get("key") == SPOT_TAINT and component != "rollout":
                self.error(w, f"tolerates the spot taint {SPOT_TAINT}; only rollout workers may run on spot nodes")
        if spec.get("nodeSelector", {}).get("eks.amazonaws.com/capacityType") == "SPOT" and component != "rollout":
            self.error(w, "selects spot nodes; only rollout workers may run on spot nodes")
        for c, init in self.containers(w):
            self.check_container(w, c, init, pod_sc, volumes, claim_templates)

    def check_container(self, w, c, init, pod_sc, volumes, claim_templates):
        where = f"container {c['name']}"
        image = c.get("image", "")
        tag = image.rsplit("/", 1)[-1]
        if "@sha256:" not in image and (":" not in tag or tag.endswith(":latest")):
            self.error(w, f"{where}: image '{image}' is not pinned to a tag (or digest) other than latest")
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        for key in ("cpu", "memory"):
            if key not in req:
                self.error(w, f"{where}: resources.requests.{key} missing")
        if "memory" not in lim:
            self.error(w, f"{where}: resources.limits.memory missing")
        for key in set(req) | set(lim):
            if key not in BASIC_RESOURCES and str(req.get(key)) != str(lim.get(key)):
                self.error(w, f"{where}: extended resource {key}: requests {req.get(key)} != limits "
                              f"{lim.get(key)}; expected requests = limits")
        sc = c.get("securityContext", {})
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True):
            self.error(w, f"{where}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            self.error(w, f"{where}: runAsUser is 0")
        if sc.get("readOnlyRootFilesystem") is not True:
            self.error(w, f"{where}: securityContext.readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation") is not False:
            self.error(w, f"{where}: securityContext.allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            self.error(w, f"{where}: securityContext.capabilities.drop does not contain ALL")
        for cap in caps.get("add", []):
            if cap != "IPC_LOCK" or "vpc.amazonaws.com/efa" not in lim:
                self.error(w, f"{where}: adds capability {cap}; only IPC_LOCK, and only with EFA devices")
        if sc.get("privileged"):
            self.error(w, f"{where}: privileged")
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        if w["kind"] in LONG_RUNNING and not init:
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in c:
                    self.error(w, f"{where}: {probe} missing")
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port") or c.get(probe, {}).get("tcpSocket", {}).get("port")
                if isinstance(port, str) and port not in ports:
                    self.error(w, f"{where}: {probe} uses port '{port}', which the container does not name")
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes and m["name"] not in claim_templates:
                self.error(w, f"{where}: volumeMount {m['name']} has no volume")
        env = self.check_env(w, c)
        if c.get("image", "").split("/")[-1].startswith("moerl") and c.get("args", [])[:1] == ["worker"]:
            self.check_moerl_worker(w, c, env, ports, volumes)

    def check_env(self, w, c):
        """Resolves the container's environment; returns {name: value or None (from a ref)}."""
        where = f"container {c['name']}"
        defined = {}
        for e in c.get("env", []):
            if "value" in e:
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e["value"]):
                    if ref not in defined:
                        self.error(w, f"{where}: env {e['name']} refers to $({ref}), not defined before it")
                defined[e["name"]] = self.expand(e["value"], defined)
                continue
            src = e.get("valueFrom", {})
            if "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                secret = self.named("Secret", ref["name"])
                if secret is None and not ref.get("optional") and ref["name"] not in self.external_secrets:
                    self.error(w, f"{where}: env {e['name']}: Secret {ref['name']} is neither rendered nor expected")
                elif secret is not None and ref["key"] not in {**secret.get("data", {}), **secret.get("stringData", {})} and not ref.get("optional"):
                    self.error(w, f"{where}: env {e['name']}: Secret {ref['name']} has no key {ref['key']}")
                defined[e["name"]] = None
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                cm = self.named("ConfigMap", ref["name"])
                value = (cm or {}).get("data", {}).get(ref["key"])
                if value is None and not ref.get("optional"):
                    self.error(w, f"{where}: env {e['name']}: ConfigMap {ref['name']} has no key {ref['key']}")
                defined[e["name"]] = value
            elif "fieldRef" in src:
                defined[e["name"]] = "fieldRef:" + src["fieldRef"]["fieldPath"]
            else:
                defined[e["name"]] = None
        for field in ("command", "args"):
            for arg in c.get(field, []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    if ref not in defined:
                        self.error(w, f"{where}: {field} '{arg}' refers to $({ref}), which the container does not define")
        return defined

    @staticmethod
    def expand(text, env):
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: env[m.group(1)] if env.get(m.group(1)) is not None else m.group(0), text)

    @staticmethod
    def flag(args, name):
        return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None

    def check_moerl_worker(self, w, c, env, ports, volumes):
        where = f"container {c['name']}"
        args = [self.expand(a, env) for a in c["args"]]
        for flag in ("--role", "--redis", "--store", "--run-id"):
            if self.flag(args, flag) is None:
                self.error(w, f"{where}: moerl worker without {flag}")
        redis = self.flag(args, "--redis") or ""
        m = re.match(r"redis://(:[^@]*@)?([^:/]+):(\d+)", redis)
        if not m:
            self.error(w, f"{where}: --redis '{redis}' is not redis://[:password@]host:port")
        elif not self.named("Service", m.group(2).split(".")[0]):
            self.error(w, f"{where}: --redis host {m.group(2)} is not a Service of the render")
        config = args[-1]
        mounted = False
        for mount in c.get("volumeMounts", []):
            vol = volumes.get(mount["name"], {})
            if "configMap" in vol and config.startswith(mount["mountPath"].rstrip("/") + "/"):
                cm = self.named("ConfigMap", vol["configMap"]["name"]) or {}
                mounted = os.path.basename(config) in cm.get("data", {})
        if not mounted:
            self.error(w, f"{where}: the run config {config} is not a file of a mounted ConfigMap")
        port = env.get("MOERL_HEALTH_PORT")
        if port is None or int(port) not in ports.values():
            self.error(w, f"{where}: MOERL_HEALTH_PORT {port} is not a containerPort")
        if w["kind"] in LONG_RUNNING:
            if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
                self.error(w, f"{where}: livenessProbe is not httpGet /healthz")
            if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/readyz":
                self.error(w, f"{where}: readinessProbe is not httpGet /readyz")

    def role_container(self, kind, name):
        w = self.named(kind, name)
        if w is None:
            return None, None
        return w, self.pod_spec(w)["containers"][0]

    def required(self, kind, name):
        w, c = self.role_container(kind, name)
        if w is None:
            self.errors.append(f"no {name} {kind}")
        return w, c

    def run_id(self):
        w, c = self.role_container("Deployment", "rollout")
        if c is None:
            return None
        env = self.resolved_env(w, c)
        return self.flag([self.expand(a, env) for a in c.get("args", [])], "--run-id")

    def resolved_env(self, w, c):
        errors = list(self.errors)
        env = self.check_env(w, c)
        self.errors = errors  # resolution only: check_container reports
        return env

    def check_scaled_objects(self):
        for so in self.by_kind.get("ScaledObject", {}).values():
            ref = so["spec"].get("scaleTargetRef", {})
            kind = ref.get("kind", "Deployment")
            if not self.named(kind, ref.get("name", "")):
                self.error(so, f"scaleTargetRef {kind}/{ref.get('name')} is not a workload of the render")
            elif ref.get("name") != "rollout":
                self.error(so, f"scaleTargetRef {ref.get('name')}; expected the rollout Deployment")
            run_id = self.run_id()
            for t in so["spec"].get("triggers", []):
                if t.get("type") != "redis-streams":
                    self.error(so, f"trigger type {t.get('type')}; expected redis-streams")
                    continue
                md = t.get("metadata", {})
                if md.get("stream") != TASK_STREAM % run_id:
                    self.error(so, f"stream '{md.get('stream')}'; the rollout workers' run id '{run_id}' "
                                   f"puts tasks on '{TASK_STREAM % run_id}'")
                if md.get("consumerGroup") != TASK_GROUP:
                    self.error(so, f"consumerGroup '{md.get('consumerGroup')}'; expected '{TASK_GROUP}'")
                if "lagCount" not in md or "pendingEntriesCount" in md:
                    self.error(so, "expected lagCount (tasks not yet leased) and no pendingEntriesCount")
                host, _, port = md.get("address", "").partition(":")
                parts = host.split(".")
                svc = self.named("Service", parts[0])
                if svc is None or (len(parts) > 1 and parts[1] != self.namespace):
                    self.error(so, f"address {md.get('address')} is not the Redis Service of namespace {self.namespace}")
                elif str(port) not in [str(p["port"]) for p in svc["spec"]["ports"]]:
                    self.error(so, f"address port {port} is not a port of Service {parts[0]}")
                auth = t.get("authenticationRef", {}).get("name")
                ta = self.named("TriggerAuthentication", auth or "")
                if ta is None:
                    self.error(so, f"authenticationRef {auth}: no such TriggerAuthentication")
                else:
                    for s in ta["spec"].get("secretTargetRef", []):
                        if not self.named("Secret", s["name"]) and s["name"] not in self.external_secrets:
                            self.error(ta, f"secretTargetRef {s['name']}: Secret neither rendered nor expected")

    def check_trainer(self):
        sts, c = self.required("StatefulSet", "trainer")
        if sts is None:
            return
        svc = self.named("Service", sts["spec"].get("serviceName", ""))
        if svc is None or svc["spec"].get("clusterIP") != "None":
            self.error(sts, f"serviceName {sts['spec'].get('serviceName')} is not a headless Service")
        env = {e["name"]: e for e in c.get("env", [])}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                self.error(sts, f"trainer env {name} missing (torchrun's environment)")
        rank = env.get("RANK", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if "RANK" in env and rank != "metadata.labels['apps.kubernetes.io/pod-index']":
            self.error(sts, f"RANK from {rank}; expected the pod ordinal (label apps.kubernetes.io/pod-index)")
        replicas = sts["spec"].get("replicas", 1)
        if "WORLD_SIZE" in env and env["WORLD_SIZE"].get("value") != str(replicas):
            self.error(sts, f"WORLD_SIZE {env['WORLD_SIZE'].get('value')} != replicas {replicas}")
        want = f"{sts['metadata']['name']}-0.{sts['spec'].get('serviceName')}.{self.namespace}.svc.cluster.local"
        if "MASTER_ADDR" in env and env["MASTER_ADDR"].get("value") != want:
            self.error(sts, f"MASTER_ADDR {env['MASTER_ADDR'].get('value')}; expected rank 0's name {want}")
        if svc is not None and "MASTER_PORT" in env and env["MASTER_PORT"].get("value") not in [str(p["port"]) for p in svc["spec"]["ports"]]:
            self.error(sts, f"MASTER_PORT {env['MASTER_PORT'].get('value')} is not a port of Service {svc['metadata']['name']}")

    def check_rollout(self):
        d, c = self.required("Deployment", "rollout")
        if d is None:
            return
        spec = self.pod_spec(d)
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if grace >= SPOT_NOTICE_S:
            self.error(d, f"terminationGracePeriodSeconds {grace} does not fit the {SPOT_NOTICE_S} s spot notice")
        pre = c.get("lifecycle", {}).get("preStop")
        pre_s = 0
        if pre is None:
            self.error(d, "rollout container has no preStop hook")
        elif "exec" in pre:
            cmd = pre["exec"]["command"]
            pre_s = float(cmd[-1]) if cmd and os.path.basename(cmd[0]) == "sleep" else 0
        drain = self.flag(c.get("args", []), "--grace-s")
        drain_s = float(drain) if drain else 20
        if pre_s + drain_s >= grace:
            self.error(d, f"preStop {pre_s:g} s + moerl --grace-s {drain_s:g} s does not fit in "
                          f"terminationGracePeriodSeconds {grace}")
        if not any(p["spec"].get("selector", {}).get("matchLabels", {}) and
                   self.matches(p["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
                   for p in self.by_kind.get("PodDisruptionBudget", {}).values()):
            self.error(d, "no PodDisruptionBudget covers the rollout workers")

    def check_redis(self):
        sts, c = self.required("StatefulSet", "redis")
        if sts is None:
            return
        args = c.get("args", [])
        if self.flag(args, "--appendonly") != "yes":
            self.error(sts, "redis without --appendonly yes")
        if self.flag(args, "--maxmemory-policy") != "noeviction":
            self.error(sts, "redis --maxmemory-policy is not noeviction (a queue must not drop tasks)")
        data_dir = self.flag(args, "--dir")
        claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
        on_pvc = any(m["mountPath"] == data_dir and m["name"] in claims for m in c.get("volumeMounts", []))
        if not on_pvc:
            self.error(sts, f"redis --dir {data_dir} is not a mounted volumeClaimTemplate (the AOF must be on a PVC)")
        pw = self.flag(args, "--requirepass") or ""
        m = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", pw)
        env = {e["name"]: e for e in c.get("env", [])}
        if not m or "secretKeyRef" not in env.get(m.group(1), {}).get("valueFrom", {}):
            self.error(sts, "redis --requirepass does not come from a Secret")
        if not re.search(r"redis:7\.", c.get("image", "")):
            self.error(sts, f"redis image {c.get('image')}; expected Redis 7 (streams lag for KEDA)")

    # Set by EKS (IRSA's webhook, the Pod Identity agent): a value in a manifest would override it.
    INJECTED_AWS_ENV = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
                        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")

    def check_credentials(self):
        accounts = set()
        for w in self.workloads():
            moerl = [c for c, _ in self.containers(w) if c.get("image", "").split("/")[-1].startswith("moerl")]
            if not moerl:
                continue
            sa = self.pod_spec(w).get("serviceAccountName")
            if not sa or not self.named("ServiceAccount", sa):
                self.error(w, f"serviceAccountName {sa!r} is not a ServiceAccount of the render "
                              "(the S3 role of IRSA / Pod Identity hangs on it)")
            accounts.add(sa)
            for c in moerl:
                for e in c.get("env", []):
                    if e["name"] in self.INJECTED_AWS_ENV:
                        self.error(w, f"container {c['name']} sets {e['name']}, which EKS injects for IRSA / "
                                      "Pod Identity; leave it to EKS")
        if not self.cluster:
            return
        associations = {(a.get("namespace"), a.get("serviceAccountName"))
                        for a in self.cluster.get("iam", {}).get("podIdentityAssociations", [])}
        for sa in sorted(a for a in accounts if a):
            obj = self.named("ServiceAccount", sa)
            if obj is None:
                continue
            arn = obj["metadata"].get("annotations", {}).get("eks.amazonaws.com/role-arn", "")
            if (self.namespace, sa) in associations:
                continue
            if not re.fullmatch(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+", arn):
                self.error(obj, f"no IAM role for the S3 store: annotation eks.amazonaws.com/role-arn {arn!r} "
                                "is not a role ARN, and the cluster config has no podIdentityAssociation for it")

    def check_node_groups(self):
        groups = self.cluster.get("managedNodeGroups", []) + self.cluster.get("nodeGroups", [])
        for w in self.workloads():
            spec = self.pod_spec(w)
            pool = spec.get("nodeSelector", {}).get("moerl.dev/pool")
            if pool is None:
                self.error(w, "no nodeSelector moerl.dev/pool (which node group it runs on)")
                continue
            matching = [g for g in groups if g.get("labels", {}).get("moerl.dev/pool") == pool]
            if not matching:
                self.error(w, f"nodeSelector moerl.dev/pool={pool}: no node group of the cluster config has it")
                continue
            tolerated = {(t.get("key"), t.get("effect")) for t in spec.get("tolerations", [])}
            limits = {}
            for c, _ in self.containers(w):
                limits.update(c.get("resources", {}).get("limits", {}))
            for g in matching:
                for taint in g.get("taints", []):
                    if (taint["key"], taint["effect"]) not in tolerated:
                        self.error(w, f"node group {g['name']} has taint {taint['key']}:{taint['effect']}, "
                                      "which the pods do not tolerate")
                if "vpc.amazonaws.com/efa" in limits and not g.get("efaEnabled"):
                    self.error(w, f"requests EFA devices, but node group {g['name']} is not efaEnabled")
                spot_pod = spec.get("nodeSelector", {}).get("eks.amazonaws.com/capacityType") == "SPOT"
                if spot_pod and not g.get("spot"):
                    self.error(w, f"selects spot capacity, but node group {g['name']} is on-demand")


def check(objects, external_secrets=(), cluster=None):
    return validate_schemas(objects) + Lint(objects, external_secrets, cluster).run()


def check_run_configs(objects, moerl):
    """Every run config of the render loads in the binary: a worker parses it, then fails on Redis."""
    errors = []
    for cm in [o for o in objects if o["kind"] == "ConfigMap"]:
        for key, text in cm.get("data", {}).items():
            if not key.endswith(".yaml"):
                continue
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, key)
                with open(path, "w") as f:
                    f.write(text)
                out = subprocess.run([moerl, "worker", "--role", "env", "--redis", "redis://127.0.0.1:1/0?retry_ms=0",
                                      "--store", f"file://{d}/store", "--run-id", "check", "--out", d, path],
                                     capture_output=True, text=True, timeout=120,
                                     env=os.environ)
                if "127.0.0.1:1" not in out.stderr:
                    errors.append(f"ConfigMap/{cm['metadata']['name']} {key}: the binary rejects it:\n{out.stderr.strip()}")
    return errors


# ---- known-bad variants: each must be rejected, with the message named ---------------------------
def find(objects, kind, name):
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def container(objects, kind, name):
    return find(objects, kind, name)["spec"]["template"]["spec"]["containers"][0]


def set_env(c, name, value):
    for e in c["env"]:
        if e["name"] == name:
            e.clear()
            e.update({"name": name, "value": value})


BAD = {
    # name: (overlay, mutation, expected text in an error)
    "grace-over-spot-notice": ("dev", lambda o: find(o, "Deployment", "rollout")["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=150), "does not fit the 120 s spot notice"),
    "prestop-too-long": ("dev", lambda o: container(o, "Deployment", "rollout")["lifecycle"]["preStop"]["exec"].update(
        command=["/bin/sleep", "40"]), "does not fit in terminationGracePeriodSeconds"),
    "no-resources": ("dev", lambda o: container(o, "Deployment", "env").pop("resources"), "resources.requests.cpu missing"),
    "writable-root": ("dev", lambda o: container(o, "StatefulSet", "trainer")["securityContext"].update(
        readOnlyRootFilesystem=False), "readOnlyRootFilesystem is not true"),
    "root-user": ("dev", lambda o: find(o, "Deployment", "env")["spec"]["template"]["spec"]["securityContext"].pop(
        "runAsNonRoot"), "runAsNonRoot is not true"),
    "no-readiness": ("dev", lambda o: container(o, "Deployment", "rollout").pop("readinessProbe"), "readinessProbe missing"),
    "latest-image": ("dev", lambda o: container(o, "Deployment", "rollout").update(image="localhost/moerl:latest"),
                     "is not pinned"),
    "untagged-image": ("dev", lambda o: container(o, "StatefulSet", "redis").update(image="docker.io/library/redis"),
                       "is not pinned"),
    "stream-of-another-run": ("dev", lambda o: find(o, "ScaledObject", "rollout")["spec"]["triggers"][0]["metadata"].update(
        stream="moerl:{other}:tasks"), "puts tasks on 'moerl:{quickstart}:tasks'"),
    "wrong-consumer-group": ("dev", lambda o: find(o, "ScaledObject", "rollout")["spec"]["triggers"][0]["metadata"].update(
        consumerGroup="rollout"), "consumerGroup 'rollout'"),
    "pending-entries": ("dev", lambda o: find(o, "ScaledObject", "rollout")["spec"]["triggers"][0]["metadata"].update(
        pendingEntriesCount="5"), "no pendingEntriesCount"),
    "scale-target-missing": ("dev", lambda o: find(o, "ScaledObject", "rollout")["spec"]["scaleTargetRef"].update(
        name="rollouts"), "is not a workload of the render"),
    "pdb-selects-nothing": ("dev", lambda o: find(o, "PodDisruptionBudget", "rollout")["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/component": "rolout"}), "PodDisruptionBudget selector matches no workload"),
    "service-selects-nothing": ("dev", lambda o: find(o, "Service", "redis")["spec"]["selector"].update(
        {"app.kubernetes.io/component": "cache"}), "matches no workload's pod labels"),
    "world-size-mismatch": ("dev", lambda o: set_env(container(o, "StatefulSet", "trainer"), "WORLD_SIZE", "2"),
                            "WORLD_SIZE 2 != replicas 1"),
    "rank-missing": ("dev", lambda o: container(o, "StatefulSet", "trainer").update(
        env=[e for e in container(o, "StatefulSet", "trainer")["env"] if e["name"] != "RANK"]), "env RANK missing"),
    "master-addr-wrong": ("dev", lambda o: set_env(container(o, "StatefulSet", "trainer"), "MASTER_ADDR", "trainer"),
                          "expected rank 0's name"),
    "unresolved-var": ("dev", lambda o: container(o, "Deployment", "env")["args"].__setitem__(
        container(o, "Deployment", "env")["args"].index("--store") + 1, "$(MOERL_STORE_URI)"), "$(MOERL_STORE_URI)"),
    "missing-secret": ("dev", lambda o: o.remove(find(o, "Secret", "moerl-redis")), "Secret moerl-redis is neither rendered"),
    "redis-no-aof": ("dev", lambda o: container(o, "StatefulSet", "redis")["args"].__setitem__(
        container(o, "StatefulSet", "redis")["args"].index("--appendonly") + 1, "no"), "--appendonly yes"),
    "redis-aof-not-on-pvc": ("dev", lambda o: container(o, "StatefulSet", "redis")["args"].__setitem__(
        container(o, "StatefulSet", "redis")["args"].index("--dir") + 1, "/tmp"), "must be on a PVC"),
    "config-not-mounted": ("dev", lambda o: container(o, "Deployment", "rollout")["args"].__setitem__(-1, "/etc/run.yaml"),
                           "is not a file of a mounted ConfigMap"),
    "extra-capability": ("dev", lambda o: container(o, "Deployment", "env")["securityContext"]["capabilities"].update(
        add=["NET_ADMIN"]), "adds capability NET_ADMIN"),
    "schema-replicas-string": ("dev", lambda o: find(o, "Deployment", "env")["spec"].update(replicas="1"),
                               "spec/replicas must be integer"),
    "schema-keda-lag-number": ("dev", lambda o: find(o, "ScaledObject", "rollout")["spec"]["triggers"][0]["metadata"].update(
        lagCount=64), "lagCount must be string"),
    "spot-toleration-on-env": ("eks", lambda o: find(o, "Deployment", "env")["spec"]["template"]["spec"].update(
        tolerations=[{"key": SPOT_TAINT, "operator": "Exists", "effect": "NoSchedule"}]), "only rollout workers may run on spot"),
    "gpu-request-not-limit": ("eks", lambda o: container(o, "Deployment", "rollout")["resources"]["requests"].update(
        {"nvidia.com/gpu": 2}), "requests 2 != limits 1"),
    "untolerated-taint": ("eks", lambda o: find(o, "StatefulSet", "redis")["spec"]["template"]["spec"].pop("tolerations"),
                          "taint moerl.dev/pool:NoSchedule"),
    "irsa-env-by-hand": ("eks", lambda o: container(o, "Deployment", "rollout")["env"].append(
        {"name": "AWS_ROLE_ARN", "value": "arn:aws:iam::111122223333:role/other"}), "which EKS injects"),
    "no-irsa-role": ("eks", lambda o: find(o, "ServiceAccount", "moerl")["metadata"].pop("annotations"),
                     "no IAM role for the S3 store"),
    "unknown-service-account": ("dev", lambda o: find(o, "Deployment", "env")["spec"]["template"]["spec"].update(
        serviceAccountName="moerl-s3"), "is not a ServiceAccount of the render"),
    "unknown-pool": ("eks", lambda o: find(o, "Deployment", "env")["spec"]["template"]["spec"]["nodeSelector"].update(
        {"moerl.dev/pool": "cpus"}), "no node group of the cluster config"),
}

OVERLAYS = {
    "base": {"external_secrets": ["moerl-redis"], "cluster": None},
    "dev": {"external_secrets": [], "cluster": None},
    "eks": {"external_secrets": ["moerl-redis"], "cluster": "deploy/eks/cluster.yaml"},
}


def load_cluster(path):
    if not path:
        return None
    with open(os.path.join(ROOT, path)) as f:
        return yaml.safe_load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overlay", choices=sorted(OVERLAYS))
    ap.add_argument("--moerl", help="the moerl binary: check that each run config of the render loads")
    ap.add_argument("--bad-fixtures", action="store_true", help="check that every known-bad variant is rejected")
    a = ap.parse_args()
    # Exit 77 (CTest: skipped) where the tools are missing, saying which.
    for tool, why in (("kubectl", "renders the overlays (kubectl kustomize)"), ("node", "runs the schema validator")):
        if not shutil.which(tool):
            print(f"check_manifests: skipped: {tool} not found; it {why}", file=sys.stderr)
            return 77
    if not os.path.isdir(os.path.join(ROOT, "node_modules", "kubernetes-models")):
        print("check_manifests: skipped: node_modules/kubernetes-models missing (npm install at the repo root)",
              file=sys.stderr)
        return 77
    if a.bad_fixtures:
        renders = {name: render(name) for name in ("dev", "eks")}
        failed = 0
        for name, (overlay, mutate, expected) in BAD.items():
            objects = copy.deepcopy(renders[overlay])
            mutate(objects)
            opts = OVERLAYS[overlay]
            errors = check(objects, opts["external_secrets"], load_cluster(opts["cluster"]))
            if not any(expected in e for e in errors):
                failed += 1
                print(f"FAIL {name}: no error containing '{expected}'; got:\n  " + "\n  ".join(errors or ["(none)"]))
            else:
                print(f"ok   {name}: {next(e for e in errors if expected in e)}")
        print(f"check_manifests: {len(BAD) - failed} of {len(BAD)} bad variants rejected")
        return 1 if failed else 0
    if not a.overlay:
        ap.error("--overlay or --bad-fixtures")
    opts = OVERLAYS[a.overlay]
    objects = render(a.overlay)
    errors = check(objects, opts["external_secrets"], load_cluster(opts["cluster"]))
    if a.moerl:
        errors += check_run_configs(objects, a.moerl)
    for e in errors:
        print(e)
    kinds = sorted({o["kind"] for o in objects})
    print(f"check_manifests: {a.overlay}: {len(objects)} objects ({', '.join(kinds)}), {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
