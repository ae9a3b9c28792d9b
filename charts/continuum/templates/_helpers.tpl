{{/* Names and labels shared by every template. */}}

{{- define "continuum.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "continuum.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "continuum.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "continuum.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: continuum
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "operator"). */}}
{{- define "continuum.selectorLabels" -}}
app.kubernetes.io/name: {{ include "continuum.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "continuum.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "continuum.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "continuum.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create -}}
{{- default (printf "%s-agent" (include "continuum.fullname" .)) .Values.agent.serviceAccount.name -}}
{{- else -}}
{{- required "agent.serviceAccount.name is required when agent.serviceAccount.create is false" .Values.agent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: (dict "image" .Values.images.operator "root" $). */}}
{{- define "continuum.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "continuum.webhook.serviceName" -}}
{{- printf "%s-webhook" (include "continuum.fullname" .) -}}
{{- end -}}

{{- define "continuum.webhook.secretName" -}}
{{- default (printf "%s-webhook-tls" (include "continuum.fullname" .)) .Values.webhook.certificates.secretName -}}
{{- end -}}

{{/* The operator's --engine-selector from operator.engineSelector (KEY=VALUE,...). */}}
{{- define "continuum.operator.engineSelector" -}}
{{- $parts := list -}}
{{- range $k, $v := .Values.operator.engineSelector -}}
{{- $parts = append $parts (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}

{{- define "continuum.operator.leaseName" -}}
{{- printf "%s-leader" (include "continuum.fullname" .) -}}
{{- end -}}
