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
NAMESPACE/NAME of the ModelDeployment the EPLB service balances: eplb.modelDeployment, else the
first the gateway serves.
*/}}
{{- define "baton.eplbDeployment" -}}
{{- .Values.eplb.modelDeployment | default (first (.Values.gateway.modelDeployments | default list)) | default "" -}}
{{- end }}

{{/*
Every ModelDeployment this release serves (the gateway's and the EPLB service's), as a JSON list
of NAMESPACE/NAME: their engines' PodMonitors and NetworkPolicies.
*/}}
{{- define "baton.servedDeployments" -}}
{{- $all := .Values.gateway.modelDeployments | default list -}}
{{- with include "baton.eplbDeployment" . }}{{ $all = append $all . }}{{ end -}}
{{- $all | uniq | toJson -}}
{{- end }}

{{/*
The EPLB service's series carry the deployment it balances as the engines' do
(modeldeployment="NAMESPACE/NAME"), so that the dashboards select one deployment; the gateway
labels its own series by the deployment each request went to (it may serve several).
*/}}
{{- define "baton.eplbDeploymentRelabeling" -}}
{{- with include "baton.eplbDeployment" . -}}
relabelings:
  - action: replace
    sourceLabels: [__meta_kubernetes_service_label_app_kubernetes_io_component]
    regex: eplb
    targetLabel: modeldeployment
    replacement: {{ . | quote }}
{{- end }}
{{- end }}
