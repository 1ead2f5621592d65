#!/usr/bin/env python3
"""Runs the rendered dev overlay without a cluster: each pod's container as a local process.

    run_dev_locally.py --moerl BUILD/src/cli/moerl [--steps 6] [--keep DIR]

What a kubelet would do, done here: the command and args of each container with Kubernetes'
$(VAR) expansion, its env from the rendered ConfigMaps, Secrets and field refs, ConfigMap volumes
written as files, emptyDir and PVC mounts as local directories; Service names resolve to
loopback (every NAME:PORT of the render is rewritten to 127.0.0.1 and a free port). Redis runs
from the redis StatefulSet's own command and args (real redis-server, AOF on its "PVC"); MinIO,
which cannot run here, is stood in for by s3rver with the bucket of the minio-bucket Job (and
s3rver's fixed keys in place of the dev Secret's).

Checked, each failing the run when wrong:
  - the run makes progress: the trainer trains steps;
  - KEDA's figure: the lag of the ScaledObject's stream and consumer group (XINFO GROUPS) is
    exact while the queue fills (= tasks put, nothing leased yet: the desired replica count is
    the ScaledObject's maximum), never null, and falls as the workers drain it;
  - a spot interruption of a rollout pod, as the manifest defines it (its preStop, SIGTERM, the
    grace period, then SIGKILL): the worker exits in time, releases its leases, the lag counts
    them again, a replacement pod resumes them, and no task is lost or trained twice (the
    trainer's audit file: one line per step with the task ids it trained);
  - the probes and /metrics of each moerl pod, when the binary serves them.
Exit 77 (CTest: skipped) without redis-server, node or the npm s3rver.
"""
import argparse
import base64
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_manifests as cm  # noqa: E402

ROOT = cm.ROOT
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(text):
    raise SystemExit(f"run_dev_locally: FAIL: {text}")


def wait_until(what, seconds, check, interval=0.2):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    fail(f"{what} did not happen within {seconds} s")


class Cluster:
    def __init__(self, objects, moerl, work):
        self.objects = objects
        self.moerl = moerl
        self.work = work
        self.by_kind = {}
        for o in objects:
            self.by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
        self.ns = objects[-1]["metadata"].get("namespace", "default")
        self.procs = {}  # pod name -> (Popen, log path, container, pod spec)
        self.service_ports = {}  # "name:port" -> local port
        for s in self.by_kind.get("Service", {}).values():
            for p in s["spec"]["ports"]:
                self.service_ports[f"{s['metadata']['name']}:{p['port']}"] = free_port()
        self.s3_keys = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"}

    # ---- what the kubelet resolves -----------------------------------------------------------
    def loopback(self, text):
        """NAME[.NS.svc[.cluster.local]]:PORT and pod DNS names -> 127.0.0.1:LOCAL."""
        def sub(m):
            host, port = m.group(1), m.group(2)
            name = host.split(".")[0]
            key = f"{name}:{port}"
            if key in self.service_ports:
                return f"127.0.0.1:{self.service_ports[key]}"
            # trainer-0.trainer.NS.svc.cluster.local:29500 (a pod of a headless Service)
            parts = host.split(".")
            if len(parts) > 1 and f"{parts[1]}:{port}" in self.service_ports:
                return f"127.0.0.1:{self.service_ports[parts[1] + ':' + port]}"
            return m.group(0)
        text = re.sub(r"([a-z0-9][a-z0-9.-]*):(\d+)", sub, text)
        # A bare pod DNS name (MASTER_ADDR) resolves to loopback too.
        return re.sub(r"^[a-z0-9-]+-\d+\.[a-z0-9-]+\.%s\.svc\.cluster\.local$" % re.escape(self.ns), "127.0.0.1", text)

    def env_of(self, pod, c, ordinal):
        env = {"PATH": os.environ["PATH"], "HOME": os.path.join(self.work, pod, "home"),
               "HOSTNAME": pod, "OPENBLAS_NUM_THREADS": "1"}
        os.makedirs(env["HOME"], exist_ok=True)
        for e in c.get("env", []):
            if "value" in e:
                value = VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
            else:
                src = e["valueFrom"]
                if "configMapKeyRef" in src:
                    ref = src["configMapKeyRef"]
                    value = self.by_kind["ConfigMap"][ref["name"]].get("data", {}).get(ref["key"])
                elif "secretKeyRef" in src:
                    ref = src["secretKeyRef"]
                    secret = self.by_kind.get("Secret", {}).get(ref["name"], {})
                    raw = secret.get("data", {}).get(ref["key"])
                    value = base64.b64decode(raw).decode() if raw is not None else None
                    if ref["name"] == "moerl-s3" and ref["key"] in self.s3_keys:
                        value = self.s3_keys[ref["key"]]  # the stand-in's keys
                elif "fieldRef" in src:
                    path = src["fieldRef"]["fieldPath"]
                    value = {"metadata.name": pod, "metadata.namespace": self.ns,
                             "metadata.labels['apps.kubernetes.io/pod-index']": str(ordinal)}.get(path)
                    if value is None:
                        fail(f"{pod}: env {e['name']}: field {path} is not known here")
                else:
                    fail(f"{pod}: env {e['name']}: unsupported source {src}")
            if value is not None:
                env[e["name"]] = self.loopback(value)
        return env

    def mounts_of(self, pod, c, spec):
        """mountPath -> local directory; ConfigMap volumes written out as files."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out = {}
        for m in c.get("volumeMounts", []):
            local = os.path.join(self.work, pod, "volumes", m["name"])
            v = volumes.get(m["name"], {})
            if "configMap" in v and not os.path.isdir(local):
                os.makedirs(local)
                for key, text in self.by_kind["ConfigMap"][v["configMap"]["name"]].get("data", {}).items():
                    with open(os.path.join(local, key), "w") as f:
                        f.write(text)
            os.makedirs(local, exist_ok=True)
            out[m["mountPath"]] = local
        return out

    @staticmethod
    def remap(text, mounts):
        for path in sorted(mounts, key=len, reverse=True):
            if text == path or text.startswith(path.rstrip("/") + "/"):
                return mounts[path] + text[len(path):]
        return text

    def listen_ports(self, w, c):
        """containerPort -> the local port of the Service that targets it."""
        labels = w["spec"]["template"]["metadata"]["labels"]
        named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        out = {}
        for svc in self.by_kind.get("Service", {}).values():
            if not cm.Lint.matches(svc["spec"].get("selector", {}), labels):
                continue
            for p in svc["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                out[named.get(target, target)] = self.service_ports[f"{svc['metadata']['name']}:{p['port']}"]
        return out

    def command_of(self, w, pod, c, spec, env, extra_args=()):
        mounts = self.mounts_of(pod, c, spec)
        ports = self.listen_ports(w, c)
        argv = list(c.get("command") or [self.moerl]) + list(c.get("args", [])) + list(extra_args)
        if argv[0] == "redis-server":
            argv[0] = shutil.which("redis-server")
            argv += ["--bind", "127.0.0.1"]  # loopback only, here
        out = []
        for a in argv:
            a = VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a)  # Kubernetes' expansion
            if out and out[-1] == "--port" and a.isdigit() and int(a) in ports:
                a = str(ports[int(a)])  # the port this pod listens on, behind its Service
            out.append(self.remap(self.loopback(a), mounts))
        for key, value in env.items():
            if key.endswith("_PORT") and value.isdigit() and int(value) in ports:
                env[key] = str(ports[int(value)])
        if "MOERL_HEALTH_PORT" in env:
            env["MOERL_HEALTH_PORT"] = str(free_port())
        return out

    # ---- pods ---------------------------------------------------------------------------------
    def start(self, workload_kind, name, pod, ordinal=0, extra_args=(), patch=None):
        w = self.by_kind[workload_kind][name]
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        env = self.env_of(pod, c, ordinal)
        argv = self.command_of(w, pod, c, spec, env, extra_args)
        if patch:
            argv = patch(argv)
        log = os.path.join(self.work, f"{pod}.log")
        p = subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=self.work)
        self.procs[pod] = (p, log, c, spec, env)
        return p

    def interrupt(self, pod):
        """The kubelet's termination: preStop, SIGTERM, grace period, SIGKILL. Returns (code, s)."""
        p, log, c, spec, env = self.procs[pod]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        t0 = time.time()
        pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if pre:
            subprocess.run(pre, timeout=grace, env=env)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=max(0.0, grace - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return None, time.time() - t0
        return p.returncode, time.time() - t0

    def stop_all(self):
        """The moerl pods first, then Redis (the workers release their leases into it)."""
        moerl = [p for name, (p, *_) in self.procs.items() if not name.startswith("redis")]
        rest = [p for name, (p, *_) in self.procs.items() if name.startswith("redis")]
        for group in (moerl, rest):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.time() + 30
            for p in group:
                try:
                    p.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def alive(self, pod):
        p, log, *_ = self.procs[pod]
        if p.poll() is not None:
            with open(log) as f:
                tail = f.read()[-3000:]
            fail(f"pod {pod} exited with {p.returncode}:\n{tail}")
        return True


def redis_cli(cluster, *args):
    password = base64.b64decode(cluster.by_kind["Secret"]["moerl-redis"]["data"]["password"]).decode()
    port = cluster.service_ports["redis:6379"]
    out = subprocess.run(["redis-cli", "-p", str(port), "--no-auth-warning", "-a", password, "--json", *args],
                         capture_output=True, text=True, timeout=10)
    if out.returncode != 0 or out.stdout.startswith("ERR") or '"ERR' in out.stdout[:10]:
        return None
    return json.loads(out.stdout) if out.stdout.strip() else None


def scaler_reading(cluster, so):
    """The lag KEDA's redis-streams scaler reads, and the replica count it asks for."""
    md = so["spec"]["triggers"][0]["metadata"]
    groups = redis_cli(cluster, "XINFO", "GROUPS", md["stream"])
    if not groups:
        return None, None
    g = next((g for g in groups if g.get("name") == md["consumerGroup"]), None)
    if g is None:
        return None, None
    # Redis reports the lag as null when entries were deleted at or past the group's read position;
    # KEDA's lagCount scaler would read that as no task waiting. The queue trims done entries from the
    # stream's head only, so the lag is a number at every reading.
    lag = g.get("lag")
    if lag is None:
        fail(f"XINFO GROUPS {md['stream']}: the lag is null, so KEDA's lagCount scaler cannot read it")
    lo, hi = so["spec"].get("minReplicaCount", 0), so["spec"]["maxReplicaCount"]
    want = min(hi, max(lo, math.ceil(lag / float(md["lagCount"]))))
    return lag, want


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*) (NaN|[+-]Inf|-?[0-9.]+(?:e[+-]?[0-9]+)?)")

# What each role must export on /metrics (names with their Prometheus type).
ROLE_METRICS = {
    "trainer": {"moerl_train_steps_total": "counter", "moerl_train_policy_version": "gauge",
                "moerl_train_reward_mean": "gauge", "moerl_train_staleness_mean": "gauge",
                "moerl_train_tokens_per_second": "gauge", "moerl_train_weight_publish_seconds": "gauge",
                "moerl_train_experiences_waiting": "gauge", "moerl_queue_tasks_outstanding": "gauge"},
    "rollout": {"moerl_rollout_tasks_leased_total": "counter", "moerl_rollout_tasks_done_total": "counter",
                "moerl_rollout_tasks_requeued_total": "counter", "moerl_rollout_tokens_generated_total": "counter",
                "moerl_rollout_tokens_per_second": "gauge", "moerl_rollout_policy_version": "gauge",
                "moerl_rollout_policy_sync_seconds": "gauge"},
    "env": {"moerl_env_tasks_put_total": "counter", "moerl_queue_tasks_outstanding": "gauge"},
}


def scrape(pod, port):
    """The samples of a pod's /metrics, after checking every line is a HELP, a TYPE or its sample."""
    status, body = get(f"http://127.0.0.1:{port}/metrics")
    if status != 200 or not body.endswith("\n"):
        fail(f"{pod}: /metrics answered {status}: {body[:200]}")
    samples, types, typed = {}, {}, None
    for line in body.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, typed, kind = line.split(" ")
            types[typed] = kind
            continue
        m = SAMPLE.fullmatch(line)
        if not m or m.group(1) != typed:
            fail(f"{pod}: /metrics line {line!r} is not a sample of the TYPE before it")
        samples[m.group(1)] = float(m.group(2))
    role = next((r for r in ROLE_METRICS if pod.startswith(r)), None)
    for name, kind in ROLE_METRICS.get(role, {}).items():
        if types.get(name) != kind:
            fail(f"{pod}: /metrics has no {kind} {name}: {sorted(types)}")
    return samples


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moerl", required=True)
    ap.add_argument("--steps", type=int, default=6, help="steps to train after the interruption")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    a = ap.parse_args()
    for tool in ("redis-server", "redis-cli", "node", "kubectl"):
        if not shutil.which(tool):
            print(f"run_dev_locally: skipped: {tool} not found", file=sys.stderr)
            return 77
    s3rver = os.path.join(ROOT, "node_modules", ".bin", "s3rver")
    if not os.path.exists(s3rver):
        print("run_dev_locally: skipped: node_modules/.bin/s3rver missing (npm install)", file=sys.stderr)
        return 77
    work = a.keep or tempfile.mkdtemp(prefix="moerl-dev-")
    os.makedirs(work, exist_ok=True)
    objects = cm.render("dev")
    cluster = Cluster(objects, os.path.abspath(a.moerl), work)
    so = cluster.by_kind["ScaledObject"]["rollout"]
    t_start = time.time()
    helpers = []
    try:
        # Redis from its own manifest; the "PVC" is a local directory.
        cluster.start("StatefulSet", "redis", "redis-0")
        wait_until("redis answering", 20, lambda: redis_cli(cluster, "PING") == "PONG")
        aof = os.path.join(work, "redis-0", "volumes", "data", "appendonlydir")
        wait_until("the append-only file on the PVC", 10, lambda: os.path.isdir(aof))
        # MinIO's stand-in, with the bucket the minio-bucket Job makes.
        bucket = cluster.by_kind["Job"]["minio-bucket"]["spec"]["template"]["spec"]["containers"][0]["args"][-1].split("/")[-1]
        s3_port = cluster.service_ports["minio:9000"]
        helpers.append(subprocess.Popen(
            [s3rver, "--directory", os.path.join(work, "s3"), "--address", "127.0.0.1", "--port", str(s3_port),
             "--silent", "--configure-bucket", bucket],
            env={**os.environ, "NODE_OPTIONS": "--openssl-legacy-provider"},
            stdout=open(os.path.join(work, "s3rver.log"), "w"), stderr=subprocess.STDOUT))
        wait_until("s3rver answering", 30, lambda: get(f"http://127.0.0.1:{s3_port}/")[0] is not None)

        # A rollout pod before any policy is published: alive, not ready (503), and it drains on SIGTERM.
        early = cluster.start("Deployment", "rollout", "rollout-local-0")
        early_port = cluster.procs["rollout-local-0"][4]["MOERL_HEALTH_PORT"]
        rc = cluster.procs["rollout-local-0"][2]
        wait_until("rollout-local-0 serving its probes", 30,
                   lambda: get(f"http://127.0.0.1:{early_port}{rc['livenessProbe']['httpGet']['path']}")[0] == 200)
        for _ in range(10):
            status, body = get(f"http://127.0.0.1:{early_port}{rc['readinessProbe']['httpGet']['path']}")
            if status != 503:
                fail(f"rollout-local-0 has no policy to load, but its readiness probe answered {status}: {body}")
            time.sleep(0.1)
        code, _ = cluster.interrupt("rollout-local-0")
        if code != 0:
            fail(f"rollout-local-0, never ready, exited with {code} on SIGTERM")
        del cluster.procs["rollout-local-0"]
        print("readiness: a rollout pod without a policy answers 503 for 1 s, and exits 0 on SIGTERM")

        audit = os.path.join(work, "audit.jsonl")
        cluster.start("StatefulSet", "trainer", "trainer-0", extra_args=(), patch=lambda argv: argv[:-1] + ["--audit", audit, argv[-1]])
        cluster.start("Deployment", "env", "env-local-1")
        # The queue fills before any rollout worker runs: the lag is every task put.
        md = so["spec"]["triggers"][0]["metadata"]
        run_id = md["stream"][len("moerl:{"):-len("}:tasks")]
        open_key = f"moerl:{{{run_id}}}:tasks:open"
        lag, want = wait_until("tasks on the stream", 180,
                               lambda: cluster.alive("trainer-0") and cluster.alive("env-local-1")
                               and (scaler_reading(cluster, so)[0] or None) and scaler_reading(cluster, so))
        time.sleep(1.0)  # env puts steps 0..max_staleness
        lag, want = scaler_reading(cluster, so)
        put = redis_cli(cluster, "SCARD", open_key)
        if lag != put:
            fail(f"lag {lag} != tasks put and not leased {put} before any worker ran")
        if want != so["spec"]["maxReplicaCount"]:
            fail(f"lag {lag} / lagCount {md['lagCount']}: KEDA would ask for {want} replicas; expected the maximum")
        print(f"queue filled: lag {lag} = tasks put; KEDA asks for {want} rollout replicas (max)")

        # Two rollout pods (the desired count), as KEDA would scale the Deployment.
        cluster.start("Deployment", "rollout", "rollout-local-1")
        cluster.start("Deployment", "rollout", "rollout-local-2")
        # rollout-local-2's readiness from its start: no answer or 503 until it holds a policy, then 200.
        ready_port = cluster.procs["rollout-local-2"][4]["MOERL_HEALTH_PORT"]
        ready_path = cluster.procs["rollout-local-2"][2]["readinessProbe"]["httpGet"]["path"]
        seen = []

        def ready():
            status, _ = get(f"http://127.0.0.1:{ready_port}{ready_path}")
            if not seen or seen[-1] != status:
                seen.append(status)
            return status == 200
        wait_until("rollout-local-2 ready", 120, lambda: cluster.alive("rollout-local-2") and ready(), interval=0.02)
        if any(st not in (None, 503) for st in seen[:-1]):
            fail(f"rollout-local-2's readiness went {seen} before it was ready")
        print(f"readiness: rollout-local-2 went {' -> '.join(str(st or 'no answer') for st in seen)}")

        def steps_done():
            if not os.path.exists(audit):
                return 0
            with open(audit) as f:
                return sum(1 for l in f if '"event":"step"' in l.replace(" ", ""))
        lags = []

        def progress(n):
            lags.append(scaler_reading(cluster, so)[0])
            return steps_done() >= n
        wait_until("2 trained steps", 600, lambda: cluster.alive("trainer-0") and progress(2), interval=0.5)

        # Probes and metrics of every moerl pod.
        served = 0
        first_scrape = {}
        for pod, (p, log, c, spec, env) in cluster.procs.items():
            if "MOERL_HEALTH_PORT" not in env:
                continue
            port = env["MOERL_HEALTH_PORT"]
            status, _ = get(f"http://127.0.0.1:{port}{c['livenessProbe']['httpGet']['path']}")
            if status is None:
                continue
            served += 1
            if status != 200:
                fail(f"{pod}: liveness probe answered {status}")
            status, body = get(f"http://127.0.0.1:{port}{c['readinessProbe']['httpGet']['path']}")
            if status != 200:
                fail(f"{pod}: readiness probe answered {status}: {body}")
            first_scrape[pod] = scrape(pod, port)
        if served != len(cluster.procs) - 1:
            fail(f"probes: {served} of {len(cluster.procs) - 1} moerl pods serve them")
        t, r = first_scrape["trainer-0"], first_scrape["rollout-local-2"]
        if t["moerl_train_steps_total"] < 2 or t["moerl_train_policy_version"] < 2:
            fail(f"trainer-0 trained 2 steps, but /metrics says {t}")
        if r["moerl_rollout_policy_version"] < 0:
            fail(f"rollout-local-2 is ready, but /metrics says no policy is loaded: {r}")
        if r["moerl_rollout_tasks_leased_total"] < r["moerl_rollout_tasks_done_total"]:
            fail(f"rollout-local-2 finished more tasks than it leased: {r}")
        print(f"probes and /metrics: all {served} moerl pods serve them; trainer steps "
              f"{t['moerl_train_steps_total']:.0f}, rollout-local-2 tasks done {r['moerl_rollout_tasks_done_total']:.0f}")

        # A spot interruption of rollout-local-1, as the manifest defines it.
        code, seconds = cluster.interrupt("rollout-local-1")
        with open(cluster.procs["rollout-local-1"][1]) as f:
            log = f.read()
        grace = cluster.by_kind["Deployment"]["rollout"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        if code is None:
            fail(f"the interrupted rollout worker outlived its {grace} s grace period:\n{log[-2000:]}")
        if code != 0:
            fail(f"the interrupted rollout worker exited with {code}:\n{log[-2000:]}")
        m = re.search(r"terminated: pushed (\d+) duplicates (\d+) released (\d+)", log)
        if not m:
            fail(f"the interrupted worker did not report its drain:\n{log[-2000:]}")
        released = int(m.group(3))
        lag_after, _ = scaler_reading(cluster, so)
        print(f"spot interruption: exited 0 in {seconds:.1f} s (grace {grace} s), released {released} tasks, "
              f"lag now {lag_after}")
        # The replacement pod the Deployment would start.
        cluster.start("Deployment", "rollout", "rollout-local-3")
        base = steps_done()
        ports = {pod: env["MOERL_HEALTH_PORT"] for pod, (_, _, _, _, env) in cluster.procs.items()
                 if "MOERL_HEALTH_PORT" in env}

        def replacement_worked():
            # The steps can outrun the new pod's start: the run goes on until it has done work too.
            status, body = get(f"http://127.0.0.1:{ports['rollout-local-3']}/metrics")
            m = re.search(r"^moerl_rollout_tasks_done_total (\S+)$", body, re.M) if status == 200 else None
            return m is not None and float(m.group(1)) > 0
        wait_until(f"{a.steps} more trained steps, some by the replacement pod", 900,
                   lambda: cluster.alive("trainer-0") and cluster.alive("rollout-local-3") and
                   progress(base + a.steps) and replacement_worked(), interval=0.5)
        # The counters moved with the run.
        moved = []
        for pod, name in (("trainer-0", "moerl_train_steps_total"), ("trainer-0", "moerl_train_tokens_total"),
                          ("rollout-local-2", "moerl_rollout_tasks_done_total"),
                          ("rollout-local-2", "moerl_rollout_tokens_generated_total"),
                          ("env-local-1", "moerl_env_tasks_put_total")):
            before, now = first_scrape[pod].get(name, 0), scrape(pod, ports[pod]).get(name, 0)
            if now <= before:
                fail(f"{pod}: {name} did not grow while the run went on ({before} -> {now})")
            moved.append(f"{pod} {name} {before:.0f} -> {now:.0f}")
        r3 = scrape("rollout-local-3", ports["rollout-local-3"])
        if r3["moerl_rollout_tasks_done_total"] <= 0 or r3["moerl_rollout_policy_version"] < 0:
            fail(f"rollout-local-3 trained steps but its /metrics shows no work: {r3}")
        print("metrics moved: " + "; ".join(moved))
    finally:
        cluster.stop_all()
        for h in helpers:
            h.terminate()
            h.wait()

    # Nothing lost, nothing trained twice.
    cfg = cm.yaml.safe_load(cluster.by_kind["ConfigMap"][next(n for n in cluster.by_kind["ConfigMap"] if n.startswith("moerl-run"))]["data"]["run.yaml"])
    per_step = cfg["train"]["prompts_per_step"] * cfg["train"]["group_size"]
    seen = {}
    steps = []
    with open(audit) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") != "step":
                continue
            steps.append(e["step"])
            if len(e["tasks"]) != per_step or len(set(e["tasks"])) != per_step:
                fail(f"step {e['step']} trained {len(set(e['tasks']))} distinct tasks; expected {per_step}")
            for t in e["tasks"]:
                if t in seen:
                    fail(f"task {t} trained twice (steps {seen[t]} and {e['step']})")
                seen[t] = e["step"]
                if not t.startswith(f"s{e['step']}-"):
                    fail(f"task {t} trained in step {e['step']}")
    if steps != list(range(steps[0], steps[0] + len(steps))):
        fail(f"trained steps {steps} are not consecutive")
    retried = 0
    with open(audit) as f:
        retried = sum(json.loads(l).get("retried", 0) for l in f)
    numeric = [l for l in lags if l is not None]
    if not numeric or min(numeric) >= lag:
        fail(f"the lag never fell below the filled queue's {lag} while workers ran: {numeric[:20]}")
    print(f"trained steps {steps[0]}..{steps[-1]}: {len(seen)} tasks, each once; {retried} retried after the "
          f"interruption; lag fell from {lag} to {min(numeric)}; {time.time() - t_start:.0f} s in all")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
