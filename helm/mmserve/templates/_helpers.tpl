{{- define "mmserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mmserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mmserve.labels" -}}
{{ include "mmserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "mmserve.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{/* Serve/AppConfig autoscaling, snake_case; the same text goes into args and into the
     deployments: override, so the two cannot disagree. */}}
{{- define "mmserve.autoscaling" -}}
min_replicas: {{ .minReplicas | toJson }}
max_replicas: {{ .maxReplicas | toJson }}
{{- if hasKey . "initialReplicas" }}
initial_replicas: {{ .initialReplicas | toJson }}
{{- end }}
target_ongoing_requests: {{ .targetOngoingRequests | default 2 | toJson }}
upscale_delay_s: {{ if hasKey . "upscaleDelayS" }}{{ .upscaleDelayS | toJson }}{{ else }}30{{ end }}
downscale_delay_s: {{ if hasKey . "downscaleDelayS" }}{{ .downscaleDelayS | toJson }}{{ else }}600{{ end }}
look_back_period_s: {{ .lookBackPeriodS | default 30 | toJson }}
{{- end -}}

{{/* AppConfig DeploymentOptions of one pool: dict "pool" <pools.x> "gpus" bool "resources" map */}}
{{- define "mmserve.deployment" -}}
num_cpus: {{ .pool.numCpus | toJson }}
{{- if .gpus }}
num_gpus: {{ .pool.numGpus | default 0 | toJson }}
{{- end }}
max_ongoing_requests: {{ .pool.maxOngoingRequests | default 64 | toJson }}
{{- with .resources }}
resources: {{ toJson . }}
{{- end }}
autoscaling:
{{ include "mmserve.autoscaling" .pool.autoscaling | indent 2 }}
{{- end -}}

{{/* ray start --resources for a worker group: the shell-quoted JSON KubeRay passes through. */}}
{{- define "mmserve.markerStartParam" -}}
{{ printf "\"{\\\"%s\\\": 1}\"" . | squote }}
{{- end -}}
