{{/* Names and labels shared by every template, as `helm create` lays them out. */}}

{{- define "baton.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Quoted: a release named "n" or "on" would otherwise be a YAML boolean. */}}
{{- define "baton.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name | quote }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "baton.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Baton's image with the serve extra (`make image EXTRAS=serve`), which Ray's pods run. */}}
{{- define "baton.serveImage" -}}
{{ .Values.image.repository }}:{{ .Values.gateway.rayService.imageTag | default (printf "%s-serve" (.Values.image.tag | default .Chart.AppVersion)) }}
{{- end -}}

{{/* The gateway Service's port: under KubeRay the Service forwards Serve's port as it is. */}}
{{- define "baton.gatewayServicePort" -}}
{{ .Values.gateway.rayService.enabled | ternary .Values.gateway.port .Values.gateway.service.port }}
{{- end -}}

{{/*
The gateway and the EPLB service serve gateway.modelDeployment: their series carry it as the
engines' do (modeldeployment="NAMESPACE/NAME"), so that the dashboards select one deployment.
*/}}
{{- define "baton.servedDeploymentRelabeling" -}}
{{- with .Values.gateway.modelDeployment -}}
relabelings:
  - action: replace
    sourceLabels: [__meta_kubernetes_service_label_app_kubernetes_io_component]
    regex: gateway|eplb
    targetLabel: modeldeployment
    replacement: {{ . | quote }}
{{- end }}
{{- end }}
