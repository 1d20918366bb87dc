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

{{- /* Several replicas must be one gateway: one audit chain, signed, with a witness outside the database,
and the routing state and admission in one Redis. Refuse to render anything less. */ -}}
{{- define "omnigate.checkShared" -}}
{{- $n := int (include "omnigate.maxReplicas" .) -}}
{{- $a := .Values.audit -}}
{{- $c := .Values.config | default dict -}}
{{- $ca := $c.audit | default dict -}}
{{- if and (hasKey $ca "store") (ne (toString $ca.store) (toString $a.store)) -}}
{{- fail (printf "config.audit.store is %s, but audit.store is %s: set the store with audit.store (the chart wires its Secret and witness)" (toString $ca.store) $a.store) -}}
{{- end -}}
{{- if and (eq $a.store "postgres") (not $a.existingSecret) -}}
{{- fail "audit.store postgres needs audit.existingSecret: a Secret holding the DSN and the signing key" -}}
{{- end -}}
{{- if gt $n 1 -}}
{{- $why := printf "this release can run %d replicas" $n -}}
{{- if ne $a.store "postgres" -}}
{{- fail (printf "audit.store is %s, but %s: every pod would keep its own chain, lost when the pod goes. Set audit.store: postgres (with audit.existingSecret), or run one replica with autoscaling off." $a.store $why) -}}
{{- end -}}
{{- if and (hasKey $ca "enabled") (not $ca.enabled) -}}
{{- fail (printf "config.audit.enabled is false, but %s need one audit chain: remove it, or run one replica" $why) -}}
{{- end -}}
{{- if not $a.signingKeySecretKey -}}
{{- fail (printf "audit.signingKeySecretKey is empty, but %s: unsigned checkpoints let a consistent rewrite verify. Name the key in audit.existingSecret that signs them." $why) -}}
{{- end -}}
{{- if not ($a.witness | default dict).claimName -}}
{{- fail (printf "audit.witness.claimName is empty, but %s: the signed heads must also go to a witness outside the database (a PersistentVolumeClaim)" $why) -}}
{{- end -}}
{{- if not .Values.redis.existingSecret -}}
{{- fail (printf "redis.existingSecret is empty, but %s: admission limits would hold per pod and every pod would run its own rollback controller. Name a Secret holding the Redis URL, or run one replica with autoscaling off." $why) -}}
{{- end -}}
{{- $state := (($c.routing | default dict).state | default dict) -}}
{{- if and (hasKey $state "backend") (ne (toString $state.backend) "redis") -}}
{{- fail (printf "config.routing.state.backend is %s, but %s: a pin or freeze would hold on one pod. Remove it (the chart sets redis)." (toString $state.backend) $why) -}}
{{- end -}}
{{- $traffic := $c.traffic | default dict -}}
{{- if and (hasKey $traffic "enabled") (not $traffic.enabled) -}}
{{- fail (printf "config.traffic.enabled is false, but %s share their admission limits through Redis: remove it, or run one replica" $why) -}}
{{- end -}}
{{- end -}}
{{- end -}}
