{{/*
The alerting rules of files/alerts.yaml as this release renders them: alerts.disabled
left out, alerts.for overriding an alert's `for`, alerts.labels added to every alert
(an alert's own labels, severity first of all, win), and the runbook links moved to
alerts.runbookBaseURL. Used by the PrometheusRule and the rules ConfigMap.
*/}}
{{- define "weightship.alertRules" -}}
{{- $file := .Files.Get "files/alerts.yaml" | fromYaml -}}
{{- $defaultBase := "https://github.com/weightship/weightship/blob/main/docs/runbook.md" -}}
{{- $base := .Values.alerts.runbookBaseURL | default $defaultBase -}}
{{- $groups := list -}}
{{- range $group := $file.groups -}}
{{- $rules := list -}}
{{- range $rule := $group.rules -}}
{{- if not (has $rule.alert $.Values.alerts.disabled) -}}
{{- $rule = deepCopy $rule -}}
{{- $_ := set $rule "labels" (merge (deepCopy $rule.labels) (deepCopy $.Values.alerts.labels)) -}}
{{- $url := $rule.annotations.runbook_url | replace $defaultBase $base -}}
{{- $_ := set $rule.annotations "runbook_url" $url -}}
{{- with index $.Values.alerts.for $rule.alert -}}
{{- $_ := set $rule "for" . -}}
{{- end -}}
{{- $rules = append $rules $rule -}}
{{- end -}}
{{- end -}}
{{- if $rules -}}
{{- $groups = append $groups (dict "name" $group.name "rules" $rules) -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "groups" $groups) -}}
{{- end -}}
