{{- define "cnat.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cnat.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "cnat.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "cnat.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "cnat.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cnat.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "cnat.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "cnat.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "cnat.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cnat.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cnat.webhookService" -}}
{{- printf "%s-webhook" (include "cnat.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cnat.certSecret" -}}
{{- default (printf "%s-webhook-tls" (include "cnat.fullname" .)) .Values.webhook.certs.existingSecret }}
{{- end }}
