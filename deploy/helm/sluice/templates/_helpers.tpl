{{/* The release's full name: the release name, prefixed with the chart name unless it holds it already. */}}
{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sluice.labels" -}}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/component: node-agent
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sluice.serviceAccountName" -}}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}

{{/* ADDRESS:PORT of the agent's metrics/admin listener; $(HOST_IP) is expanded by the kubelet. */}}
{{- define "sluice.metricsAddr" -}}
{{- if or (eq (toString .Values.metrics.address) "off") (kindIs "bool" .Values.metrics.address) -}}
{{- fail "metrics.address cannot be off: set metrics.port to move it (Prometheus scrapes it)" -}}
{{- end -}}
{{- printf "%s:%v" (default "$(HOST_IP)" .Values.metrics.address) .Values.metrics.port -}}
{{- end -}}

{{- define "sluice.hostEnv" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: RUST_LOG
  value: {{ .Values.logLevel | quote }}
{{- end -}}

{{/* The platform: .Values.platform, else "gke" on a cluster whose version
says GKE (v1.30.5-gke.1014001), as Istio's charts detect it. */}}
{{- define "sluice.platform" -}}
{{- if .Values.platform -}}
{{- toString .Values.platform -}}
{{- else if contains "-gke" .Capabilities.KubeVersion.GitVersion -}}
gke
{{- end -}}
{{- end -}}

{{/* The node's CNI config dir: cni.confDir, else the platform's. */}}
{{- define "sluice.cniConfDir" -}}
{{- $p := dict "" "/etc/cni/net.d" "gke" "/etc/cni/net.d" "k3s" "/var/lib/rancher/k3s/agent/etc/cni/net.d" -}}
{{- $platform := include "sluice.platform" . -}}
{{- if eq $platform "openshift" -}}
{{- fail "platform openshift is not supported: OpenShift's primary network is Multus' (its /etc/cni/multus/net.d holds attachment configs, not the primary conflist), and sluice-cni has no Multus (non-chained) mode; see docs/INSTALL.md, Platforms" -}}
{{- end -}}
{{- if not (hasKey $p $platform) -}}
{{- fail (printf "platform %q: expected one of \"\", gke, k3s" $platform) -}}
{{- end -}}
{{- default (get $p $platform) .Values.cni.confDir -}}
{{- end -}}

{{/* The node's CNI plugin dir: cni.binDir, else the platform's. */}}
{{- define "sluice.cniBinDir" -}}
{{- $p := dict "" "/opt/cni/bin" "gke" "/home/kubernetes/bin" "k3s" "/var/lib/rancher/k3s/data/cni" -}}
{{- default (get $p (include "sluice.platform" .)) .Values.cni.binDir -}}
{{- end -}}

{{/* A duration flag's value, checked here so that a bad one fails the render
with its name instead of crash-looping the agent on every node: a number and
a unit, repeated (500ms, 10s, 1m30s, 1h). Called with (list NAME VALUE). */}}
{{- define "sluice.duration" -}}
{{- $name := index . 0 -}}
{{- $value := toString (index . 1) -}}
{{- if not (regexMatch "^([0-9]+(ns|us|ms|s|m|h))+$" $value) -}}
{{- fail (printf "%s: %q is not a duration: use a number and a unit, e.g. 500ms, 10s, 1m30s, 1h" $name $value) -}}
{{- end -}}
{{- $value -}}
{{- end -}}

{{/* --served-check. YAML 1.1 reads an unquoted off as the boolean false:
that is off, not a value for the agent to refuse. */}}
{{- define "sluice.servedCheck" -}}
{{- $v := .Values.readiness.servedCheck -}}
{{- if kindIs "bool" $v -}}
{{- if $v -}}
{{- fail "readiness.servedCheck: true is not a mode: use auto or off" -}}
{{- end -}}
off
{{- else if has $v (list "auto" "off") -}}
{{- $v -}}
{{- else -}}
{{- fail (printf "readiness.servedCheck: %q is not a mode: use auto or off" (toString $v)) -}}
{{- end -}}
{{- end -}}

{{/* --pod-exclusions: off or annotations (an unquoted off, which YAML reads
as false, is off too). */}}
{{- define "sluice.podExclusions" -}}
{{- $v := .Values.cni.ambient.podExclusions -}}
{{- if kindIs "bool" $v -}}
{{- if $v -}}
{{- fail "cni.ambient.podExclusions: true is not a mode: use \"off\" or annotations" -}}
{{- end -}}
off
{{- else if has $v (list "annotations" "off") -}}
{{- $v -}}
{{- else -}}
{{- fail (printf "cni.ambient.podExclusions: %q is not a mode: use \"off\" or annotations" (toString $v)) -}}
{{- end -}}
{{- end -}}

{{/* --log-format of both containers. */}}
{{- define "sluice.logFormat" -}}
{{- $v := toString .Values.logFormat -}}
{{- if not (has $v (list "auto" "text" "json")) -}}
{{- fail (printf "logFormat: %q is not auto, text or json" $v) -}}
{{- end -}}
{{- $v -}}
{{- end -}}
