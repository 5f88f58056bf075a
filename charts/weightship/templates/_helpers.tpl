{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "weightship.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name; the release name alone when it already contains the chart name. */}}
{{- define "weightship.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "weightship.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "weightship.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "weightship.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "weightship.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: weightship
{{- end }}

{{/* Selector labels of one component: include "weightship.selectorLabels" (list . "operator") */}}
{{- define "weightship.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "weightship.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* repository@digest when a digest is set (the tag unused), else repository:tag. */}}
{{- define "weightship.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "weightship.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "weightship.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "weightship.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (printf "%s-agent" (include "weightship.fullname" .)) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Namespaces with a Secret-reading Role, as a JSON list; [] means cluster-wide. */}}
{{- define "weightship.secretNamespaces" -}}
{{- default .Values.operator.watchNamespaces .Values.rbac.secretNamespaces | uniq | toJson }}
{{- end }}
