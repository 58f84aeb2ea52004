#!/usr/bin/env python3
"""Offline checks of deploy/ and of the repository's shell scripts.

Run by `cargo xtask check-deploy` (and `cargo xtask test`) from a venv that
holds helm-python-sdk (Helm's own Go library: lint and template without a
helm binary) and kubernetes-validate (Kubernetes' OpenAPI schemas).

  1. every plain manifest under deploy/ (not the chart) and tests/kind/ is
     schema-valid;
  2. the chart lints clean (strict) and renders with default values, with a
     set exercising every option and with a minimal set; every rendered
     object is schema-valid; bad values are refused;
  3. custom resources (NodeReadinessRule) are checked field by field against
     the node-readiness-controller v1alpha1 API, which has no bundled schema;
  4. the plain manifests deploy/daemonset.yaml and deploy/rbac.yaml are the
     chart's default render, byte for byte (`cargo xtask render-deploy`
     writes them: the chart is the one source);
  5. shellcheck passes on every shell script;
  6. the kind suite, on a machine without its tools, says it skipped and
     exits 0 (run with a PATH that holds only what it needs before the check).
"""

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

import helm_python as helm
from helm_python import _native as helm_native
import kubernetes_validate
import yaml

K8S_VERSION = "1.32.0"
NAMESPACE = "istio-system"
RELEASE = "sluice"

errors = []


def fail(what, msg):
    errors.append(f"{what}: {msg}")
    print(f"FAIL {what}: {msg}")


def ok(what):
    print(f"ok   {what}")


# --- custom resources ---------------------------------------------------------

NRR_SPEC = {"conditions", "enforcementMode", "taint", "nodeSelector", "dryRun"}


def check_node_readiness_rule(what, obj):
    """readiness.node.x-k8s.io/v1alpha1 NodeReadinessRule (cluster-scoped)."""
    problems = []
    if obj.get("apiVersion") != "readiness.node.x-k8s.io/v1alpha1":
        problems.append(f"apiVersion {obj.get('apiVersion')!r}")
    meta = obj.get("metadata") or {}
    if not isinstance(meta.get("name"), str) or not meta["name"]:
        problems.append("metadata.name missing")
    if "namespace" in meta:
        problems.append("metadata.namespace set on a cluster-scoped object")
    unknown = set(obj) - {"apiVersion", "kind", "metadata", "spec"}
    if unknown:
        problems.append(f"unknown top-level fields {sorted(unknown)}")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        problems.append("spec missing")
        spec = {}
    if set(spec) - NRR_SPEC:
        problems.append(f"unknown spec fields {sorted(set(spec) - NRR_SPEC)}")
    conds = spec.get("conditions")
    if not isinstance(conds, list) or not 1 <= len(conds) <= 32:
        problems.append("spec.conditions must list 1..32 conditions")
        conds = []
    types = []
    for c in conds:
        if not isinstance(c, dict) or set(c) - {"type", "requiredStatus"}:
            problems.append(f"condition {c!r}: only type and requiredStatus")
            continue
        if not isinstance(c.get("type"), str) or not 1 <= len(c["type"]) <= 316:
            problems.append(f"condition {c!r}: type")
        if c.get("requiredStatus") not in ("True", "False", "Unknown"):
            problems.append(f"condition {c!r}: requiredStatus must be True, False or Unknown")
        types.append(c.get("type"))
    if len(types) != len(set(types)):
        problems.append("spec.conditions: duplicate type")
    taint = spec.get("taint")
    if not isinstance(taint, dict):
        problems.append("spec.taint missing")
    else:
        if set(taint) - {"key", "value", "effect"}:
            problems.append(f"spec.taint: unknown fields {sorted(set(taint) - {'key', 'value', 'effect'})}")
        if not isinstance(taint.get("key"), str) or not taint["key"]:
            problems.append("spec.taint.key missing")
        if taint.get("effect") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            problems.append(f"spec.taint.effect {taint.get('effect')!r}")
        if "value" in taint and not isinstance(taint["value"], str):
            problems.append("spec.taint.value must be a string")
    if spec.get("enforcementMode", "bootstrap-only") not in ("bootstrap-only", "continuous"):
        problems.append(f"spec.enforcementMode {spec.get('enforcementMode')!r}")
    sel = spec.get("nodeSelector")
    if not isinstance(sel, dict) or set(sel) - {"matchLabels", "matchExpressions"}:
        problems.append("spec.nodeSelector must be a label selector")
    elif not all(isinstance(k, str) and isinstance(v, str) for k, v in (sel.get("matchLabels") or {}).items()):
        problems.append("spec.nodeSelector.matchLabels: string keys and values")
    if "dryRun" in spec and not isinstance(spec["dryRun"], bool):
        problems.append("spec.dryRun must be a boolean")
    for p in problems:
        fail(what, p)
    if not problems:
        ok(f"{what} (NodeReadinessRule, checked field by field)")


def check_kustomization(what, obj, base):
    for res in obj.get("resources", []):
        if not os.path.exists(os.path.join(base, res)):
            fail(what, f"resource {res} does not exist")
    ok(f"{what} (Kustomization: resources exist)")


def check_kind_cluster(what, obj):
    """The kind config of tests/kind (kind.x-k8s.io/v1alpha4 Cluster)."""
    nodes = obj.get("nodes") or []
    good = (obj.get("apiVersion") == "kind.x-k8s.io/v1alpha4"
            and all(n.get("role") in ("control-plane", "worker") for n in nodes)
            and sum(n.get("role") == "control-plane" for n in nodes) >= 1)
    if good:
        ok(f"{what} (kind Cluster config)")
    else:
        fail(what, "not a kind v1alpha4 Cluster with a control-plane node")


CUSTOM = {"NodeReadinessRule": check_node_readiness_rule, "Cluster": check_kind_cluster}


def validate(what, obj):
    kind = obj.get("kind")
    if kind in CUSTOM:
        CUSTOM[kind](what, obj)
        return
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        ok(f"{what} ({kind}, Kubernetes {K8S_VERSION} schema, strict)")
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        fail(what, f"{kind}: {e.message} (at {path or 'top level'})")
    except kubernetes_validate.SchemaNotFoundError as e:
        fail(what, f"no schema: {e}")


def docs(text):
    return [d for d in yaml.safe_load_all(text) if d]


# --- plain manifests ------------------------------------------------------------

def plain_manifests(deploy, root, found=None):
    found = {} if found is None else found
    for top, dirs, files in os.walk(deploy):
        dirs[:] = sorted(d for d in dirs if os.path.join(top, d) != os.path.join(deploy, "helm"))
        for f in sorted(files):
            if not f.endswith((".yaml", ".yml")):
                continue
            path = os.path.join(top, f)
            rel = os.path.relpath(path, root)
            with open(path) as fh:
                objs = docs(fh.read())
            for i, obj in enumerate(objs):
                what = f"{rel}[{i}] {obj.get('kind')}/{(obj.get('metadata') or {}).get('name', '')}"
                if obj.get("kind") == "Kustomization":
                    check_kustomization(what, obj, top)
                else:
                    validate(what, obj)
                found.setdefault(obj.get("kind"), []).append(obj)
    return found


# --- the chart ------------------------------------------------------------------

FULL = {
    "image": {"repository": "registry.example/sluice", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "pull"}],
    "bpfRoot": "/sys/fs/bpf/sluice-test",
    "controlSocket": "/run/sluice-test/agent.sock",
    "zdsSocket": "/var/run/ztunnel-test/ztunnel.sock",
    "tcAttach": "tcx",
    "localRoute": True,
    "cni": {"install": True, "confDir": "/etc/cni/net.d.test", "binDir": "/home/kubernetes/bin",
            "ownedCNIConfig": False, "ownedCNIConfigFilename": "01-mesh.conflist",
            "excludeNamespaces": ["kube-system", "monitoring"],
            "ambient": {"dnsCapture": False, "podExclusions": "annotations",
                        "podExclusionsNamespaces": ["shop", "db"],
                        "enablementSelectors": [{"namespaceSelector": {"matchLabels": {"team": "shop"}}}]}},
    "probes": {"hostSide": False},
    "readiness": {
        "conditionType": "example.com/Redirection",
        "pendingGrace": "30s",
        "heartbeat": "2m",
        "servedCheck": "off",
        "ztunnelAdminPort": 15099,
        "servedRecheck": "45s",
        "verifyEvery": "2m",
        "untaint": ["cni.istio.io/not-ready", "example.com/startup"],
    },
    "metrics": {"port": 15031, "address": "127.0.0.1"},
    "health": {"port": 15033},
    "logLevel": "debug,kube=info",
    "agent": {
        "privileged": True,
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "extraArgs": ["--orphan-grace=1m"],
    },
    "watchdog": {"enabled": True, "interval": "5s", "failures": 4,
                 "resources": {"requests": {"cpu": "10m"}}},
    "nodeSelector": {"kubernetes.io/os": "linux", "pool": "mesh"},
    "tolerations": [{"key": "example.com/x", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    "priorityClassName": "system-cluster-critical",
    "terminationGracePeriodSeconds": 45,
    "updateStrategy": {"type": "OnDelete"},
    "rbac": {"create": True},
    "serviceAccount": {"create": True, "name": "sluice-sa", "annotations": {"a": "b"}},
    "podAnnotations": {"prometheus.io/scrape": "false"},
    "podLabels": {"team": "mesh"},
    "nodeReadinessRule": {
        "enabled": True,
        "name": "sluice-ready",
        "taint": {"key": "readiness.k8s.io/sluice-not-ready", "value": "pending", "effect": "NoExecute"},
        "enforcementMode": "bootstrap-only",
        "nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["mesh"]}]},
        "dryRun": True,
    },
    "uninstall": {"hook": {"enabled": True}, "timeout": "300s"},
}

MINIMAL = {
    "cni": {"install": False},
    "watchdog": {"enabled": False},
    "rbac": {"create": False},
    "serviceAccount": {"create": False, "name": "existing"},
    "podAnnotations": {},
    "tolerations": [],
    "nodeSelector": {},
    "priorityClassName": "",
    "imagePullSecrets": [],
    "uninstall": {"hook": {"enabled": False}},
}

BAD = {
    "bpfRoot outside /sys/fs/bpf": {"bpfRoot": "/tmp/bpf"},
    "a duration without a unit": {"readiness": {"pendingGrace": 10}},
    "a duration in words": {"readiness": {"heartbeat": "1 hour"}},
    "a bad watchdog interval": {"watchdog": {"interval": "2x"}},
    "a bad uninstall timeout": {"uninstall": {"timeout": "soon"}},
    "servedCheck true (not a mode)": {"readiness": {"servedCheck": True}},
    "servedCheck not auto or off": {"readiness": {"servedCheck": "sometimes"}},
    "metrics.address false (an unquoted off)": {"metrics": {"address": False}},
    "unknown platform": {"platform": "aks-classic"},
    "platform openshift (Multus: not supported, with the reason)": {"platform": "openshift"},
    "unknown enforcementMode": {"nodeReadinessRule": {"enabled": True, "enforcementMode": "sometimes"}},
    "logFormat not auto, text or json": {"logFormat": "yaml"},
    "takeOverNodeAgent not a boolean": {"takeOverNodeAgent": "yes please"},
    "a bad cni.recheck": {"cni": {"recheck": "often"}},
    "cni.ownedCNIConfig not a boolean": {"cni": {"ownedCNIConfig": "yes"}},
    "cni.ambient.enablementSelectors not a list": {"cni": {"ambient": {"enablementSelectors": "ambient"}}},
    "cni.ownedCNIConfigFilename with a path": {"cni": {"ownedCNIConfigFilename": "a/b.conflist"}},
    "cni.ownedCNIConfigFilename not a .conflist": {"cni": {"ownedCNIConfigFilename": "02-sluice.conf"}},
    "metrics.address off (Prometheus scrapes the listener)": {"metrics": {"address": "off"}},
    "a top-level ambient block (istio/cni's layout; here cni.ambient)": {"ambient": {"podExclusions": "annotations"}},
}


def lint(chart, label, values):
    report = helm.lint(chart, values, strict=True, namespace=NAMESPACE, kube_version=f"v{K8S_VERSION}")
    bad = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
    for m in bad:
        fail(f"helm lint ({label})", f"{m.get('path', '')} {m['error']}")
    if not bad:
        ok(f"helm lint --strict ({label})")


# Every successful render: (label, objects by kind), for the command check.
RENDERED = []

# What a cluster with node-readiness-controller installed serves.
RULE_API = "readiness.node.x-k8s.io/v1alpha1/NodeReadinessRule"


def render(chart, label, values, kube_version=None, api_versions=None, notes=None):
    try:
        if kube_version is None and api_versions is None:
            out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        else:
            # Chart.render has neither kube_version nor api_versions (lint has
            # the first); Helm's own render call takes them, as `helm template
            # --kube-version --api-versions` does.
            opts = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True}
            if kube_version is not None:
                opts["kube_version"] = kube_version
            if api_versions is not None:
                opts["api_versions"] = api_versions
            out = json.loads(helm_native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts)))
    except helm.HelmError as e:
        fail(f"helm template ({label})", str(e))
        return {}
    objs = {}
    RENDERED.append((label, objs))
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            if not text.strip():
                fail(f"{path} ({label})", "empty")
            if notes is not None:
                notes.append(text)
            continue
        for obj in docs(text):
            what = f"{path} ({label}) {obj.get('kind')}/{obj['metadata'].get('name')}"
            validate(what, obj)
            objs.setdefault(obj["kind"], []).append(obj)
    return objs


def container(ds, name):
    spec = ds["spec"]["template"]["spec"]
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        if c["name"] == name:
            return c
    return None


def args_of(ds, name):
    c = container(ds, name)
    return c["args"] if c else []


def expect(label, cond, msg):
    if not cond:
        fail(f"chart ({label})", msg)


def check_full(objs):
    ds = objs["DaemonSet"][0]
    pod = ds["spec"]["template"]["spec"]
    a = args_of(ds, "agent")
    v = FULL
    notes = ds["spec"]["template"]["metadata"].get("annotations", {})
    expect("full", notes.get("prometheus.io/port") == str(v["metrics"]["port"]),
           f"prometheus.io/port follows metrics.port: {notes}")
    for flag in [
        f"--bpf-root={v['bpfRoot']}",
        f"--control-socket={v['controlSocket']}",
        f"--zds-socket={v['zdsSocket']}",
        "--install-cni",
        "--owned-cni-config=false",
        "--owned-cni-config-filename=01-mesh.conflist",
        f"--cni-conf-dir={v['cni']['confDir']}",
        f"--cni-bin-dir={v['cni']['binDir']}",
        f"--condition-type={v['readiness']['conditionType']}",
        f"--pending-grace={v['readiness']['pendingGrace']}",
        f"--heartbeat={v['readiness']['heartbeat']}",
        "--served-check=off",
        "--ztunnel-admin-port=15099",
        "--served-recheck=45s",
        "--untaint=cni.istio.io/not-ready",
        "--untaint=example.com/startup",
        "--metrics-addr=127.0.0.1:15031",
        "--health-addr=127.0.0.1:15033",
        "--orphan-grace=1m",
        "--verify-every=2m",
        "--node-netns=off",
        "--exclude-namespaces=kube-system,monitoring",
        "--dns-capture=false",
        "--pod-exclusions=annotations",
        "--pod-exclusions-namespaces=shop,db",
        '--enablement-selectors=[{"namespaceSelector":{"matchLabels":{"team":"shop"}}}]',
        "--tc-attach=tcx",
        "--local-route=true",
    ]:
        expect("full", flag in a, f"agent args lack {flag}: {a}")
    w = args_of(ds, "watchdog")
    for flag in ["--agent-addr=127.0.0.1:15033", "--interval=5s", "--failures=4",
                 f"--condition-type={v['readiness']['conditionType']}"]:
        expect("full", flag in w, f"watchdog args lack {flag}: {w}")
    agent = container(ds, "agent")
    env = {e["name"]: e.get("value") for e in agent.get("env", [])}
    # `kubectl exec … sluice status` finds the agent's pins and socket.
    expect("full", env.get("SLUICE_BPF_ROOT") == v["bpfRoot"]
           and env.get("SLUICE_CONTROL_SOCKET") == v["controlSocket"],
           f"agent env lacks the bpf root or control socket: {env}")
    expect("full", agent["image"] == "registry.example/sluice:1.2.3", f"image {agent['image']}")
    expect("full", agent["readinessProbe"]["httpGet"].get("host") == "127.0.0.1", "probe host")
    # Ready when the agent serves, whether or not ztunnel is there yet.
    expect("full", agent["readinessProbe"]["httpGet"]["path"] == "/healthz", "readiness probe path")
    expect("full", agent["readinessProbe"]["httpGet"]["port"] == 15033
           and agent["livenessProbe"]["httpGet"]["port"] == 15033, "probes on the health port")
    expect("full", agent["securityContext"]["privileged"] is True, "agent.privileged")
    vols = {x["name"]: x["hostPath"]["path"] for x in pod["volumes"]}
    expect("full", vols["ztunnel"] == "/var/run/ztunnel-test" and vols["run"] == "/run/sluice-test"
           and vols["cni-bin"] == "/home/kubernetes/bin", f"volumes {vols}")
    expect("full", pod["serviceAccountName"] == "sluice-sa", "serviceAccountName")
    expect("full", pod["priorityClassName"] == "system-cluster-critical", "priorityClassName")
    roles = [r for r in objs.get("ClusterRole", [])
             if "helm.sh/hook" not in r["metadata"].get("annotations", {})]
    node_verbs = [v for r in roles for rule in r["rules"] if rule["resources"] == ["nodes"]
                  for v in rule["verbs"]]
    expect("full", "patch" in node_verbs, f"readiness.untaint set but no patch on nodes: {node_verbs}")
    job = objs.get("Job", [])
    expect("full", len(job) == 1 and job[0]["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete",
           f"uninstall hook Job: {job}")
    if job:
        ja = job[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        for flag in ["uninstall-cluster", f"--condition-type={v['readiness']['conditionType']}",
                     f"--taint={v['nodeReadinessRule']['taint']['key']}", "--timeout=300s",
                     f"--daemonset={ds['metadata']['name']}"]:
            expect("full", flag in ja, f"uninstall Job args lack {flag}: {ja}")
    expect("full", f"--daemonset={ds['metadata']['name']}" in a, f"agent args lack --daemonset: {a}")
    nrr = objs.get("NodeReadinessRule", [])
    expect("full", len(nrr) == 1 and nrr[0]["spec"]["enforcementMode"] == "bootstrap-only"
           and nrr[0]["spec"]["conditions"][0]["type"] == v["readiness"]["conditionType"],
           "NodeReadinessRule")
    ok("chart (full): every value reaches the rendered objects")


def check_minimal(objs):
    ds = objs["DaemonSet"][0]
    pod = ds["spec"]["template"]["spec"]
    expect("minimal", container(ds, "watchdog") is None, "watchdog rendered although disabled")
    expect("minimal", "--install-cni" not in args_of(ds, "agent"), "--install-cni despite cni.install=false")
    expect("minimal", not ({"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                            "RoleBinding", "Job"} & set(objs)),
           f"RBAC or the uninstall hook rendered although disabled: {sorted(objs)}")
    expect("minimal", pod["serviceAccountName"] == "existing", "serviceAccountName")
    expect("minimal", "NodeReadinessRule" not in objs, "NodeReadinessRule rendered by default")
    ok("chart (minimal): optional parts are left out")


def check_platforms(chart):
    """platform: the CNI dirs (flags, mounts, host paths) and GKE's quota;
    explicit cni dirs still win."""
    cases = [
        ("", "/etc/cni/net.d", "/opt/cni/bin"),
        ("gke", "/etc/cni/net.d", "/home/kubernetes/bin"),
        ("k3s", "/var/lib/rancher/k3s/agent/etc/cni/net.d", "/var/lib/rancher/k3s/data/cni"),
    ]
    for platform, conf, bin_dir in cases:
        label = f"platform {platform or '(none)'}"
        objs = render(chart, label, {"platform": platform})
        if not objs:
            continue
        ds = objs["DaemonSet"][0]
        a = args_of(ds, "agent")
        expect(label, f"--cni-conf-dir={conf}" in a and f"--cni-bin-dir={bin_dir}" in a, f"agent args {a}")
        vols = {x["name"]: x["hostPath"]["path"] for x in ds["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container(ds, "agent")["volumeMounts"]}
        expect(label, vols["cni-conf"] == conf == mounts["cni-conf"]
               and vols["cni-bin"] == bin_dir == mounts["cni-bin"], f"volumes {vols} mounts {mounts}")
        quota = objs.get("ResourceQuota", [])
        expect(label, bool(quota) == (platform == "gke"), f"ResourceQuota {quota}")
        if quota:
            sel = quota[0]["spec"]["scopeSelector"]["matchExpressions"][0]
            expect(label, sel["scopeName"] == "PriorityClass" and sel["values"] == ["system-node-critical"],
                   f"quota scope {sel}")
        se = container(ds, "agent")["securityContext"].get("seLinuxOptions")
        expect(label, se is None, f"seLinuxOptions {se}")
    objs = render(chart, "platform gke, explicit dirs",
                  {"platform": "gke", "cni": {"binDir": "/opt/x/bin"}, "agent": {"seLinuxOptions": {"level": "s0"}}})
    if objs:
        ds = objs["DaemonSet"][0]
        expect("explicit dirs", "--cni-bin-dir=/opt/x/bin" in args_of(ds, "agent"), "cni.binDir does not win")
        se = container(ds, "agent")["securityContext"].get("seLinuxOptions")
        expect("explicit dirs", se == {"level": "s0"}, f"seLinuxOptions {se}")
    # An empty platform on a GKE cluster (its version says so) is gke, as
    # Istio's charts detect it; an explicit platform wins.
    gke_version = "v1.30.5-gke.1014001"
    for values, want in [({}, "gke"), ({"platform": "k3s"}, "k3s")]:
        label = f"GKE cluster, values {values}"
        objs = render(chart, label, values, kube_version=gke_version)
        if not objs:
            continue
        a = args_of(objs["DaemonSet"][0], "agent")
        bin_dir = dict((p, b) for p, _, b in cases)[want]
        expect(label, f"--cni-bin-dir={bin_dir}" in a, f"agent args {a}")
        expect(label, bool(objs.get("ResourceQuota")) == (want == "gke"), "ResourceQuota")
    ok("chart platforms: CNI dirs, GKE quota, GKE detected from the cluster version")


def check_rule_defaults(objs, plain):
    nrr = objs.get("NodeReadinessRule", [])
    plain_rules = [r["spec"] for r in plain.get("NodeReadinessRule", [])]
    expect("NodeReadinessRule defaults", [r["spec"] for r in nrr] == plain_rules,
           f"chart {nrr} vs deploy/node-readiness-rule.yaml {plain_rules}")
    want = {
        "conditions": [{"type": "sluice.dev/RedirectionReady", "requiredStatus": "True"}],
        "taint": {"key": "readiness.k8s.io/sluice-not-ready", "value": "pending", "effect": "NoSchedule"},
        "enforcementMode": "continuous",
        "nodeSelector": {"matchLabels": {"kubernetes.io/os": "linux"}},
    }
    expect("NodeReadinessRule defaults", len(nrr) == 1 and nrr[0]["spec"] == want,
           f"rendered {nrr}")
    ok("chart (NodeReadinessRule defaults): taint kept until the condition is True, continuous")


# The plain manifests the chart's default render writes: template → file.
GENERATED = {"daemonset.yaml": "daemonset.yaml", "rbac.yaml": "rbac.yaml"}
# Labels that say Helm manages an object: not true of `kubectl apply -k`.
HELM_ONLY_LABELS = ("app.kubernetes.io/managed-by: Helm", "helm.sh/chart: ")


def plain_from_chart(chart):
    """deploy/<file> → its text, from the chart's default values."""
    out = chart.render(None, name=RELEASE, namespace=NAMESPACE, is_install=True)
    files = {}
    for template, name in GENERATED.items():
        text = out[f"{RELEASE}/templates/{template}"]
        lines = [l for l in text.strip("\n").split("\n")
                 if not l.strip().startswith(HELM_ONLY_LABELS)]
        files[name] = (
            f"# Generated from deploy/helm/sluice/templates/{template} (default values) by\n"
            "# `cargo xtask render-deploy`: edit the chart, then run it. See deploy/README.md.\n"
            + "\n".join(lines) + "\n"
        )
    return files


def write_plain(deploy):
    chart = helm.Chart.load(os.path.join(deploy, "helm", "sluice"))
    for name, text in plain_from_chart(chart).items():
        with open(os.path.join(deploy, name), "w") as fh:
            fh.write(text)
        print(f"render-deploy: wrote deploy/{name}")


def check_generated(chart_dir, deploy):
    chart = helm.Chart.load(chart_dir)
    for name, want in plain_from_chart(chart).items():
        with open(os.path.join(deploy, name)) as fh:
            got = fh.read()
        if got == want:
            ok(f"deploy/{name} is the chart's default render")
        else:
            fail(f"deploy/{name}", "differs from the chart's default render: run `cargo xtask render-deploy`")


# Values files as users write them: YAML 1.1 reads an unquoted off as false.
VALUES_FILES = {
    "servedCheck: off unquoted": ("readiness:\n  servedCheck: off\n", "agent", "--served-check=off"),
    "servedCheck: \"off\" quoted": ("readiness:\n  servedCheck: \"off\"\n", "agent", "--served-check=off"),
    "pendingGrace: 1m30s": ("readiness:\n  pendingGrace: 1m30s\n", "agent", "--pending-grace=1m30s"),
    "watchdog interval: 1h": ("watchdog:\n  interval: 1h\n", "watchdog", "--interval=1h"),
}


def check_values_files(chart):
    for label, (text, name, arg) in VALUES_FILES.items():
        objs = render(chart, label, yaml.safe_load(text))
        ds = objs.get("DaemonSet", [])
        args = args_of(ds[0], name) if ds else []
        expect(f"values file ({label})", arg in args, f"{name} args lack {arg}: {args}")
        if arg in args:
            ok(f"values file ({label}) renders {arg}")


def check_uninstall_mark(objs, rule):
    """The DaemonSet renders the uninstall mark "false" (a helm upgrade clears a
    failed uninstall's "true"); with the rule enabled, the hook deletes it first
    and may: its flag and its RBAC."""
    ds = objs.get("DaemonSet", [{}])[0]
    mark = (ds.get("metadata", {}).get("annotations") or {}).get("sluice.dev/uninstall")
    expect("uninstall mark", mark == "false", f"DaemonSet annotation sluice.dev/uninstall is {mark!r}")
    job = next((j for j in rule.get("Job", []) if j["metadata"]["name"].endswith("uninstall")), None)
    args = job["spec"]["template"]["spec"]["containers"][0]["args"] if job else []
    name = rule.get("NodeReadinessRule", [{}])[0].get("metadata", {}).get("name")
    expect("uninstall hook", f"--node-readiness-rule={name}" in args, f"hook args {args}")
    roles = [r for r in rule.get("ClusterRole", []) if r["metadata"]["name"].endswith("uninstall")]
    grants = [x for r in roles for x in r["rules"] if "nodereadinessrules" in x.get("resources", [])]
    expect("uninstall hook", grants == [{"apiGroups": ["readiness.node.x-k8s.io"],
                                         "resources": ["nodereadinessrules"],
                                         "resourceNames": [name], "verbs": ["delete"]}],
           f"hook grants {grants}")
    if mark == "false" and f"--node-readiness-rule={name}" in args and grants:
        ok("chart: the uninstall mark renders false; the hook deletes the NodeReadinessRule first, with its grant")


def check_rule_without_crd(chart):
    """The rule enabled on a cluster without node-readiness-controller's CRD:
    no NodeReadinessRule (it would fail the install), and NOTES.txt says so."""
    notes = []
    objs = render(chart, "NodeReadinessRule without its CRD", {"nodeReadinessRule": {"enabled": True}},
                  api_versions=[], notes=notes)
    said = any("no\nNodeReadinessRule CRD" in n or "no NodeReadinessRule CRD" in n for n in notes)
    if "NodeReadinessRule" not in objs and said:
        ok("chart: without the NodeReadinessRule CRD, no rule and a NOTES.txt warning")
    else:
        fail("chart (NodeReadinessRule without its CRD)",
             f"rendered {sorted(objs)}; NOTES say it: {said}")


def cli_flags(root):
    """The long flags of `sluice agent` and the global ones, from the clap
    structs' fields (`#[arg(long …)] name: …`)."""
    import re
    flags = set()
    for rel in ("userspace/src/cli/agent.rs", "userspace/src/cli/mod.rs", "userspace/src/cli/common.rs"):
        with open(os.path.join(root, rel)) as fh:
            src = fh.read()
        for attr, field in re.findall(r"#\[arg\((.*?)\)\]\s*(?:pub\s+)?(\w+)\s*:", src, re.S):
            if re.search(r"\blong\b", attr):
                flags.add("--" + field.replace("_", "-"))
    return flags


# Agent flags that come from the pod rather than a value.
FROM_THE_POD = {"--namespace": "POD_NAMESPACE"}
# Flags that are not the agent's settings.
NOT_SETTINGS = {"--check-args"}


def check_every_flag_has_a_value(root, full):
    """Each flag of the agent's is set by the chart (every option rendered),
    or comes from the pod's environment: none is out of the user's reach."""
    ds = full.get("DaemonSet", [])
    if not ds:
        return
    agent = container(ds[0], "agent")
    given = {a.split("=", 1)[0] for a in agent["args"]}
    env = {e["name"] for e in agent.get("env", [])}
    flags = cli_flags(root)
    missing = sorted(f for f in flags - NOT_SETTINGS if f not in given and FROM_THE_POD.get(f) not in env)
    if len(flags) < 20:
        fail("chart flags", f"found only {sorted(flags)} in the CLI sources")
    elif missing:
        fail("chart flags", f"agent flags no value sets: {missing}")
    else:
        ok(f"chart: every one of the agent's {len(flags)} flags has a value (or comes from the pod)")


# What the kubelet expands $(VAR) to in a container's args, for the dry run.
KUBELET_VARS = {"NODE_NAME": "node-1", "HOST_IP": "10.0.0.1", "POD_NAMESPACE": NAMESPACE}


def sluice_commands(objs):
    """(what, args) of every container that runs sluice, in every workload."""
    import re
    for kind in ("DaemonSet", "Job"):
        for w in objs.get(kind, []):
            spec = w["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                command = c.get("command") or []
                # The image's entrypoint is sluice; a shell command is not.
                if command and not command[0].endswith("/sluice"):
                    continue
                args = [re.sub(r"\$\((\w+)\)", lambda m: KUBELET_VARS.get(m.group(1), m.group(0)), a)
                        for a in command[1:] + c.get("args", [])]
                yield f"{kind}/{w['metadata']['name']} {c['name']}", args


def check_commands():
    """Every sluice command line the chart rendered (each value set and
    platform) through the CLI's own parser: a flag the binary does not know,
    a bad duration or mode, a missing requirement fails here, not on a node."""
    sluice = os.environ.get("SLUICE_BIN")
    if not sluice:
        fail("rendered commands", "SLUICE_BIN is not set: run this through `cargo xtask check-deploy`")
        return
    seen, bad = set(), 0
    for label, objs in RENDERED:
        for what, args in sluice_commands(objs):
            key = tuple(args)
            if key in seen:
                continue
            seen.add(key)
            r = subprocess.run([sluice, "--check-args", *args], capture_output=True, text=True,
                               env={"PATH": os.environ.get("PATH", "")}, timeout=30)
            if r.returncode != 0:
                bad += 1
                fail(f"rendered command ({label}) {what}", f"sluice {' '.join(args)}: {r.stderr.strip()}")
    if len(seen) < 4:
        fail("rendered commands", f"found only {len(seen)} sluice commands in the renders")
    elif not bad:
        ok(f"every rendered sluice command parses ({len(seen)} distinct, `sluice --check-args`)")


def check_chart(chart_dir, plain):
    chart = helm.Chart.load(chart_dir)
    defaults = copy.deepcopy(chart.values)
    for label, values in [("default values", None), ("every option", FULL), ("minimal", MINIMAL)]:
        lint(chart_dir, label, values)
    render(chart, "default values", None)
    full = render(chart, "every option", FULL, api_versions=[RULE_API])
    minimal = render(chart, "minimal", MINIMAL)
    rule = render(chart, "NodeReadinessRule defaults", {"nodeReadinessRule": {"enabled": True}},
                  api_versions=[RULE_API])
    check_rule_without_crd(chart)
    if full:
        check_full(full)
        check_every_flag_has_a_value(os.path.dirname(os.path.dirname(os.path.dirname(chart_dir))), full)
    if minimal:
        check_minimal(minimal)
    if rule:
        check_rule_defaults(rule, plain)
        check_uninstall_mark(rule, rule)
    check_platforms(chart)
    check_values_files(chart)
    for label, values in BAD.items():
        try:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
            fail(f"helm template ({label})", "rendered, expected a refusal")
        except helm.HelmError as e:
            why = str(e).splitlines()[-1].split("): ", 1)[-1]
            ok(f"helm template refuses {label}: {why}")
    if chart.values != defaults:
        fail("chart", "rendering changed the default values")


# --- shell scripts ---------------------------------------------------------------

def shell_scripts(root):
    skip = {".git", "target", "node_modules"}
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for f in sorted(files):
            path = os.path.join(top, f)
            if f.endswith(".sh"):
                yield path
                continue
            try:
                with open(path, "rb") as fh:
                    first = fh.readline(200)
            except OSError:
                continue
            if first.startswith(b"#!") and first.rstrip().split(b"/")[-1].split(b" ")[-1] in (b"sh", b"bash"):
                yield path


def check_shell(root):
    scripts = list(shell_scripts(root))
    for s in scripts:
        rel = os.path.relpath(s, root)
        r = subprocess.run(["shellcheck", "--external-sources", s], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"shellcheck {rel}", "\n" + r.stdout + r.stderr)
        else:
            ok(f"shellcheck {rel}")


def run_kind_script(script, bare, stubs, tools=("bash", "dirname", "uname")):
    """tests/kind/run.sh with PATH holding only `tools` (the real ones) and
    `stubs` (name → a script's text), all in directory `bare`."""
    for tool in tools:
        os.symlink(shutil.which(tool), os.path.join(bare, tool))
    for name, body in stubs.items():
        path = os.path.join(bare, name)
        with open(path, "w") as f:
            f.write(body)
        os.chmod(path, 0o755)
    return subprocess.run([os.path.join(bare, "bash"), script], capture_output=True,
                          text=True, env={"PATH": bare}, timeout=30)


def check_kind_skips(root):
    """tests/kind/run.sh where its tools are missing, where docker is installed
    but no engine answers, under rootless Docker, and where the engine's kernel
    fails sluice's feature probe (stubs: the real suite never starts)."""
    script = os.path.join(root, "tests", "kind", "run.sh")
    stub = "#!/bin/sh\n" + 'echo "Cannot connect to the Docker daemon" >&2; exit 1\n'
    # `docker info --format ...` of an engine with these security options;
    # `docker run IMAGE features --require` answering `probe` with exit 1.
    def engine(options, probe=None):
        run = f"echo '{probe}'; exit 1" if probe else "exit 0"
        # `docker build` succeeds without building anything.
        return ("#!/bin/sh\n"
                f'case "$1" in\n  info) echo \'{options}\' ;;\n  build) exit 0 ;;\n  run) {run} ;;\n  *) exit 1 ;;\nesac\n')
    tools = lambda docker: {"docker": docker, "kind": stub, "kubectl": stub, "helm": stub}
    built = {}
    # (label, stubs, the skip line, whether it is the whole of stdout or only its
    # last line: the probe runs after the build has logged its progress)
    cases = [
        ("without its tools", {}, "skipped: needs Docker and kind (missing: docker kind kubectl helm)", True),
        ("without a Docker engine", tools(stub),
         "skipped: needs Docker and kind (docker info failed: Cannot connect to the Docker daemon)", True),
        ("under rootless Docker", tools(engine('["name=seccomp,profile=builtin","name=rootless"]')),
         "skipped: rootless Docker (kind nodes cannot load eBPF programs or use the host's bpffs)", True),
        ("with an engine whose kernel lacks a feature sluice needs",
         {**tools(engine('["name=seccomp,profile=builtin"]', "missing: sk_lookup")), **built},
         "skipped: the Docker engine's kernel lacks what sluice needs: missing: sk_lookup", False),
    ]
    for label, stubs, want, whole in cases:
        with tempfile.TemporaryDirectory() as bare:
            r = run_kind_script(script, bare, stubs)
        out = r.stdout.strip()
        got = out if whole else (out.splitlines() or [""])[-1]
        if r.returncode == 0 and got == want:
            ok(f"tests/kind/run.sh skips cleanly {label}")
        else:
            fail(f"tests/kind/run.sh {label}", f"exit {r.returncode}: {r.stdout!r} {r.stderr!r}")
    check_kind_kept_cluster(script, engine('["name=seccomp,profile=builtin"]'))


def check_kind_kept_cluster(script, docker):
    """A rerun beside a cluster a KEEP_CLUSTER=1 run left: it stops with the
    reason, and neither reuses nor deletes that cluster."""
    with tempfile.TemporaryDirectory() as bare:
        calls = os.path.join(bare, "kind-calls")
        stubs = {
            "docker": docker,
            "kind": ("#!/bin/sh\n"
                     f'echo "$*" >> {calls}\n'
                     'case "$1" in\n  get) echo sluice-e2e ;;\n  *) exit 0 ;;\nesac\n'),
            "kubectl": "#!/bin/sh\nexit 1\n",
            "helm": "#!/bin/sh\nexit 1\n",
        }
        r = run_kind_script(script, bare, stubs, ("bash", "dirname", "uname", "grep"))
        with open(calls) as f:
            seen = f.read().split("\n")
    touched = [c for c in seen if c.startswith(("create", "delete"))]
    if r.returncode == 1 and "already exists" in r.stderr and not touched:
        ok("tests/kind/run.sh stops beside a kept cluster and leaves it alone")
    else:
        fail("tests/kind/run.sh beside a kept cluster",
             f"exit {r.returncode}, kind calls {seen}: {r.stdout!r} {r.stderr!r}")


# --- the image ---------------------------------------------------------------------

def check_dockerfile(root):
    """The build stage installs the toolchain (the one nightly pin, in
    xtask/src/setup.rs) from the manifests and xtask alone, before the
    sources: that layer must load the workspace with only what it copies."""
    import re
    with open(os.path.join(root, "Dockerfile")) as fh:
        lines = [l for l in fh.read().split("\n") if not l.lstrip().startswith("#")]
    text = "\n".join(lines)
    setup = next((i for i, l in enumerate(lines) if "cargo xtask setup --build-only" in l), None)
    sources = next((i for i, l in enumerate(lines) if re.match(r"COPY \. \.\s*$", l)), None)
    if setup is None or sources is None or setup > sources:
        fail("Dockerfile", "`cargo xtask setup --build-only` must run before `COPY . .`")
        return
    if re.search(r"toolchain install|nightly", text):
        fail("Dockerfile", "names a toolchain itself: the nightly pin lives in xtask/src/setup.rs only")
        return
    with tempfile.TemporaryDirectory() as stage:
        for l in lines[:sources]:
            words = l.split()
            if len(words) < 3 or words[0] != "COPY" or words[1].startswith("--"):
                continue
            srcs, dest = words[1:-1], words[-1]
            for src in srcs:
                path = os.path.join(root, src)
                to = os.path.join(stage, dest, os.path.basename(src)) if dest.endswith("/") else os.path.join(stage, dest)
                if os.path.isdir(path):
                    shutil.copytree(path, to, ignore=shutil.ignore_patterns("target"))
                else:
                    os.makedirs(os.path.dirname(to), exist_ok=True)
                    shutil.copy(path, to)
        m = re.search(r"for d in ([\w ]+); do", text)
        for d in (m.group(1).split() if m else []):
            os.makedirs(os.path.join(stage, d, "src"), exist_ok=True)
            open(os.path.join(stage, d, "src", "lib.rs"), "w").close()
        r = subprocess.run(["cargo", "metadata", "--offline", "--no-deps", "--format-version", "1"],
                           cwd=stage, capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        ok("Dockerfile: the toolchain layer loads the workspace from the manifests and xtask alone")
    else:
        fail("Dockerfile (the toolchain layer)", r.stderr.strip()[-400:])


def main():
    args = [a for a in sys.argv[1:] if a != "--write-plain"]
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    deploy = os.path.join(root, "deploy")
    if "--write-plain" in sys.argv:
        write_plain(deploy)
        return
    plain = plain_manifests(deploy, root)
    # The kind suite's cluster config and workloads (not compared with the chart).
    plain_manifests(os.path.join(root, "tests", "kind"), root, {})
    check_chart(os.path.join(deploy, "helm", "sluice"), plain)
    check_generated(os.path.join(deploy, "helm", "sluice"), deploy)
    check_commands()
    check_shell(root)
    check_kind_skips(root)
    check_dockerfile(root)
    if errors:
        print(f"\ncheck-deploy: {len(errors)} problem(s)")
        sys.exit(1)
    print("\ncheck-deploy: all checks passed")


if __name__ == "__main__":
    main()
