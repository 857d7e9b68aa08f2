#!/usr/bin/env python3
"""Static check of the Kubernetes manifests in deploy/k8s (no cluster, no kubectl).

  k8s_check.py SOURCE_DIR FARMEMD FARMEM_NBD FARMEMCTL

What it asserts, each a way these manifests could silently break:
  - every YAML file parses (PyYAML), every object has apiVersion/kind/metadata.name of a known
    kind, and the fields it uses are fields of that kind (a small schema of the Kubernetes API
    objects used here: a typo such as `readinesProbe` is an error, not an ignored key);
  - kustomization.yaml lists exactly the manifests of the folder;
  - every flag a manifest gives farmemd, farmem-nbd or farmemctl (container args and exec probes)
    is a flag of that binary's --help;
  - secrets: every --secret-file/--key-file path is a key of a mounted Secret volume with mode
    0400, no pod sets fsGroup (it would make the file group-readable, which farmem refuses), and
    the README creates each Secret with that key;
  - ports and probes: --listen and --metrics-listen match the named container ports the Service
    and the probes use; the readiness probe asks the daemon's own port with its own secret;
    --peers-dns names the headless Service;
  - farmemd's memory limit covers --capacity plus overhead, the grace period covers
    --drain-timeout, and the only capability added is IPC_LOCK.
Exit status 0 when all hold; otherwise every failure is printed and the status is 1.
"""
import os
import re
import shlex
import subprocess
import sys

try:
    import yaml
except ImportError:
    print("k8s_check: PyYAML is missing: apt-get install python3-yaml (deploy/install-deps.sh)")
    sys.exit(1)

errors = []


def fail(where, msg):
    errors.append(f"{where}: {msg}")


# ---- a small schema: the fields of the API objects the manifests use ----

OBJECT_META = {"name", "namespace", "labels", "annotations"}
KINDS = {
    "Namespace": ("v1", {"apiVersion", "kind", "metadata"}),
    "Service": ("v1", {"apiVersion", "kind", "metadata", "spec"}),
    "DaemonSet": ("apps/v1", {"apiVersion", "kind", "metadata", "spec"}),
    "Deployment": ("apps/v1", {"apiVersion", "kind", "metadata", "spec"}),
}
SERVICE_SPEC = {"clusterIP", "selector", "ports", "publishNotReadyAddresses", "type"}
SERVICE_PORT = {"name", "port", "targetPort", "protocol"}
DAEMONSET_SPEC = {"selector", "updateStrategy", "template", "minReadySeconds"}
DEPLOYMENT_SPEC = {"replicas", "selector", "strategy", "template", "minReadySeconds"}
POD_TEMPLATE = {"metadata", "spec"}
POD_SPEC = {"nodeSelector", "hostNetwork", "dnsPolicy", "terminationGracePeriodSeconds",
            "securityContext", "containers", "initContainers", "volumes", "tolerations",
            "priorityClassName", "serviceAccountName", "affinity"}
POD_SECURITY = {"seccompProfile", "runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup",
                "supplementalGroups"}
CONTAINER = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "resources",
             "readinessProbe", "livenessProbe", "startupProbe", "lifecycle", "securityContext",
             "volumeMounts"}
CONTAINER_SECURITY = {"runAsUser", "runAsGroup", "runAsNonRoot", "allowPrivilegeEscalation",
                      "readOnlyRootFilesystem", "capabilities", "privileged", "seccompProfile"}
CONTAINER_PORT = {"name", "containerPort", "protocol", "hostPort"}
PROBE = {"exec", "httpGet", "tcpSocket", "initialDelaySeconds", "periodSeconds", "timeoutSeconds",
         "failureThreshold", "successThreshold"}
VOLUME_MOUNT = {"name", "mountPath", "readOnly", "subPath"}
VOLUME = {"name", "secret", "emptyDir", "hostPath"}
SECRET_VOLUME = {"secretName", "defaultMode", "items", "optional"}
RESOURCES = {"requests", "limits"}
ENV = {"name", "value", "valueFrom"}


def check_keys(where, obj, allowed):
    if not isinstance(obj, dict):
        fail(where, f"expected a mapping, got {type(obj).__name__}")
        return False
    for k in obj:
        if k not in allowed:
            fail(where, f"unknown field '{k}' (known: {', '.join(sorted(allowed))})")
    return True


def quantity(where, q):
    """Kubernetes memory/cpu quantity -> bytes (or cores for cpu, as float)."""
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T|m)?", str(q))
    if not m:
        fail(where, f"'{q}' is not a quantity")
        return 0
    mult = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 1e3,
            "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}[m.group(2)]
    return float(m.group(1)) * mult


def farmem_size(s):
    """A farmem size option (4G, 512M, 1073741824): binary multiples, as farmem parses them."""
    m = re.fullmatch(r"([0-9]+)([KMGT]?)", s)
    if not m:
        return None
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]


# ---- the binaries' flags ----

def help_flags(cmd):
    r = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        fail(" ".join(cmd), f"--help exited {r.returncode}: {r.stderr.strip()}")
        return set()
    return set(re.findall(r"(?:^|[\s,])(--[a-z0-9][a-z0-9-]*)", r.stdout, re.M))


class Flags:
    def __init__(self, farmemd, nbd, ctl):
        self.bins = {"farmemd": [farmemd], "farmem-nbd": [nbd], "farmemctl": [ctl]}
        self.cache = {}

    def of(self, program, sub=None):
        key = (program, sub)
        if key not in self.cache:
            self.cache[key] = help_flags(self.bins[program] + (sub.split() if sub else []))
        return self.cache[key]


def options(args):
    """--name=value / --name value / --flag -> {name: value or True}, in order."""
    out = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            if "=" in a:
                name, value = a.split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                name, value = a, args[i + 1]
                i += 1
            else:
                name, value = a, True
            out[name] = value
        i += 1
    return out


def farmem_invocations(cmdline):
    """[(program, subcommand, args)] for each farmem program in a command (also inside sh -c)."""
    found = []
    if len(cmdline) >= 3 and cmdline[0] in ("sh", "bash", "/bin/sh") and cmdline[1] == "-c":
        words = shlex.split(cmdline[2])
        words = [w for w in words if w != "exec"]
        return farmem_invocations(words)
    if cmdline and os.path.basename(cmdline[0]) in ("farmemd", "farmem-nbd", "farmemctl"):
        program = os.path.basename(cmdline[0])
        rest = list(cmdline[1:])
        sub = None
        if program == "farmemctl":
            subs = []
            while rest and not rest[0].startswith("-"):
                subs.append(rest.pop(0))
            sub = " ".join(subs[:1]) if subs else None
            # `farmemctl key issue NAME`: the positional words are not flags; --help wants `key issue`
            if subs[:1] == ["key"] and len(subs) > 1:
                sub = "key " + subs[1]
        found.append((program, sub, rest))
    return found


def check_flags(where, flags, program, sub, args):
    known = flags.of(program, sub)
    for a in args:
        if a.startswith("--"):
            name = a.split("=", 1)[0]
            if name not in known:
                fail(where, f"{program}{' ' + sub if sub else ''} has no flag {name} (its --help)")


def expand(value, env_names, where):
    """$(VAR) references must name env entries; returns value with them replaced by <VAR>."""
    for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value):
        if var not in env_names:
            fail(where, f"$({var}) is not an env entry of the container")
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", r"<\1>", value)


def port_of(addr):
    m = re.search(r":([0-9]+)$", addr)
    return int(m.group(1)) if m else None


# ---- the checks ----

def check_workload(path, doc, flags, services, readme):
    kind, name = doc["kind"], doc["metadata"]["name"]
    where = f"{os.path.basename(path)} {kind}/{name}"
    spec = doc.get("spec", {})
    check_keys(where + " spec", spec, DAEMONSET_SPEC if kind == "DaemonSet" else DEPLOYMENT_SPEC)
    tmpl = spec.get("template", {})
    check_keys(where + " template", tmpl, POD_TEMPLATE)
    labels = tmpl.get("metadata", {}).get("labels", {})
    for k, v in spec.get("selector", {}).get("matchLabels", {}).items():
        if labels.get(k) != v:
            fail(where, f"selector {k}={v} does not match the pod template's labels")
    pod = tmpl.get("spec", {})
    check_keys(where + " pod spec", pod, POD_SPEC)
    psec = pod.get("securityContext", {})
    check_keys(where + " pod securityContext", psec, POD_SECURITY)
    volumes = {}
    for v in pod.get("volumes", []):
        check_keys(where + " volume", v, VOLUME)
        if "secret" in v:
            check_keys(where + f" volume {v['name']} secret", v["secret"], SECRET_VOLUME)
        volumes[v["name"]] = v
    grace = pod.get("terminationGracePeriodSeconds", 30)
    names = set()
    for c in pod.get("containers", []):
        cw = f"{where} container {c.get('name')}"
        check_keys(cw, c, CONTAINER)
        if c.get("name") in names:
            fail(cw, "duplicate container name")
        names.add(c.get("name"))
        if "image" not in c:
            fail(cw, "no image")
        env_names = set()
        for e in c.get("env", []):
            check_keys(cw + " env", e, ENV)
            env_names.add(e["name"])
        ports = {}
        for p in c.get("ports", []):
            check_keys(cw + " port", p, CONTAINER_PORT)
            if "name" in p:
                if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", p["name"]):
                    fail(cw, f"port name '{p['name']}' is not a valid IANA_SVC_NAME")
                ports[p["name"]] = p["containerPort"]
        res = c.get("resources", {})
        check_keys(cw + " resources", res, RESOURCES)
        req_mem = quantity(cw, res.get("requests", {}).get("memory", 0))
        lim_mem = quantity(cw, res.get("limits", {}).get("memory", 0))
        if not lim_mem:
            fail(cw, "no memory limit")
        elif req_mem > lim_mem:
            fail(cw, "memory request above the limit")
        sec = c.get("securityContext", {})
        check_keys(cw + " securityContext", sec, CONTAINER_SECURITY)
        if sec.get("privileged"):
            fail(cw, "privileged")
        caps = sec.get("capabilities", {})
        if caps.get("drop") != ["ALL"]:
            fail(cw, "does not drop ALL capabilities")
        mounts = {}
        for m in c.get("volumeMounts", []):
            check_keys(cw + " volumeMount", m, VOLUME_MOUNT)
            if m["name"] not in volumes:
                fail(cw, f"mounts volume '{m['name']}' that the pod does not define")
            mounts[m["mountPath"].rstrip("/")] = volumes.get(m["name"], {})
        for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(probe_name)
            if probe is None:
                continue
            check_keys(f"{cw} {probe_name}", probe, PROBE)
            for handler in ("httpGet", "tcpSocket"):
                port = probe.get(handler, {}).get("port")
                if isinstance(port, str) and port not in ports:
                    fail(cw, f"{probe_name} uses port '{port}' that the container does not name")
        if c.get("name") in ("farmemd", "farmem-nbd") and "readinessProbe" not in c:
            fail(cw, "no readiness probe")

        def secret_path(what, path):
            d, base = os.path.dirname(path), os.path.basename(path)
            vol = mounts.get(d)
            if vol is None or "secret" not in vol:
                fail(cw, f"{what} {path} is not in a mounted Secret volume")
                return
            s = vol["secret"]
            mode = s.get("defaultMode")
            if mode != 0o400:
                fail(cw, f"{what}: Secret volume mode is {oct(mode) if mode else 'the default 0644'},"
                         " not 0400 (farmem refuses a secret group or others may read)")
            items = s.get("items")
            if items and base not in [i["path"] for i in items]:
                fail(cw, f"{what} {path}: the Secret volume has no item {base}")
            if "fsGroup" in psec:
                fail(cw, "the pod sets fsGroup, which makes the secret file group-readable")
            pattern = (rf"create secret generic {re.escape(s['secretName'])}\b[^\n]*"
                       rf"--from-file={re.escape(base)}=")
            if not re.search(pattern, readme):
                fail(cw, f"README.md does not create Secret {s['secretName']} with key {base}")

        # The program and its flags.
        cmdline = [expand(x, env_names, cw) for x in c.get("command", []) + c.get("args", [])]
        invocations = farmem_invocations(cmdline)
        opts = {}
        for program, sub, args in invocations:
            check_flags(cw, flags, program, sub, args)
            opts = options(args)
            for f in ("--secret-file", "--key-file", "--old-secret-file", "--revoked-file"):
                if f in opts:
                    secret_path(f, opts[f])
        for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
            exec_cmd = c.get(probe_name, {}).get("exec", {}).get("command")
            if not exec_cmd:
                continue
            for program, sub, args in farmem_invocations(exec_cmd):
                check_flags(f"{cw} {probe_name}", flags, program, sub, args)
                popts = options(args)
                for f in ("--secret-file", "--key-file"):
                    if f in popts:
                        secret_path(f"{probe_name} {f}", popts[f])
                if program == "farmemctl" and "--peers" in popts and "--listen" in opts:
                    if port_of(popts["--peers"]) != port_of(opts["--listen"]):
                        fail(cw, f"{probe_name} asks port {port_of(popts['--peers'])}, the daemon "
                                 f"listens on {port_of(opts['--listen'])}")
                    if popts.get("--secret-file") != opts.get("--secret-file"):
                        fail(cw, f"{probe_name} uses another secret file than the daemon")
        if not invocations:
            continue
        program = invocations[0][0]
        if "--metrics-listen" in opts:
            if ports.get("metrics") != port_of(opts["--metrics-listen"]):
                fail(cw, f"--metrics-listen port {port_of(opts['--metrics-listen'])} is not the "
                         f"container port 'metrics' ({ports.get('metrics')})")
        if program == "farmemd":
            listen = port_of(opts.get("--listen", "127.0.0.1:7411"))
            if ports.get("farmem") != listen:
                fail(cw, f"--listen port {listen} is not the container port 'farmem'")
            for svc in services:
                if all(labels.get(k) == v for k, v in svc["spec"].get("selector", {}).items()):
                    for sp in svc["spec"]["ports"]:
                        t = sp.get("targetPort", sp["port"])
                        if (ports.get(t) if isinstance(t, str) else t) != listen:
                            fail(cw, f"Service {svc['metadata']['name']} targets {t}, not {listen}")
            capacity = farmem_size(opts.get("--capacity", "1G"))
            if capacity is None:
                fail(cw, f"--capacity {opts.get('--capacity')} is not a size")
            elif lim_mem < capacity + (256 << 20):
                fail(cw, f"memory limit {lim_mem / (1 << 20):.0f} MiB does not hold --capacity "
                         f"{capacity >> 20} MiB plus 256 MiB for the daemon")
            source = opts.get("--memory-source", "auto")
            reserve = farmem_size(str(opts.get("--reserve", "10%")))
            if source not in ("host", "off") and reserve is not None and capacity is not None:
                if lim_mem < capacity + reserve:
                    fail(cw, "with a cgroup memory source the limit must hold --capacity plus "
                             "--reserve, or the daemon can never lend all of --capacity")
            drain = int(opts.get("--drain-timeout", 0))
            if grace * 1000 < drain + 5000:
                fail(cw, f"terminationGracePeriodSeconds {grace} does not cover --drain-timeout "
                         f"{drain} ms plus 5 s")
            if caps.get("add", []) != ["IPC_LOCK"]:
                fail(cw, f"adds capabilities {caps.get('add')}; farmemd needs IPC_LOCK only")
        if program == "farmem-nbd" and "--peers-dns" in opts:
            host, _, port = opts["--peers-dns"].rpartition(":")
            ok = False
            for svc in services:
                meta = svc["metadata"]
                fqdn = f"{meta['name']}.{meta.get('namespace', 'default')}.svc.cluster.local"
                if host in (fqdn, meta["name"]) and any(
                        str(p["port"]) == port for p in svc["spec"]["ports"]):
                    ok = svc["spec"].get("clusterIP") == "None"
                    if not ok:
                        fail(cw, f"--peers-dns names Service {meta['name']}, which is not headless")
            if not ok:
                fail(cw, f"--peers-dns {opts['--peers-dns']} names no headless Service here")


def main():
    if len(sys.argv) != 5:
        print(__doc__)
        return 2
    src, farmemd, nbd, ctl = sys.argv[1:]
    k8s = os.path.join(src, "deploy", "k8s")
    flags = Flags(farmemd, nbd, ctl)
    readme_path = os.path.join(k8s, "README.md")
    readme = open(readme_path).read() if os.path.exists(readme_path) else ""
    if not readme:
        fail("deploy/k8s", "README.md is missing")
    files = sorted(f for f in os.listdir(k8s) if f.endswith((".yaml", ".yml")))
    docs = []
    kustomization = None
    for f in files:
        path = os.path.join(k8s, f)
        try:
            with open(path) as fh:
                parsed = [d for d in yaml.safe_load_all(fh) if d is not None]
        except yaml.YAMLError as e:
            fail(f, f"does not parse: {e}")
            continue
        if f == "kustomization.yaml":
            kustomization = parsed[0] if parsed else {}
            continue
        for d in parsed:
            kind = d.get("kind")
            if kind not in KINDS:
                fail(f, f"kind {kind} is not one this check knows: extend tests/deploy/k8s_check.py")
                continue
            api, top = KINDS[kind]
            if d.get("apiVersion") != api:
                fail(f, f"{kind} has apiVersion {d.get('apiVersion')}, not {api}")
            check_keys(f"{f} {kind}", d, top)
            meta = d.get("metadata", {})
            check_keys(f"{f} {kind} metadata", meta, OBJECT_META)
            if not meta.get("name"):
                fail(f, f"{kind} without metadata.name")
            if kind != "Namespace" and meta.get("namespace") != "farmem":
                fail(f, f"{kind}/{meta.get('name')} is not in namespace farmem")
            docs.append((path, d))
    if kustomization is None:
        fail("deploy/k8s", "kustomization.yaml is missing")
    else:
        listed = kustomization.get("resources", [])
        for r in listed:
            if r not in files:
                fail("kustomization.yaml", f"lists {r}, which does not exist")
        for f in files:
            if f != "kustomization.yaml" and f not in listed:
                fail("kustomization.yaml", f"does not list {f}")
    services = [d for _, d in docs if d["kind"] == "Service"]
    for s in services:
        check_keys(f"Service/{s['metadata']['name']} spec", s["spec"], SERVICE_SPEC)
        for p in s["spec"].get("ports", []):
            check_keys(f"Service/{s['metadata']['name']} port", p, SERVICE_PORT)
    workloads = 0
    for path, d in docs:
        if d["kind"] in ("DaemonSet", "Deployment"):
            workloads += 1
            check_workload(path, d, flags, services, readme)
    if workloads < 2:
        fail("deploy/k8s", f"{workloads} workloads: expected the farmemd DaemonSet and the "
                           "farmem-nbd example")
    for e in errors:
        print("k8s_check: " + e)
    print(f"k8s_check: {len(files)} files, {len(docs)} objects, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
