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
{{- if eq (toString .Values.metrics.address) "off" -}}
{{- fail "metrics.address cannot be off: the probes and the watchdog use the admin listener" -}}
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
