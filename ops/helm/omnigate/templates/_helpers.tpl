{{/* Names and labels shared by every template. */}}

{{- define "omnigate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "omnigate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "omnigate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omnigate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "omnigate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "omnigate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "omnigate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "omnigate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "omnigate.adminSecretName" -}}
{{- default (printf "%s-admin" (include "omnigate.fullname" .)) .Values.admin.existingSecret -}}
{{- end -}}

{{- define "omnigate.adminSecretKey" -}}
{{- if .Values.admin.existingSecret -}}{{ .Values.admin.existingSecretKey }}{{- else -}}admin-api-key{{- end -}}
{{- end -}}

{{- /* The most replicas this release can run: the HPA's ceiling, or replicaCount. */ -}}
{{- define "omnigate.maxReplicas" -}}
{{- if .Values.autoscaling.enabled -}}{{ .Values.autoscaling.maxReplicas }}{{- else -}}{{ .Values.replicaCount }}{{- end -}}
{{- end -}}

{{- /* Several replicas need one directory they all read: refuse to render otherwise. */ -}}
{{- define "omnigate.checkDirectory" -}}
{{- if and (gt (int (include "omnigate.maxReplicas" .)) 1) (ne .Values.directory.backend "postgres") -}}
{{- fail (printf "directory.backend is %s, but this release can run %s replicas: tenants and keys made through /admin would hold on one pod only. Set directory.backend: postgres (with directory.existingSecret), or run one replica with autoscaling off." .Values.directory.backend (include "omnigate.maxReplicas" .)) -}}
{{- end -}}
{{- if and (eq .Values.directory.backend "postgres") (not .Values.directory.existingSecret) -}}
{{- fail "directory.backend postgres needs directory.existingSecret: a Secret holding the DSN" -}}
{{- end -}}
{{- end -}}
