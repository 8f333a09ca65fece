#!/usr/bin/python3
"""Checks the refitd containers of rendered Kubernetes manifests against refitd itself.

Usage: check_refitd.py REFITD RENDERED.json [CERTS]
  (RENDERED: a JSON array of objects, `kubectl kustomize`'s output; CERTS: a directory made by
  tools/gen_certs.sh, whose ca.pem, node-0.pem and node-0.key stand for the pods' TLS files)

For every container whose image names refitd:
- refitd parses its arguments and its --config file (the ConfigMap mounted at that path, written
  to a temporary file) with `--help` last: refitd's parser reads the config file first, then the
  arguments in order, so an unknown flag or key, or a value of the wrong type, exits 2 naming it
  before --help is reached and exits 0. `$(VAR)` references are replaced by a sample value first
  (Kubernetes expands them from the container's env), and `--node=0` stands for the entrypoint's
  (as do --tls-cert/--tls-key where REFIT_TLS_DIR asks the entrypoint for them).
- transport security: a refitd on a routable --listen, --data-listen or --worker-listen without
  the three --tls-* flags fails here (refitd refuses it at start), and so does --insecure-listen.
  Each TLS file lies on a mounted volume (the key not on a ConfigMap). With CERTS, refitd then runs
  its whole start-up check of the flags (no --help: refitd's --help exits before the checks that
  follow parsing: the TLS files readable, all three or none, listeners loopback without TLS) with
  the pod's TLS paths replaced by CERTS' files, with --check-config (refitd checks everything it
  checks at start, opens nothing, exits 0; exit 2 is a refusal naming what is wrong), and must
  say it uses TLS.
- the probes have one handler each and ask the port of --health-listen (plaintext, health only)
  when refitd has TLS: a kubelet's probe presents no client certificate; else --listen's;
- a prometheus.io/port annotation names --metrics-listen's port;
- the worker socket lies on a mounted volume, and in a pod with other containers they mount it;
- a --coordinator dns:/// target names a headless Service of the rendered objects, in its
  namespace, with that port;
- a coordinator's --state-file lies on a persistent volume (a StatefulSet's volumeClaimTemplate).
Prints one line per finding; exits 1 if any check failed.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

SAMPLE = {"status.hostIP": "10.0.0.2", "status.podIP": "10.1.0.2"}
failures = []


def fail(where, message):
    failures.append(f"{where}: {message}")
    print(f"FAIL {where}: {message}")


BOOLS = {"insecure-listen", "routing", "nccl-register", "nccl-stream-priority", "aligned-copy-kernel"}


def flag_values(argv):
    """--name=value and --name value pairs, as refitd's parser reads them; --bool, --nobool."""
    out = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            out[k] = v
        elif a.startswith("--") and a[2:] in BOOLS:
            out[a[2:]] = "true"
        elif a.startswith("--no") and a[4:] in BOOLS:
            out[a[4:]] = "false"
        elif a.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[a[2:]] = argv[i + 1]
            i += 1
        i += 1
    return out


def is_loopback(address):
    """daemon/config.cc's IsLoopbackAddress: host:port, [v6]:port, or ipv4:/ipv6:/dns:/// URIs."""
    host = address
    for scheme in ("ipv4:", "ipv6:", "dns:///"):
        if host.startswith(scheme):
            host = host[len(scheme):]
    if ":" in host:
        host = host[:host.rindex(":")]
    if len(host) >= 2 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    return host in ("localhost", "::1") or host.startswith("127.")


def truthy(v):
    return str(v).lower() in ("true", "1", "yes")


def pod_templates(objects):
    for o in objects:
        kind = o.get("kind")
        if kind in ("DaemonSet", "StatefulSet", "Deployment", "Job", "ReplicaSet"):
            yield o, o["spec"]["template"]["spec"]
        elif kind == "Pod":
            yield o, o["spec"]


def mount_for(container, path):
    """The volumeMount whose mountPath holds `path` (the deepest)."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
                best = m
    return best


def main():
    refitd, rendered = sys.argv[1], sys.argv[2]
    certs = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
    objects = json.load(open(rendered))
    configmaps = {(o["metadata"].get("namespace"), o["metadata"]["name"]): o.get("data", {})
                  for o in objects if o.get("kind") == "ConfigMap"}
    services = [o for o in objects if o.get("kind") == "Service"]
    checked = 0
    for owner, spec in pod_templates(objects):
        ns = owner["metadata"].get("namespace")
        where0 = f"{owner['kind']}/{owner['metadata']['name']}"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in owner.get("spec", {}).get("volumeClaimTemplates", [])}
        for c in spec.get("containers", []):
            if "refitd" not in c.get("image", ""):
                continue
            where = f"{where0} container {c['name']}"
            checked += 1
            env = {}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = e["value"]
                elif "fieldRef" in e.get("valueFrom", {}):
                    env[e["name"]] = SAMPLE.get(e["valueFrom"]["fieldRef"]["fieldPath"], "sample")
            args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
                    for a in c.get("command", [])[1:] + c.get("args", [])]
            for a in args:
                if "$(" in a:
                    fail(where, f"{a}: refers to a variable the container does not define")
            # The entrypoint's --tls-cert/--tls-key (REFIT_TLS_DIR/node-<N>.crt|.key), before the
            # container's arguments, as it passes them.
            tls_dir = env.get("REFIT_TLS_DIR")
            if tls_dir:
                args = [f"--tls-cert={tls_dir}/node-0.crt", f"--tls-key={tls_dir}/node-0.key"] + args
            flags = flag_values(args)
            config = {}
            with tempfile.TemporaryDirectory() as tmp:
                argv = [a for a in args if not a.startswith("--config")]
                if "config" in flags:
                    m = mount_for(c, flags["config"])
                    vol = volumes.get(m["name"]) if m else None
                    if vol is None or "configMap" not in vol:
                        fail(where, f"--config {flags['config']} is on no ConfigMap volume")
                        continue
                    key = os.path.relpath(flags["config"], m["mountPath"])
                    data = configmaps.get((ns, vol["configMap"]["name"]))
                    if data is None or key not in data:
                        fail(where, f"--config {flags['config']}: ConfigMap {vol['configMap']['name']} has no key {key}")
                        continue
                    try:
                        config = json.loads(data[key])
                    except ValueError as e:
                        fail(where, f"ConfigMap {vol['configMap']['name']} {key}: not JSON ({e})")
                        continue
                    path = os.path.join(tmp, "refitd.json")
                    with open(path, "w") as f:
                        f.write(data[key])
                    argv = [f"--config={path}"] + argv
                run = subprocess.run([refitd] + argv + ["--node=0", "--help"],
                                     capture_output=True, text=True, timeout=30)
                if run.returncode != 0:
                    fail(where, f"refitd refuses its flags (exit {run.returncode}): {run.stderr.strip()}")
                else:
                    print(f"ok   {where}: refitd accepts {' '.join(argv)} "
                          f"(config keys: {', '.join(sorted(config)) or 'none'})")
            settings = {**{k: str(v) for k, v in config.items()}, **flags}
            # Transport security: no routable listener without TLS (refitd refuses it at start).
            tls = bool(settings.get("tls-cert"))
            if truthy(settings.get("insecure-listen", "false")):
                fail(where, "--insecure-listen: refitd would serve plaintext to anyone who reaches it (use TLS)")
            plain = [f"--{k} {settings[k]}" for k in ("listen", "data-listen", "worker-listen")
                     if settings.get(k) and not is_loopback(settings[k])]
            if plain and not tls:
                fail(where, f"starts refitd on a routable address without TLS ({', '.join(plain)}): "
                     "refitd refuses to start; give --tls-cert, --tls-key and --tls-ca")
            placeholders = {"tls-cert": "node-0.pem", "tls-key": "node-0.key", "tls-ca": "ca.pem"}
            overrides = []
            for k, placeholder in placeholders.items():
                path = settings.get(k)
                if not path:
                    continue
                m = mount_for(c, path)
                vol = volumes.get(m["name"]) if m else None
                kinds = [x for x in ("secret", "configMap", "hostPath", "projected", "csi") if vol and x in vol]
                if not kinds:
                    fail(where, f"--{k} {path} is on no Secret, ConfigMap, hostPath, projected or CSI volume")
                    continue
                if k == "tls-key" and kinds[0] == "configMap":
                    fail(where, f"--tls-key {path} is on ConfigMap {vol['configMap']['name']}: a private key belongs in a Secret or on the host")
                if m.get("subPath"):
                    fail(where, f"--{k} {path} is mounted with subPath: a rotated file would never reach the pod")
                print(f"ok   {where}: --{k} {path} on {kinds[0]} volume {m['name']}")
                if certs:
                    overrides.append(f"--{k}={os.path.join(certs, placeholder)}")
            if tls and not certs:
                print(f"SKIP {where}: refitd's start-up check of the TLS flags (no certificates: openssl missing?)")
            elif certs:
                # refitd's own checks after parsing (which --help skips): the real arguments, the
                # TLS paths replaced by readable placeholders, --check-config.
                with tempfile.TemporaryDirectory() as tmp:
                    argv = [a for a in args if not a.startswith("--config")]
                    if "config" in flags and config:
                        path = os.path.join(tmp, "refitd.json")
                        with open(path, "w") as f:
                            json.dump(config, f)
                        argv = [f"--config={path}"] + argv
                    argv += overrides + ["--node=0", f"--worker-socket={tmp}/w.sock", "--state-file=",
                                         "--metrics-listen=", "--log-format=text", "--log-level=info",
                                         "--check-config"]
                    try:
                        run = subprocess.run([refitd] + argv, capture_output=True, text=True, timeout=30)
                        rc, err = run.returncode, run.stderr + run.stdout
                    except subprocess.TimeoutExpired as e:
                        rc, err = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
                    if rc != 0:
                        fail(where, f"refitd refuses to start with these flags (exit {rc}): {err.strip().splitlines()[-1] if err.strip() else ''}")
                    elif tls and "TLS: certificate" not in err:
                        fail(where, f"refitd did not report TLS at start (exit {rc}): {err.strip()[-300:]}")
                    else:
                        print(f"ok   {where}: refitd's start-up checks pass ({'mutual TLS' if tls else 'no TLS, loopback'}; "
                              f"--check-config)")
            # Probes: --health-listen's port (plaintext) under TLS, else the port refitd listens on.
            listen_port = settings.get("listen", "127.0.0.1:0").rsplit(":", 1)[-1]
            health = settings.get("health-listen", "")
            port = health.rsplit(":", 1)[-1] if health else listen_port
            if tls and not health:
                fail(where, "TLS without --health-listen: a kubelet's probe presents no client certificate, so it cannot ask --listen")
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                p = c.get(probe)
                if p is None:
                    if probe != "startupProbe":
                        fail(where, f"no {probe}")
                    continue
                handlers = [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if p.get(h) is not None]
                if len(handlers) != 1:
                    fail(where, f"{probe} has {len(handlers)} handlers ({', '.join(handlers)}): the API server wants one")
                handler = p.get("grpc") or p.get("tcpSocket") or {}
                if str(handler.get("port")) != port:
                    fail(where, f"{probe} asks port {handler.get('port')}, refitd serves health on {port}"
                         f"{' (--health-listen: --listen is mutual TLS)' if health else ''}")
            # Prometheus' annotations name the port refitd serves metrics on.
            annotations = (owner.get("spec", {}).get("template", {}).get("metadata", {})
                           .get("annotations", {})) if owner["kind"] != "Pod" else owner["metadata"].get("annotations", {})
            scrape_port = annotations.get("prometheus.io/port")
            metrics = settings.get("metrics-listen", "")
            if scrape_port is not None:
                if not metrics:
                    fail(where, f"prometheus.io/port {scrape_port} but no --metrics-listen")
                elif metrics.rsplit(":", 1)[-1] != scrape_port:
                    fail(where, f"prometheus.io/port {scrape_port}, --metrics-listen {metrics}")
                else:
                    print(f"ok   {where}: Prometheus scrapes --metrics-listen's port {scrape_port}")
            # The worker socket on a volume the pod's other containers share.
            sock = settings.get("worker-socket", f"/tmp/refitd-{settings.get('node', 0)}.sock")
            m = mount_for(c, os.path.dirname(sock))
            if m is None:
                fail(where, f"worker socket {sock} is on no volume (workers could not reach it)")
            else:
                for other in spec["containers"]:
                    if other is c:
                        continue
                    om = [x for x in other.get("volumeMounts", []) if x["name"] == m["name"]]
                    if not om:
                        fail(where, f"container {other['name']} does not mount the socket volume {m['name']}")
            # The coordinator's name: a headless Service of these objects.
            coord = settings.get("coordinator", "")
            if coord.startswith("dns:///"):
                mm = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", coord)
                if not mm:
                    fail(where, f"--coordinator {coord}: not <service>.<namespace>.svc.cluster.local:<port>")
                else:
                    name, sns, sport = mm.groups()
                    svc = [s for s in services if s["metadata"]["name"] == name
                           and s["metadata"].get("namespace") == sns]
                    if not svc:
                        fail(where, f"--coordinator {coord}: no Service {name} in namespace {sns} here")
                    elif svc[0]["spec"].get("clusterIP") != "None":
                        fail(where, f"Service {name} is not headless (clusterIP: None)")
                    elif int(sport) not in [p["port"] for p in svc[0]["spec"].get("ports", [])]:
                        fail(where, f"Service {name} has no port {sport}")
                    else:
                        print(f"ok   {where}: --coordinator names the headless Service {sns}/{name}:{sport}")
            elif not coord:
                # The coordinator: its state on a persistent volume.
                state = settings.get("state-file", sock + ".state")
                m = mount_for(c, os.path.dirname(state))
                if state == "" or m is None or m["name"] not in claims:
                    fail(where, f"coordinator's --state-file {state!r} is not on a persistent volume claim")
                else:
                    print(f"ok   {where}: coordinator state {state} on claim {m['name']}")
    if checked == 0:
        fail(rendered, "no refitd container found")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
