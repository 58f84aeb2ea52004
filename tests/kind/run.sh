#!/usr/bin/env bash
# End-to-end suite: Istio ambient on a kind cluster with sluice in place of
# istio-cni's node agent. Needs Docker (a running engine), kind, kubectl, helm,
# network access (Istio's charts and images, python:3.12-alpine) and a Docker
# engine whose kernel sluice runs on (the kernels the agent runs on, 6.1 and
# later: kind nodes share the engine's kernel, which is not this shell's with
# Docker Desktop or a remote engine). After building the image it asks that
# kernel the agent's own feature probe (`sluice features --require` in a
# privileged container) before it creates a cluster.
# Rootless Docker cannot run it (no host bpffs, no BPF in the nodes).
# Without them it prints "skipped: ..." and exits 0. Not part of .ci/run.
#
# Istio is installed from its Helm charts, version $ISTIO_VERSION:
#   istio/base      (defaults)
#   istio/istiod    --set profile=ambient
#   istio/ztunnel   (defaults; it connects to /var/run/ztunnel/ztunnel.sock,
#                    which sluice serves)
# and NOT istio/cni: sluice's chart (deploy/helm/sluice) takes its place.
#
# The image is built with `docker build` from the repository's Dockerfile (no
# Rust toolchain needed here).
#
# Environment: ISTIO_VERSION, KIND_NODE_IMAGE (a Kubernetes version Istio
# $ISTIO_VERSION supports), CLUSTER (kind cluster name), IMAGE (tag built and
# loaded), KEEP_CLUSTER=1 (leave the cluster for inspection).
set -euo pipefail
shopt -s inherit_errexit

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ISTIO_VERSION=${ISTIO_VERSION:-1.28.0}
# Kubernetes 1.33: inside Istio 1.28's supported range (1.30-1.34).
KIND_NODE_IMAGE=${KIND_NODE_IMAGE:-kindest/node:v1.33.1}
ISTIO_CHARTS=https://istio-release.storage.googleapis.com/charts
CLUSTER=${CLUSTER:-sluice-e2e}
IMAGE=${IMAGE:-sluice:e2e}
KEEP_CLUSTER=${KEEP_CLUSTER:-0}
NS=sluice-e2e
SYS=istio-system
CONDITION=sluice.dev/RedirectionReady
# How long a pod created while the agent is away must stay not running.
HOLD_SECONDS=${HOLD_SECONDS:-30}

log() { printf '\n== %s\n' "$*"; }
die() {
  printf 'FAIL: %s\n' "$*" >&2
  exit 1
}

# --- can this machine run the suite? -----------------------------------------
missing=()
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "skipped: needs Docker and kind (missing: ${missing[*]})"
  exit 0
fi
# The engine's security options, not this shell's. (Whether the engine's
# kernel can run sluice is asked of the built image, below.)
if ! info=$(docker info --format '{{json .SecurityOptions}}' 2>&1); then
  echo "skipped: needs Docker and kind (docker info failed: ${info%%$'\n'*})"
  exit 0
fi
if [[ $info == *rootless* ]]; then
  echo "skipped: rootless Docker (kind nodes cannot load eBPF programs or use the host's bpffs)"
  exit 0
fi

# --- helpers -------------------------------------------------------------------
k() { kubectl --context "kind-$CLUSTER" "$@"; }

# wait_for SECONDS DESCRIPTION COMMAND...: retry COMMAND every 2 s.
wait_for() {
  local secs=$1 what=$2
  shift 2
  local end=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || die "timed out after ${secs}s waiting for: $what"
    sleep 2
  done
  echo "ok: $what"
}

diagnostics() {
  echo "--- diagnostics" >&2
  k get nodes -o wide >&2 || true
  k get pods -A -o wide >&2 || true
  k -n "$SYS" logs -l app.kubernetes.io/name=sluice -c agent --tail=50 --prefix >&2 || true
  k -n "$SYS" logs -l app=ztunnel --tail=30 --prefix >&2 || true
}

cleanup() {
  local rc=$?
  if ((rc != 0)); then
    diagnostics
  fi
  if [[ $KEEP_CLUSTER == 1 ]]; then
    echo "KEEP_CLUSTER=1: leaving cluster $CLUSTER (kind delete cluster --name $CLUSTER)"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  exit "$rc"
}

node_condition() { # node -> status of $CONDITION
  k get node "$1" -o jsonpath="{.status.conditions[?(@.type==\"$CONDITION\")].status}"
}

all_nodes_ready_condition() {
  local n
  for n in $(k get nodes -o name); do
    [[ $(node_condition "${n#node/}") == True ]] || return 1
  done
}

redirection() { # pod -> value of ambient.istio.io/redirection
  k -n "$NS" get pod "$1" -o jsonpath='{.metadata.annotations.ambient\.istio\.io/redirection}'
}

probe() { k -n "$NS" exec client -- python3 /app/probe.py server 9000; }
probe_fails() { ! probe; }

# Sum of istio_tcp_connections_opened_total over every ztunnel.
ztunnel_connections_opened() {
  local total=0 pod v
  for pod in $(k -n "$SYS" get pods -l app=ztunnel -o jsonpath='{.items[*].metadata.name}'); do
    v=$(k get --raw "/api/v1/namespaces/$SYS/pods/$pod:15020/proxy/metrics" |
      awk '/^istio_tcp_connections_opened_total/ { s += $NF } END { printf "%d", s }')
    total=$((total + v))
  done
  echo "$total"
}

long_connection_count() { # round trips the long-lived connection has made
  k -n "$NS" logs long-connection | awk '/^ok / { n = $2 } END { print n + 0 }'
}

long_connection_alive() {
  [[ $(k -n "$NS" get pod long-connection -o jsonpath='{.status.phase}') == Running ]] &&
    ! k -n "$NS" logs long-connection | grep -q BROKEN
}

count_above() { # min -> succeeds once the long connection made more round trips
  (($(long_connection_count) > $1))
}

agents_ready() { # every node's agent pod exists and is Ready
  local desired ready
  desired=$(k -n "$SYS" get daemonset sluice -o jsonpath='{.status.desiredNumberScheduled}')
  ready=$(k -n "$SYS" get pods -l app.kubernetes.io/name=sluice \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
    grep -c True || true)
  ((desired > 0 && ready == desired))
}

agent_pods_gone() {
  [[ -z $(k -n "$SYS" get pods -l app.kubernetes.io/name=sluice -o name) ]]
}

pod_phase() { k -n "$NS" get pod "$1" -o jsonpath='{.status.phase}'; }

# --- build, cluster, install ----------------------------------------------------
log "building the image $IMAGE"
# Plain docker build (what `cargo xtask image` runs): no Rust toolchain needed
# on this machine, the Dockerfile builds everything.
docker build --tag "$IMAGE" --file "$ROOT/Dockerfile" "$ROOT"

# kind nodes share the Docker engine's kernel: ask it the agent's own feature
# probe (the same code, not a version number) before creating a cluster. Exit 1
# names a missing required feature; anything else is the probe failing to run.
features_rc=0
features=$(docker run --rm --privileged "$IMAGE" features --require 2>&1) || features_rc=$?
if ((features_rc == 1)); then
  echo "skipped: the Docker engine's kernel lacks what sluice needs: ${features//$'\n'/; }"
  exit 0
elif ((features_rc != 0)); then
  die "the kernel feature probe did not run (docker run exited $features_rc): ${features//$'\n'/; }"
fi

# A cluster of this name is someone's (a KEEP_CLUSTER=1 run's, say): never
# reuse it, and never let this run's cleanup delete it.
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  die "a kind cluster named $CLUSTER already exists (left by KEEP_CLUSTER=1?): delete it (kind delete cluster --name $CLUSTER) or set CLUSTER to another name"
fi

trap cleanup EXIT

log "creating kind cluster $CLUSTER"
kind create cluster --name "$CLUSTER" --image "$KIND_NODE_IMAGE" --config "$HERE/kind-config.yaml" --wait 120s
for node in $(kind get nodes --name "$CLUSTER"); do
  # sluice pins on the node's bpffs; make sure one is mounted.
  docker exec "$node" sh -c \
    '[ "$(stat -f -c %T /sys/fs/bpf)" = bpf_fs ] || mount -t bpf bpf /sys/fs/bpf'
done
kind load docker-image "$IMAGE" --name "$CLUSTER"

log "installing Istio $ISTIO_VERSION (base, istiod profile=ambient, ztunnel; not cni)"
helm_istio() { # release chart [args...]
  local release=$1 chart=$2
  shift 2
  helm --kube-context "kind-$CLUSTER" install "$release" "$chart" --repo "$ISTIO_CHARTS" \
    --version "$ISTIO_VERSION" --namespace "$SYS" "$@"
}
helm_istio istio-base base --create-namespace --wait
helm_istio istiod istiod --set profile=ambient --wait

log "installing sluice (in place of istio/cni)"
repo=${IMAGE%:*}
tag=${IMAGE##*:}
helm --kube-context "kind-$CLUSTER" install sluice "$ROOT/deploy/helm/sluice" --namespace "$SYS" \
  --set image.repository="$repo" --set image.tag="$tag" --set image.pullPolicy=Never
# ztunnel becomes ready once it has its node agent's ZDS socket: after sluice.
helm_istio ztunnel ztunnel --wait
k -n "$SYS" rollout status daemonset/sluice --timeout=180s

# --- checks ---------------------------------------------------------------------
log "node condition $CONDITION"
wait_for 120 "every node has $CONDITION=True" all_nodes_ready_condition

log "client and server in an ambient namespace"
k apply -f "$HERE/workloads.yaml"
k -n "$NS" rollout status deployment/server --timeout=180s
k -n "$NS" wait pod/client --for=condition=Ready --timeout=180s
server=$(k -n "$NS" get pods -l app=server -o jsonpath='{.items[0].metadata.name}')

log "pods carry ambient.istio.io/redirection=enabled"
for pod in "$server" client; do
  [[ $(redirection "$pod") == enabled ]] || die "$pod: redirection annotation is '$(redirection "$pod")'"
  echo "ok: $pod is enabled"
done

log "traffic goes through ztunnel"
before=$(ztunnel_connections_opened)
wait_for 60 "client reaches server" probe
after=$(ztunnel_connections_opened)
((after > before)) || die "ztunnel's istio_tcp_connections_opened_total did not grow ($before -> $after)"
echo "ok: istio_tcp_connections_opened_total $before -> $after"

log "an L4 AuthorizationPolicy denying the client is enforced"
k apply -f - <<EOF
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: deny-client
  namespace: $NS
spec:
  action: DENY
  rules:
    - from:
        - source:
            principals: ["cluster.local/ns/$NS/sa/client"]
EOF
wait_for 60 "the client is denied" probe_fails
k -n "$NS" delete authorizationpolicy deny-client
wait_for 60 "the client is allowed again" probe

log "deleting the agent pods drops no established connection"
k -n "$NS" run long-connection --image=python:3.12-alpine --restart=Never \
  --overrides='{"spec":{"serviceAccountName":"client","nodeSelector":{"sluice-e2e/role":"client"},"volumes":[{"name":"p","configMap":{"name":"e2e-programs"}}],"containers":[{"name":"long-connection","image":"python:3.12-alpine","command":["python3","-u","/app/long_connection.py","server","9000"],"volumeMounts":[{"name":"p","mountPath":"/app"}]}]}}'
k -n "$NS" wait pod/long-connection --for=condition=Ready --timeout=120s
wait_for 30 "the long-lived connection is exchanging data" count_above 3
k -n "$SYS" delete pods -l app.kubernetes.io/name=sluice --wait=true --timeout=120s
wait_for 180 "new agent pods are Ready" agents_ready
n=$(long_connection_count)
wait_for 30 "the long-lived connection still exchanges data" count_above "$n"
long_connection_alive || die "the long-lived connection broke: $(k -n "$NS" logs long-connection | tail -3)"
echo "ok: one connection, $(long_connection_count) round trips, across the agent's restart"

log "a pod created while the agent is away does not start until it is back"
k -n "$SYS" patch daemonset sluice --type=merge \
  -p '{"spec":{"template":{"spec":{"nodeSelector":{"sluice-e2e/agent-off":"true"}}}}}'
wait_for 120 "no agent pod runs" agent_pods_gone
server_node=$(k -n "$NS" get pod "$server" -o jsonpath='{.spec.nodeName}')
[[ $(node_condition "$server_node") == False ]] ||
  die "$server_node: $CONDITION is '$(node_condition "$server_node")' with no agent (want False)"
echo "ok: $server_node reports $CONDITION=False while the agent is away"
k apply -f - <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: late
  namespace: $NS
spec:
  nodeSelector:
    sluice-e2e/role: server
  readinessGates:
    - conditionType: sluice.dev/redirected
  containers:
    - name: late
      image: python:3.12-alpine
      command: ["sleep", "infinity"]
EOF
end=$((SECONDS + HOLD_SECONDS))
while ((SECONDS < end)); do
  phase=$(pod_phase late)
  [[ $phase == Pending ]] || die "pod late is $phase while no agent runs"
  sleep 3
done
echo "ok: pod late stayed Pending for ${HOLD_SECONDS}s ($(k -n "$NS" get pod late \
  -o jsonpath='{.status.containerStatuses[0].state.waiting.reason}'))"
k -n "$SYS" patch daemonset sluice --type=merge \
  -p '{"spec":{"template":{"spec":{"nodeSelector":{"sluice-e2e/agent-off":null}}}}}'
k -n "$SYS" rollout status daemonset/sluice --timeout=180s
wait_for 180 "agent pods are Ready again" agents_ready
k -n "$NS" wait pod/late --for=condition=Ready --timeout=180s
[[ $(redirection late) == enabled ]] || die "late: redirection annotation is '$(redirection late)'"
gate_reason=$(k -n "$NS" get pod late -o jsonpath='{.status.conditions[?(@.type=="sluice.dev/redirected")].reason}')
[[ $gate_reason == Served ]] || die "late: readiness gate reason is '$gate_reason' (want Served: ztunnel has its workload)"
echo "ok: late started once the agent was back, captured"
long_connection_alive || die "the long-lived connection broke while the agent was away"
echo "ok: the long-lived connection survived the agent's absence too"

log "helm uninstall leaves working pods and nothing of sluice"
helm --kube-context "kind-$CLUSTER" uninstall sluice --namespace "$SYS" --wait --timeout 5m
for n in $(k get nodes -o name); do
  [[ -z $(node_condition "${n#node/}") ]] || die "${n#node/} still has $CONDITION"
  docker exec "${n#node/}" sh -c '! ls /sys/fs/bpf/sluice 2>/dev/null | grep -q . && ! grep -rqs sluice-cni /etc/cni/net.d && [ ! -e /opt/cni/bin/sluice-cni ]' ||
    die "${n#node/}: sluice's pins, CNI entry or plugin left behind"
done
for pod in "$server" client late; do
  [[ -z $(redirection "$pod") ]] || die "$pod: redirection annotation still '$(redirection "$pod")'"
done
gate_reason=$(k -n "$NS" get pod late -o jsonpath='{.status.conditions[?(@.type=="sluice.dev/redirected")].reason}')
[[ $gate_reason == SluiceUninstalled ]] || die "late: readiness gate reason is '$gate_reason' after uninstall"
k -n "$NS" wait pod/late --for=condition=Ready --timeout=60s
wait_for 60 "client reaches server, uncaptured" probe
echo "ok: sluice removed from every node; pods keep working uncaptured"

log "all checks passed"
