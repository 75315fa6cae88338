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

{{/* AppConfig AutoscalingConfig of one pool, snake_case:
     dict "name" <pool, for errors> "a" <pools.x.autoscaling> "policy" <{policy_function, policy_kwargs} or nil>.
     cluster.app passes it to Serve as the deployment's autoscaling_config, policy included. */}}
{{- define "mmserve.autoscaling" -}}
{{- $a := .a -}}
{{- $interval := $a.metricsIntervalS | default 10 -}}
{{- $lookBack := $a.lookBackPeriodS | default 30 -}}
{{- if le (float64 $lookBack) (float64 $interval) -}}
{{- fail (printf "pools.%s.autoscaling: lookBackPeriodS (%v) must exceed metricsIntervalS (%v; Ray's default 10 when unset), or the window may hold no sample" .name $lookBack $interval) -}}
{{- end -}}
min_replicas: {{ $a.minReplicas | toJson }}
max_replicas: {{ $a.maxReplicas | toJson }}
{{- if hasKey $a "initialReplicas" }}
initial_replicas: {{ $a.initialReplicas | toJson }}
{{- end }}
target_ongoing_requests: {{ $a.targetOngoingRequests | default 2 | toJson }}
upscale_delay_s: {{ if hasKey $a "upscaleDelayS" }}{{ $a.upscaleDelayS | toJson }}{{ else }}30{{ end }}
downscale_delay_s: {{ if hasKey $a "downscaleDelayS" }}{{ $a.downscaleDelayS | toJson }}{{ else }}600{{ end }}
{{- if hasKey $a "metricsIntervalS" }}
metrics_interval_s: {{ $a.metricsIntervalS | toJson }}
{{- end }}
look_back_period_s: {{ $lookBack | toJson }}
{{- with .policy }}
policy: {{ toJson . }}
{{- end }}
{{- end -}}

{{/* A Serve autoscaling policy: dict "function" "module:Class" "values" <pools.x.policy, camelCase>.
     The values' keys become the class's constructor arguments in snake_case (policy_kwargs). */}}
{{- define "mmserve.policy" -}}
{{- $kwargs := dict -}}
{{- range $k, $v := .values | default dict -}}
{{- $_ := set $kwargs (snakecase $k) $v -}}
{{- end -}}
{{- toJson (dict "policy_function" .function "policy_kwargs" $kwargs) -}}
{{- end -}}

{{/* AppConfig DeploymentOptions of one pool:
     dict "name" <pool> "pool" <pools.x> "gpus" bool "resources" map "policy" <policy or nil>.
     With encoder TP > 1, num_cpus / num_gpus are per rank (cluster.app.encoder_placement). */}}
{{- define "mmserve.deployment" -}}
num_cpus: {{ .pool.numCpus | toJson }}
{{- if .gpus }}
num_gpus: {{ .pool.numGpus | default 0 | toJson }}
{{- end }}
max_ongoing_requests: {{ .pool.maxOngoingRequests | default 64 | toJson }}
{{- if hasKey .pool "maxQueuedRequests" }}
max_queued_requests: {{ .pool.maxQueuedRequests | toJson }}
{{- end }}
{{- if hasKey .pool "gracefulShutdownTimeoutS" }}
graceful_shutdown_timeout_s: {{ .pool.gracefulShutdownTimeoutS | toJson }}
{{- end }}
{{- if hasKey .pool "cpuAffinity" }}
cpu_affinity: {{ .pool.cpuAffinity | toJson }}
{{- end }}
{{- with .resources }}
resources: {{ toJson . }}
{{- end }}
autoscaling:
{{ include "mmserve.autoscaling" (dict "name" .name "a" .pool.autoscaling "policy" .policy) | indent 2 }}
{{- end -}}

{{/* ray start --resources for a worker group: the shell-quoted JSON KubeRay passes through. */}}
{{- define "mmserve.markerStartParam" -}}
{{ printf "\"{\\\"%s\\\": 1}\"" . | squote }}
{{- end -}}

{{/* Volumes of every Ray pod: the writable directories (writableDirs, emptyDirs: the root
     filesystem is read-only), the API keys Secret (auth.apiKeysSecret; the ingress replica may run
     on any pod), the model volume (modelVolume; every replica that loads a model reads it) and, on the
     head with the in-tree autoscaler, the service-account token projected for the autoscaler sidecar
     alone (mmserve.autoscalerToken). */}}
{{- define "mmserve.modelVolumeSource" -}}
{{- with .Values.modelVolume -}}
{{- if .persistentVolumeClaim -}}
persistentVolumeClaim: {claimName: {{ .persistentVolumeClaim | quote }}, readOnly: true}
{{- else if .hostPath -}}
hostPath: {path: {{ .hostPath | quote }}, type: Directory}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The autoscaler sidecar's service-account token: what the kubelet mounts for
     automountServiceAccountToken (token, cluster CA, namespace), as a volume of the head pod that
     only the sidecar mounts (autoscalerOptions.volumeMounts). */}}
{{- define "mmserve.autoscalerTokenVolume" -}}
- name: kube-api-access-autoscaler
  projected:
    defaultMode: 420  # 0644, as the kubelet's own
    sources:
      - serviceAccountToken: {path: token, expirationSeconds: 3607}
      - configMap:
          name: kube-root-ca.crt
          items: [{key: ca.crt, path: ca.crt}]
      - downwardAPI:
          items:
            - path: namespace
              fieldRef: {apiVersion: v1, fieldPath: metadata.namespace}
{{- end -}}

{{/* dict "root" $ "head" bool */}}
{{- define "mmserve.volumes" -}}
{{- $root := .root -}}
{{- $model := include "mmserve.modelVolumeSource" $root -}}
{{- $token := and .head $root.Values.cluster.enableInTreeAutoscaling -}}
{{- if or $root.Values.writableDirs $root.Values.auth.apiKeysSecret $model $token -}}
volumes:
  {{- range $root.Values.writableDirs }}
  - {name: {{ .name }}, emptyDir: {{ pick . "medium" "sizeLimit" | toJson }}}
  {{- end }}
  {{- if $root.Values.auth.apiKeysSecret }}
  - name: mmserve-api-keys
    secret: {secretName: {{ $root.Values.auth.apiKeysSecret | quote }}}
  {{- end }}
  {{- if $model }}
  - name: mmserve-models
    {{- $model | nindent 4 }}
  {{- end }}
  {{- if $token }}
  {{- include "mmserve.autoscalerTokenVolume" $root | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "mmserve.volumeMounts" -}}
{{- $model := include "mmserve.modelVolumeSource" . -}}
{{- if or .Values.writableDirs .Values.auth.apiKeysSecret $model -}}
volumeMounts:
  {{- range .Values.writableDirs }}
  - {name: {{ .name }}, mountPath: {{ .mountPath | quote }}}
  {{- end }}
  {{- if .Values.auth.apiKeysSecret }}
  - {name: mmserve-api-keys, mountPath: /etc/mmserve/auth, readOnly: true}
  {{- end }}
  {{- if $model }}
  - {name: mmserve-models, mountPath: {{ .Values.modelVolume.mountPath | quote }}, readOnly: true}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level hardening of every Ray pod: no service-account token (the autoscaler sidecar gets its
     own, see mmserve.autoscalerTokenVolume) and podSecurityContext. */}}
{{- define "mmserve.podSecurity" -}}
automountServiceAccountToken: false
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A Ray container's securityContext (securityContext in values). */}}
{{- define "mmserve.containerSecurity" -}}
{{- with .Values.securityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Serve's environment (serveEnv) for every Ray container; a null value unsets a default. With
     auth.operatorKeySecret, MMSERVE_OPERATOR_API_KEY from that Secret too (the ingress replica, which
     may run in any Ray pod, reads it at start: only that key sees /stats). */}}
{{- define "mmserve.env" -}}
{{- $env := list -}}
{{- range $k, $v := .Values.serveEnv -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $env = append $env (dict "name" $k "value" (toString $v)) -}}
{{- end -}}
{{- end -}}
{{- if or $env .Values.auth.operatorKeySecret }}
env:
  {{- range $env }}
  - {name: {{ .name }}, value: {{ .value | quote }}}
  {{- end }}
  {{- with .Values.auth.operatorKeySecret }}
  - name: MMSERVE_OPERATOR_API_KEY
    valueFrom: {secretKeyRef: {name: {{ . | quote }}, key: {{ $.Values.auth.operatorKeySecretKey | quote }}}}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The serving port on a Ray container: the Service targets it, KubeRay's worker readiness probe
     GETs /-/healthz on the port named `serve`. */}}
{{- define "mmserve.servePort" -}}
- {containerPort: {{ .Values.service.port }}, name: serve}
{{- end -}}

{{/* A model's `path` in the Serve config: relative paths live in the model volume. */}}
{{- define "mmserve.modelPath" -}}
{{- $path := .m.path -}}
{{- if regexMatch "(^|/)[.][.](/|$)" $path -}}
{{- fail (printf "models[%s].path %q: no '..' segments" .m.name $path) -}}
{{- end -}}
{{- if hasPrefix "/" $path -}}
{{- $path -}}
{{- else if include "mmserve.modelVolumeSource" .root -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.modelVolume.mountPath) $path -}}
{{- else -}}
{{- fail (printf "models[%s].path %q is relative: set modelVolume.persistentVolumeClaim or modelVolume.hostPath (it is taken inside modelVolume.mountPath), or give an absolute path" .m.name $path) -}}
{{- end -}}
{{- end -}}
