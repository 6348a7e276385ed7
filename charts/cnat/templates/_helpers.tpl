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

{{- /* Where the webhook certificate comes from: "cert-manager", "existing" (a Secret you keep),
"operator" (cnat keeps it in <fullname>-webhook-certs) or "chart" (generated here, reused through
`lookup`). webhook.certs.mode=auto is "operator" except on an upgrade of a release whose chart
generated the certificate (its Secret exists, and no Secret cnat keeps): that one stays "chart",
since a render without its caBundle would delete it before any replica could write one (docs:
Certificates). */ -}}
{{- define "cnat.certMode" -}}
{{- if .Values.certManager.enabled }}cert-manager
{{- else if .Values.webhook.certs.existingSecret }}existing
{{- else if eq (.Values.webhook.certs.mode | default "auto") "auto" }}
{{- $kept := lookup "v1" "Secret" .Release.Namespace (include "cnat.operatorCertSecret" .) }}
{{- $generated := lookup "v1" "Secret" .Release.Namespace (printf "%s-webhook-tls" (include "cnat.fullname" .)) }}
{{- if and .Release.IsUpgrade $generated (not $kept) }}chart{{ else }}operator{{ end }}
{{- else }}{{ .Values.webhook.certs.mode }}
{{- end }}
{{- end }}

{{- define "cnat.operatorCertSecret" -}}
{{- printf "%s-webhook-certs" (include "cnat.fullname" .) }}
{{- end }}

{{- define "cnat.certSecret" -}}
{{- default (printf "%s-webhook-tls" (include "cnat.fullname" .)) .Values.webhook.certs.existingSecret }}
{{- end }}

{{- /* Labels for a hook's pod (`cnat release`, `helm test`): the chart's, but not the operator's
selector labels, so that no Service, PodDisruptionBudget or anti-affinity takes it for a replica.
Call with (list . "component"). */ -}}
{{- define "cnat.hookPodLabels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version }}
app.kubernetes.io/name: {{ printf "%s-%s" (include "cnat.name" $root) (index . 1) }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end }}
