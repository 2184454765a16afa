{{/* Chart name, overridable. */}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, suffixed with the chart name unless it already contains it. */}}
{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kvpool.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of the operator's Deployment, Service, Role... */}}
{{- define "kvpool.operator.fullname" -}}
{{- printf "%s-operator" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels shared by every object of the release. */}}
{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- end -}}

{{/* Labels that select the operator's pods (immutable once deployed). */}}
{{- define "kvpool.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpool.operator.labels" -}}
{{ include "kvpool.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpool.operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* registry/repository:tag or @digest; tag defaults to appVersion. Args: (list image root). */}}
{{- define "kvpool.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- $ref := printf "%s/%s" $image.registry $image.repository -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $ref $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The namespace the operator watches: "" (all) for cluster scope unless set. */}}
{{- define "kvpool.watchNamespace" -}}
{{- if eq .Values.rbac.scope "namespace" -}}
{{- default .Release.Namespace .Values.operator.watchNamespace -}}
{{- else -}}
{{- .Values.operator.watchNamespace -}}
{{- end -}}
{{- end -}}

{{/* Refuse combinations that cannot work. */}}
{{- define "kvpool.validate" -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection.enabled) -}}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled=true: without a Lease every replica would reconcile" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) -}}
{{- fail "metrics.serviceMonitor.enabled needs metrics.service.enabled=true: the ServiceMonitor scrapes that Service" -}}
{{- end -}}
{{- if .Values.operator.rootKey.create -}}
{{- if lt (len .Values.operator.rootKey.value) 32 -}}
{{- fail "operator.rootKey.create=true needs operator.rootKey.value with at least 32 characters (openssl rand -hex 32); the chart does not make one up" -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.rbac.scope "cluster") .Values.operator.watchNamespace -}}
{{- fail "operator.watchNamespace is set with rbac.scope=cluster: use rbac.scope=namespace so the operator gets only a Role in that namespace" -}}
{{- end -}}
{{- end -}}

{{/* metadata: block (with labels and, if kept, the keep policy) spliced into each CRD. */}}
{{- define "kvpool.crdMetadata" -}}
metadata:
  labels:
    {{- include "kvpool.labels" . | nindent 4 }}
  {{- if .Values.crds.keep }}
  annotations:
    helm.sh/resource-policy: keep
  {{- end }}
{{- end -}}

{{/* Name of the Secret holding the operator's root key: given, created by the chart, or (the
default) kept by the operator itself. */}}
{{- define "kvpool.rootKeySecret" -}}
{{- if and (not .Values.operator.rootKey.create) .Values.operator.rootKey.existingSecret -}}
{{- .Values.operator.rootKey.existingSecret -}}
{{- else -}}
{{- printf "%s-root-key" (include "kvpool.operator.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Whether the operator keeps its root key Secret itself (neither given nor created here). */}}
{{- define "kvpool.rootKeyManaged" -}}
{{- if not (or .Values.operator.rootKey.create .Values.operator.rootKey.existingSecret) -}}true{{- end -}}
{{- end -}}
